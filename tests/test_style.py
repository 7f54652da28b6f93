"""The linter and formatter are part of the test suite."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff")
    cmd = [exe] if exe else [sys.executable, "-m", "ruff"]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize(
    "args", [("check", "."), ("format", "--check", ".")], ids=["lint", "format"]
)
def test_ruff(args):
    result = _ruff(*args)
    assert result.returncode == 0, result.stdout + result.stderr


def _literal_number(node) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) in (int, float, bool)


def test_no_select_between_two_python_literals_in_triton_kernels():
    # Pallas Triton lowers jnp.where(p, 1, 2) with a scalar p and two Python-number
    # branches to an i1 select of true/false: 2 is stored as 0 (WORKSPACE.md, run 25).
    # Interpret mode cannot see it. Vector predicates lower correctly, but the rule is
    # kept simple: no select between two Python literals in a kernel module.
    found = []
    for path in sorted(ROOT.glob("jsparse/**/triton.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "where"
                and len(node.args) == 3
                and _literal_number(node.args[1])
                and _literal_number(node.args[2])
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"where(p, literal, literal) in Triton kernel modules: {found}"


def test_every_cited_math_section_exists():
    # The code cites docs/MATH.md by section ("MATH.md §1.10"); a renumbered or missing
    # section would leave the citation pointing at nothing.
    import re

    sections = set(re.findall(r"^#{2,3} (\d+\.\d+) ", (ROOT / "docs/MATH.md").read_text(), re.M))
    assert {"1.1", "1.10", "2.8"} <= sections
    cited = {}
    for path in ROOT.glob("**/*"):
        if path.suffix not in (".py", ".md") or {"diag", ".venv", ".git"} & set(path.parts):
            continue
        if path.name == "WORKSPACE.md":  # the notebook quotes what earlier code cited
            continue
        for match in re.finditer(r"MATH\.md,? ?§(\d+\.\d+)(?:-(\d+\.\d+))?", path.read_text()):
            for section in filter(None, match.groups()):
                cited.setdefault(section, []).append(str(path.relative_to(ROOT)))
    missing = {s: where for s, where in cited.items() if s not in sections}
    assert cited and not missing, missing
