"""The sliding-window perplexity protocol."""

from __future__ import annotations

import numpy as np
import numpy_llama
import pytest
from test_llama import TINY, nnx_model, random_hf_weights, tokens_of

from jsparse.models.perplexity import perplexity, token_nll, windows


@pytest.mark.parametrize(
    ("n", "context", "stride"),
    [(10, 10, 9), (10, 20, 10), (23, 8, 7), (23, 8, 3), (23, 8, 1), (9, 4, 2), (2, 2, 1)],
)
def test_windows_score_every_token_once(n, context, stride):
    scored = []
    for begin, end, n_scored in windows(n, context, stride):
        assert 0 <= begin < end <= n and end - begin <= context
        assert 1 <= n_scored <= end - begin - (begin == 0)
        scored.extend(range(end - n_scored, end))
    assert scored == list(range(1, n))


def test_windows_match_the_strided_recipe():
    # context 8, stride 3 over 14 tokens: [0,8) scores 1..7, [3,11) scores 8..10, [6,14) 11..13
    assert windows(14, 8, 3) == [(0, 8, 7), (3, 11, 3), (6, 14, 3)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="stride"):
        windows(10, 4, 4)  # windows must overlap, or each window's first token is unscored
    with pytest.raises(ValueError, match="at least 2 tokens"):
        windows(1, 4, 4)


def test_token_nll_equals_numpy_per_window():
    weights = random_hf_weights(TINY, seed=31)
    model = nnx_model(TINY, weights)
    ids = tokens_of(17, seed=32)
    context, stride = 8, 3
    got = token_nll(model, ids, context_len=context, stride=stride)
    expected = []
    for begin, end, n_scored in windows(len(ids), context, stride):
        window = ids[begin:end]
        nll = numpy_llama.token_nll(
            numpy_llama.forward(weights, TINY.to_dict(), window)["logits"], window
        )
        expected.append(nll[len(nll) - n_scored :])
    np.testing.assert_allclose(got, np.concatenate(expected), rtol=1e-5, atol=1e-5)
    result = perplexity(model, ids, context_len=context, stride=stride)
    assert result.n_scored == 16
    np.testing.assert_allclose(
        result.perplexity, np.exp(np.mean(np.concatenate(expected))), rtol=1e-5
    )


def test_context_longer_than_model_is_refused():
    model = nnx_model(TINY, random_hf_weights(TINY))
    with pytest.raises(ValueError, match="context_len"):
        token_nll(model, tokens_of(10), context_len=TINY.max_seq_len + 1)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, -2, 3, 4], r"token_ids: ids must lie in \[0, 96\); got -2 at position 1"),
        ([1, 2, 96, 4], r"token_ids: ids must lie in \[0, 96\); got 96 at position 2"),
        (np.array([1, 2, 3, 2**32 + 1]), r"got 4294967297 at position 3"),
        ([1, 2, 3, 2**70], r"token_ids: id 1180591620717411303424 at position 3"),
        ([1.7, 2.9, 3.2, 4.8], "token_ids: dtype float64 is not an integer type"),
        (np.array([1, 2, 3], np.float32), "token_ids: dtype float32"),
        ([True, False, True], "token_ids: dtype bool"),
    ],
)
def test_bad_token_ids_are_refused(ids, match):
    # Each of these once scored silently: a negative id wrapped, id == V gave NaN,
    # floats truncated and ids >= 2^32 wrapped into range.
    model = nnx_model(TINY, random_hf_weights(TINY))
    with pytest.raises(ValueError, match=match):
        perplexity(model, ids, context_len=4)
    with pytest.raises(ValueError, match=match):
        token_nll(model, ids, context_len=4)


def test_non_integer_window_sizes_are_refused():
    model = nnx_model(TINY, random_hf_weights(TINY))
    with pytest.raises(ValueError, match=r"context_len: got 4\.0; expected an int"):
        perplexity(model, tokens_of(6), context_len=4.0)
    with pytest.raises(ValueError, match=r"stride: got 1\.5; expected an int"):
        perplexity(model, tokens_of(6), context_len=4, stride=1.5)
