"""Projected-key scores: each KV head's projected query against a stored projected cache."""

from jsparse.ops.projected.api import projected_scores

__all__ = ["projected_scores"]
