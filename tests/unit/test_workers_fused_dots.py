"""Register-tile scores over keys stored as rows (workers/fused_dots.py): within the one-shot
error bound of a float32 dot product against float64 on ragged shapes and every key dtype, and a
row gives bitwise the same scores alone as in a tile, whatever rows, heads and keys share it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from kernel_bits import DTYPES, EPS32, bits  # noqa: E402
from workers.fused_dots import TILE_KEYS, TILE_ROWS, scores_rows_f32  # noqa: E402


def scores(q: np.ndarray, keys: np.ndarray, nb: int, first: int = 0) -> np.ndarray:
    """The kernel's scores of ``q [H, R, d]`` over keys ``[first, first + nb)`` of ``keys [n, H, d]``."""
    h_kv, n_rows, d = q.shape
    flat = bits(keys).reshape(-1)
    s = np.full((h_kv, n_rows, nb + 5), np.nan, np.float32)  # [H, R, B], wider: columns past nb untouched
    lanes = np.full(h_kv * -(-n_rows // TILE_ROWS) * TILE_ROWS * (nb + 1), np.nan, np.float32)
    step = h_kv * d
    scores_rows_f32(q, d, flat, first * step, step, d, s, nb, lanes, flat, first * step, step)
    assert np.isnan(s[:, :, nb:]).all()
    return s[:, :, :nb]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("rows", "d", "nb", "heads"), [(1, 5, 1, 1), (3, 8, 15, 2), (4, 19, 16, 1),
                                                        (5, 37, 37, 3), (4, 128, 64, 8), (9, 64, TILE_KEYS, 2)])
def test_scores_match_float64_within_the_dot_product_bound(rng, dtype, rows, d, nb, heads):
    keys = rng.standard_normal((nb, heads, d)).astype(np.float32).astype(DTYPES[dtype])
    q = rng.standard_normal((heads, rows, d)).astype(np.float32)
    s = scores(q, keys, nb)
    k64 = keys.astype(np.float64)
    ref = np.einsum("hrt,jht->hrj", q.astype(np.float64), k64)  # [H, R, nb]
    bound = d * EPS32 * np.einsum("hrt,jht->hrj", np.abs(q).astype(np.float64), np.abs(k64))  # dot product's bound
    assert np.all(np.abs(s - ref) <= bound)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scores_of_a_row_alone_are_bitwise_its_scores_in_a_tile(rng, dtype):
    heads, d, nb, rows = 2, 44, 2 * TILE_KEYS * 5 + 1, TILE_ROWS * 2 + 1  # tail dims, an odd last key, a lone row
    keys = rng.standard_normal((nb, heads, d)).astype(np.float32).astype(DTYPES[dtype])
    q = rng.standard_normal((heads, rows, d)).astype(np.float32)
    s = scores(q, keys, nb)
    for r in (0, 3, rows - 1):
        alone = scores(np.ascontiguousarray(q[:, r:r + 1]), keys, nb)
        np.testing.assert_array_equal(alone[:, 0].view(np.uint32), s[:, r].view(np.uint32))
    # A key's score depends neither on its neighbour in the tile nor on the other head.
    for j in (0, nb - 1):
        one = scores(q, keys, 1, first=j)
        np.testing.assert_array_equal(one[:, :, 0].view(np.uint32), s[:, :, j].view(np.uint32))
    head = scores(np.ascontiguousarray(q[1:]), np.ascontiguousarray(keys[:, 1:]), nb)
    np.testing.assert_array_equal(head[0].view(np.uint32), s[1].view(np.uint32))
