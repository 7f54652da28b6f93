"""Where a measurement ran: date, device, versions and commit (every CLI prints this)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax

from jsparse.ops import f32_dots

_REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The commit measured: ``$JSPARSE_COMMIT`` if set (copies without .git), else git's."""
    if os.environ.get("JSPARSE_COMMIT"):
        return os.environ["JSPARSE_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=_REPO, capture_output=True, text=True
        )
        if head.returncode != 0:
            return "unknown (not a git checkout; set JSPARSE_COMMIT)"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_REPO, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return "unknown (no git)"


def environment() -> dict:
    device = jax.devices()[0]
    try:
        import flax

        flax_version = flax.__version__
    except ImportError:
        flax_version = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"{device.platform}:{device.device_kind}",
        "n_devices": jax.device_count(),
        "host_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "flax": flax_version,
        "commit": git_commit(),
        # how the kernels and XLA multiply f32 inputs: part of any f32 number
        "f32 dots": f32_dots.mode(),
        "command": " ".join(sys.argv),
    }
