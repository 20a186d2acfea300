"""The fused kernels' partition plan (workers.gpu.plan), simulated with the numpy kernel.

Each chunk of the plan gets its state from the numpy path (streaming KEY_TILE
keys at a time, as a thread block does), the chunk states are merged in the
plan's order with ``merge_group`` (the combine kernel's order), and the result
must match the float64 reference.
"""

import numpy as np
import pytest
from reference import assert_close_to_reference

from merge import finalize, merge_group
from workers import BFLOAT16, partial_attention
from workers.gpu.plan import (
    BLOCKS_PER_SM,
    DECODE_ROWS,
    KEY_TILE,
    MIN_CHUNK_TILES,
    PREFILL_ROWS,
    make_fused_plan,
)

DTYPES = [np.float16, BFLOAT16, np.float32, np.float64]


def simulate(plan, q, k, v, q_pos, k_pos, **opts):
    """Chunk states in plan order (numpy path), then their merge: what the fused path computes."""
    states = [partial_attention(q, k[a:b], v[a:b], q_pos=q_pos, k_pos=k_pos[a:b], block_size=KEY_TILE, **opts)
              for a, b in plan.chunks]
    return states, finalize(merge_group(states))


def random_case(rng):
    h_kv = int(rng.choice([1, 2, 4]))
    g = int(rng.choice([1, 2, 4, 8]))
    n_q = int(rng.choice([1, 1, 2, 3, 9, 20]))
    d = int(rng.choice([8, 16, 64]))
    d_v = int(rng.choice([d, 8, 24]))
    n_k = int(rng.integers(1, 700))
    dtype = DTYPES[int(rng.integers(0, len(DTYPES)))]
    q = rng.standard_normal((n_q, h_kv * g, d)).astype(dtype)
    k = rng.standard_normal((n_k, h_kv, d)).astype(dtype)
    v = rng.standard_normal((n_k, h_kv, d_v)).astype(dtype)
    if rng.random() < 0.5:
        k_pos, q_pos = np.arange(n_k), np.arange(n_k - n_q, n_k)
    else:  # gappy, unsorted positions
        k_pos = rng.permutation(3 * n_k)[:n_k].astype(np.int64)
        q_pos = rng.integers(0, 3 * n_k, n_q).astype(np.int64)
    opts = {}
    if rng.random() < 0.5:
        opts["causal"] = True
    if rng.random() < 0.4:
        opts["window"] = (None if rng.random() < 0.3 else int(rng.integers(0, n_k + 1)), int(rng.integers(0, 6)))
    if rng.random() < 0.3:
        opts["softcap"] = float(rng.uniform(1, 20))
    if rng.random() < 0.3:
        opts["alibi_slopes"] = rng.uniform(0, 0.5, h_kv * g)
    return q, k, v, q_pos, k_pos, opts


@pytest.mark.parametrize("seed", range(40))
def test_simulated_fused_plan_matches_reference(seed):
    rng = np.random.default_rng(1000 + seed)
    q, k, v, q_pos, k_pos, opts = random_case(rng)
    n_q, h_q, _ = q.shape
    n_k, h_kv, _ = k.shape
    chunk = None if rng.random() < 0.5 else int(rng.integers(1, 300))
    plan = make_fused_plan(n_q * (h_q // h_kv), h_kv, n_k, sm_count=int(rng.integers(1, 140)), chunk_keys=chunk)
    _, (out, lse) = simulate(plan, q, k, v, q_pos, k_pos, **opts)
    assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, **opts)


def test_decode_plan_with_fully_masked_chunks_is_exact(rng):
    # A window of 50 keys behind a query at position 400: chunks away from it see nothing.
    q = rng.standard_normal((1, 8, 32)).astype(np.float32)
    k = rng.standard_normal((1000, 2, 32)).astype(np.float32)
    v = rng.standard_normal((1000, 2, 32)).astype(np.float32)
    q_pos, k_pos = np.array([400]), np.arange(1000)
    plan = make_fused_plan(4, 2, 1000, sm_count=132, chunk_keys=128)
    states, (out, lse) = simulate(plan, q, k, v, q_pos, k_pos, window=(50, 0))
    empty = [bool(np.all(np.isneginf(st.m))) for st in states]
    assert any(empty) and not all(empty)
    assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, window=(50, 0))


def test_decode_plan_where_every_chunk_is_masked_gives_zero_output(rng):
    q = rng.standard_normal((2, 4, 16)).astype(np.float16)
    k = rng.standard_normal((300, 4, 16)).astype(np.float16)
    v = rng.standard_normal((300, 4, 16)).astype(np.float16)
    q_pos, k_pos = np.array([-10, -1]), np.arange(300)  # causal: every key is in the future
    plan = make_fused_plan(2, 4, 300, sm_count=8, chunk_keys=KEY_TILE)
    _, (out, lse) = simulate(plan, q, k, v, q_pos, k_pos, causal=True)
    assert plan.n_chunks > 1
    assert np.all(np.isneginf(lse)) and np.all(out == 0)
    assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, causal=True)


@pytest.mark.parametrize("n_k", [1, 63, 64, 65, 1000, 4096, 1_000_003])
@pytest.mark.parametrize("sm_count", [1, 7, 132])
@pytest.mark.parametrize("n_rows", [1, 4, 32, 33, 8192])
def test_fused_plan_chunks_cover_the_keys_in_order_without_overlap(n_k, sm_count, n_rows):
    plan = make_fused_plan(n_rows, 8, n_k, sm_count)
    chunks = plan.chunks
    assert chunks[0][0] == 0 and chunks[-1][1] == n_k
    assert all(a < b for a, b in chunks)
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(chunks[:-1], chunks[1:]))
    assert plan.chunk_keys % KEY_TILE == 0
    assert all(b - a == plan.chunk_keys for a, b in chunks[:-1])
    assert plan.grid == (len(chunks), 8, plan.row_tiles)
    assert plan.row_tiles * plan.rows_per_block >= n_rows > (plan.row_tiles - 1) * plan.rows_per_block


def test_decode_plan_splits_long_shards_until_the_device_is_full():
    plan = make_fused_plan(4, 8, 1 << 20, sm_count=132)
    assert plan.kernel == "decode" and plan.rows_per_block == 4
    assert plan.n_chunks * 8 >= 132 * BLOCKS_PER_SM
    assert (plan.n_chunks - 1) * 8 < 132 * BLOCKS_PER_SM + 8  # and not much further


def test_short_shards_keep_chunks_of_at_least_the_minimum_tiles():
    plan = make_fused_plan(1, 1, 10 * KEY_TILE, sm_count=132)
    assert plan.chunk_keys >= MIN_CHUNK_TILES * KEY_TILE


def test_prefill_plan_whose_row_tiles_fill_the_device_does_not_split_keys():
    plan = make_fused_plan(8192, 8, 32768, sm_count=132)
    assert plan.kernel == "prefill" and plan.rows_per_block == PREFILL_ROWS
    assert plan.n_chunks == 1 and plan.row_tiles == 128


@pytest.mark.parametrize(("n_rows", "rows"), [(1, 2), (2, 2), (3, 4), (17, 32), (32, 32)])
def test_decode_rows_use_the_smallest_tile_that_holds_them(n_rows, rows):
    plan = make_fused_plan(n_rows, 2, 100, sm_count=4)
    assert plan.kernel == "decode" and plan.rows_per_block == rows and rows in DECODE_ROWS


def test_forced_chunk_keys_round_up_to_whole_tiles():
    assert make_fused_plan(4, 2, 1000, sm_count=4, chunk_keys=65).chunk_keys == 2 * KEY_TILE
    assert make_fused_plan(4, 2, 1000, sm_count=4, chunk_keys=64).n_chunks == 16


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(n_rows=0, h_kv=1, n_k=1, sm_count=1), "n_rows must be an int >= 1, got 0"),
    (dict(n_rows=1, h_kv=1, n_k=0, sm_count=1), "n_k (an empty shard needs no kernel) must be an int >= 1, got 0"),
    (dict(n_rows=1, h_kv=True, n_k=1, sm_count=1), "h_kv must be an int >= 1, got True"),
    (dict(n_rows=1, h_kv=1, n_k=1, sm_count=1.5), "sm_count must be an int >= 1, got 1.5"),
    (dict(n_rows=1, h_kv=1, n_k=1, sm_count=1, chunk_keys=0), "chunk_keys must be an int >= 1, got 0"),
])
def test_fused_plan_rejects_bad_sizes_naming_them(kwargs, message):
    with pytest.raises(ValueError) as err:
        make_fused_plan(**kwargs)
    assert str(err.value) == message
