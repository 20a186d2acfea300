"""Several queries over the same keys in one pass: exact, and bitwise what each gives alone.

The shapes include the service's decode shape (d = 128, blocks of thousands of keys,
BLAS calls in every regime the library picks by size), not only small ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import assert_close_to_reference

import workers.cpu
from merge import finalize
from workers.gpu import backend as gpu
from workers import BFLOAT16, StreamingKV, partial_attention_resident
from workers.api import partial_attention_resident_many
from workers.options import AttentionOptions, KernelOptions
from workers.plan import batchable
from workers.problem import build_problem, check_problem

DTYPES = [np.float16, BFLOAT16, np.float32, np.float64]
#: Option groups; scale and ALiBi slopes vary per query too, and "mixed" batches all of them together.
GROUPS = [{}, {"causal": True}, {"window": (40, 0)}, {"softcap": 4.0}, {"window": (None, 3), "softcap": 9.0}, None]
GROUP_IDS = ["plain", "causal", "window", "softcap", "window-softcap", "mixed"]
MIXED = [g for g in GROUPS if g is not None]


def context(rng, n_k=700, h_kv=2, d=16, d_v=12, dtype=np.float32, gaps=True):
    k = rng.standard_normal((n_k, h_kv, d)).astype(dtype)
    v = rng.standard_normal((n_k, h_kv, d_v)).astype(dtype)
    k_pos = np.cumsum(rng.integers(1, 3, n_k)) if gaps else np.arange(n_k)
    return k, v, k_pos, StreamingKV.from_arrays(k, v, k_pos).snapshot()


def queries(rng, count, k_pos, group=None, n_q=1, h_q=8, d=16, dtype=np.float32):
    """``count`` queries of one option group, each with its own positions, scale and (every other one) slopes."""
    out = []
    for i in range(count):
        q = rng.standard_normal((n_q, h_q, d)).astype(dtype)
        q_pos = rng.integers(int(k_pos[0]) - 5, int(k_pos[-1]) + 5, n_q)
        mine = MIXED[i % len(MIXED)] if group is None else group
        opts = {**mine, "scale": float(rng.uniform(0.1, 0.4))}
        if i % 2:
            opts["alibi_slopes"] = rng.uniform(0.0, 0.2, h_q)
        out.append((q, q_pos, opts))
    return out


def options(batch):
    return [(q, q_pos, AttentionOptions(**o)) for q, q_pos, o in batch]


def bits(state) -> tuple[bytes, bytes, bytes]:
    return state.m.tobytes(), state.l.tobytes(), state.acc.tobytes()


@pytest.mark.parametrize("group", GROUPS, ids=GROUP_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 16, 32])
def test_a_query_gives_the_same_bits_alone_and_in_a_batch_of_any_size(rng, dtype, size, group):
    k, v, k_pos, view = context(rng, dtype=dtype)
    batch = queries(rng, size, k_pos, group, dtype=dtype)
    kernel = KernelOptions(block_size=96)  # several blocks, and blocks a mask skips
    together = partial_attention_resident_many(options(batch), view, kernel=kernel)
    for (q, q_pos, opts), state in zip(batch, together):
        alone = partial_attention_resident(q, view, q_pos=q_pos, options=AttentionOptions(**opts), kernel=kernel)
        assert bits(state) == bits(alone)
        out, lse = finalize(state)
        assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, **opts)


@pytest.mark.parametrize("n_q, h_q", [(1, 2), (2, 8), (3, 4)], ids=["one-row", "two-queries", "odd-rows"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_batches_split_over_threads_stay_invariant(rng, threads, n_q, h_q):
    _, _, k_pos, view = context(rng, n_k=2000)
    batch = queries(rng, 9, k_pos, {"causal": True}, n_q=n_q, h_q=h_q)
    kernel = KernelOptions(block_size=128, threads=threads)
    together = partial_attention_resident_many(options(batch), view, kernel=kernel)
    for (q, q_pos, opts), state in zip(batch, together):
        alone = partial_attention_resident(q, view, q_pos=q_pos, options=AttentionOptions(**opts), kernel=kernel)
        assert bits(state) == bits(alone)


@pytest.mark.parametrize("per_pass, passes", [(1, 7), (2, 4), (3, 3)])
def test_a_batch_past_its_scratch_bound_takes_more_passes_with_the_same_bits(rng, monkeypatch, per_pass, passes):
    _, _, k_pos, view = context(rng)
    batch = queries(rng, 7, k_pos, {"causal": True}, n_q=2, h_q=8)  # 8 rows per kv head and request
    tile = 2 * 8 * 96 * 4  # one request's score tile: [h_kv, rows, block] float32
    wide = partial_attention_resident_many(options(batch), view, kernel=KernelOptions(block_size=96))
    calls = []
    real = workers.cpu.stream
    monkeypatch.setattr(workers.cpu, "stream", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    narrow = partial_attention_resident_many(
        options(batch), view, kernel=KernelOptions(block_size=96, batch_scratch_bytes=per_pass * tile))
    assert len(calls) == passes  # one pass over the keys per group of requests that fits
    assert [bits(s) for s in narrow] == [bits(s) for s in wide]


def test_the_same_batch_twice_is_bitwise_identical(rng):
    _, _, k_pos, view = context(rng)
    batch = options(queries(rng, 12, k_pos, {"window": (30, 2)}))
    first = partial_attention_resident_many(batch, view, kernel=KernelOptions())
    again = partial_attention_resident_many(batch, view, kernel=KernelOptions())
    assert [bits(s) for s in first] == [bits(s) for s in again]


def test_queries_of_other_shapes_run_one_by_one_and_stay_exact(rng):
    k, v, k_pos, view = context(rng)
    mixed = [*queries(rng, 2, k_pos, n_q=1), *queries(rng, 2, k_pos, {"causal": True}),
             *queries(rng, 2, k_pos, n_q=3), *queries(rng, 1, k_pos, n_q=40)]
    states = partial_attention_resident_many(options(mixed), view, kernel=KernelOptions(block_size=64))
    for (q, q_pos, opts), state in zip(mixed, states):
        out, lse = finalize(state)
        assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, **opts)


def test_only_decode_shaped_problems_of_one_shape_are_batchable(rng):
    k, v, _, _ = context(rng, n_k=50)

    def problem(n_q=1, dtype=np.float32, **opts):
        return check_problem(rng.standard_normal((n_q, 8, 16)).astype(dtype), k, v, None, None,
                             AttentionOptions(**opts))

    q = problem()
    assert batchable([q, problem()]) and batchable([problem(2), problem(2)])
    assert batchable([q, problem(scale=0.5, alibi_slopes=np.ones(8)), problem(causal=True), problem(softcap=3.0)])
    assert not batchable([q, problem(2)])  # rows per kv head differ: so would the plan
    assert not batchable([problem(9), problem(9)])  # prefill-shaped
    assert not batchable([q, problem(dtype=np.float64)])  # the accumulation dtype differs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("n_q, h_q, h_kv, d, n_k", [
    (1, 32, 8, 128, 9000),  # the service's decode shape: a full block and a partial one
    (1, 8, 8, 128, 5000),  # one row per kv head
    (2, 16, 2, 256, 3000),
    (4, 8, 1, 64, 20000),
], ids=["decode", "one-row", "d256", "n_q4"])
def test_a_query_gives_the_same_bits_alone_and_in_a_batch_at_service_shapes(rng, dtype, n_q, h_q, h_kv, d, n_k):
    k, v, k_pos, view = context(rng, n_k=n_k, h_kv=h_kv, d=d, d_v=d, dtype=dtype)
    batch = queries(rng, 9, k_pos, None, n_q=n_q, h_q=h_q, d=d, dtype=dtype)
    for kernel in (KernelOptions(), KernelOptions(threads=2)):
        together = partial_attention_resident_many(options(batch), view, kernel=kernel)
        for (q, q_pos, opts), state in zip(batch, together):
            alone = partial_attention_resident(q, view, q_pos=q_pos, options=AttentionOptions(**opts), kernel=kernel)
            assert bits(state) == bits(alone)
    out, lse = finalize(together[0])
    q, q_pos, opts = batch[0]
    assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, **opts)


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=["float32", "bfloat16"])
def test_the_generic_gpu_path_batches_with_the_same_bits_on_numpy(rng, dtype):
    k, v, k_pos, view = context(rng, n_k=900, dtype=dtype)
    batch = queries(rng, 6, k_pos, None, dtype=dtype)
    parts = [(q, build_problem(q, view.dims, (view.kt.dtype, view.v.dtype), q_pos, view.k_pos, AttentionOptions(**o),
                               np)) for q, q_pos, o in batch]
    kernel = KernelOptions(block_size=128)
    together = gpu.run_generic_many(parts, view, kernel, xp=np)
    for (q, problem), state, (_, q_pos, opts) in zip(parts, together, batch):
        assert bits(state) == bits(gpu.run_generic(q, view, problem, kernel, xp=np))
        out, lse = finalize(state)
        assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, **opts)
