"""Vector building blocks of the fused kernels (workers/fused_simd.py), at eight lanes and at the
target's wide width: every 16-bit element widens exactly, loads work at any offset, a fused multiply-add
rounds once, a prefetch never faults, the lane sums of eight vectors come in one fixed tree, a pair of
vectors loads in its dtype's tile order and weaves back in order."""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from kernel_bits import DTYPES, bits  # noqa: E402
from workers.fused_simd import (  # noqa: E402
    LANES,
    WIDE,
    prefetch,
    split_order,
    vfma,
    vload,
    vload_pair,
    vmax,
    vmax_lanes,
    vsplat_at,
    vstore,
    vsum8,
    vweave,
    vzero,
    wide_lanes,
    wload,
    wload_pair,
    wsplat_at,
    wzero,
)

#: The two sets of loads, by width: (load, load_pair, splat_at, zero, lanes).
KITS = {"eight": (vload, vload_pair, vsplat_at, vzero, LANES), "wide": (wload, wload_pair, wsplat_at, wzero, WIDE)}


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


def _pair_kernels(kit: str):
    """(load a pair at i, load pairs over a whole array and weave them in order) for one width."""
    _, load_pair, _, _, n = KITS[kit]

    @numba.njit
    def pair_at(a, i, out):
        x, y = load_pair(a, i)
        vstore(out, 0, x)
        vstore(out, n, y)

    @numba.njit
    def woven(a, out):
        for i in range(0, a.size, 2 * n):
            x, y = load_pair(a, i)
            if split_order(a):
                x, y = vweave(x, y)
            vstore(out, i, x)
            vstore(out, i + n, y)

    return pair_at, woven


@numba.njit
def _split(a):
    return split_order(a)


@pytest.mark.parametrize("kit", list(KITS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("offset", [0, 1, 3, 8])
def test_load_pair_gives_twice_the_lanes_in_tile_order_from_any_offset(rng, kit, dtype, offset):
    n = KITS[kit][-1]
    a = rng.standard_normal(2 * n + 9).astype(np.float32).astype(DTYPES[dtype])
    out = np.empty(2 * n, np.float32)
    _pair_kernels(kit)[0](bits(a), offset, out)
    x = a[offset:offset + 2 * n].astype(np.float32)  # exact: every element widens exactly
    expected = np.concatenate([x[0::2], x[1::2]]) if dtype == "bfloat16" else x
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_split_order_is_bfloat16s_alone(dtype):
    assert _split(bits(np.zeros(4, DTYPES[dtype]))) == (dtype == "bfloat16")


@pytest.mark.parametrize("kit", list(KITS))
def test_load_pair_then_vweave_widens_every_bfloat16_bit_pattern_in_order(kit):
    patterns = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(patterns.size, np.float32)
    _pair_kernels(kit)[1](patterns, out)
    expected = (patterns.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_wide_loads_splat_and_fma_at_the_wide_width(rng, dtype):
    @numba.njit
    def run(a, i, p, out):  # out = p[0] * a[i : i + WIDE] + 0, then one lane of p splat onto the next WIDE
        vstore(out, 0, vfma(wsplat_at(p, 0), wload(a, i), wzero()))
        vstore(out, WIDE, vfma(wsplat_at(p, 1), wload(a, i + 1), wzero()))

    a = rng.standard_normal(3 * WIDE).astype(np.float32).astype(DTYPES[dtype])
    p = np.array([2.0, -0.5], np.float32)
    out = np.empty(2 * WIDE, np.float32)
    run(bits(a), 3, p, out)
    x = a.astype(np.float32)
    np.testing.assert_array_equal(out, np.concatenate([2 * x[3:3 + WIDE], -0.5 * x[4:4 + WIDE]]))


def test_wide_lanes_follow_the_compile_targets_avx512f(monkeypatch):
    from numba.core import config

    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,-avx512f")
    assert wide_lanes() == 8
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,+avx512f,+avx512bw")
    assert wide_lanes() == 16
    assert WIDE in (8, 16)


@numba.njit
def _max_of_pairs(a, b, out):
    vstore(out, 0, vmax(wload(a, 0), wload(b, 0)))


@numba.njit
def _largest_lane(a):
    return vmax_lanes(wload(a, 0))


def test_vmax_takes_the_larger_of_each_lane_pair(rng):
    a = rng.standard_normal(WIDE).astype(np.float32)
    b = rng.standard_normal(WIDE).astype(np.float32)
    a[0], b[0] = -np.inf, 1.0  # a masked score against a visible one
    out = np.empty(WIDE, np.float32)
    _max_of_pairs(a, b, out)
    np.testing.assert_array_equal(out, np.maximum(a, b))


@pytest.mark.parametrize("where", range(WIDE))
def test_vmax_lanes_finds_the_largest_lane_wherever_it_sits(rng, where):
    a = -np.abs(rng.standard_normal(WIDE)).astype(np.float32) - 1
    a[where] = 0.5
    a[(where + 3) % WIDE] = -np.inf
    assert _largest_lane(a) == np.float32(0.5)
    assert _largest_lane(np.full(WIDE, -np.inf, np.float32)) == -np.inf  # a fully masked row
