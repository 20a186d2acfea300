"""partial_attention / attention against the float64 reference over many cases."""

import warnings

import numpy as np
import pytest
from reference import assert_close_to_reference, reference

from merge import finalize, merge_all
from workers import BFLOAT16, attention, bfloat16_from_bits, partial_attention
from workers.api import partial_attention_shard
from workers.options import AttentionOptions, KernelOptions

DTYPES = [np.float16, BFLOAT16, np.float32, np.float64]


def make(rng, n_q, h_q, h_kv, d, d_v, n_k, dtype=np.float64, spread=1.0):
    q = (rng.standard_normal((n_q, h_q, d)) * spread).astype(dtype)
    k = rng.standard_normal((n_k, h_kv, d)).astype(dtype)
    v = rng.standard_normal((n_k, h_kv, d_v)).astype(dtype)
    return q, k, v


def random_options(rng, n_q, n_k, h_q):
    """One random combination of every option of docs/API.md section 3."""
    opts = {}
    if rng.random() < 0.5:
        opts["causal"] = True
    if rng.random() < 0.4:
        left = None if rng.random() < 0.3 else int(rng.integers(0, max(n_k, 1)))
        right = None if rng.random() < 0.3 else int(rng.integers(0, 5))
        opts["window"] = (left, right)
    if rng.random() < 0.3:
        opts["softcap"] = float(rng.uniform(1, 30))
    if rng.random() < 0.3:
        opts["alibi_slopes"] = rng.uniform(0, 0.5, h_q)
    if rng.random() < 0.3:
        opts["scale"] = float(rng.uniform(0.05, 1.0))
    if rng.random() < 0.4:
        # Arbitrary (unsorted, gappy) positions: the mask must still be exact.
        opts["k_pos"] = rng.permutation(n_k * 3)[:n_k].astype(np.int64)
        opts["q_pos"] = rng.integers(0, n_k * 3, n_q).astype(np.int64)
    return opts


@pytest.mark.parametrize("seed", range(60))
def test_sharded_attention_matches_reference_on_random_cases(seed):
    rng = np.random.default_rng(seed)
    h_kv = int(rng.choice([1, 2, 4]))
    h_q = h_kv * int(rng.choice([1, 2, 4]))
    d = int(rng.choice([1, 8, 16, 64]))
    d_v = int(rng.choice([d, 4, 24]))
    n_q = int(rng.integers(1, 40))
    n_k = int(rng.integers(0, 300))
    dtype = DTYPES[seed % len(DTYPES)]
    q, k, v = make(rng, n_q, h_q, h_kv, d, d_v, n_k, dtype, spread=float(rng.choice([0.5, 2.0, 6.0])))
    opts = random_options(rng, n_q, n_k, h_q)
    shards = int(rng.integers(1, 10))
    block = int(rng.integers(1, max(n_k, 1) + 1))
    threads = int(rng.choice([1, 2]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention(q, k, v, shards=shards, block_size=block, threads=threads, **opts)
    want_dtype = np.float64 if dtype == np.float64 else np.float32
    assert out.dtype == want_dtype and lse.dtype == want_dtype
    assert out.shape == (n_q, h_q, d_v) and lse.shape == (n_q, h_q)
    assert_close_to_reference(out, lse, q, k, v, **opts)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("shards", [1, 2, 3, 5, 9])
def test_each_dtype_and_shard_count_matches_reference(rng, dtype, shards):
    q, k, v = make(rng, 7, 8, 2, 32, 16, 257, dtype)
    out, lse = attention(q, k, v, shards=shards, block_size=37, causal=True)
    assert_close_to_reference(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("block", [1, 2, 7, 64, 100, 101, 1000])
def test_every_block_size_gives_the_same_answer(rng, block):
    q, k, v = make(rng, 3, 4, 2, 16, 16, 101, np.float32)
    out, lse = attention(q, k, v, block_size=block, window=(30, 4), alibi_slopes=np.linspace(0.1, 0.4, 4))
    assert_close_to_reference(out, lse, q, k, v, window=(30, 4), alibi_slopes=np.linspace(0.1, 0.4, 4))


def test_decode_split_k_over_threads_matches_reference(rng):
    q, k, v = make(rng, 1, 32, 8, 128, 128, 5000, np.float32)
    for threads in (1, 2, 3):
        out, lse = attention(q, k, v, threads=threads, block_size=512)
        assert_close_to_reference(out, lse, q, k, v)


def test_prefill_tiles_rows_and_matches_reference(rng):
    q, k, v = make(rng, 300, 8, 2, 32, 32, 700, np.float32)
    out, lse = attention(q, k, v, causal=True, threads=2)
    assert_close_to_reference(out, lse, q, k, v, causal=True)


def test_fully_masked_shard_is_empty_and_merges_exactly(rng):
    q, k, v = make(rng, 2, 2, 1, 8, 8, 40)
    q_pos = np.array([10, 11])
    k_pos = np.arange(40)
    # Causal: keys 12..39 are in the future of every query; that shard is fully masked.
    late = partial_attention(q, k[12:], v[12:], causal=True, q_pos=q_pos, k_pos=k_pos[12:])
    assert np.all(late.m == -np.inf) and np.all(late.l == 0) and np.all(late.acc == 0)
    early = partial_attention(q, k[:12], v[:12], causal=True, q_pos=q_pos, k_pos=k_pos[:12])
    out, lse = finalize(merge_all([early, late]))
    ref_out, ref_lse = reference(q, k, v, causal=True, q_pos=q_pos, k_pos=k_pos)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)


def test_query_that_sees_no_key_gets_zero_out_and_minus_inf_lse(rng):
    q, k, v = make(rng, 3, 2, 2, 4, 4, 10, np.float32)
    q_pos = np.array([-5, 3, 100])  # the first sees nothing under causal; the last nothing under window
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention(q, k, v, causal=True, window=(20, None), q_pos=q_pos, shards=3, block_size=3)
    assert np.all(lse[0] == -np.inf) and np.all(out[0] == 0)
    assert np.all(lse[2] == -np.inf) and np.all(out[2] == 0)
    assert np.all(np.isfinite(lse[1]))
    assert_close_to_reference(out, lse, q, k, v, causal=True, window=(20, None), q_pos=q_pos)


def test_empty_keys_give_the_empty_state():
    st = partial_attention(np.ones((2, 4, 8), np.float32), np.ones((0, 2, 8), np.float32), np.ones((0, 2, 3), np.float32))
    assert st.acc.shape == (2, 4, 3) and np.all(st.m == -np.inf) and np.all(st.l == 0)


def test_float32_scores_in_the_hundreds_stay_finite(rng):
    q, k, v = make(rng, 2, 2, 1, 16, 8, 64, np.float32, spread=60.0)
    out, lse = attention(q, k, v, shards=3, block_size=5)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert float(np.max(lse)) > 100
    assert_close_to_reference(out, lse, q, k, v)


def test_bfloat16_from_raw_bits_equals_ml_dtypes(rng):
    q, k, v = make(rng, 2, 4, 2, 8, 8, 30, BFLOAT16)
    kb = bfloat16_from_bits(k.view(np.uint16))
    a = attention(q, k, v)
    b = attention(q, kb, v)
    np.testing.assert_array_equal(a[0], b[0])


def test_default_positions_align_queries_with_the_last_keys(rng):
    q, k, v = make(rng, 4, 2, 1, 8, 8, 10)
    out, lse = attention(q, k, v, causal=True)
    explicit = attention(q, k, v, causal=True, q_pos=np.arange(6, 10), k_pos=np.arange(10))
    np.testing.assert_array_equal(out, explicit[0])
    # The first query (position 6) sees keys 0..6 only.
    ref_out, _ = reference(q[:1], k[:7], v[:7], causal=True, q_pos=np.array([6]), k_pos=np.arange(7))
    np.testing.assert_allclose(out[:1], ref_out, rtol=1e-12)


def test_default_query_positions_end_one_past_the_last_given_key_position(rng):
    # Keys given at 100..109: queries without positions are the last n_q of them, as the
    # service places them, not 6..9 (which would see no key under causal).
    q, k, v = make(rng, 4, 2, 1, 8, 8, 10)
    out, lse = attention(q, k, v, causal=True, k_pos=np.arange(100, 110))
    explicit = attention(q, k, v, causal=True, q_pos=np.arange(106, 110), k_pos=np.arange(100, 110))
    np.testing.assert_array_equal(out, explicit[0])
    assert np.isfinite(lse).all()


def test_default_query_positions_end_one_past_negative_key_positions_too(rng):
    q, k, v = make(rng, 3, 2, 1, 8, 8, 1)
    out, lse = attention(q, k, v, causal=True, k_pos=np.array([-5]))
    explicit = attention(q, k, v, causal=True, q_pos=np.array([-7, -6, -5]), k_pos=np.array([-5]))
    np.testing.assert_array_equal(out, explicit[0])
    assert np.isneginf(lse[:2]).all() and np.isfinite(lse[2]).all()  # queries at -7 and -6 see no key


def test_gqa_maps_query_head_i_to_kv_head_i_div_g(rng):
    q, k, v = make(rng, 1, 4, 2, 8, 8, 20)
    out, _ = attention(q, k, v)
    for i in range(4):
        single, _ = attention(q[:, i:i + 1], k[:, i // 2:i // 2 + 1], v[:, i // 2:i // 2 + 1])
        np.testing.assert_allclose(out[:, i], single[:, 0], rtol=1e-12)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda q, k, v: partial_attention(q[0], k, v), r"q must be \[n_q, h_q, d\], got shape \(4, 8\)"),
        (lambda q, k, v: partial_attention(q, k[:, :, :4], v), "k must have head dim d = 8 as q, got 4"),
        (lambda q, k, v: partial_attention(q, k, v[:5]), r"v must be \[n_k, h_kv, d_v\]"),
        (lambda q, k, v: partial_attention(q[:, :3], k, v), "h_q must be a positive multiple of h_kv, got h_q = 3, h_kv = 2"),
        (lambda q, k, v: partial_attention(q.astype(np.int32), k, v), "q must have dtype float16, bfloat16, float32 or float64, got int32"),
        (lambda q, k, v: partial_attention(q, k, v, q_pos=np.arange(3)), r"q_pos must have shape \[2\], got \(3,\)"),
        (lambda q, k, v: partial_attention(q, k, v, k_pos=np.arange(9)), r"k_pos must have shape \[10\], got \(9,\)"),
        (lambda q, k, v: partial_attention(q, k, v, k_pos=np.zeros(10)), "k_pos must be an integer array, got dtype float64"),
        (lambda q, k, v: partial_attention(q, k, v, k_pos=[[0, 1], [2]]), r"k_pos must have shape \[10\], got a ragged sequence"),
        (lambda q, k, v: partial_attention(q, k, v, q_pos=[8, [9]]), r"q_pos must have shape \[2\], got a ragged sequence"),
        (lambda q, k, v: partial_attention(q, k, v, q_pos=[2**70, 1]),  # "an integer array, got dtype object" before
         r"q_pos must lie within \+-2\*\*61, got values in \[1, 1180591620717411303424\]"),
        (lambda q, k, v: partial_attention(q, k, v, scale=-1.0), "scale must be a finite number > 0, got -1.0"),
        (lambda q, k, v: partial_attention(q, k, v, scale=float("nan")), "scale must be a finite number, got nan"),
        (lambda q, k, v: partial_attention(q, k, v, scale=10**400), "scale must be a finite number, got 1000"),
        (lambda q, k, v: partial_attention(q, k, v, scale=1e39),  # every float32 score inf: "overflow" before
         r"scale must be at most 3.403e\+38 \(float32's range\), got 1e\+39"),
        (lambda q, k, v: partial_attention(q, k, v, window=(1,)), r"window must be \[left, right\], .* got \[1\]"),
        (lambda q, k, v: partial_attention(q, k, v, window=(-1, None)),
         r"window must be \[left, right\], each null or an int in \[0, 2\*\*62\], got \[-1, None\]"),
        (lambda q, k, v: partial_attention(q, k, v, softcap=-2.0), "softcap must be a finite number >= 0, got -2.0"),
        (lambda q, k, v: partial_attention(q, k, v, softcap=1e39),  # float32 tanh * inf: NaN answers before
         r"softcap must be at most 3.403e\+38 \(float32's range\), got 1e\+39"),
        (lambda q, k, v: partial_attention(q, k, v, alibi_slopes=np.ones(3)), r"alibi_slopes must have shape \[4\], got \(3,\)"),
        (lambda q, k, v: partial_attention(q, k, v, alibi_slopes=[[0.5, 0.25], [1.0]]),
         r"alibi_slopes must have shape \[4\], got a ragged sequence"),
        (lambda q, k, v: partial_attention(q, k, v, alibi_slopes=np.array([1.0, 1e39, 1.0, 1.0])),
         r"alibi_slopes must lie within \+-3.403e\+38 \(float32's range\), got a slope of magnitude 1e\+39"),
        (lambda q, k, v: partial_attention(q, k, v, block_size=0), "block_size must be null or an int >= 1, got 0"),
        (lambda q, k, v: partial_attention(q, k, v, causal="yes"), "causal must be a bool, got 'yes'"),
        (lambda q, k, v: attention(q, k, v, shards=0), "shards must be an int >= 1, got 0"),
        (lambda q, k, v: partial_attention(q.tolist(), k, v), "q must be a numpy or cupy array, got list"),
        (lambda q, k, v: partial_attention_shard(q, k, v, q_pos=None, k_pos=None, options=None,
                                                 kernel=KernelOptions()), "options must be an AttentionOptions, got NoneType"),
        (lambda q, k, v: partial_attention_shard(q, k, v, q_pos=None, k_pos=None, options=AttentionOptions(),
                                                 kernel=None), "kernel must be a KernelOptions, got NoneType"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(call, match):
    rng = np.random.default_rng(0)
    q, k, v = make(rng, 2, 4, 2, 8, 8, 10)
    with pytest.raises(ValueError, match=match):
        call(q, k, v)


@pytest.mark.parametrize("cpu_kernels", ["numpy", "fused"])
def test_a_row_whose_every_visible_score_overflowed_towards_minus_inf_is_nan_not_a_row_that_saw_no_key(cpu_kernels):
    """Scores of -1e40 and -2e40 are -inf in float32; the exact answer weighs the first key alone. Before
    2026-12-06 such a row read as one that saw no key (out 0, lse -inf): a wrong answer."""
    pytest.importorskip("numba") if cpu_kernels == "fused" else None
    big = np.float32(1e20)
    q = np.array([[[-1.0, -2.0]], [[-1.0, -2.0]]], np.float32) * big  # [n_q=2, h_q=1, d=2]
    k = np.array([[[1.0, 0.0]], [[0.0, 1.0]]], np.float32) * big  # [n_k=2, h_kv=1, d=2]
    v = np.array([[[1.0]], [[2.0]]], np.float32)
    opts = AttentionOptions(causal=True)
    kernel = KernelOptions(cpu_kernels=cpu_kernels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the scores' overflow
        st = partial_attention_shard(q, k, v, q_pos=np.array([-1, 5]), k_pos=None, options=opts, kernel=kernel)
        # row 0 (at -1) sees no key: the empty row, exactly; row 1 sees both and every score overflowed
        assert st.m[0, 0] == -np.inf and st.m[1, 0] == np.finfo(np.float32).min and (st.l == 0).all()
        out, lse = finalize(st)
        assert out[0, 0, 0] == 0 and lse[0, 0] == -np.inf
        assert np.isnan(out[1, 0, 0]) and np.isnan(lse[1, 0])  # as a score past +inf gives: refused by the service
        for shards in (2, 3):  # shards that saw some of the keys, or none
            out, lse = attention(q, k, v, shards=shards, causal=True, q_pos=[-1, 5])
            assert out[0, 0, 0] == 0 and np.isnan(out[1, 0, 0]) and np.isnan(lse[1, 0])
        # Beside a finite score the overflowed keys weigh nothing (their exact weights round to 0): the
        # state merges as any other, and the row answers the finite key's value exactly.
        finite = partial_attention_shard(q, np.zeros((1, 1, 2), np.float32), np.full((1, 1, 1), 7.0, np.float32),
                                         q_pos=np.array([-1, 5]), k_pos=np.array([0]), options=opts, kernel=kernel)
        out, lse = finalize(merge_all([st, finite]))
        assert out[1, 0, 0] == 7.0 and lse[1, 0] == 0.0 and out[0, 0, 0] == 0 and lse[0, 0] == -np.inf
        # ALiBi biases past float32's range on every key (slope 1e38 over distances 9 and 10): NaN too.
        out, _ = attention(np.zeros((1, 1, 2), np.float32), k / big, v, q_pos=[10], alibi_slopes=np.array([1e38]))
        assert np.isnan(out).all()


def test_bfloat16_alibi_slopes_give_what_float32_slopes_of_the_same_values_give(rng):
    q, k, v = make(rng, 3, 4, 2, 8, 8, 20)
    slopes = np.array([0.5, 0.25, 0.125, 1.0], BFLOAT16)
    got = attention(q, k, v, causal=True, alibi_slopes=slopes)
    want = attention(q, k, v, causal=True, alibi_slopes=slopes.astype(np.float32))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_empty_position_lists_of_an_empty_axis_are_taken(rng):
    q, k, v = make(rng, 2, 4, 2, 8, 8, 0)  # no keys: k_pos = [] reads as float64 in NumPy
    out, lse = attention(q[:0], k, v, q_pos=[], k_pos=[])
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4)
    out, lse = attention(q, k, v, k_pos=[], q_pos=[3, 4])
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_a_huge_softcap_is_served_and_equals_no_softcap_at_these_scores(rng):
    q, k, v = (a.astype(np.float32) for a in make(rng, 1, 2, 1, 8, 8, 16))
    plain = attention(q, k, v)
    capped = attention(q, k, v, softcap=1e30)  # c tanh(s / c) = s to float32's precision
    np.testing.assert_allclose(capped[0], plain[0], rtol=1e-6)
    # Up to float32's largest the answer stays finite (past it: refused, not NaN); scale / softcap x q
    # is then below float32's normal range, where it keeps fewer digits (docs/API.md, "Overflow").
    top = attention(q, k, v, softcap=3e38)
    assert np.isfinite(top[0]).all() and np.isfinite(top[1]).all()
    np.testing.assert_allclose(top[0], plain[0], rtol=1e-4)
