"""Register-tile scores over keys stored as rows (the inline layout), float32 accumulation.

The contract layout holds key ``j`` of kv head ``h`` as one run of ``d`` elements,
``k[base + j*sk0 + h*sk1 :][:d]``, so a block's scores are dot products
``s[h, r, j] = sum_t q[h, r, t] k[j, h, t]`` (README, "The math"; the loop around this
is ``workers.fused_kernels.inline_kernel``). :func:`scores_rows_f32` computes them in
tiles of :data:`TILE_ROWS` query rows x :data:`TILE_KEYS` keys: eight accumulators of
eight lanes stay in registers over the whole of ``d`` (lane ``l`` of the accumulator
of ``(r, j)`` sums the dims ``t = l (mod 8)``), each key vector loaded and widened once
for the four rows, and at the end :func:`workers.fused_simd.vsum8` folds the eight
accumulators' lanes in one fixed tree. The ``d % 8`` dims past the last whole vector
follow as one scalar chain. The block is read in address order (a pair of keys for
every head, then the next pair): per head, a key's run sits 2-4 KiB from the next, a
page apart for float32, and reading that way ran at half the rate (benchmarks/results/2026-12-03/NOTES.md,
"Inline scores as register tiles").

**Order of arithmetic.** Every score is the same computation wherever its row
sits: its lanes' fused multiply-add chains in dim order, the fixed tree, then the
tail dims in order. Tiles at the edges (fewer than four rows left, an odd last
key) repeat their last row or key in the empty slots and drop those results, so
there is no second code path: a row gives bitwise the same scores alone or in a
batch.
"""

from __future__ import annotations

from typing import Any

import numba

import workers.fused_simd as fused_simd
from workers.fused_simd import LANES, widen

prefetch: Any = fused_simd.prefetch
vfma: Any = fused_simd.vfma
vload: Any = fused_simd.vload
vstore: Any = fused_simd.vstore
vsum8: Any = fused_simd.vsum8
vzero: Any = fused_simd.vzero

#: Query rows per tile.
TILE_ROWS = 4
#: Keys per tile: with four rows, the eight accumulators :func:`vsum8` folds.
TILE_KEYS = 2

_FM = {"contract"}  # the tail dims: contraction only (a fixed, compile-time choice)


@numba.njit(inline="always", nogil=True)
def _tile(q: Any, q0: int, q1: int, q2: int, q3: int, k: Any, o0: int, o1: int,
          n_vec: int) -> Any:  # pragma: no cover - compiled
    """Rows at flat ``q0..q3`` x keys at flat ``o0, o1``: the eight scores over the first ``8 n_vec`` dims,
    in the lanes ``(r0, k0), (r0, k1), (r1, k0), ..., (r3, k1)``."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()
    t = 0
    for _ in range(n_vec):
        k0, k1 = vload(k, o0 + t), vload(k, o1 + t)
        x = vload(q, q0 + t)
        a0, a1 = vfma(x, k0, a0), vfma(x, k1, a1)
        x = vload(q, q1 + t)
        a2, a3 = vfma(x, k0, a2), vfma(x, k1, a3)
        x = vload(q, q2 + t)
        a4, a5 = vfma(x, k0, a4), vfma(x, k1, a5)
        x = vload(q, q3 + t)
        a6, a7 = vfma(x, k0, a6), vfma(x, k1, a7)
        t += LANES
    return vsum8(a0, a1, a2, a3, a4, a5, a6, a7)


@numba.njit(fastmath=_FM, nogil=True, cache=True)
def scores_rows_f32(q: Any, d: int, k: Any, base: int, sk0: int, sk1: int, s: Any, nb: int, lanes: Any,
                    v: Any, vbase: int, sv0: int) -> None:  # pragma: no cover - compiled
    """``s[h, r, j] = q[h, r] . k[base + j*sk0 + h*sk1 :][:d]`` for ``j < nb``, every kv head ``h`` and
    row ``r`` (float32 ``q [H, R, d]`` and ``s [H, R, B]``); ``lanes`` a float32 scratch of at
    least ``H * ceil(R / 4) * 4 * (nb + 1)`` elements.

    The keys are read in address order: a pair of keys for every head, then the next
    pair (one key's heads are one contiguous run). The values of the same keys,
    ``v[vbase + j*sv0 :][:sv0]``, are prefetched alongside, so that ``p @ v`` finds
    them in cache. Rows whose keys are all masked are computed too (never read):
    skipping them would change no other row's result, only the work.
    """
    h_kv, n_rows = s.shape[0], s.shape[1]
    n_vec = d // LANES
    last = n_rows - 1
    groups = (n_rows + TILE_ROWS - 1) // TILE_ROWS
    per_group = TILE_ROWS * (nb + 1)  # lanes of one row group's tiles (nb rounded up to a pair)
    line = 64 // v.itemsize  # elements per cache line
    for j in range(0, nb, TILE_KEYS):
        o0 = base + j * sk0
        o1 = o0 + sk0 if j + 1 < nb else o0  # an odd last key: repeated, its copy dropped
        for x in range(vbase + j * sv0, vbase + min(j + TILE_KEYS, nb) * sv0, line):
            prefetch(v, x)
        for h in range(h_kv):
            for g in range(groups):
                r = g * TILE_ROWS
                # Edge rows repeated (their copies dropped below): every tile the same code.
                q0 = (h * n_rows + r) * d
                q1 = (h * n_rows + min(r + 1, last)) * d
                q2 = (h * n_rows + min(r + 2, last)) * d
                q3 = (h * n_rows + min(r + 3, last)) * d
                # The tile's eight scores, (row r + i, key j + m) at lane 2 i + m.
                vstore(lanes, (h * groups + g) * per_group + TILE_ROWS * j,
                       _tile(q, q0, q1, q2, q3, k, o0 + h * sk1, o1 + h * sk1, n_vec))
    for h in range(h_kv):
        for g in range(groups):
            at = (h * groups + g) * per_group
            for i in range(min(TILE_ROWS, n_rows - g * TILE_ROWS)):
                srow = s[h, g * TILE_ROWS + i]  # [B]
                for j in range(nb):
                    srow[j] = lanes[at + TILE_ROWS * (j - j % 2) + TILE_KEYS * i + j % 2]
    if LANES * n_vec < d:
        for h in range(h_kv):
            for r in range(n_rows):
                for j in range(nb):
                    x = s[h, r, j]
                    o = base + j * sk0 + h * sk1
                    for t in range(LANES * n_vec, d):  # the tail dims, in order, after the tree
                        x += q[h, r, t] * widen(k[o + t])
                    s[h, r, j] = x
