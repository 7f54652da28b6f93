"""The machine code of an indexer case's Triton kernels, from a CPU (no GPU needed).

    pip install -e ".[sass]"   # Triton's compiler with ptxas and cuobjdump (CPU use only)
    python bench/sass.py --t 64 --s 65536 --batch --page-size 64
    python bench/sass.py --t 1 --s 65536 --set jsparse.ops.indexer.triton.SCALE_PREFETCH=True

The case's `base` step is lowered for an abstract H200 (as the CPU lowering tests do),
each Pallas Triton kernel's IR is compiled for sm_90 at its launch's warps and stages,
and the SASS is read: registers, local memory (spills), shared memory, and for the
kernel's main loop (its longest backward branch) each global or shared load with the
number of instructions before something first reads what it loaded. A first reader
a few instructions after a load stalls on the load's whole latency every iteration.

The compiler here is the `triton` package's, not the one built into jaxlib, so
registers differ from the GPU build (FP8 batch scorer: 146 here, 120 there); the loop's
structure and the placement of its loads matched the GPU's (WORKSPACE.md, sessions
69-70). Check a change here first; time it on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run import apply_settings

_ADDRESS = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_GUARD = re.compile(r"^@!?U?P[T0-9]+\s+")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_REGISTER = re.compile(r"^R(\d+)$")
_WIDTHS = {"64": 2, "128": 4}


@dataclasses.dataclass(frozen=True)
class LoopLoad:
    """One load of a kernel's main loop: its position in the loop, its text, and the
    first later instruction (wrapping around the loop) that reads what it loaded."""

    position: int
    text: str
    reader_distance: int | None  # instructions from the load to its first reader
    reader: str


def _instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of each line of a SASS listing."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_ADDRESS.match, sass.splitlines()) if m]


def _opcode_and_operands(text: str) -> tuple[str, list[str]]:
    core = _GUARD.sub("", text)
    opcode, _, rest = core.partition(" ")
    return opcode, [part.strip() for part in rest.split(",")] if rest else []


def _loaded_registers(opcode: str, operands: list[str]) -> set[str]:
    """Registers a load writes: its destination and, for 64/128-bit loads, the next ones."""
    m = _REGISTER.match(operands[0]) if operands else None
    if not m:
        return set()  # RZ: a load for its side effect only
    width = next((w for bits, w in _WIDTHS.items() if f".{bits}" in opcode), 1)
    return {f"R{int(m.group(1)) + i}" for i in range(width)}


def _reads(opcode: str, operands: list[str], registers: set[str]) -> bool:
    # Stores, reductions and atomics read every operand; other instructions all but
    # the first (their destination).
    sources = operands if opcode.startswith(("ST", "RED", "ATOM")) else operands[1:]
    return any(re.search(rf"\b{r}\b", s) for s in sources for r in registers)


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a backward branch to an earlier address)."""
    instructions = _instructions(sass)
    index = {address: i for i, (address, _) in enumerate(instructions)}
    best = None
    for i, (address, text) in enumerate(instructions):
        m = _BRANCH.search(text)
        target = int(m.group(1), 16) if m else None
        if target is not None and target < address and target in index:
            span = (index[target], i)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    return [] if best is None else [text for _, text in instructions[best[0] : best[1] + 1]]


def loop_loads(loop: list[str]) -> list[LoopLoad]:
    """Each global or shared load of ``loop`` (asynchronous copies excluded: nothing in
    registers waits on them) and its first reader."""
    loads = []
    for k, text in enumerate(loop):
        opcode, operands = _opcode_and_operands(text)
        if not opcode.startswith(("LDG", "LDS", "LD.")) or opcode.startswith(
            ("LDGSTS", "LDGDEPBAR")
        ):
            continue
        registers = _loaded_registers(opcode, operands)
        if not registers:
            continue
        distance, reader = None, ""
        for d in range(1, len(loop) + 1):
            later = loop[(k + d) % len(loop)]
            if _reads(*_opcode_and_operands(later), registers):
                distance, reader = d, _GUARD.sub("", later)
                break
        loads.append(LoopLoad(k, _GUARD.sub("", text), distance, reader))
    return loads


def _case(args):
    """(function, argument structs) of the case's Triton `base` step."""
    import jax
    import jax.numpy as jnp

    from jsparse.ops.indexer import batch, methods

    dtype = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[args.dtype]
    f32, i32 = jnp.float32, jnp.int32
    t, s, h, d, p = args.t, args.s, args.heads, args.dim, args.page_size
    q, w = jax.ShapeDtypeStruct((t, h, d), dtype), jax.ShapeDtypeStruct((t, h), f32)
    if args.batch:
        cache = (t * -(-s // p), p) if p else (t, s)
        structs = [q, w, jax.ShapeDtypeStruct((*cache, d), dtype), jax.ShapeDtypeStruct(cache, f32)]
        structs.append(jax.ShapeDtypeStruct((t,), i32))
        if p:
            structs.append(jax.ShapeDtypeStruct((t, -(-s // p)), i32))

        def step(q, w, k_cache, k_scale, lengths, table=None):
            return batch._base_triton(q, w, k_cache, args.top_k, k_scale, lengths, table)

        return step, structs
    if p:
        raise SystemExit("--page-size: paged caches are batch cases (add --batch)")
    keys = [jax.ShapeDtypeStruct((s, d), dtype), jax.ShapeDtypeStruct((s,), f32)]
    ranges = [jax.ShapeDtypeStruct((t,), i32)] * 2

    def step(q, w, k, k_scale, start, end):
        return methods.topk_base(q, w, k, args.top_k, k_scale, start, end)

    return step, [q, w, *keys, *ranges]


def triton_modules(fn, structs) -> list[dict]:
    """Lowers ``fn`` for an abstract H200 and returns each Pallas Triton kernel as
    {name, warps, stages, ir} (the IR as text) in launch order."""
    import jax
    from jax._src.pallas.triton import pallas_call_registration as registration

    from jsparse.testing import lower_for_h200

    lower = getattr(registration.lowering, "lower_jaxpr_to_triton_module", None)
    if lower is None:
        raise SystemExit("this jax has no Pallas Triton lowering hook to read the IR from")
    texts = []

    def keep_text(*a, **k):
        result = lower(*a, **k)
        texts.append(result.module.operation.get_asm())
        return result

    registration.lowering.lower_jaxpr_to_triton_module = keep_text
    jax.clear_caches()  # a kernel lowered before in this process must be lowered again
    try:
        lowered = lower_for_h200(fn, *structs).as_text()
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    # Each custom call's attributes, in the module's order; matched to the IR by name.
    launches = re.findall(
        r'name = "([^"]+)"[^{}]*?num_stages = (\d+)[^{}]*?num_warps = (\d+)', lowered
    )
    modules, used = [], set()
    for ir in texts:
        name = re.search(r"tt\.func \w+ @(\w+)", ir).group(1)
        j = next(j for j, launch in enumerate(launches) if launch[0] == name and j not in used)
        used.add(j)
        modules.append(
            dict(name=name, stages=int(launches[j][1]), warps=int(launches[j][2]), ir=ir)
        )
    return modules


def compile_module(module: dict, stem: Path) -> dict:
    """Compiles one module for sm_90 (its IR, cubin and SASS at ``stem``.*): registers,
    local and shared bytes, and the SASS."""
    import triton
    from triton.backends.compiler import GPUTarget

    stem.with_suffix(".ttir").write_text(module["ir"])
    kernel = triton.compile(
        str(stem.with_suffix(".ttir")),
        target=GPUTarget("cuda", 90, 32),
        # FP fusion on: Triton's default up to 3.9, which 3.10 turns off
        options=dict(num_warps=module["warps"], num_stages=module["stages"], enable_fp_fusion=True),
    )
    stem.with_suffix(".cubin").write_bytes(kernel.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"

    def dump(flag):
        cubin = str(stem.with_suffix(".cubin"))
        return subprocess.run(
            [str(cuobjdump), flag, cubin], capture_output=True, text=True, check=True
        ).stdout

    usage = dump("-res-usage")
    sass = dump("-sass")
    stem.with_suffix(".sass").write_text(sass)
    field = lambda key: int(re.search(rf"{key}:(\d+)", usage).group(1))  # noqa: E731
    return dict(
        registers=field("REG"), local=field("LOCAL"), shared=kernel.metadata.shared, sass=sass
    )


def main(argv=None) -> int:
    argv, applied = apply_settings(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--t", type=int, default=64, help="queries (sequences with --batch)")
    parser.add_argument("--s", type=int, default=65536, help="keys (a sequence's with --batch)")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="fp8")
    parser.add_argument(
        "--batch", action="store_true", help="one query a sequence over its own keys"
    )
    parser.add_argument("--page-size", type=int, default=0, help="a paged cache (with --batch)")
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this")
    parser.add_argument(
        "--loads", action="store_true", help="every loop load, not only global ones"
    )
    parser.add_argument("--keep", type=Path, help="write each kernel's IR, cubin and SASS here")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        needs = "bench/sass.py needs the triton package: pip install -e '.[sass]'"
        raise SystemExit(needs) from None
    for setting in applied:
        print(f"set {setting}")
    modules = [m for m in triton_modules(*_case(args)) if args.kernel in m["name"]]
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="jsparse_sass_"))
    workdir.mkdir(parents=True, exist_ok=True)
    for n, module in enumerate(modules):  # (a kernel may launch more than once)
        built = compile_module(module, workdir / f"{n}_{module['name']}")
        loop = main_loop(built["sass"])
        print(
            f"{module['name']}: {module['warps']} warps, {module['stages']} stages, "
            f"{built['registers']} registers, {built['local']} B local, "
            f"{built['shared']} B shared; main loop {len(loop)} instructions"
        )
        for load in loop_loads(loop):
            if args.loads or load.text.startswith(("LDG", "LD.")):
                reader = "never" if load.reader_distance is None else f"+{load.reader_distance}"
                where = f"  {load.position:5d}  {load.text[:56]:56s}"
                print(f"{where} first reader {reader}: {load.reader[:48]}")
    if args.keep:
        print(f"IR, cubin and SASS in {workdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
