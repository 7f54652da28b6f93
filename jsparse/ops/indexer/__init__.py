"""The DeepSeek-style sparse-attention indexer: scores and exact Top-K."""

from jsparse.ops.indexer.api import METHODS, indexer_scores, indexer_topk
from jsparse.ops.indexer.batch import indexer_topk_batch
from jsparse.ops.indexer.result import IndexerTopK

__all__ = ["METHODS", "IndexerTopK", "indexer_scores", "indexer_topk", "indexer_topk_batch"]
