"""Eight-lane building blocks of the fused kernels (workers/fused_simd.py): every 16-bit element
widens exactly, loads work at any offset, a fused multiply-add rounds once, a prefetch never faults,
the lane sums of eight vectors come in one fixed tree, sixteen elements load in their dtype's tile order
and weave back in order."""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from kernel_bits import DTYPES, bits  # noqa: E402
from workers.fused_simd import (  # noqa: E402
    LANES,
    prefetch,
    split_order,
    vfma,
    vload,
    vload16,
    vsplat_at,
    vstore,
    vsum8,
    vweave,
    vzero,
)


@numba.njit
def _widen_all(a, out):
    for i in range(0, a.size, LANES):
        vstore(out, i, vload(a, i))


@numba.njit
def _load_at(a, i, out):
    vstore(out, 0, vload(a, i))


@numba.njit
def _fma(a, b, c, out):
    vstore(out, 0, vfma(vload(a, 0), vload(b, 0), vload(c, 0)))


@numba.njit
def _splat_plus_zero(a, i, out):
    vstore(out, 0, vfma(vsplat_at(a, i), vload(out, 0), vzero()))


@numba.njit
def _prefetch_far(a, ahead):
    for i in range(a.size):
        prefetch(a, i + ahead)
    return a.size


def test_vload_widens_every_bfloat16_bit_pattern_exactly():
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.size, np.float32)
    _widen_all(bits, out)
    expected = (bits.astype(np.uint32) << 16).view(np.float32)  # bfloat16 is float32's top half
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_vload_widens_every_float16_bit_pattern_exactly():
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.size, np.float32)
    _widen_all(bits.view(np.int16), out)
    expected = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), expected[~nan].view(np.uint32))  # subnormals, inf, -0


@pytest.mark.parametrize("offset", range(LANES + 1))
def test_vload_reads_eight_elements_from_any_offset(offset):
    a = np.arange(40, dtype=np.float32) * 0.5
    out = np.empty(LANES, np.float32)
    _load_at(a, offset, out)
    np.testing.assert_array_equal(out, a[offset:offset + LANES])


def test_vfma_rounds_once():
    # (1 + 2**-12)**2 - 1 = 2**-11 + 2**-24 exactly; a float32 product would round the 2**-24 away first.
    a = np.full(LANES, 1 + 2.0**-12, np.float32)
    c = np.full(LANES, -1.0, np.float32)
    out = np.empty(LANES, np.float32)
    _fma(a, a, c, out)
    assert np.all(out == np.float32(2.0**-11 + 2.0**-24))
    assert np.float32(a[0] * a[0]) + c[0] == np.float32(2.0**-11)  # the unfused result differs


def test_vsplat_at_puts_one_element_in_every_lane():
    a = np.array([[1, 2, 3], [4, 5, 6]], np.float32)  # flat index 4 is a[1, 1]
    out = np.ones(LANES, np.float32)
    _splat_plus_zero(a, 4, out)
    np.testing.assert_array_equal(out, np.full(LANES, 5.0, np.float32))


def test_vload_refuses_strided_arrays():
    out = np.empty(LANES, np.float32)
    with pytest.raises(numba.core.errors.TypingError):
        _load_at(np.zeros(32, np.float32)[::2], 0, out)


def test_prefetch_far_past_the_end_does_not_fault():
    assert _prefetch_far(np.zeros(64, np.float32), 1 << 30) == 64


def test_vsum8_puts_each_vectors_lane_sum_in_its_lane_by_a_fixed_tree():
    @numba.njit
    def fold(a, out):
        vstore(out, 0, vsum8(vload(a, 0), vload(a, 8), vload(a, 16), vload(a, 24),
                             vload(a, 32), vload(a, 40), vload(a, 48), vload(a, 56)))

    rng = np.random.default_rng(5)
    a = (rng.standard_normal(64) * 10.0 ** rng.integers(-6, 6, 64)).astype(np.float32)
    out = np.empty(LANES, np.float32)
    fold(a, out)
    x = a.reshape(LANES, LANES)
    tree = ((x[:, 0] + x[:, 1]) + (x[:, 2] + x[:, 3])) + ((x[:, 4] + x[:, 5]) + (x[:, 6] + x[:, 7]))  # float32 throughout
    np.testing.assert_array_equal(out.view(np.uint32), tree.view(np.uint32))


@numba.njit
def _load16_at(a, i, out):
    x, y = vload16(a, i)
    vstore(out, 0, x)
    vstore(out, LANES, y)


@numba.njit
def _load16_woven(a, out):
    for i in range(0, a.size, 2 * LANES):
        x, y = vload16(a, i)
        if split_order(a):
            x, y = vweave(x, y)
        vstore(out, i, x)
        vstore(out, i + LANES, y)


@numba.njit
def _split(a):
    return split_order(a)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("offset", [0, 1, 3, 8])
def test_vload16_gives_sixteen_elements_in_tile_order_from_any_offset(rng, dtype, offset):
    a = rng.standard_normal(40).astype(np.float32).astype(DTYPES[dtype])
    out = np.empty(2 * LANES, np.float32)
    _load16_at(bits(a), offset, out)
    x = a[offset:offset + 2 * LANES].astype(np.float32)  # exact: every element widens exactly
    expected = np.concatenate([x[0::2], x[1::2]]) if dtype == "bfloat16" else x
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_split_order_is_bfloat16s_alone(dtype):
    assert _split(bits(np.zeros(4, DTYPES[dtype]))) == (dtype == "bfloat16")


def test_vload16_then_vweave_widens_every_bfloat16_bit_pattern_in_order():
    patterns = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(patterns.size, np.float32)
    _load16_woven(patterns, out)
    expected = (patterns.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
