"""Argument checks shared by the command lines (calibration, the benchmarks): a bad flag
is refused with its name before any work, not found deep inside a run."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (a window, chunk or row count of 0 used to divide by
    zero or fail inside the run)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def check_writable(flag: str, path: str | os.PathLike | None) -> None:
    """Stops with a message naming ``flag`` when ``path`` cannot be written, before the
    run (an output that failed at the end lost the whole run). Creates the parent
    directory and writes a scratch file beside ``path``, so nothing is left at ``path``
    itself if the run fails."""
    if not path:
        return
    target = Path(path)
    try:
        if target.is_dir():
            raise IsADirectoryError(21, "it is a directory")
        for parent in (target.parent, *target.parent.parents):
            if parent.exists() and not parent.is_dir():
                raise NotADirectoryError(20, f"{parent} is not a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}."):
            pass
        if target.exists() and not os.access(target, os.W_OK):
            raise PermissionError(13, "it is not writable")
    except OSError as err:
        raise SystemExit(f"{flag}: cannot write {path}: {err.strerror or err}") from None
