"""Capture the SmolLM2 activations the recall evaluation uses (real model, Austen text).

    python bench/captures.py [--out-root ~/.cache/jsparse/captures] [--tokens 8192]
        [--windows emma:40000 ...]

Default windows: 64K calibration tokens (8 windows of 8192 from the four calibration
novels, away from their openings) and two held-out windows of Persuasion. Each window
is a fresh causal forward pass from position 0; one directory per window,
``<novel>_<offset>_<tokens>``, in the format of :mod:`jsparse.models.capture`.
Existing complete directories are skipped.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CALIBRATION_WINDOWS = (
    "emma:40000",
    "emma:120000",
    "mansfieldpark:40000",
    "mansfieldpark:120000",
    "sensesensibility:40000",
    "sensesensibility:110000",
    "northangerabbey:30000",
    "northangerabbey:70000",
)
HELD_OUT_WINDOWS = ("persuasion:30000", "persuasion:80000")


def window_dir(root: Path, window: str, tokens: int) -> Path:
    novel, offset = window.split(":")
    return root / f"{novel}_{int(offset)}_{tokens}"


def main(argv: list[str] | None = None) -> int:
    from jsparse import assets
    from jsparse.models.capture import capture_text
    from jsparse.models.gguf_loader import load_model

    p = argparse.ArgumentParser(prog="bench/captures.py", description=__doc__.split("\n")[0])
    p.add_argument("--out-root", default=str(assets.cache_dir() / "captures"))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--windows", nargs="+", default=[*CALIBRATION_WINDOWS, *HELD_OUT_WINDOWS])
    args = p.parse_args(argv)
    root = Path(args.out_root).expanduser()
    model = None
    for window in args.windows:
        out = window_dir(root, window, args.tokens)
        if (out / "meta.json").is_file():
            print(f"{out}: exists, skipped")
            continue
        model = load_model() if model is None else model
        novel, offset = window.split(":")
        t0 = time.perf_counter()
        capture_text(novel, int(offset), args.tokens, out, model=model)
        print(f"{out}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
