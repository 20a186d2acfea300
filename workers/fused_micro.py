"""Register-blocked micro-kernels of the fused CPU path, float32 accumulation (``workers.fused_kernels``).

The two products of a key block, for the rows ``r`` of one kv head (README,
"The math"; the module docstring of ``workers.fused_kernels`` for the loop around
them):

* scores ``s[r, j] = sum_t q[r, t] k[t, j]`` over d-major keys (the resident
  layout: dim ``t`` of the block's keys is one contiguous run ``k[base + t*step :]``);
* ``acc[r, e] += sum_j p[r, j] v[j, e]`` over values whose keys are ``step`` apart.

Both hold a tile of :data:`TILE_ROWS` rows x :data:`TILE_KEYS` lanes (two
``workers.fused_simd.f32xw``: 16 keys with AVX2, 32 with AVX-512) of accumulators
in registers across a stretch of their reduction, so
that each key (value) vector loaded serves four rows, widened once for all four
when it is 16-bit. The scores tile holds its keys in the key array's tile
order (``workers.fused_simd.split_order``): in order, or for bfloat16 the even
keys and the odd ones, which widen from one load with half the instructions; the
partial sums keep that order in ``s`` from panel to panel, and after the last
panel one pass over the block puts each tile's keys in order. (``p @ v`` widens
its values in order: there the accumulators go back to ``acc`` every
:data:`PV_KEYS` keys, and reordering them in and out cost what the split load saves.)

* **scores** walk the block in panels of :data:`PANEL_DIMS` dims: a panel reads
  its dims' runs side by side, each front to back, and prefetches each run
  :data:`PREFETCH_KEYS` keys further along, once per cache line (past the block's
  end that is the next block's part of the same run, so each run streams as one);
  the partial sums go back to ``s`` between panels (after a panel, ``s[r, j]``
  holds the sum over the dims seen so far).
* **scores of many rows** (:data:`PACK_ROWS` or more: a batch of decode queries, a short
  prefill) copy each tile's keys, all ``d`` dims, widened and in order, into one contiguous
  scratch first; every group of four rows then runs all ``d`` dims from it with its
  accumulators in registers throughout, and writes ``s`` once.
* **p @ v** takes :data:`PV_KEYS` keys at a time (their value rows read side by
  side) and, per :data:`TILE_KEYS` columns, keeps the four rows' accumulators in registers over
  those keys, prefetching the tile :data:`PREFETCH_VALUES` keys ahead in address
  order.

The sizes trade registers against memory streams: a whole-``d`` panel would
keep the scores in registers throughout but read 128 runs at once, which the
hardware prefetchers do not follow (benchmarks/results/2026-12-02/NOTES.md, "Register tiles").

**Order of arithmetic.** Every lane of a tile computes its ``s[r, j]`` (its
``acc[r, e]``) as one chain of fused multiply-adds in dim order (key order),
whatever rows share the tile: a row gives bitwise the same result in a group of
four or alone (:func:`_row`), in a batch or not, and at either vector width. Keys
past the last whole tile of a block (``nb % TILE_KEYS``) and value columns past the
last whole tile (``d_v % TILE_KEYS``) take a scalar loop, chosen by position alone:
the same chain of fused multiply-adds (contraction), so the same bits.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

import workers.fused_simd as fused_simd
from workers.fused_simd import narrow, split_order, widen

# The wide intrinsics (workers.fused_simd.WIDE lanes), typed as their calls in compiled code
# read (numba supplies the typing context that their Python signatures start with).
prefetch: Any = fused_simd.prefetch
vfma: Any = fused_simd.vfma
vload: Any = fused_simd.wload
vload_pair: Any = fused_simd.wload_pair
vweave: Any = fused_simd.vweave
vsplat_at: Any = fused_simd.wsplat_at
vstore: Any = fused_simd.vstore
vzero: Any = fused_simd.wzero

#: Lanes of one vector: 16 where the compile target has AVX-512F, else 8.
LANES = fused_simd.WIDE
#: Query rows per register tile (their accumulators: 4 x 2 vectors, with the key
#: vectors and a broadcast 11 of the 16 AVX2 or 32 AVX-512 registers).
TILE_ROWS = 4
#: Keys (value columns) per register tile: two vectors.
TILE_KEYS = 2 * LANES
#: Dims per scores panel: as many runs of keys read side by side.
PANEL_DIMS = 8
#: How far ahead (keys) the scores prefetch along each run they read: past the block's
#: end, into the next block's part of the same run (benchmarks/results/2026-12-05/NOTES.md, "Scores prefetch
#: along their own runs").
PREFETCH_KEYS = 256
#: Bytes per cache line, the unit of a prefetch: 64 on x86-64 and on most Arm cores (a
#: larger line only means some prefetches repeat one already made; never a wrong answer).
CACHE_LINE_BYTES = 64
#: Rows from which the scores copy each tile's keys (all ``d`` dims of TILE_KEYS keys, widened to
#: float32) into one contiguous scratch before the rows' tiles read them. The runs of a block sit
#: ``step`` keys apart (4 KiB for 1024 float32 keys), so a tile's keys of every dim fall in the same
#: few L1 sets and evict one another: each group of four rows read them again from L2. Packed, they
#: are read from memory once and from L1 by every group; below this many rows (decode's four) the
#: copy costs more than it saves. The same chains of fused multiply-adds either way: the same bits.
PACK_ROWS = 16
#: Keys per value tile of ``p @ v``: their value rows are read side by side.
PV_KEYS = 32
#: How far ahead (keys) ``p @ v`` prefetches.
PREFETCH_VALUES = 32

_FM = {"contract"}  # scalar tails: contraction only (a fixed, compile-time choice)


@numba.njit(inline="always", nogil=True)
def _load4(a: Any, i: int, row: int) -> Any:  # pragma: no cover - compiled
    """A tile's accumulators from flat ``a``: TILE_KEYS lanes at ``i``, ``i + row``, ``i + 2 row``, ``i + 3 row``."""
    return (vload(a, i), vload(a, i + LANES), vload(a, i + row), vload(a, i + row + LANES),
            vload(a, i + 2 * row), vload(a, i + 2 * row + LANES), vload(a, i + 3 * row),
            vload(a, i + 3 * row + LANES))


@numba.njit(inline="always", nogil=True)
def _store4(a: Any, i: int, row: int, t: Any) -> None:  # pragma: no cover - compiled
    """:func:`_load4`'s places, written back."""
    for n in numba.literal_unroll((0, 1, 2, 3)):
        vstore(a, i + n * row, t[2 * n])
        vstore(a, i + n * row + LANES, t[2 * n + 1])


@numba.njit(inline="always", nogil=True)
def _weave4(t: Any) -> Any:  # pragma: no cover - compiled
    """A tile's four rows from (even, odd) keys to keys in order (:func:`workers.fused_simd.vweave`)."""
    a0, a1 = vweave(t[0], t[1])
    a2, a3 = vweave(t[2], t[3])
    a4, a5 = vweave(t[4], t[5])
    a6, a7 = vweave(t[6], t[7])
    return (a0, a1, a2, a3, a4, a5, a6, a7)


@numba.njit(inline="always", nogil=True)
def _fma4(src: Any, i: int, row: int, w0: Any, w1: Any, t: Any) -> Any:  # pragma: no cover - compiled
    """The tile ``t`` plus ``src[i + n row] * (w0, w1)`` on row ``n`` (one fused multiply-add per lane)."""
    x0, x1 = vsplat_at(src, i), vsplat_at(src, i + row)
    x2, x3 = vsplat_at(src, i + 2 * row), vsplat_at(src, i + 3 * row)
    return (vfma(x0, w0, t[0]), vfma(x0, w1, t[1]), vfma(x1, w0, t[2]), vfma(x1, w1, t[3]),
            vfma(x2, w0, t[4]), vfma(x2, w1, t[5]), vfma(x3, w0, t[6]), vfma(x3, w1, t[7]))


@numba.njit(inline="always", fastmath=_FM, nogil=True)
def _scores_tile4(q: Any, r: int, t0: int, n_t: int, k: Any, base: int, step: int, j0: int, s: Any,
                  sb: int, first: bool) -> None:  # pragma: no cover - compiled
    """Rows ``r..r+3``, keys ``j0 .. j0 + TILE_KEYS - 1``, dims ``[t0, t0 + n_t)`` added onto ``s`` (or into it when ``first``).

    ``q [R, d]`` and ``s [R, sb]`` indexed flat; ``n_t`` is a compile-time constant
    (a whole panel, unrolled) or the last panel's width. The keys go to ``s`` in
    ``k``'s tile order (:func:`scores_dmajor_f32` puts them in order after the last panel).
    """
    d = q.shape[1]
    i0 = r * sb + j0  # flat s[r, j0]
    if first:
        z = vzero()
        t = (z, z, z, z, z, z, z, z)
    else:
        t = _load4(s, i0, sb)
    o = base + t0 * step + j0  # key j0 of dim t
    qi = r * d + t0  # flat q[r, t]
    for _ in range(n_t):
        k0, k1 = vload_pair(k, o)  # the tile's keys of dim t, in tile order
        t = _fma4(q, qi, d, k0, k1, t)
        o += step
        qi += 1
    _store4(s, i0, sb, t)


@numba.njit(inline="always", nogil=True)
def _row(src: Any, si: int, w: Any, o: int, step: int, n: int, a: Any, ai: int,
         first: bool) -> None:  # pragma: no cover - compiled
    """One row alone: ``a[ai : ai+TILE_KEYS] (or 0 when first) + sum_{m<n} src[si + m] * w[o + m step :][:TILE_KEYS]``,
    the chain a lane of :func:`_fma4` computes for its row, in the same order."""
    if first:
        a0, a1 = vzero(), vzero()
    else:
        a0, a1 = vload(a, ai), vload(a, ai + LANES)
    for _ in range(n):
        x = vsplat_at(src, si)
        a0, a1 = vfma(x, vload(w, o), a0), vfma(x, vload(w, o + LANES), a1)
        o += step
        si += 1
    vstore(a, ai, a0)
    vstore(a, ai + LANES, a1)


@numba.njit(inline="always", nogil=True)
def _scores_dmajor_packed(q: Any, d: int, k: Any, base: int, step: int, s: Any, full: int) -> None:  # pragma: no cover
    """The whole tiles (keys ``< full``) of :func:`scores_dmajor_f32` for many rows (:data:`PACK_ROWS`):
    each tile's keys packed once, widened and in order, then every row over all ``d`` dims from them.
    After a tile, ``s[r, j0 : j0 + TILE_KEYS]`` holds its finished scores, in key order."""
    n_rows = s.shape[0]
    kp = np.empty(d * TILE_KEYS, dtype=np.float32)  # [d, TILE_KEYS] the tile's keys, widened
    line_keys = CACHE_LINE_BYTES // (2 if narrow(k) else 4)
    for j0 in range(0, full, TILE_KEYS):
        o = base + j0
        for t in range(d):
            for jl in range(j0 + (-j0) % line_keys, j0 + TILE_KEYS, line_keys):
                prefetch(k, o - j0 + jl + PREFETCH_KEYS)  # the same run, further along
            vstore(kp, t * TILE_KEYS, vload(k, o))
            vstore(kp, t * TILE_KEYS + LANES, vload(k, o + LANES))
            o += step
        r = 0
        while r + TILE_ROWS <= n_rows:  # kp as a block of TILE_KEYS keys a dim: base -j0 puts key j0 at kp[0]
            _scores_tile4(q, r, 0, d, kp, -j0, TILE_KEYS, j0, s, s.shape[1], True)
            r += TILE_ROWS
        while r < n_rows:  # rows past the last group of four, alone
            _row(q, r * d, kp, 0, TILE_KEYS, d, s, r * s.shape[1] + j0, True)
            r += 1


@numba.njit(fastmath=_FM, nogil=True, cache=True)
def scores_dmajor_f32(q: Any, kind: Any, d: int, k: Any, base: int, step: int, s: Any,
                      nb: int) -> None:  # pragma: no cover - compiled
    """``s[r, :nb] = sum_t q[r, t] k_t`` for every row (float32 ``q [R, d]``, ``s [R, B]``), over
    ``d`` key runs ``k[base + t*step :][:nb]``. Rows with ``kind[r] == 0`` are computed too
    (never read): skipping them would split the tiles by the other rows of a batch.

    Many rows (:data:`PACK_ROWS`) take packed tiles, fewer the panels; each lane is the same
    chain of fused multiply-adds either way, so a row's scores are bitwise the same in a batch
    as alone.
    """
    n_rows, sb = s.shape
    full = nb - nb % TILE_KEYS
    if n_rows >= PACK_ROWS:
        _scores_dmajor_packed(q, d, k, base, step, s, full)
        for r in range(n_rows):  # the last nb % TILE_KEYS keys: the panels' scalar chain, all dims at once
            for j in range(full, nb):
                x = numba.float32(0)
                for t in range(d):
                    x += q[r, t] * widen(k[base + t * step + j])
                s[r, j] = x
        return
    line_keys = CACHE_LINE_BYTES // (2 if narrow(k) else 4)  # keys per cache line of each run (a constant)
    for t0 in range(0, d, PANEL_DIMS):
        t1 = min(t0 + PANEL_DIMS, d)
        first = t0 == 0
        for j0 in range(0, full, TILE_KEYS):
            # Once per line of each run, whatever the rows: the lines that start in this tile
            # (a tile spans two lines of float32 at 16 lanes, half a line of 16-bit keys at 8).
            for jl in range(j0 + (-j0) % line_keys, j0 + TILE_KEYS, line_keys):
                for t in range(t0, t1):
                    prefetch(k, base + t * step + jl + PREFETCH_KEYS)  # the same run, further along
            r = 0
            while r + TILE_ROWS <= n_rows:
                if t1 - t0 == PANEL_DIMS:  # a whole panel: a constant count, the loop unrolled
                    _scores_tile4(q, r, t0, PANEL_DIMS, k, base, step, j0, s, sb, first)
                else:
                    _scores_tile4(q, r, t0, t1 - t0, k, base, step, j0, s, sb, first)
                r += TILE_ROWS
            while r < n_rows:  # rows past the last group of four, alone
                _row(q, r * d + t0, k, base + t0 * step + j0, step, t1 - t0, s, r * sb + j0, first)
                r += 1
        for r in range(n_rows):  # the block's last nb % TILE_KEYS keys: one scalar chain each, in dim order
            for j in range(full, nb):
                x = s[r, j] if not first else numba.float32(0)
                for t in range(t0, t1):
                    x += q[r, t] * widen(k[base + t * step + j])
                s[r, j] = x
    if split_order(k):  # the tiles' keys from (even, odd) to in order
        for j0 in range(0, full, TILE_KEYS):
            r = 0
            while r + TILE_ROWS <= n_rows:
                i0 = r * sb + j0
                _store4(s, i0, sb, _weave4(_load4(s, i0, sb)))
                r += TILE_ROWS


@numba.njit(inline="always", fastmath=_FM, nogil=True)
def _pv_tile4(s: Any, r: int, j0: int, j1: int, v: Any, base: int, step: int, acc: Any, d_v: int,
              full: int) -> None:  # pragma: no cover - compiled
    """Rows ``r..r+3``: ``acc[:, :full] += p[:, j0:j1] @ v[j0:j1, :full]`` (at most PV_KEYS keys).

    For each TILE_KEYS columns, the tile's accumulators stay in registers over the keys;
    the keys' value rows are read side by side (PV_KEYS streams of ``d_v`` values).
    """
    sb = s.shape[1]
    line = CACHE_LINE_BYTES // (2 if narrow(v) else 4)  # values per cache line (a constant: the loop unrolls)
    for e0 in range(0, full, TILE_KEYS):
        i0 = r * d_v + e0  # flat acc[r, e0]
        t = _load4(acc, i0, d_v)
        o = base + j0 * step + e0
        # This pass's share of the tile PREFETCH_VALUES keys on, in address order.
        pf = base + (j0 + PREFETCH_VALUES) * step + e0 * (j1 - j0)
        pi = r * sb + j0  # flat p[r, j]
        for _ in range(j1 - j0):
            w0, w1 = vload(v, o), vload(v, o + LANES)
            for el in range(0, TILE_KEYS, line):  # every line of the tile's share
                prefetch(v, pf + el)
            t = _fma4(s, pi, sb, w0, w1, t)
            pf += TILE_KEYS
            o += step
            pi += 1
        _store4(acc, i0, d_v, t)


@numba.njit(fastmath=_FM, nogil=True, cache=True)
def pv_f32(s: Any, kind: Any, nb: int, v: Any, base: int, step: int, acc: Any,
           d_v: int) -> None:  # pragma: no cover - compiled
    """``acc[r, :d_v] += sum_j s[r, j] v_j`` for every row with ``kind[r] != 0`` (float32 ``s [R, B]``,
    ``acc [R, d_v]``), over ``nb`` values ``v[base + j*step :][:d_v]``.

    A group of four rows runs as one tile only when all four are visible; otherwise
    its visible rows run alone (bitwise the same per row).
    """
    n_rows = s.shape[0]
    full = d_v - d_v % TILE_KEYS
    for j0 in range(0, nb, PV_KEYS):
        j1 = min(j0 + PV_KEYS, nb)
        r = 0
        while r < n_rows:
            group = r + TILE_ROWS <= n_rows
            if group:
                for i in range(TILE_ROWS):
                    group = group and kind[r + i] != 0
            if group:
                _pv_tile4(s, r, j0, j1, v, base, step, acc, d_v, full)
                r += TILE_ROWS
                continue
            if kind[r] != 0:
                for e0 in range(0, full, TILE_KEYS):
                    _row(s, r * s.shape[1] + j0, v, base + j0 * step + e0, step, j1 - j0, acc, r * d_v + e0, False)
            r += 1
        for r in range(n_rows):  # the last d_v % TILE_KEYS columns: one scalar chain each, in key order
            if kind[r] == 0:
                continue
            for e in range(full, d_v):
                x = acc[r, e]
                for j in range(j0, j1):
                    x += s[r, j] * widen(v[base + j * step + e])
                acc[r, e] = x
