"""Running a test under one implementation name the way this machine can."""

from __future__ import annotations

import contextlib

from jsparse import backend


@contextlib.contextmanager
def running(name: str):
    """``name`` as given: the jnp reference as is, a Pallas implementation compiled on an
    NVIDIA GPU and in Pallas interpret mode elsewhere."""
    with backend.interpret_mode(name != "reference" and not backend.has_nvidia_gpu()):
        yield name
