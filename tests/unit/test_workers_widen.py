"""Widening 16-bit blocks: float16 through the bit arithmetic equals NumPy's cast bit for bit."""

import numpy as np
import pytest

from workers import BFLOAT16
from workers.widen import _bits_numpy, as_rows, float16_to_float32, widen


def test_every_float16_widens_exactly_including_subnormals_infinities_and_nans():
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    got = float16_to_float32(every)
    want = every.astype(np.float32)
    finite = np.isfinite(want)
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))  # bit for bit, -0.0 too
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[np.isinf(want)], want[np.isinf(want)])


def test_the_numpy_fallback_computes_the_same_bits():
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    bits = np.empty(every.shape, np.uint32)
    _bits_numpy(every, bits)
    with np.errstate(invalid="ignore"):  # signalling NaN patterns
        fallback = bits.view(np.float32) * np.float32(2.0**112)
    want = every.view(np.float16).astype(np.float32)
    finite = np.isfinite(want)
    assert np.array_equal(fallback[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.array_equal(np.isnan(fallback), np.isnan(want))


@pytest.mark.parametrize("make", [
    lambda a: a,                                   # contiguous
    lambda a: a[:, 1:, ::1][..., :5],              # strided in the outer axes, unit stride inside
    lambda a: a.transpose(1, 2, 0)[..., 2:9],      # a key-block view of the streaming layout
    lambda a: a[0],                                # 2-d
    lambda a: a[0, 0],                             # 1-d
    lambda a: a[:0],                               # empty
    lambda a: a[:, :, 2:9],                        # streaming keys kt [hb, d, B]: rows a capacity apart
    lambda a: a[1:4, 1:3],                         # streaming values v [hb, B, d_v]: heads apart
    lambda a: a[:, ::-1],                          # a negative stride: gathered
    lambda a: a[:, :, ::2],                        # no unit stride inside: gathered
    lambda a: np.broadcast_to(a[:1], a.shape),     # a zero stride
])
def test_blocks_of_any_layout_widen_to_contiguous_float32(make, rng):
    block = make((rng.standard_normal((6, 4, 11)) * 100).astype(np.float16))
    got = float16_to_float32(block)
    assert got.dtype == np.float32 and got.flags.c_contiguous and got.shape == block.shape
    np.testing.assert_array_equal(got, block.astype(np.float32))


def test_widen_passes_matching_dtypes_through_and_casts_the_rest(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    assert widen(x, np.float32) is x
    b = x.astype(BFLOAT16)
    np.testing.assert_array_equal(widen(b, np.float32), b.astype(np.float32))
    h = x.astype(np.float16)
    np.testing.assert_array_equal(widen(h, np.float64), h.astype(np.float64))
    with pytest.raises(ValueError, match="x must have dtype float16, got float32"):
        float16_to_float32(x)


def test_without_numba_the_numpy_arithmetic_gives_the_same_block(monkeypatch, rng):
    from workers import widen as module

    block = (rng.standard_normal((4, 3, 7)) * 1e3).astype(np.float16).transpose(2, 0, 1)
    compiled = float16_to_float32(block)
    monkeypatch.setattr(module, "compiled_widen16", lambda: None)
    fallback = float16_to_float32(block)
    assert np.array_equal(fallback.view(np.uint32), compiled.view(np.uint32))


def test_streaming_blocks_are_read_in_place_as_rows_without_a_gather_copy():
    kt = np.zeros((8, 16, 100), np.float16).view(np.uint16)  # [h_kv, d, capacity]
    base, row_stride, rows, cols = as_rows(kt[2:4, :, 10:30])  # [hb, d, B]
    assert (row_stride, rows, cols) == (100, 2 * 16, 20) and np.shares_memory(base, kt)
    v = np.zeros((8, 100, 16), np.float16).view(np.uint16)  # [h_kv, capacity, d_v]
    base, row_stride, rows, cols = as_rows(v[2:4, 10:30])  # [hb, B, d_v]
    assert (row_stride, rows, cols) == (100 * 16, 2, 20 * 16) and np.shares_memory(base, v)
    assert as_rows(kt[:, :, ::2]) is None


def test_after_loading_no_block_of_any_layout_or_writability_compiles_another_loop(rng):
    from workers.widen import compiled_widen16, load_widen16

    assert load_widen16()
    loop = compiled_widen16()
    assert loop is not None and len(loop.signatures) == 1
    kt = rng.standard_normal((2, 16, 50)).astype(np.float16)  # [h_kv, d, capacity], a shard's, writable
    request = np.frombuffer(rng.standard_normal(300).astype(np.float16).tobytes(), np.float16)  # read-only
    for block in (kt[:, :, 5:25], kt[:, 3], request.reshape(10, 3, 10), request[::3]):
        assert np.array_equal(float16_to_float32(block), block.astype(np.float32))
    assert len(loop.signatures) == 1, loop.signatures
