"""Shared fixtures and markers.

* ``gpu`` tests run only where jax sees an NVIDIA GPU (``pytest -m gpu`` there).
* ``assets`` tests need the real model and text; they skip with the fetch command
  when those are absent (``real_assets`` / ``real_model`` fixtures).
* Pallas kernels are tested in interpret mode on the CPU through the
  ``kernel_impl`` fixture, compiled on the GPU.
"""

from __future__ import annotations

import importlib.metadata
import os

# Parallel workers (`pytest -n`) may share one GPU: none may claim 75% of it up front.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Without a GPU, the suite is mostly XLA compiling interpreted kernels that then run on
# tiny shapes: LLVM at -O0 compiles them ~20% faster (an interpreted indexer test 40 →
# 35 s), and the CPU's loop emitters in place of its fusion emitters ~30% more (one
# interpreted `full` call 15 → 11 s of compile, `base` 7.3 → 2.7; the suite on two cores
# 15.5 → 10.2 min). Both compute the same values (no fast-math either way). Not where a
# GPU is: its tests time nothing, but XLA's own GPU code should be what users run. XLA
# aborts on a flag it does not know, so the emitter flag is given only to the jaxlib
# versions it was checked on. One LLVM module a program, not split for parallel codegen:
# two workers already fill two cores, and the split's threads only add CPU time (type
# settings 47 → 39 s of user time; the whole suite at `-n 2` on two cores 747 → 562 s,
# with the one-launch tests' ~46 s also gone).
if not os.path.exists("/dev/nvidiactl"):
    _jaxlib = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])
    _cpu_flags = {
        "xla_backend_optimization_level": "0",
        "xla_cpu_parallel_codegen_split_count": "1",
    }
    if _jaxlib <= (0, 10):
        _cpu_flags["xla_cpu_use_fusion_emitters"] = "false"
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", "")]
        + [f"--{k}={v}" for k, v in _cpu_flags.items() if k not in os.environ.get("XLA_FLAGS", "")]
    ).strip()

import gc
import shutil
import tempfile

import jax  # after the allocator setting (it is read when a backend starts)
import pytest

from jsparse import assets, backend

# Tracing and lowering interpreted kernels allocate millions of short-lived objects, and
# Python's default collector (gen-0 at 700 allocations) spent ~5% of a test's CPU time
# scanning them (perf, an interpreted prefill test). Collecting less often took the
# DoSA-Triton and f32 files' user CPU time on two workers 189 → 174-185 s with the same
# peak memory. Nothing a test checks depends on when garbage is collected.
gc.set_threshold(100_000, 50, 1000)

# Parallel workers share compiled executables through a cache directory that lives for
# one run (made by the controlling process, removed at its end): interpreted kernels
# are mostly XLA compile time, and workers often compile the same module (the suite
# on two workers, ~21 → ~18.5 min). Nothing but compiled code is shared.
_COMPILE_CACHE_ENV = "JSPARSE_TEST_COMPILE_CACHE"


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker and getattr(config.option, "numprocesses", None):
        os.environ[_COMPILE_CACHE_ENV] = tempfile.mkdtemp(prefix="jsparse-xla-")
    elif worker and os.environ.get(_COMPILE_CACHE_ENV):
        jax.config.update("jax_compilation_cache_dir", os.environ[_COMPILE_CACHE_ENV])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_unconfigure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_COMPILE_CACHE_ENV):
        shutil.rmtree(os.environ.pop(_COMPILE_CACHE_ENV), ignore_errors=True)


def _assets_skip_reason() -> str:
    return (
        f"needs the real model and text, absent from {assets.cache_dir()}; "
        f"fetch them with `{assets.FETCH_COMMAND}` (or set ${assets.CACHE_ENV})"
    )


def pytest_collection_modifyitems(config, items):
    on_gpu = backend.has_nvidia_gpu()
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (jax sees none)")
    have_assets = None
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
        if "assets" in item.keywords:
            if have_assets is None:
                have_assets = assets.available()
            if not have_assets:
                item.add_marker(pytest.mark.skip(reason=_assets_skip_reason()))


@pytest.fixture(scope="session")
def real_assets():
    """The :mod:`jsparse.assets` module, once the real model and text are known present;
    skips with the fetch command otherwise. Tests using it should also be marked ``assets``."""
    if not assets.available():
        pytest.skip(_assets_skip_reason())
    return assets


@pytest.fixture(scope="session")
def real_model(real_assets):
    """SmolLM2-135M-Instruct loaded once per session (dense attention cores)."""
    from jsparse.models.gguf_loader import load_model

    return load_model()


@pytest.fixture
def monkeypatch():
    """pytest's ``monkeypatch``, with JAX's caches cleared before and after the test: the
    library's switches are module constants read when a function is traced, and a trace
    cached with the other setting would run it unseen (a sweep of such constants in one
    process measured one tile ten times)."""
    jax.clear_caches()
    with pytest.MonkeyPatch.context() as patch:
        yield patch
    jax.clear_caches()


@pytest.fixture
def interpret():
    """Pallas kernels in interpret mode for the duration of one test."""
    with backend.interpret_mode(True):
        yield


@pytest.fixture(params=["triton"])
def kernel_impl(request):
    """A Pallas implementation name, interpreted on the CPU and compiled on a GPU."""
    if backend.has_nvidia_gpu():
        yield request.param
    else:
        with backend.interpret_mode(True):
            yield request.param


class _Fp8Widening:
    def __init__(self, monkeypatch):
        from jsparse.ops.indexer import triton as scorer

        self._monkeypatch, self._scorer = monkeypatch, scorer
        self.decisions = []  # one per traced scorer launch with FP8 inputs: True = widened
        widen = scorer._widen_in_memory

        def spy(*args, **kwargs):
            self.decisions.append(widen(*args, **kwargs))
            return self.decisions[-1]

        monkeypatch.setattr(scorer, "_widen_in_memory", spy)

    def set_threshold(self, threshold):
        self._monkeypatch.setattr(self._scorer, "WIDEN_FP8_IN_MEMORY_FROM", threshold)
        jax.clear_caches()  # the threshold is read when a launch is traced
        self.decisions.clear()


@pytest.fixture
def fp8_widening(monkeypatch):
    """The scorer's in-memory FP8 widening under test: ``set_threshold(n)`` sets
    ``WIDEN_FP8_IN_MEMORY_FROM`` (None: never) and clears the traces; ``decisions``
    records each launch's choice since."""
    return _Fp8Widening(monkeypatch)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.devices()}"
