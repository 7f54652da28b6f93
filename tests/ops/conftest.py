"""Fixtures of the decode kernels' tests: the (q, cache) dtype pairs they take, and
both settings of each switch the GQA and MLA kernels share by name (both modules are set
alike)."""

import pytest

from jsparse.ops.attention import triton as attention_triton
from jsparse.ops.mla import triton as mla_triton
from tests.ops.decode_dtypes import DECODE_DTYPES, DecodeDtypes


def _set_both(monkeypatch, name: str, value: bool):
    for module in (attention_triton, mla_triton):
        monkeypatch.setattr(module, name, value)


@pytest.fixture(params=["words", "bytes"])
def fp8_reading(request, monkeypatch):
    """FP8 caches read as 16-bit words with f16 dots (the default), or byte by byte."""
    _set_both(monkeypatch, "FP8_AS_WORDS", request.param == "words")
    return request.param


@pytest.fixture(params=["in_kernel", "before_launch"])
def page_lookup(request, monkeypatch):
    """A paged cache's pages looked up by the kernel, or before its launch."""
    _set_both(monkeypatch, "PAGES_BEFORE_LAUNCH", request.param == "before_launch")
    return request.param


@pytest.fixture(params=list(DECODE_DTYPES))
def decode_dtypes(request) -> DecodeDtypes:
    """A (q, cache) dtype pair of the decode kernels, with its tolerance."""
    return DecodeDtypes(request.param, *DECODE_DTYPES[request.param])
