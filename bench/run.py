"""The benchmark and report entry point of jsparse.

    python bench/run.py                               # small default: CPU (interpret) or GPU
    python bench/run.py --backend pallas-gpu --preset prefill-chunk --method xla base full
    python bench/run.py --op indexer --preset decode --json out/decode.json
    python bench/run.py --op topk --preset selection --unsorted --device-time   # selection alone
    python bench/run.py --op indexer-grad --preset training --device-time   # the scores' derivative
    python bench/run.py --op attention --preset decode --device-time  # indexed decode attention
    python bench/run.py --op decode-step --preset decode --device-time  # a sparse decode step
    python bench/run.py --op mla --preset decode --device-time  # indexed MLA decode attention
    python bench/run.py --op mla-step --preset decode --device-time  # a sparse MLA decode step
    python bench/run.py --op dsa-step --preset decode --device-time  # a DSA decode step
    python bench/run.py --op dosa --prefill --keys 131072       # DoSA (bench/dosa.py)
    python bench/run.py --op model throughput --context 2048    # the real model (bench/model.py)
    JAX_DEFAULT_MATMUL_PRECISION=highest python bench/run.py --preset f32  # IEEE f32 dots
    python bench/run.py --set jsparse.ops.topk.triton.BLOCK_RANK_MIN_ROWS=8 --op indexer \
        --preset decode --method base --device-time             # a module switch, for A/B

Every case is checked against the jnp reference before it is timed (every row or
sequence of a decode shape, a spread of rows of a longer one; Top-K results id for id in
the contract's order); a red check is reported and not timed. The run exits 1 when any
row failed its check or raised, except a naive ``xla`` baseline out of memory.

Times are medians over repeats of back-to-back calls with rotating inputs; "% floor"
compares with the larger of FLOPs at the XLA matmul rate and bytes at the copy
bandwidth, both measured at the start of the run on this device.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPS = {
    "attention": "bench.attention",
    "decode-step": "bench.decode_step",
    "dsa-step": "bench.dsa_step",
    "indexer": "bench.indexer",
    "indexer-grad": "bench.indexer_grad",
    "mla": "bench.mla",
    "mla-step": "bench.mla_step",
    "topk": "bench.topk",
}
# Each op module has DEFAULT_METHODS, and METHODS where it knows more than it runs by default.
# Ops with a command line of their own: `--op NAME` forwards every other argument.
CLIS = {"dosa": "bench.dosa", "model": "bench.model", "recall": "bench.recall"}


def apply_settings(argv: list[str]) -> tuple[list[str], list[str]]:
    """Takes every ``--set MODULE.NAME=VALUE`` out of ``argv`` and sets that module
    constant (a Python literal) before anything is traced: an A/B of a switch such as
    ``jsparse.ops.topk.triton.BLOCK_RANK_MIN_ROWS=8`` from the command line. Returns the
    rest of argv and the settings applied."""
    rest, applied = [], []
    it = iter(argv)
    for arg in it:
        if arg != "--set" and not arg.startswith("--set="):
            rest.append(arg)
            continue
        spec = arg[len("--set=") :] if arg.startswith("--set=") else next(it, "")
        target, eq, text = spec.partition("=")
        module_name, _, name = target.rpartition(".")
        if not eq or not module_name:
            raise SystemExit(f"--set: expected MODULE.NAME=VALUE, got {spec!r}")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:  # a typo in the module path: say so, not a traceback
            raise SystemExit(f"--set: no module {module_name} ({err})") from None
        if not hasattr(module, name):
            raise SystemExit(f"--set: {module_name} has no {name}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--set: {text!r} is not a Python literal") from None
        setattr(module, name, value)
        applied.append(f"{target}={value!r}")
    return rest, applied


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def _cli_op(argv: list[str]) -> tuple[str, list[str]] | None:
    """(name, the other arguments) when ``--op NAME`` or ``--op=NAME`` names an op with a
    command line of its own (``--op=dosa`` was not forwarded: KeyError 'dosa')."""
    for at, arg in enumerate(argv):
        if arg == "--op" and at + 1 < len(argv):
            name, rest = argv[at + 1], argv[:at] + argv[at + 2 :]
        elif arg.startswith("--op="):
            name, rest = arg[len("--op=") :], argv[:at] + argv[at + 1 :]
        else:
            continue
        return (name, rest) if name in CLIS else None
    return None


# A row's status, set by common.check_then_time: "ok" (checked, then timed), "CHECK
# FAILED: ..." (a wrong result), "out of memory: ..." or "error: ..." (the method raised);
# or "does not fit this device: ..." (the case's inputs could not be built, so no
# method ran). A naive baseline that does not fit in memory is an expected outcome (the
# issue's targets hold "wherever xla fits"), and so is a case sized for a larger card;
# every other non-ok row makes the run exit 1, after its row is printed and written to
# the JSON.
MAY_NOT_FIT = ("xla",)


def failed(row: dict) -> bool:
    """Whether ``row`` makes the run exit 1 (see above)."""
    from bench import common

    status = row.get("status", "ok")
    if status == "ok" or status.startswith(common.DOES_NOT_FIT):
        return False
    return not (row["method"] in MAY_NOT_FIT and status.startswith(common.OUT_OF_MEMORY))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, settings = apply_settings(argv)
    if settings:  # (the ops with a command line of their own print no header here)
        print("settings: " + ", ".join(settings))
    forwarded = _cli_op(argv)
    if forwarded is not None:
        name, rest = forwarded
        return importlib.import_module(CLIS[name]).main(rest) or 0

    from bench import common
    from jsparse import backend

    on_gpu = backend.has_nvidia_gpu()
    # -h is added after the op's own flags, so that `--op X --help` lists them too.
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False
    )
    parser.add_argument("--op", choices=sorted(OPS) + sorted(CLIS), default="indexer")
    parser.add_argument("--preset", default=None, help="a preset of configs/<op>.toml")
    parser.add_argument("--method", nargs="+", default=None, help="default: the op's own list")
    parser.add_argument(
        "--backend", choices=sorted(common.BACKENDS),
        default="pallas-gpu" if on_gpu else "interpret",
        help="pallas-gpu: compiled Pallas kernels; interpret: the same kernels in Pallas "
        "interpret mode (any machine); xla: the jnp reference implementation",
    )  # fmt: skip
    parser.add_argument(
        "--budget", type=_positive_seconds, default=1.0, help="seconds of timing per case"
    )
    parser.add_argument("--json", default=None, help="write rows and environment here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    module_args, _ = parser.parse_known_args(argv)
    module = importlib.import_module(OPS[module_args.op])
    module.add_arguments(parser)
    parser.add_argument("-h", "--help", action="help", help="show this help message and exit")
    args = parser.parse_args(argv)
    args.method = args.method or module.DEFAULT_METHODS
    # Before the floors are measured: an unknown method used to stop the run only there.
    common.refuse_unknown_methods(
        args.op, args.method, getattr(module, "METHODS", module.DEFAULT_METHODS)
    )
    if args.preset is None:
        args.preset = "gpu-smoke" if on_gpu else "smoke"
    if args.backend == "pallas-gpu" and not on_gpu:
        parser.error("--backend pallas-gpu needs an NVIDIA GPU; use --backend interpret or xla")
    presets = common.load_presets(args.op)
    if args.preset not in presets:
        parser.error(
            f"--preset {args.preset!r}: configs/{args.op}.toml has {', '.join(sorted(presets))}"
        )
    # load_presets checked every preset's fields; this one's dtype against the op's own
    # list (attention has no f32), and the JSON's path: both before any work.
    op_dtypes = getattr(module, "DTYPES", common.DTYPE_NAMES)
    common.check_preset(args.op, args.preset, presets[args.preset], op_dtypes)
    common.check_writable("--json", args.json)

    env = common.environment()
    if settings:
        env["settings"] = ", ".join(settings)
    print(" | ".join(f"{k} {v}" for k, v in env.items()))
    methods = " ".join(args.method)
    print(f"op {args.op} | preset {args.preset} | backend {args.backend} | methods {methods}")
    cases = common.expand_cases(presets[args.preset])
    dtypes = {c[k] for c in cases for k in ("dtype", "index_dtype") if k in c}
    floors = common.measure_floors(sorted(dtypes), on_gpu=on_gpu)
    print(floors.describe())

    impl = common.BACKENDS[args.backend]
    with backend.interpret_mode(args.backend == "interpret"):
        rows = module.run(args, floors, impl)
    common.print_table(rows, module.COLUMNS)
    common.print_kernels(rows)
    common.write_json(
        args.json, {"env": env, "floors": floors.as_dict(), "args": vars(args), "rows": rows}
    )
    unfit = sorted({r["case"] for r in rows if r.get("status", "").startswith(common.DOES_NOT_FIT)})
    if unfit:
        print(f"not run, {common.DOES_NOT_FIT}'s memory: " + "; ".join(unfit))
    return 1 if any(failed(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
