"""Shared fixtures and markers.

* ``gpu`` tests run only where jax sees an NVIDIA GPU (``pytest -m gpu`` there).
* ``assets`` tests need the real model and text; they skip with the fetch command
  when those are absent.
* Pallas kernels are tested in interpret mode on the CPU through the
  ``kernel_impl`` fixture, compiled on the GPU.
"""

from __future__ import annotations

import jax
import pytest

from jsparse import backend


def pytest_collection_modifyitems(config, items):
    on_gpu = backend.has_nvidia_gpu()
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (jax sees none)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)


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


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.devices()}"
