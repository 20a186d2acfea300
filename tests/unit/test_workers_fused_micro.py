"""Register-tile micro-kernels (workers/fused_micro.py): within the one-shot error bound of a
float32 dot product against float64 on ragged shapes and every key dtype, and a row gives
bitwise the same result alone as in a tile of four, and at sixteen lanes as at eight."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from kernel_bits import DTYPES, EPS32, bits

from workers import BFLOAT16
from workers.fused_micro import LANES, PACK_ROWS, PANEL_DIMS, PV_KEYS, TILE_KEYS, TILE_ROWS, pv_f32, scores_dmajor_f32


def dmajor(rng, d: int, n: int, dtype, pad: int) -> tuple[np.ndarray, int, int, np.ndarray]:
    """Keys d-major inside a larger flat array: (flat, base, step, keys [d, n] widened to float64)."""
    step = n + pad
    flat = rng.standard_normal(pad + d * step).astype(np.float32).astype(dtype)
    base = pad
    keys = np.stack([flat[base + t * step: base + t * step + n] for t in range(d)]).astype(np.float64)
    return bits(flat), base, step, keys


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("rows", "d", "nb"), [(1, 5, 1), (3, 8, 15), (4, 19, 16), (5, PANEL_DIMS * 2 + 3, 37),
                                               (9, 128, 100), (4, 128, 2 * TILE_KEYS),
                                               (PACK_ROWS, 128, 2 * TILE_KEYS), (PACK_ROWS + 3, 19, TILE_KEYS + 5)])
def test_scores_match_float64_within_the_dot_product_bound(rng, dtype, rows, d, nb):
    flat, base, step, keys = dmajor(rng, d, nb, DTYPES[dtype], pad=7)
    q = rng.standard_normal((rows, d)).astype(np.float32)
    s = np.full((rows, nb + 5), np.nan, np.float32)  # [R, B], wider than the block: columns past nb untouched
    scores_dmajor_f32(q, np.ones(rows, np.int64), d, flat, base, step, s, nb)
    ref = q.astype(np.float64) @ keys  # [R, nb]
    bound = d * EPS32 * (np.abs(q).astype(np.float64) @ np.abs(keys))  # a float32 dot product's error bound
    assert np.all(np.abs(s[:, :nb] - ref) <= bound)
    assert np.isnan(s[:, nb:]).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scores_of_a_row_alone_are_bitwise_its_scores_in_a_tile(rng, dtype):
    d, nb, rows = 40, 3 * TILE_KEYS + 5, TILE_ROWS * 2 + 1
    flat, base, step, _ = dmajor(rng, d, nb, DTYPES[dtype], pad=0)
    q = rng.standard_normal((rows, d)).astype(np.float32)
    s = np.empty((rows, nb), np.float32)
    scores_dmajor_f32(q, np.ones(rows, np.int64), d, flat, base, step, s, nb)
    for r in (0, 3, rows - 1):
        alone = np.empty((1, nb), np.float32)
        scores_dmajor_f32(np.ascontiguousarray(q[r:r + 1]), np.ones(1, np.int64), d, flat, base, step, alone, nb)
        np.testing.assert_array_equal(alone[0].view(np.uint32), s[r].view(np.uint32))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows", [PACK_ROWS, PACK_ROWS + 3])
def test_scores_of_many_rows_in_packed_tiles_are_bitwise_each_row_alone_on_panels(rng, dtype, rows):
    # PACK_ROWS rows or more take the packed tiles, one row alone the panels: the same chains.
    d, nb = PANEL_DIMS * 5 + 3, 3 * TILE_KEYS + 5  # a ragged last panel; keys past the last whole tile
    flat, base, step, _ = dmajor(rng, d, nb, DTYPES[dtype], pad=3)
    q = rng.standard_normal((rows, d)).astype(np.float32)
    s = np.empty((rows, nb), np.float32)
    scores_dmajor_f32(q, np.ones(rows, np.int64), d, flat, base, step, s, nb)
    for r in range(rows):
        alone = np.empty((1, nb), np.float32)
        scores_dmajor_f32(np.ascontiguousarray(q[r:r + 1]), np.ones(1, np.int64), d, flat, base, step, alone, nb)
        np.testing.assert_array_equal(alone[0].view(np.uint32), s[r].view(np.uint32))


def values(rng, nb: int, d_v: int, dtype, heads: int) -> tuple[np.ndarray, int, int, np.ndarray]:
    """Values of the last of ``heads`` interleaved heads (the contract layout's stride):
    (flat, base, step, v [nb, d_v] widened to float64)."""
    full = rng.standard_normal((nb, heads, d_v)).astype(np.float32).astype(dtype)
    h = heads - 1
    return bits(full.reshape(-1)), h * d_v, heads * d_v, full[:, h, :].astype(np.float64)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("rows", "nb", "d_v", "heads"), [(1, 1, 16, 1), (4, PV_KEYS + 3, 20, 2), (6, 7, 5, 1),
                                                         (9, 2 * PV_KEYS + 1, 128, 3)])
def test_pv_matches_float64_and_leaves_invisible_rows_alone(rng, dtype, rows, nb, d_v, heads):
    flat, base, step, v = values(rng, nb, d_v, DTYPES[dtype], heads)
    p = rng.uniform(0, 1, (rows, nb + 3)).astype(np.float32)  # [R, B]: columns past nb must not be read
    p[:, nb:] = np.nan
    acc0 = rng.standard_normal((rows, d_v)).astype(np.float32)
    kind = np.ones(rows, np.int64)
    kind[1::3] = 0  # rows that see nothing of this block
    acc = acc0.copy()
    pv_f32(p, kind, nb, flat, base, step, acc, d_v)
    ref = acc0.astype(np.float64) + p[:, :nb].astype(np.float64) @ v
    bound = (nb + 1) * EPS32 * (np.abs(acc0).astype(np.float64) + p[:, :nb].astype(np.float64) @ np.abs(v))
    seen = kind != 0
    assert np.all(np.abs(acc[seen] - ref[seen]) <= bound[seen])
    np.testing.assert_array_equal(acc[~seen], acc0[~seen])


def test_pv_of_a_row_alone_is_bitwise_its_result_in_a_tile(rng):
    rows, nb, d_v = TILE_ROWS * 2 + 1, PV_KEYS + 9, 36
    flat, base, step, _ = values(rng, nb, d_v, BFLOAT16, heads=2)
    p = rng.uniform(0, 1, (rows, nb)).astype(np.float32)
    acc0 = rng.standard_normal((rows, d_v)).astype(np.float32)
    acc = acc0.copy()
    pv_f32(p, np.ones(rows, np.int64), nb, flat, base, step, acc, d_v)
    for r in (0, 5, rows - 1):
        alone = acc0[r:r + 1].copy()
        pv_f32(np.ascontiguousarray(p[r:r + 1]), np.ones(1, np.int64), nb, flat, base, step, alone, d_v)
        np.testing.assert_array_equal(alone[0].view(np.uint32), acc[r].view(np.uint32))


#: A child that runs both micro-kernels on the arrays of ``in.npz`` and saves what they wrote to ``out.npz``.
_CHILD = """
import sys
import numpy as np
import workers.fused_micro as fm
d = dict(np.load(sys.argv[1]))
out = {}
for name in ("float32", "bfloat16", "float16"):
    k, q, v, p, acc = (d[f"{x}_{name}"] for x in ("k", "q", "v", "p", "acc"))
    nb, step = int(d["nb"]), int(d["step"])
    s = np.zeros((q.shape[0], nb), np.float32)
    fm.scores_dmajor_f32(q, np.ones(q.shape[0], np.int64), q.shape[1], k, 0, step, s, nb)
    qb = d[f"qbig_{name}"]  # PACK_ROWS rows and more: the packed tiles
    sb = np.zeros((qb.shape[0], nb), np.float32)
    fm.scores_dmajor_f32(qb, np.ones(qb.shape[0], np.int64), qb.shape[1], k, 0, step, sb, nb)
    fm.pv_f32(p, np.ones(p.shape[0], np.int64), p.shape[1], v, 0, acc.shape[1], acc, acc.shape[1])
    out[f"s_{name}"], out[f"sbig_{name}"], out[f"acc_{name}"], out["lanes"] = s, sb, acc, np.int64(fm.LANES)
np.savez(sys.argv[2], **out)
"""


@pytest.mark.skipif(LANES == 8, reason="the compile target has no AVX-512F: the kernels run eight lanes already")
def test_sixteen_lanes_give_bitwise_the_results_of_eight(rng, tmp_path, pytestconfig):
    # The same arithmetic on twice the lanes: every score and every acc lane is the same chain of
    # fused multiply-adds, and the tails past the last whole tile (wider at 16 lanes) the same chain
    # as a scalar loop, on the panels and on the packed tiles. A child compiled for the host without
    # AVX-512 runs eight lanes; its machine code is cached in pytest's cache folder (numba keys it
    # by the source and the CPU features), so that only the first run compiles.
    import os
    import subprocess
    import sys

    from numba.core.codegen import get_host_cpu_features

    rows, d, nb, d_v = TILE_ROWS * 2 + 1, 128, 3 * TILE_KEYS + 5, 56  # tail keys; 56 columns: 48 + 8, or 32 + 24
    arrays: dict[str, np.ndarray] = {"nb": np.int64(nb), "step": np.int64(nb + 3)}
    for name, dtype in DTYPES.items():
        arrays[f"k_{name}"] = bits(rng.standard_normal(d * (nb + 3)).astype(np.float32).astype(dtype))
        arrays[f"q_{name}"] = rng.standard_normal((rows, d)).astype(np.float32)
        arrays[f"qbig_{name}"] = rng.standard_normal((PACK_ROWS + 1, d)).astype(np.float32)
        arrays[f"v_{name}"] = bits(rng.standard_normal(2 * PV_KEYS * d_v + 7 * d_v).astype(np.float32).astype(dtype))
        arrays[f"p_{name}"] = rng.uniform(0, 1, (rows, 2 * PV_KEYS + 7)).astype(np.float32)
        arrays[f"acc_{name}"] = rng.standard_normal((rows, d_v)).astype(np.float32)
    np.savez(tmp_path / "in.npz", **arrays)
    features = ",".join(("-" + f[1:]) if f.startswith("+avx512") else f
                        for f in str(get_host_cpu_features()).split(","))
    cache = getattr(pytestconfig, "cache", None)  # none under -p no:cacheprovider: a fresh folder, a compile
    cache_dir = cache.mkdir("numba-eight-lanes") if cache is not None else tmp_path / "cache"
    env = {**os.environ, "NUMBA_CPU_FEATURES": features, "NUMBA_CACHE_DIR": str(cache_dir)}
    subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "in.npz"), str(tmp_path / "eight.npz")],
                   env=env, check=True, timeout=300)
    eight = np.load(tmp_path / "eight.npz")
    assert int(eight["lanes"]) == 8
    for name in DTYPES:
        q, k, p, v = (arrays[f"{x}_{name}"] for x in ("q", "k", "p", "v"))
        s = np.zeros((rows, nb), np.float32)
        scores_dmajor_f32(q, np.ones(rows, np.int64), d, k, 0, nb + 3, s, nb)
        qb = arrays[f"qbig_{name}"]
        sb = np.zeros((qb.shape[0], nb), np.float32)
        scores_dmajor_f32(qb, np.ones(qb.shape[0], np.int64), d, k, 0, nb + 3, sb, nb)
        acc = arrays[f"acc_{name}"].copy()
        pv_f32(p, np.ones(rows, np.int64), p.shape[1], v, 0, d_v, acc, d_v)
        np.testing.assert_array_equal(s.view(np.uint32), eight[f"s_{name}"].view(np.uint32), err_msg=name)
        np.testing.assert_array_equal(sb.view(np.uint32), eight[f"sbig_{name}"].view(np.uint32), err_msg=name)
        np.testing.assert_array_equal(acc.view(np.uint32), eight[f"acc_{name}"].view(np.uint32), err_msg=name)
