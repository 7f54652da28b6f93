"""Exact Top-K selection under one total order (score descending, id ascending)."""

from jsparse.ops.topk.api import topk, topk_prefix
from jsparse.ops.topk.codes import EMPTY_CODE, code_to_score, score_code
from jsparse.ops.topk.reference import select_codes_reference, select_topk_reference

__all__ = [
    "EMPTY_CODE",
    "code_to_score",
    "score_code",
    "select_codes_reference",
    "select_topk_reference",
    "topk",
    "topk_prefix",
]
