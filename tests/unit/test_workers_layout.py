import numpy as np
import pytest
from reference import assert_close_to_reference, contract_layout

from merge import finalize
from workers import BFLOAT16, StreamingKV, StreamingView, partial_attention_resident
from workers.layout import LINE_BYTES, PAGE_BYTES, padded_capacity
from workers.options import AttentionOptions, KernelOptions


def test_streaming_layout_after_appends_equals_the_concatenated_arrays(rng):
    k = rng.standard_normal((1000, 2, 8)).astype(np.float32)
    v = rng.standard_normal((1000, 2, 5)).astype(np.float32)
    kv = StreamingKV(2, 8, 5, np.float32)
    for a, b in ((0, 1), (1, 300), (300, 300), (300, 1000)):
        kv.append(k[a:b], v[a:b], np.arange(a, b))
    view = kv.snapshot()
    k2, v2 = contract_layout(view)
    np.testing.assert_array_equal(k2, k)
    np.testing.assert_array_equal(v2, v)
    np.testing.assert_array_equal(view.k_pos, np.arange(1000))
    assert kv.capacity >= 1000 and kv.capacity * 4 % PAGE_BYTES == LINE_BYTES


def test_snapshot_taken_before_an_append_keeps_its_length(rng):
    kv = StreamingKV.from_arrays(np.ones((10, 1, 4), np.float32), np.ones((10, 1, 4), np.float32), np.arange(10))
    view = kv.snapshot()
    kv.append(np.ones((5000, 1, 4), np.float32), np.ones((5000, 1, 4), np.float32), np.arange(10, 5010))
    assert view.n_k == 10 and kv.snapshot().n_k == 5010


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64], ids=lambda t: np.dtype(t).name)
def test_resident_attention_matches_reference(rng, dtype):
    q = rng.standard_normal((6, 8, 16)).astype(dtype)
    k = rng.standard_normal((777, 2, 16)).astype(dtype)
    v = rng.standard_normal((777, 2, 12)).astype(dtype)
    kv = StreamingKV.from_arrays(k, v, np.arange(777))
    opts = AttentionOptions(causal=True, softcap=20.0)
    st = partial_attention_resident(q, kv.snapshot(), q_pos=np.arange(771, 777), options=opts,
                                    kernel=KernelOptions(block_size=100, threads=2))
    out, lse = finalize(st)
    assert_close_to_reference(out, lse, q, k, v, causal=True, softcap=20.0)


def test_append_rejects_wrong_shapes_and_dtypes():
    kv = StreamingKV(2, 8, 4, np.float32)
    with pytest.raises(ValueError, match=r"k must be \[n, 2, 8\]"):
        kv.append(np.ones((3, 1, 8), np.float32), np.ones((3, 2, 4), np.float32), np.arange(3))
    with pytest.raises(ValueError, match="stored dtype float32"):
        kv.append(np.ones((3, 2, 8), np.float16), np.ones((3, 2, 4), np.float16), np.arange(3))
    assert kv.n_k == 0


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_rows_span_an_odd_number_of_pages_plus_a_cache_line(itemsize):
    for n in (1, 256, 1000, 1024, 65536, 262144, 10**6):
        c = padded_capacity(n, itemsize)
        row = c * itemsize
        assert c >= n and c & (c - 1) != 0
        if row >= PAGE_BYTES:
            assert row % PAGE_BYTES == LINE_BYTES and (row // PAGE_BYTES) % 2 == 1
        else:
            assert row % LINE_BYTES == 0


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64], ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
def test_appended_keys_and_values_are_the_bits_given_in_the_streaming_layout(dtype, n):
    rng = np.random.default_rng(n)
    k = rng.standard_normal((n, 3, 5)).astype(dtype)
    v = rng.standard_normal((n, 3, 7)).astype(dtype)
    kv = StreamingKV(3, 5, 7, dtype, capacity=7)  # grows (copies what it holds) on the second append
    half = n // 2
    kv.append(k[:half], v[:half], np.arange(half))
    kv.append(k[half:], v[half:], np.arange(half, n))
    view = kv.snapshot()
    assert view.kt.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(view.kt.view(np.uint8), k.transpose(1, 2, 0).copy().view(np.uint8))
    np.testing.assert_array_equal(view.v.view(np.uint8), v.transpose(1, 0, 2).copy().view(np.uint8))


def _kv(n=4, dtype=np.float32):
    return np.ones((n, 2, 3), dtype), np.ones((n, 2, 5), dtype)


@pytest.mark.parametrize("make, message", [
    (lambda: StreamingKV.from_arrays(*_kv(dtype=np.int32), np.arange(4)), "k must have dtype float16"),
    (lambda: StreamingKV.from_arrays(*_kv(), np.arange(4) + 0.9), "k_pos must be an integer array, got dtype float64"),
    (lambda: StreamingKV.from_arrays(*_kv(), None), r"k_pos must have shape \[4\], got \(\)"),
    (lambda: StreamingKV.from_arrays(*_kv(), [0, 1, 2]), r"k_pos must have shape \[4\], got \(3,\)"),
    (lambda: StreamingKV.from_arrays(*_kv(), np.array([0, 1, 2, 2**62])), "k_pos must lie within"),
    (lambda: StreamingKV.from_arrays(np.ones((4, 6)), np.ones((4, 2, 5)), np.arange(4)), "k must be"),
    (lambda: StreamingKV.from_arrays([[[1.0]]], np.ones((1, 1, 1)), np.arange(1)), "k must be a numpy or cupy array"),
    (lambda: StreamingKV(0, 3, 5, np.float32), "h_kv must be an int >= 1, got 0"),
    (lambda: StreamingKV(2, 3, 5, np.int32), "dtype must have dtype float16"),
    (lambda: StreamingKV(2, 3, 5, np.float32, capacity=-1), "capacity must be an int >= 0, got -1"),
    (lambda: StreamingKV(2, 3, 5, None), "dtype must have dtype float16, .* got None"),  # np.dtype(None): float64
    (lambda: StreamingKV(2, 3, 5, "nope"), "dtype must have dtype float16, .* got 'nope'"),
    # a view built by hand whose parts disagree (the fused kernel would read past v)
    (lambda: StreamingView(kt=np.zeros((1, 4, 4096), np.float32), v=np.ones((1, 8, 4), np.float32),
                           k_pos=np.arange(4096)), r"StreamingView.v must be \[h_kv, n_k, d_v\] .* got shapes \(1, 8, 4\)"),
    (lambda: StreamingView(kt=np.zeros((1, 4, 8), np.float32), v=np.ones((1, 8, 4), np.float32), k_pos=np.arange(7)),
     r"k_pos \[n_k\] with \[h_kv, n_k\] = \[1, 8\]"),
    (lambda: StreamingView(kt=np.zeros((4, 8), np.float32), v=np.ones((1, 8, 4), np.float32), k_pos=np.arange(8)),
     r"StreamingView must hold kt \[h_kv, d, n_k\]"),
    (lambda: StreamingView(kt=None, v=np.ones((1, 8, 4), np.float32), k_pos=np.arange(8)),
     "StreamingView.kt must be an array, got NoneType"),
])
def test_streaming_kv_refuses_what_the_inline_path_refuses_naming_the_argument(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_refused_append_leaves_the_keys_as_they_were():
    kv = StreamingKV.from_arrays(*_kv(), np.arange(4))
    before = kv.snapshot()
    with pytest.raises(ValueError, match="k_pos must be an integer array"):
        kv.append(*_kv(2), np.array([4.5, 5.5]))
    assert kv.n_k == 4 and np.array_equal(kv.snapshot().k_pos, before.k_pos)
