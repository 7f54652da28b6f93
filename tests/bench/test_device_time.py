"""The bench's GPU busy time, read from a profiler trace."""

import pytest

from bench import common


def _trace():
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 7, "tid": 14, "name": "thread_name", "args": {"name": "Stream #14"}},
        {"ph": "M", "pid": 7, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    kernels = [  # two calls: 10 + 5 µs, then 10 + 5 µs, one 1 µs memset
        {"ph": "X", "pid": 7, "tid": 14, "ts": t, "dur": d, "name": n}
        for t, d, n in [(0, 10, "a"), (12, 5, "b"), (40, 10, "a"), (52, 5, "b"), (60, 1, "Memset")]
    ]
    nested = [{"ph": "X", "pid": 7, "tid": 2, "ts": 0, "dur": 60, "name": "fusion"}]
    host = [{"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 500, "name": "PjitFunction"}]
    return meta + kernels + nested + host


def test_busy_counts_stream_kernels_only():
    # annotation lines nest the kernels and host lines are not device time
    assert sum(common.kernels_from_trace(_trace(), calls=2).values()) == pytest.approx(15.5e-6)


def test_busy_is_none_without_gpu_activity():
    events = [e for e in _trace() if e.get("pid") != 7]
    assert common.kernels_from_trace(events, calls=2) is None


def test_kernels_are_summed_by_name_per_call():
    kernels = common.kernels_from_trace(_trace(), calls=2)
    assert list(kernels) == ["a", "b", "Memset"]  # largest first
    assert kernels == pytest.approx({"a": 10e-6, "b": 5e-6, "Memset": 0.5e-6})


def test_print_kernels_names_the_largest(capsys):
    rows = [{"case": "T8", "method": "base", "kernels_us": {"scorer": 21.3, "merge": 1.7}}]
    common.print_kernels(rows, top=1)
    out = capsys.readouterr().out
    assert "T8 base: scorer 21.3, 1 more 1.7" in out
