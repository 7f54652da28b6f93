"""Evaluation of token selectors: recall metrics, capture reading, synthetic test data."""
