"""The benchmark's FLOP and byte counts hold at the largest preset shapes."""

import numpy as np

from bench.indexer import counts


def test_counts_of_a_64k_causal_prefill_do_not_wrap():
    # 65536 causal queries see 2^31 + 2^15 pairs: an int32 sum wraps to a negative count.
    t = 65536
    inputs = dict(
        q=np.zeros((1,), np.float32), k=np.zeros((1,), np.float32),
        weights=np.zeros((1,), np.float32), k_scale=None,
        kv_start=np.zeros((t,), np.int32), kv_end=np.arange(1, t + 1, dtype=np.int32),
    )  # fmt: skip
    flops, nbytes = counts(dict(h=64, d=128, top_k=2048, t=t), inputs)
    assert flops == (t * (t + 1) // 2) * 2 * 64 * 128
    assert nbytes > 0


def test_batch_case_inputs_give_each_query_its_own_keys():
    from bench.indexer import make_inputs

    case = dict(t=3, s=40, h=2, d=8, top_k=4, dtype="fp8", ranges="batch")
    inputs = make_inputs(case, seed=0)
    assert inputs["k_cache"].shape == (3, 40, 8) and inputs["k_scale"].shape == (3, 40)
    flops, nbytes = counts(case, inputs)
    assert flops == 3 * 40 * 2 * 2 * 8
    assert nbytes >= inputs["k_cache"].nbytes
