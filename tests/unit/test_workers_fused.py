"""The fused CPU kernel (workers/fused.py): exact against float64, deterministic, batch-invariant,
chosen explicitly, and replaced by the NumPy kernel when numba is missing or broken.

The first run compiles the kernels (about 10 s per dtype and layout on 2 cores); numba caches
them on disk next to the module, so later runs take seconds.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
from reference import assert_close_to_reference

from merge import finalize, merge_all
from workers import BFLOAT16, StreamingKV, fused
from workers.api import partial_attention_resident, partial_attention_resident_many, partial_attention_shard
from workers.layout import NaturalKV
from workers.options import AttentionOptions, CpuKernels, KernelOptions
from workers.problem import check_problem

pytestmark = pytest.mark.skipif(fused.kernels() is None, reason="numba is not importable")

DTYPES = [np.float32, BFLOAT16, np.float16, np.float64]
LAYOUTS = ["inline", "resident"]
#: (h_q, h_kv, d, d_v, n_q): MHA, GQA, MQA, d_v != d, several queries.
SHAPES = {"gqa": (8, 2, 16, 12, 1), "mha": (2, 2, 8, 8, 2), "mqa": (6, 1, 16, 16, 1), "dv": (4, 2, 8, 20, 3)}
CASES = {
    "plain": {},
    "causal": {"causal": True},
    "window-softcap-alibi": {"window": (40, 2), "softcap": 3.0, "alibi": True},
    "right-window": {"window": (None, 5), "scale": 0.3},
}


def fused_opts(**kw) -> KernelOptions:
    return KernelOptions(cpu_kernels=CpuKernels.FUSED, **kw)


def make(rng, shape="gqa", dtype=np.float32, n_k=300, gaps=True):
    h_q, h_kv, d, d_v, n_q = SHAPES[shape]
    q = rng.standard_normal((n_q, h_q, d)).astype(dtype)
    k = rng.standard_normal((n_k, h_kv, d)).astype(dtype)
    v = rng.standard_normal((n_k, h_kv, d_v)).astype(dtype)
    k_pos = np.cumsum(rng.integers(1, 3, n_k)) if gaps else np.arange(n_k)
    q_pos = rng.integers(int(k_pos[0]), int(k_pos[-1]) + 3, n_q) if n_k else np.zeros(n_q, dtype=np.int64)
    return q, k, v, k_pos, q_pos


def run(layout, q, k, v, k_pos, q_pos, opts, kernel, shards=1):
    """``finalize(merge_all(states))`` over ``shards`` contiguous key ranges, on one layout."""
    bounds = [len(k) * i // shards for i in range(shards + 1)]
    states = []
    for a, b in itertools.pairwise(bounds):
        if layout == "inline":
            states.append(partial_attention_shard(q, k[a:b], v[a:b], q_pos=q_pos, k_pos=k_pos[a:b], options=opts,
                                                  kernel=kernel))
        else:
            view = StreamingKV.from_arrays(k[a:b], v[a:b], k_pos[a:b]).snapshot()
            states.append(partial_attention_resident(q, view, q_pos=q_pos, options=opts, kernel=kernel))
    return finalize(merge_all(states))


def options_of(case, h_q, rng):
    kw = dict(CASES[case])
    alibi = rng.uniform(0.0, 0.2, h_q) if kw.pop("alibi", False) else None
    return kw, AttentionOptions(alibi_slopes=alibi, **kw), alibi


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_every_dtype_option_and_layout_matches_reference(rng, layout, case, dtype):
    q, k, v, k_pos, q_pos = make(rng, dtype=dtype)
    kw, opts, alibi = options_of(case, q.shape[1], rng)
    out, lse = run(layout, q, k, v, k_pos, q_pos, opts, fused_opts(threads=2), shards=2)
    assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, alibi_slopes=alibi, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gqa_mqa_and_dv_shapes_match_reference(rng, layout, shape):
    q, k, v, k_pos, q_pos = make(rng, shape=shape, dtype=BFLOAT16)
    out, lse = run(layout, q, k, v, k_pos, q_pos, AttentionOptions(causal=True), fused_opts())
    assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, causal=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_block_far_longer_than_the_keys_runs_fused_and_keeps_the_kernel(rng, layout):
    q, k, v, k_pos, q_pos = make(rng, n_k=40)
    want = run(layout, q, k, v, k_pos, q_pos, AttentionOptions(), fused_opts(block_size=40))
    got = run(layout, q, k, v, k_pos, q_pos, AttentionOptions(), fused_opts(block_size=2**40))
    assert fused.available()  # no scratch of 2**40 keys tried, so the compiled path was not given up
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block", [1, 7, 64, 100, 1000, None])
@pytest.mark.parametrize("shards", [1, 3, 5])
def test_block_sizes_and_shard_counts_match_reference(rng, layout, block, shards):
    # None: the default blocks (fused.RESIDENT_BLOCK, INLINE_BLOCK), several of them per shard.
    q, k, v, k_pos, q_pos = make(rng, dtype=np.float16, n_k=257 if block else 5 * 1024 + 13)
    opts = AttentionOptions(window=(60, 0))
    out, lse = run(layout, q, k, v, k_pos, q_pos, opts, fused_opts(block_size=block, threads=2), shards=shards)
    assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, window=(60, 0))


def test_mixed_input_dtypes_accumulate_in_float64(rng):
    q, k, v, k_pos, q_pos = make(rng, dtype=np.float16)
    q = q.astype(np.float64)  # float64 sums over float16 keys: chosen for the NumPy kernel (fused.choose)
    st = partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=AttentionOptions(), kernel=fused_opts())
    assert st.m.dtype == np.float64
    assert_close_to_reference(*finalize(st), q, k, v, q_pos=q_pos, k_pos=k_pos)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fully_masked_shard_is_exactly_empty_and_blocks_of_it_are_skipped(rng, layout):
    q, k, v, k_pos, q_pos = make(rng, gaps=False)
    q_pos = np.array([-10])  # before every key: causal sees nothing
    opts = AttentionOptions(causal=True)
    kernel = fused_opts(block_size=16)
    if layout == "inline":
        st = partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=opts, kernel=kernel)
    else:
        view = StreamingKV.from_arrays(k, v, k_pos).snapshot()
        st = partial_attention_resident(q, view, q_pos=q_pos, options=opts, kernel=kernel)
    assert np.all(st.m == -np.inf) and np.all(st.l == 0) and np.all(st.acc == 0)
    out, lse = finalize(st)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_rows_that_see_no_key_beside_rows_that_do(rng):
    q, k, v, k_pos, q_pos = make(rng, shape="dv", gaps=False)
    q_pos = np.array([-3, 150, 299])  # the first query sees no key under causal
    out, lse = run("inline", q, k, v, k_pos, q_pos, AttentionOptions(causal=True), fused_opts(block_size=32))
    assert np.all(lse[0] == -np.inf) and np.all(out[0] == 0)
    assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, causal=True)


def test_empty_keys_give_the_empty_state(rng):
    q, k, v, k_pos, q_pos = make(rng, n_k=0)
    st = partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=AttentionOptions(), kernel=fused_opts())
    assert np.all(st.m == -np.inf) and np.all(st.l == 0) and np.all(st.acc == 0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("threads", [1, 2])
def test_same_call_twice_is_bitwise_identical(rng, layout, threads):
    q, k, v, k_pos, q_pos = make(rng, dtype=BFLOAT16, n_k=2000)
    opts = AttentionOptions(softcap=5.0)
    a = run(layout, q, k, v, k_pos, q_pos, opts, fused_opts(threads=threads))
    b = run(layout, q, k, v, k_pos, q_pos, opts, fused_opts(threads=threads))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize(("block", "n_k"), [(128, 1500), (None, 2603)], ids=["block-128", "default-block"])
def test_batched_decode_is_bitwise_each_query_alone(rng, dtype, block, n_k):
    # The default block (RESIDENT_BLOCK) over 2603 keys: two full blocks and a tail whose
    # quarters leave keys over; the batch stacks the five queries' rows, alone each has its own.
    _, k, v, k_pos, _ = make(rng, dtype=dtype, n_k=n_k)
    view = StreamingKV.from_arrays(k, v, k_pos).snapshot()
    queries = []
    for i, case in enumerate(["plain", "causal", "window-softcap-alibi", "right-window", "causal"]):
        q = rng.standard_normal((1, 8, 16)).astype(dtype)
        _, opts, _ = options_of(case, 8, rng)
        q_pos = np.array([int(k_pos[0]) - 5 if i == 4 else int(rng.integers(k_pos[0], k_pos[-1]))])
        queries.append((q, q_pos, opts))
    kernel = fused_opts(threads=2, block_size=block)
    batch = partial_attention_resident_many(queries, view, kernel=kernel)
    for (q, q_pos, opts), st in zip(queries, batch):
        alone = partial_attention_resident(q, view, q_pos=q_pos, options=opts, kernel=kernel)
        for a, b in zip((st.m, st.l, st.acc), (alone.m, alone.l, alone.acc)):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16, np.float16], ids=lambda t: np.dtype(t).name)
def test_prefill_over_resident_keys_runs_in_row_tiles_and_matches_reference(rng, monkeypatch, case, dtype):
    # 21 queries x 4 rows = 84 rows per kv head, in tiles of 16: five whole tiles and a short one.
    monkeypatch.setattr(fused, "ROW_TILE", 16)
    _, k, v, k_pos, _ = make(rng, dtype=dtype, n_k=700)
    q = rng.standard_normal((21, 8, 16)).astype(dtype)  # [n_q, h_q, d]
    q_pos = np.sort(rng.integers(int(k_pos[0]), int(k_pos[-1]) + 3, 21))
    kw, opts, alibi = options_of(case, 8, rng)
    out, lse = run("resident", q, k, v, k_pos, q_pos, opts, fused_opts(threads=2), shards=2)
    assert fused.available()  # the tiles ran compiled: no fallback to NumPy
    assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, alibi_slopes=alibi, **kw)


def test_prefill_rows_are_bitwise_each_query_alone_whatever_the_row_tiles(rng, monkeypatch):
    _, k, v, k_pos, _ = make(rng, dtype=BFLOAT16, n_k=2603)
    view = StreamingKV.from_arrays(k, v, k_pos).snapshot()
    q = rng.standard_normal((12, 8, 16)).astype(BFLOAT16)  # 48 rows per kv head: prefill-shaped
    q_pos = np.sort(rng.integers(int(k_pos[0]), int(k_pos[-1]), 12))
    opts, kernel = AttentionOptions(causal=True, softcap=4.0), fused_opts(threads=2)
    whole = partial_attention_resident(q, view, q_pos=q_pos, options=opts, kernel=kernel)  # one tile
    monkeypatch.setattr(fused, "ROW_TILE", 8)
    tiled = partial_attention_resident(q, view, q_pos=q_pos, options=opts, kernel=kernel)  # six tiles
    for i in range(12):
        alone = partial_attention_resident(q[i:i + 1], view, q_pos=q_pos[i:i + 1], options=opts, kernel=kernel)
        for st in (whole, tiled):
            for a, b in zip((st.m, st.l, st.acc), (alone.m, alone.l, alone.acc)):
                assert np.array_equal(a[i:i + 1], b)
    assert fused.available()


def test_a_prefill_past_its_deadline_stops_between_row_tiles_and_keeps_the_kernel(rng, monkeypatch):
    import contextvars

    from workers import cutoff

    monkeypatch.setattr(fused, "ROW_TILE", 8)
    _, k, v, k_pos, _ = make(rng, n_k=300)
    view = StreamingKV.from_arrays(k, v, k_pos).snapshot()
    q = rng.standard_normal((6, 8, 16)).astype(np.float32)  # 24 rows per kv head: three tiles
    q_pos = np.full(6, int(k_pos[-1]))
    context = contextvars.copy_context()
    context.run(cutoff.DEADLINE.set, 0.0)  # a deadline long past, as workers.batch sets a batch's
    with pytest.raises(cutoff.Cut):
        context.run(partial_attention_resident, q, view, q_pos=q_pos, options=AttentionOptions(), kernel=fused_opts())
    assert fused.available()  # a cut is no failure of the compiled path


def test_a_long_prefill_holds_the_key_chunks_states_of_one_row_tile_not_of_all_its_rows(rng):
    import tracemalloc

    # One kv head at 2 threads: 8 key chunks, each with its own state until they merge. 2048 rows per
    # kv head: 8 row tiles. acc over all rows is 1 MiB; kept per chunk for every row it would be 8 MiB.
    n_k, h_q, d, d_v, n_q = 8 * fused.RESIDENT_BLOCK, 8, 16, 128, 256
    k = rng.standard_normal((n_k, 1, d)).astype(np.float32)
    v = rng.standard_normal((n_k, 1, d_v)).astype(np.float32)
    view = StreamingKV.from_arrays(k, v, np.arange(n_k)).snapshot()
    q = rng.standard_normal((n_q, h_q, d)).astype(np.float32)
    q_pos, kernel = np.full(n_q, n_k), fused_opts(threads=2)
    n_chunks = len(fused._chunks(n_k, fused.RESIDENT_BLOCK, 1, 2)) - 1
    assert n_chunks == 8 and n_q * h_q > 4 * fused.ROW_TILE
    partial_attention_resident(q, view, q_pos=q_pos, options=AttentionOptions(), kernel=kernel)  # compiled, warm
    tracemalloc.start()
    try:
        partial_attention_resident(q, view, q_pos=q_pos, options=AttentionOptions(), kernel=kernel)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    acc_bytes = n_q * h_q * d_v * 4  # the call's answer holds one; measured: 4.5 MiB at the peak, 12.4 before
    assert peak < 0.75 * n_chunks * acc_bytes, f"peak {peak / 2**20:.1f} MiB"
    assert fused.available()


# -- selection and fallback ---------------------------------------------------------------------

def problem_and_kv(rng, n_q=1, layout="inline"):
    q, k, v, k_pos, q_pos = make(rng)
    q = rng.standard_normal((n_q, q.shape[1], q.shape[2])).astype(np.float32)
    q_pos = np.full(n_q, int(k_pos[-1]))
    p = check_problem(q, k, v, q_pos, k_pos, AttentionOptions())
    kv = NaturalKV(k, v, p.k_pos) if layout == "inline" else StreamingKV.from_arrays(k, v, k_pos).snapshot()
    return q, p, kv


def test_choose_runs_fused_where_asked_and_prefill_only_over_resident_keys(rng):
    _, p, kv = problem_and_kv(rng)
    assert fused.choose([p], kv, KernelOptions()) is fused.CpuPath.NUMPY  # the default
    assert fused.choose([p], kv, fused_opts()) is fused.CpuPath.FUSED
    _, p, view = problem_and_kv(rng, layout="resident")
    assert fused.choose([p], view, fused_opts()) is fused.CpuPath.FUSED
    _, p, kv = problem_and_kv(rng, n_q=5)  # 5 x 4 = 20 rows per kv head: still decode-shaped
    assert fused.choose([p], kv, fused_opts()) is fused.CpuPath.FUSED
    _, p, kv = problem_and_kv(rng, n_q=9)  # 36 rows: prefill-shaped over the contract layout, BLAS
    assert fused.choose([p], kv, fused_opts()) is fused.CpuPath.NUMPY
    _, p, view = problem_and_kv(rng, n_q=9, layout="resident")  # over the resident layout: the register tiles
    assert fused.choose([p], view, fused_opts()) is fused.CpuPath.FUSED
    _, p, view = problem_and_kv(rng, n_q=600, layout="resident")  # 2400 rows: a prefill, on the (packed) tiles
    assert fused.choose([p], view, fused_opts()) is fused.CpuPath.FUSED


def test_auto_picks_numpy_until_this_process_has_warmed_the_kernels_then_fused(rng, monkeypatch):
    _, p, view = problem_and_kv(rng, layout="resident")
    auto = KernelOptions(cpu_kernels="auto")
    monkeypatch.setitem(fused._state, "ready_at", None)
    assert fused.choose([p], view, auto) is fused.CpuPath.NUMPY
    fused.warm()  # compiled by the tests above, or loaded from numba's disk cache
    assert fused.ready_at() is not None and fused.choose([p], view, auto) is fused.CpuPath.FUSED
    monkeypatch.setitem(fused._state, "broken", True)  # a broken compiled path: NumPy again
    assert fused.ready_at() is None and fused.choose([p], view, auto) is fused.CpuPath.NUMPY


def test_a_background_compile_readies_auto_and_a_call_meanwhile_runs_on_numpy(rng, monkeypatch):
    monkeypatch.setitem(fused._state, "ready_at", None)
    q, p, view = problem_and_kv(rng, layout="resident")
    auto = KernelOptions(cpu_kernels="auto")
    thread = fused.warm_in_background()
    before = partial_attention_resident(q, view, q_pos=p.q_pos, options=AttentionOptions(), kernel=auto)
    thread.join(timeout=fused.COMPILE_APART_S)
    assert fused.ready_at() is not None and fused.choose([p], view, auto) is fused.CpuPath.FUSED
    after = partial_attention_resident(q, view, q_pos=p.q_pos, options=AttentionOptions(), kernel=auto)
    numpy_state = partial_attention_resident(q, view, q_pos=p.q_pos, options=AttentionOptions(),
                                             kernel=KernelOptions())
    fused_state = partial_attention_resident(q, view, q_pos=p.q_pos, options=AttentionOptions(), kernel=fused_opts())
    if not thread.is_alive() and fused.ready_at() is not None:
        # The switch changes last bits (two kernels, two orders of arithmetic); each side is its kernel's.
        np.testing.assert_array_equal(after.acc, fused_state.acc)
    assert before.acc.tobytes() in (numpy_state.acc.tobytes(), fused_state.acc.tobytes())


def test_a_background_compile_that_fails_leaves_numpy_serving_with_one_log_line(rng, monkeypatch, caplog):
    import sys

    monkeypatch.setitem(fused._state, "ready_at", None)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the child exits 1 at once
    with caplog.at_level(logging.WARNING, logger="workers.fused"):
        fused.warm_in_background().join(timeout=30)
    assert fused.ready_at() is None
    assert [r.getMessage() for r in caplog.records if "background" in r.getMessage()] == [
        "fused CPU kernel not compiled in the background (exit 1: no output): the NumPy kernel serves"]
    _, p, view = problem_and_kv(rng, layout="resident")
    assert fused.choose([p], view, KernelOptions(cpu_kernels="auto")) is fused.CpuPath.NUMPY


def test_choose_falls_back_for_keys_whose_inner_axis_is_strided(rng):
    q, k, v, k_pos, q_pos = make(rng)
    k2 = np.repeat(k, 2, axis=2)[:, :, ::2]  # same values, dim stride 2
    p = check_problem(q, k2, v, q_pos, k_pos, AttentionOptions())
    assert fused.choose([p], NaturalKV(k2, v, p.k_pos), fused_opts()) is fused.CpuPath.NUMPY
    st = partial_attention_shard(q, k2, v, q_pos=q_pos, k_pos=k_pos, options=AttentionOptions(), kernel=fused_opts())
    assert_close_to_reference(*finalize(st), q, k, v, q_pos=q_pos, k_pos=k_pos)


def test_choose_sends_to_numpy_the_dtype_mixes_that_warm_does_not_compile(rng):
    q, k, v, k_pos, q_pos = make(rng, dtype=np.float16)
    for q_dt, k_dt, v_dt, path in [(np.float16, np.float16, np.float16, fused.CpuPath.FUSED),
                                   (np.float32, BFLOAT16, BFLOAT16, fused.CpuPath.FUSED),
                                   (np.float64, np.float64, np.float64, fused.CpuPath.FUSED),
                                   (np.float64, np.float16, np.float16, fused.CpuPath.NUMPY),  # float64 sums
                                   (np.float32, np.float16, np.float32, fused.CpuPath.NUMPY),  # k, v apart
                                   (np.float32, np.float64, np.float64, fused.CpuPath.FUSED)]:
        qq, kk, vv = q.astype(q_dt), k.astype(k_dt), v.astype(v_dt)
        p = check_problem(qq, kk, vv, q_pos, k_pos, AttentionOptions())
        assert fused.choose([p], NaturalKV(kk, vv, p.k_pos), fused_opts()) is path, (q_dt, k_dt, v_dt)
        if k_dt is v_dt:  # a resident context holds K and V in one dtype
            view = StreamingKV.from_arrays(kk, vv, k_pos).snapshot()
            assert fused.choose([p], view, fused_opts()) is path, (q_dt, k_dt, v_dt)


def test_no_call_the_fused_kernel_serves_compiles_after_warm(rng):
    """Every mix of q, K and V dtypes that ``choose`` sends to the fused kernel was compiled by ``warm``
    (a worker's start): no request pays for a compile. Before 2026-12-06 a float64 query over a
    float16 context compiled on its first request (41 s on 2 cores); before 2026-12-07 the first
    inline request of each dtype did (12-13 s): its keys, values and positions arrive read-only (views
    of its body), which numba types apart from ``warm``'s writable arrays."""
    mod = fused.kernels()
    fused.warm()
    kernels = (mod.inline_kernel, mod.resident_kernel)
    compiled = [len(fn.signatures) for fn in kernels]
    q, k, v, k_pos, q_pos = make(rng, n_k=40)
    for q_dt, k_dt, v_dt in itertools.product(DTYPES, repeat=3):
        for writable, positions in itertools.product((True, False), ("given", "default")):
            qq, kk, vv, pos = q.astype(q_dt), k.astype(k_dt), v.astype(v_dt), k_pos.copy()
            for a in (kk, vv, pos):
                a.flags.writeable = writable  # read-only: as a request's body gives them
            p = check_problem(qq, kk, vv, q_pos, pos if positions == "given" else None, AttentionOptions())
            layouts = [NaturalKV(kk, vv, p.k_pos)]
            if k_dt is v_dt:  # a resident context holds K and V in one dtype
                layouts.append(StreamingKV.from_arrays(kk, vv, pos).snapshot())
            for kv in layouts:
                if fused.choose([p], kv, fused_opts()) is fused.CpuPath.FUSED:
                    assert fused.try_fused([(qq, p)], kv, fused_opts()) is not None
    assert [len(fn.signatures) for fn in kernels] == compiled


def test_cpu_kernels_option_is_validated():
    assert KernelOptions(cpu_kernels="fused").cpu_kernels is CpuKernels.FUSED
    with pytest.raises(ValueError, match="cpu_kernels must be one of 'numpy', 'fused', 'auto', got 'fast'"):
        KernelOptions(cpu_kernels="fast")


def test_missing_numba_falls_back_to_numpy_with_one_log_line(rng, monkeypatch, caplog):
    q, k, v, k_pos, q_pos = make(rng)
    fused.kernels.cache_clear()

    def no_numba(name, *args, **kwargs):
        if name == "workers.fused_kernels" or (name == "workers" and "fused_kernels" in (args[2] or ())):
            raise ImportError("No module named 'numba'")
        return real_import(name, *args, **kwargs)

    import builtins
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", no_numba)
    try:
        with caplog.at_level(logging.WARNING, logger="workers.fused"):
            assert fused.kernels() is None
            st = partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=AttentionOptions(),
                                         kernel=fused_opts())
            assert fused.warm() == {}
    finally:
        monkeypatch.undo()
        fused.kernels.cache_clear()
    assert len([r for r in caplog.records if "NumPy kernel" in r.message]) == 1
    ref = partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=AttentionOptions(),
                                  kernel=KernelOptions())
    assert np.array_equal(st.acc, ref.acc) and np.array_equal(st.m, ref.m)  # NumPy answered
    assert fused.kernels() is not None


def test_broken_compiled_kernel_falls_back_to_numpy_once(rng, monkeypatch, caplog):
    q, k, v, k_pos, q_pos = make(rng)
    mod = fused.kernels()

    class Broken:
        def __getattr__(self, name):
            def fail(*args):
                raise RuntimeError("LLVM ERROR: simulated")
            return fail

    monkeypatch.setattr(fused, "kernels", lambda: Broken() if mod else None)
    monkeypatch.setitem(fused._state, "broken", False)
    with caplog.at_level(logging.WARNING, logger="workers.fused"):
        a = partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=AttentionOptions(), kernel=fused_opts())
        b = partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=AttentionOptions(), kernel=fused_opts())
        assert not fused.available()
    assert len([r for r in caplog.records if "fused CPU kernel failed" in r.message]) == 1
    ref = partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=AttentionOptions(), kernel=KernelOptions())
    for st in (a, b):
        assert np.array_equal(st.acc, ref.acc) and np.array_equal(st.l, ref.l)


def test_a_call_out_of_memory_runs_on_numpy_and_leaves_the_fused_path_on(rng, monkeypatch, caplog):
    q, k, v, k_pos, q_pos = make(rng)
    real = fused.run_fused
    calls = []

    def short_of_memory(*args):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError()
        return real(*args)

    monkeypatch.setattr(fused, "run_fused", short_of_memory)
    monkeypatch.setitem(fused._state, "broken", False)
    with caplog.at_level(logging.WARNING, logger="workers.fused"):
        a = partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=AttentionOptions(), kernel=fused_opts())
        assert fused.available()  # not a broken kernel: the next call takes the fused path again
        b = partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=AttentionOptions(), kernel=fused_opts())
    assert len(calls) == 2 and any("out of memory" in r.message for r in caplog.records)
    ref = partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=AttentionOptions(), kernel=KernelOptions())
    assert np.array_equal(a.acc, ref.acc) and np.array_equal(a.l, ref.l)  # NumPy answered the first
    np.testing.assert_allclose(b.acc, ref.acc, rtol=1e-5, atol=1e-6)


def test_disabled_jit_is_named_in_the_one_log_line(monkeypatch, caplog):
    import numba

    fused.kernels.cache_clear()
    monkeypatch.setattr(numba.config, "DISABLE_JIT", True)
    try:
        with caplog.at_level(logging.WARNING, logger="workers.fused"):
            assert fused.kernels() is None
    finally:
        monkeypatch.undo()
        fused.kernels.cache_clear()
    assert [r.message for r in caplog.records if "NumPy kernel" in r.message] == [
        "fused CPU kernel unavailable, using the NumPy kernel: numba's JIT is disabled (NUMBA_DISABLE_JIT)"]
    assert fused.kernels() is not None


def test_warm_compiles_each_dtype_for_both_layouts():
    took = fused.warm(("float32", "bfloat16"))
    assert set(took) == {"float32", "bfloat16"} and all(t >= 0 for t in took.values())


def test_kernel_file_names_the_digest_of_the_micro_kernels_it_compiles_in():
    # numba's disk cache checks only fused_kernels.py's stamp: a change to the micro-kernels
    # must come with a new digest there, so that no worker loads stale machine code.
    import hashlib
    from pathlib import Path

    workers_dir = Path(fused.__file__).parent
    digest = hashlib.sha256()
    for name in ("fused_dots.py", "fused_micro.py", "fused_simd.py"):
        digest.update((workers_dir / name).read_bytes())
    assert fused.kernels().COMPILED_IN_DIGEST == digest.hexdigest()[:16]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_row_of_probabilities_is_summed_in_its_written_order_under_reassoc(rng, dtype):
    # The kernels compile with FASTMATH's reassoc; the sum behind l must keep one order wherever it is
    # compiled (tests/e2e/test_workers_fused.py runs a compile against a load from the disk cache).
    import numba

    kernels = fused.kernels()
    summed = numba.njit(fastmath=kernels.FASTMATH)(lambda row, nb, zero: kernels.sum_in_order(row, nb, zero))

    def written(row: np.ndarray) -> float:  # element j into sum j % 8 over whole groups, a fixed tree, the rest
        n8 = row.size // 8 * 8
        s = [dtype(0)] * 8
        for j in range(n8):
            s[j % 8] = dtype(s[j % 8] + row[j])
        total = dtype(dtype(dtype(s[0] + s[1]) + dtype(s[2] + s[3])) + dtype(dtype(s[4] + s[5]) + dtype(s[6] + s[7])))
        for x in row[n8:]:
            total = dtype(total + x)
        return total

    differs = 0
    for nb in [*range(0, 20), 63, 64, 65, 1000, 1024]:
        row = rng.uniform(0, 1, nb + 3).astype(dtype) ** 3  # [nb + 3]: elements past nb are not summed
        got = dtype(summed(row, nb, dtype(0)))
        assert np.asarray(got).tobytes() == np.asarray(written(row[:nb])).tobytes(), nb
        differs += bool(nb) and got != np.cumsum(row[:nb], dtype=dtype)[-1]
    assert differs, "the order must matter for these rows, or the test could not fail"


def test_values_take_the_register_tiles_for_every_dtype_and_inline_float32_only_at_sixteen_lanes():
    # workers.fused_kernels.pv_dense (resident: value rows d_v apart) runs float32 on the tiles too;
    # pv (inline: value rows a whole key apart) keeps float32 on the loop at eight lanes
    # (benchmarks/results/2026-12-05/NOTES.md, "A Zen 1 host") and takes the tiles at sixteen
    # (benchmarks/results/2026-12-07/NOTES.md, "Sixteen lanes").
    from numba.core import types

    mod = fused.kernels()
    f32 = types.Array(types.float32, 2, "C")  # s [R, B] and acc [R, d_v]
    inline_f32 = "micro" if mod.WIDE == 16 else "loop"
    for bits, dense, want in ((types.float32, True, "micro"), (types.float32, False, inline_f32),
                              (types.uint16, True, "micro"), (types.uint16, False, "micro"),
                              (types.int16, True, "micro"), (types.int16, False, "micro"),
                              (types.float64, True, "loop")):
        values = types.Array(bits, 1, "C")  # flat values as the kernels get them
        acc = types.Array(types.float64, 2, "C") if bits == types.float64 else f32
        assert mod._pv_choice(acc, acc, values, dense).__name__ == want, (bits, dense)


def test_resident_scores_take_the_register_tiles_for_float32_and_16_bit_keys_and_float64_the_loop():
    # workers.fused_kernels._dense_choice: d-major keys (the resident layout) run float32 on the
    # tiles too, which prefetch along each run (benchmarks/results/2026-12-05/NOTES.md, "Scores prefetch along their own runs"),
    # and so do the inline layout's scores (2026-12-07/NOTES.md, "A Zen 4 host"); float64 and mixed dtypes,
    # and arrays that are not C-contiguous, take the loop.
    from numba.core import types

    mod = fused.kernels()
    f32, f64 = types.Array(types.float32, 2, "C"), types.Array(types.float64, 2, "C")  # q [R, d], s [R, B]
    for rows, keys, want in ((f32, types.Array(types.float32, 1, "C"), True),
                             (f32, types.Array(types.uint16, 1, "C"), True),
                             (f32, types.Array(types.int16, 1, "C"), True),
                             (f64, types.Array(types.float64, 1, "C"), False),
                             (f32, types.Array(types.float64, 1, "C"), False),
                             (f32, types.Array(types.float32, 1, "A"), False)):
        assert mod._dense_choice(rows, rows, keys) is want, (rows, keys)


P = 2**61  # workers.options.MAX_POSITION: the range's ends


@pytest.mark.parametrize("kernel", ["numpy", "fused"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case, q_pos, k_pos, opts, want_out, want_lse", [
    # ALiBi's distance 2P: the far key gets a penalty of 2P, not a wrapped-around bonus.
    ("alibi", [P], [-P, P], dict(alibi_slopes=np.array([1.0])), [20.0], [1.0]),
    ("window", [P], [-P, P], dict(window=(0, None)), [20.0], [1.0]),
    ("window_right", [-P], [-P, P], dict(window=(None, 0)), [10.0], [1.0]),
    ("wide_window", [P], [-P, P], dict(window=(2**62, 2**62)), [15.0], [1.0 + np.log(2.0)]),
    ("causal", [0, P], [P, 0, -P], dict(causal=True), [30.0, 70.0 / 3], [1.0 + np.log(2.0), 1.0 + np.log(3.0)]),
], ids=lambda x: x if isinstance(x, str) else "")
def test_positions_at_the_ends_of_their_range_mask_and_bias_exactly(layout, kernel, case, q_pos, k_pos, opts,
                                                                   want_out, want_lse):
    """Every q_pos - k_pos within +-2**61 positions fits int64 (docs/API.md section 2, "Position range")."""
    n_q, n_k = len(q_pos), len(k_pos)
    q = np.ones((n_q, 1, 1))
    k = np.ones((n_k, 1, 1))
    v = np.array([10.0, 20.0, 40.0][:n_k]).reshape(n_k, 1, 1)
    chosen = fused_opts() if kernel == "fused" else KernelOptions()
    out, lse = run(layout, q, k, v, np.array(k_pos), np.array(q_pos), AttentionOptions(scale=1.0, **opts), chosen)
    np.testing.assert_allclose(out[:, 0, 0], want_out, rtol=1e-12)
    np.testing.assert_allclose(lse[:, 0], want_lse, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_max_is_the_largest_score_for_every_length(rng, dtype):
    # float32 rows take the maximum WIDE lanes at a time, float64 one chain: both exact.
    numba = pytest.importorskip("numba")
    mod = fused.kernels()

    @numba.njit
    def row_max(row, nb, start):
        return mod.row_max(row, nb, start)

    wide = mod.WIDE
    for nb in (0, 1, wide - 1, wide, wide + 1, 3 * wide + 5, 1024):
        row = rng.standard_normal(nb + 3).astype(dtype)
        row[nb:] = 100.0  # past nb: never read
        row[: nb // 2] = -np.inf  # masked keys
        for start in (dtype(-np.inf), dtype(0.25), dtype(50.0)):
            want = max([start, *row[:nb]])
            assert row_max(row, nb, start) == want, (nb, start)
