"""Projected-key scores: each KV head's projected query against a stored projected cache."""

from jsparse.ops.projected.api import projected_scores, projected_step

__all__ = ["projected_scores", "projected_step"]
