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


def test_paged_batch_inputs_hold_the_dense_keys_and_the_check_catches_a_wrong_id():
    import jax.numpy as jnp

    import jsparse
    from bench.indexer import check, make_inputs

    case = dict(t=3, s=256, h=2, d=8, top_k=16, dtype="fp8", ranges="batch")
    dense = make_inputs(case, seed=0)
    paged = make_inputs(dict(case, page_size=64), seed=0)
    assert paged["k_cache"].shape == (12, 64, 8) and paged["page_table"].shape == (3, 4)
    for inputs in (dense, paged):
        result = jsparse.indexer_topk_batch(top_k=16, implementation="reference", **inputs)
        assert check(case, inputs, result, rows=3) == []
    wrong = result.replace(indices=result.indices.at[1, 0].set(result.indices[1, 15] ^ 1))
    assert check(case, paged, wrong, rows=3)
    ref = jsparse.indexer_topk_batch(top_k=16, implementation="reference", **dense)
    assert jnp.array_equal(ref.indices, result.indices)


def test_floors_line_names_only_what_was_measured():
    from bench.common import Floors

    assert Floors(3.0e12, {}).describe() == "floors: copy 3000 GB/s (read+write)"
    line = Floors(3.0e12, {"bfloat16": 7.15e14}).describe()
    assert line == "floors: copy 3000 GB/s (read+write) | XLA matmul bfloat16 715 TFLOP/s"


def test_the_indexer_check_holds_a_sorted_result_to_its_order_and_sees_every_row():
    import jsparse
    from bench.indexer import check, make_inputs

    case = dict(t=16, s=200, h=2, d=8, top_k=8, dtype="bf16", ranges="causal")
    inputs = make_inputs(case, seed=0)
    result = jsparse.indexer_topk(top_k=8, implementation="reference", **inputs)
    assert check(case, inputs, result, rows=8) == []
    reversed_ = result.replace(indices=result.indices[:, ::-1], scores=result.scores[:, ::-1])
    assert check(case, inputs, reversed_, rows=8, in_order=False) == []  # the set is right
    assert "out of order" in check(case, inputs, reversed_, rows=8)[0]
    # one wrong row of 16, with 8 rows asked for: a decode-sized case checks them all
    row1 = result.replace(indices=result.indices.at[1, 0].set(result.indices[1, 7] + 1))
    assert [p[:6] for p in check(case, inputs, row1, rows=8)][:1] == ["row 1:"]
