"""The numba kernels of the fused CPU path (``workers.fused``): one pass per key block.

Imported only through :func:`workers.fused.kernels` (which falls back to NumPy
when this import or a compile fails). Every array is handed in flat (1-D,
contiguous) with element strides, so that numba sees contiguous arrays and
vectorises the inner loops whatever the view's strides.

Per work unit (a key chunk, and for the resident layout one kv head) and per
block of ``B`` keys, for every row ``r`` (a query row of a kv head, the row
space of ``workers.rows``):

1. scores ``s[r, :B]`` of the block, in the accumulation dtype, keys widened
   in-register (bfloat16: bits shifted up 16; float16: ``fpext``, F16C);
2. softcap, ALiBi and the mask per row (rows may come from different requests);
3. the online-softmax update, with the invariant over the keys ``J`` seen so far::

       m[r]   = max_{j in J} s_j                 (-inf while J is empty)
       l[r]   = sum_{j in J} exp(s_j - m[r])
       acc[r] = sum_{j in J} exp(s_j - m[r]) v_j

4. ``acc[r] += p[r, :B] @ v[:B]``.

For bfloat16 and float16 keys, steps 1 and 4 run on register-tile micro-kernels:
``workers.fused_micro`` for the resident layout's scores and for ``p @ v``,
``workers.fused_dots`` for the inline layout's scores (:func:`scores_dmajor`,
:func:`scores_rows`, :func:`pv` and :func:`pv_dense` pick at compile time; :func:`_micro`
says why); float32 keys and values of the resident layout, and float32 keys of the inline
layout's scores, take the tiles too (:func:`_dense_choice`); every other float32 and float64
product runs the loops here,
which numba vectorises.

Each row's arithmetic is in a fixed order that depends on the row alone (its
dot products, its block skips, its reductions), never on how many rows share the
call: a row gives bitwise the same state alone or in a batch. ``FASTMATH`` lets
LLVM reassociate the loops' reductions but keeps infinities and NaNs, which the masks
rely on. A grouping LLVM chooses is not always the same from one compile to the next:
the sum of a row's probabilities (``l``) came out one way in the process that compiled
the kernel and another in a process that loaded it from numba's disk cache, so a
restarted worker changed a last bit. That sum is written in one order
(:func:`sum_in_order`), and a compile and a load are compared bit for bit
(tests/e2e/test_workers_fused.py).
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from numba import prange
from numba.core import types
from numba.extending import overload

from workers.fused_dots import TILE_ROWS as DOT_ROWS
from workers.fused_dots import scores_rows_f32
from workers.fused_micro import pv_f32, scores_dmajor_f32
from workers.fused_simd import WIDE, _bits_to_f32, narrow, widen
from workers.fused_simd import add_exact as _add_exact
from workers.fused_simd import vmax as _vmax
from workers.fused_simd import vmax_lanes as _vmax_lanes
from workers.fused_simd import wload as _wload

# The vector intrinsics, typed as their calls in compiled code read (numba supplies the typing context).
add_exact: Any = _add_exact
vmax: Any = _vmax
vmax_lanes: Any = _vmax_lanes
wload: Any = _wload

#: Reassociation and contraction for vectorised reductions; no ``nnan``/``ninf``:
#: masked scores are -inf and must stay so.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
#: Below this, float32 ``exp`` is 0 (the smallest normal float32 is exp(-87.34)).
EXP32_MIN = -87.33
#: Unsigned flat indexes (see ``_pv``).
_U = np.uint64
#: sha256 (first 16 hex digits) of ``workers/fused_dots.py``, ``workers/fused_micro.py`` and
#: ``workers/fused_simd.py``, in that order, which the kernels below compile in. numba's disk
#: cache (``cache=True``) checks only this file's stamp, so a change to those files must change
#: this one too, or a worker would load machine code built from the old micro-kernels;
#: tests/unit/test_workers_fused.py recomputes the digest.
COMPILED_IN_DIGEST = "dffed0c57655fbfd"


def expo(x: Any) -> Any:
    """``exp(x)`` in the precision of ``x`` (numba only; see the overload)."""
    raise NotImplementedError  # pragma: no cover


@overload(expo)
def _expo_impl(x: Any) -> Any:  # pragma: no cover - compiled
    if x == types.float64:
        def exp64(x: Any) -> Any:
            return math.exp(x)
        return exp64
    if x != types.float32:
        return None

    def exp32(x: Any) -> Any:
        # Cephes expf, branch-free so that it vectorises: x = n ln2 + r, |r| <= ln2/2,
        # exp(r) by a degree-6 polynomial (about 1 ulp), times 2**n built in the exponent bits.
        xc = min(x, np.float32(88.0))
        xc = max(xc, np.float32(EXP32_MIN))
        n = np.floor(xc * np.float32(1.44269504088896341) + np.float32(0.5))  # float32, as np.floor keeps it
        r = xc - n * np.float32(0.693359375)
        r = r + n * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        p = p * r * r + r + np.float32(1.0)
        scale = _bits_to_f32(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))  # type: ignore[call-arg,var-annotated]
        res = p * scale
        if x < np.float32(EXP32_MIN):
            res = np.float32(0.0)  # -inf (a masked key) included
        return res

    return exp32


@numba.njit(inline="always", fastmath=FASTMATH, nogil=True)
def _options(s: Any, r: int, nb: int, kp0: int, kpos: Any, arange: bool, qpos: Any, cap: Any, slope: Any,
             has_alibi: Any, lo: Any, hi: Any, has_lo: Any, has_hi: Any, partial: bool, tmp: Any) -> None:
    """Softcap, ALiBi and the mask on row ``r`` of a block's scores ``s[r, :nb]`` (docs/API.md section 3)."""
    if cap[r] > 0:
        for jj in range(nb):
            s[r, jj] = cap[r] * math.tanh(s[r, jj])
    if has_alibi[r] or partial:
        for jj in range(nb):
            kp = kp0 + jj if arange else kpos[kp0 + jj]
            if has_alibi[r]:
                tmp[0] = abs(qpos[r] - kp)  # cast to the accumulation dtype, as the NumPy path
                s[r, jj] = s[r, jj] - slope[r] * tmp[0]
            if partial and ((has_lo[r] and kp < lo[r]) or (has_hi[r] and kp > hi[r])):
                s[r, jj] = -np.inf


@numba.njit(inline="always", fastmath=FASTMATH, nogil=True)
def _row_kind(r: int, kmin: int, kmax: int, masked: bool, lo: Any, hi: Any, has_lo: Any, has_hi: Any) -> int:
    """0: row ``r`` sees no key with positions in [kmin, kmax]; 1: all of them; 2: some (mask them)."""
    if not masked:
        return 1
    if (has_hi[r] and kmin > hi[r]) or (has_lo[r] and kmax < lo[r]):
        return 0
    if (not has_lo[r] or kmin >= lo[r]) and (not has_hi[r] or kmax <= hi[r]):
        return 1
    return 2


@numba.njit(inline="always", fastmath=FASTMATH, nogil=True)
def _softmax(s: Any, r: int, nb: int, m: Any, l: Any, acc: Any, d_v: int, zero: Any) -> None:
    """Scores of row ``r`` to probabilities (in place); m, l grown and acc rescaled (module invariant)."""
    srow = s[r]  # [B]
    mb = row_max(srow, nb, m[r])
    # Guard: a row that has seen no visible key has mb = -inf; measure it against 0
    # so exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
    m_ref = mb if mb != -np.inf else zero
    alpha = expo(m[r] - m_ref)  # rescale of the old state; 0 while it was empty
    for jj in range(nb):
        srow[jj] = expo(srow[jj] - m_ref)  # masked keys give exactly 0
    l[r] = l[r] * alpha + sum_in_order(srow, nb, zero)
    if alpha != 1:
        arow = acc[r]  # [d_v]
        for e in range(d_v):
            arow[e] *= alpha
    m[r] = mb


@numba.njit(inline="always", nogil=True)
def sum_in_order(row: Any, nb: int, zero: Any) -> Any:  # pragma: no cover - compiled
    """``row[0] + ... + row[nb - 1]`` in one fixed order, the same wherever and however the kernel was
    compiled: eight running sums (element ``j`` into sum ``j % 8``) over the whole groups of eight,
    folded as ``((s0+s1) + (s2+s3)) + ((s4+s5) + (s6+s7))``, then the rest in order; every add is
    :func:`workers.fused_simd.add_exact`, so LLVM cannot regroup it (see there why that matters).
    ``zero`` is 0 in ``row``'s dtype."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    j = 0
    while j + 8 <= nb:
        s0, s1 = add_exact(s0, row[j]), add_exact(s1, row[j + 1])
        s2, s3 = add_exact(s2, row[j + 2]), add_exact(s3, row[j + 3])
        s4, s5 = add_exact(s4, row[j + 4]), add_exact(s5, row[j + 5])
        s6, s7 = add_exact(s6, row[j + 6]), add_exact(s7, row[j + 7])
        j += 8
    total = add_exact(add_exact(add_exact(s0, s1), add_exact(s2, s3)), add_exact(add_exact(s4, s5), add_exact(s6, s7)))
    while j < nb:
        total = add_exact(total, row[j])
        j += 1
    return total


def row_max(row: Any, nb: int, start: Any) -> Any:
    """``max(start, row[0], ..., row[nb - 1])`` (numba only; see the overload)."""
    raise NotImplementedError  # pragma: no cover


@overload(row_max, inline="always")
def _row_max_impl(row: Any, nb: Any, start: Any) -> Any:  # pragma: no cover - compiled
    # A maximum is exact in any order, so float32 rows take it WIDE lanes at a time: one scalar
    # chain of nb compares was 70% of the softmax (benchmarks/results/2026-12-07/NOTES.md, "Sixteen lanes").
    if row.dtype == types.float32 and row.layout == "C":
        def lanes(row: Any, nb: Any, start: Any) -> Any:
            mb, j = start, 0
            if nb >= WIDE:
                top = wload(row, 0)
                j = WIDE
                while j + WIDE <= nb:
                    top = vmax(top, wload(row, j))
                    j += WIDE
                mb = max(mb, vmax_lanes(top))
            for jj in range(j, nb):
                mb = max(mb, row[jj])
            return mb
        return lanes

    def chain(row: Any, nb: Any, start: Any) -> Any:
        mb = start
        for jj in range(nb):
            mb = max(mb, row[jj])
        return mb
    return chain


@numba.njit(inline="always", nogil=True)
def _widen4(src: Any, o0: Any, o1: Any, o2: Any, o3: Any, n: int, w: Any) -> None:
    """``w[i, :n]`` = the 16-bit run ``src[o_i : o_i + n]`` widened, for the four runs (L1 scratch)."""
    for e in range(n):
        ue = _U(e)
        w[0, e], w[1, e] = widen(src[o0 + ue]), widen(src[o1 + ue])
        w[2, e], w[3, e] = widen(src[o2 + ue]), widen(src[o3 + ue])


@numba.njit(inline="always", fastmath=FASTMATH, nogil=True)
def _pv(s: Any, kind: Any, nb: int, v: Any, base: int, step: int, acc: Any, d_v: int, vw: Any) -> None:
    """``acc[r, :d_v] += sum_j s[r, j] v_j`` for every row r with ``kind[r] != 0``, over a block's
    ``nb`` values ``v[base + j*step :][:d_v]``.

    Four keys per pass over a row of ``acc`` (a quarter of its loads and stores), the
    keys ``j, j + n/4, j + n/4*2, j + n/4*3`` (``n/4 = nb // 4``), then the rest one by one:
    four streams of values at once, where one stream read well under half the bandwidth
    the CPU gives several (benchmarks/results/2026-12-01/NOTES.md, "Longer resident blocks and four value streams"). The keys
    outside, the rows inside, so that the four values stay in L1 while every row reads
    them. A row's order depends on ``nb`` alone, never on the other rows. Flat indexes are
    unsigned (``_U``): numba then adds no negative-index fixup, and the loops vectorise
    without slicing (a slice costs two atomic reference counts). 16-bit values are widened
    once into ``vw [4, d_v]`` (L1 scratch) that every row then reads.
    """
    n_rows = s.shape[0]
    quarter = nb // 4
    for j in range(quarter):
        j1, j2, j3 = j + quarter, j + 2 * quarter, j + 3 * quarter
        o0, o1 = _U(base + j * step), _U(base + j1 * step)
        o2, o3 = _U(base + j2 * step), _U(base + j3 * step)
        if narrow(v):
            _widen4(v, o0, o1, o2, o3, d_v, vw)
            for r in range(n_rows):
                if kind[r] == 0:
                    continue
                p0, p1, p2, p3 = s[r, j], s[r, j1], s[r, j2], s[r, j3]
                for e in range(d_v):
                    acc[r, e] += ((p0 * vw[0, e] + p1 * vw[1, e]) + (p2 * vw[2, e] + p3 * vw[3, e]))
            continue
        for r in range(n_rows):
            if kind[r] == 0:
                continue
            p0, p1, p2, p3 = s[r, j], s[r, j1], s[r, j2], s[r, j3]
            for e in range(d_v):
                ue = _U(e)
                acc[r, e] += ((p0 * widen(v[o0 + ue]) + p1 * widen(v[o1 + ue]))
                              + (p2 * widen(v[o2 + ue]) + p3 * widen(v[o3 + ue])))
    for j in range(4 * quarter, nb):
        o0 = _U(base + j * step)
        for r in range(n_rows):
            if kind[r] == 0:
                continue
            p0 = s[r, j]
            for e in range(d_v):
                acc[r, e] += p0 * widen(v[o0 + _U(e)])


@numba.njit(inline="always", fastmath=FASTMATH, nogil=True)
def _scores_dmajor(q: Any, kind: Any, d: int, k: Any, base: int, step: int, s: Any, nb: int) -> None:
    """``s[r, :nb] = sum_t q[r, t] k_t`` for every row r with ``kind[r] != 0``, over ``d`` key
    rows ``k[base + t*step :][:nb]`` (d-major keys).

    Four dims per pass over a row of ``s``, then the rest one by one, in dim order;
    dims outside, rows inside (the four key rows stay in L1). Unsigned indexes: see :func:`_pv`.
    """
    n_rows = s.shape[0]
    for r in range(n_rows):
        for jj in range(nb):
            s[r, jj] = 0
    t = 0
    while t + 4 <= d:
        o0 = _U(base + t * step)
        o1, o2, o3 = o0 + _U(step), o0 + _U(2 * step), o0 + _U(3 * step)
        for r in range(n_rows):
            if kind[r] == 0:
                continue
            q0, q1, q2, q3 = q[r, t], q[r, t + 1], q[r, t + 2], q[r, t + 3]
            for jj in range(nb):
                uj = _U(jj)
                s[r, jj] += ((q0 * widen(k[o0 + uj]) + q1 * widen(k[o1 + uj]))
                             + (q2 * widen(k[o2 + uj]) + q3 * widen(k[o3 + uj])))
        t += 4
    while t < d:
        o0 = _U(base + t * step)
        for r in range(n_rows):
            if kind[r] == 0:
                continue
            q0 = q[r, t]
            for jj in range(nb):
                s[r, jj] += q0 * widen(k[o0 + _U(jj)])
        t += 1


@numba.njit(inline="always", fastmath=FASTMATH, nogil=True)
def _scores_rows(q: Any, kind: Any, d: int, k: Any, base: int, step: int, s: Any, nb: int, kw: Any,
                 zero: Any) -> None:
    """``s[r, j] = q[r] . k[base + j*step :][:d]`` for every row r with ``kind[r] != 0`` (keys as rows).

    Keys ``j, j + n/4, j + n/4*2, j + n/4*3`` together (four streams, each q row read once for
    four keys), then the rest one by one: a key's dot product depends on its place in the
    block alone. 16-bit keys are widened once into ``kw [4, d]`` (L1 scratch) for all rows.
    """
    n_rows = s.shape[0]
    quarter = nb // 4
    for jj in range(quarter):
        j1, j2, j3 = jj + quarter, jj + 2 * quarter, jj + 3 * quarter
        c0 = _U(base + jj * step)  # key jj: k[c0:c0 + d]
        c1, c2, c3 = c0 + _U(quarter * step), c0 + _U(2 * quarter * step), c0 + _U(3 * quarter * step)
        if narrow(k):
            _widen4(k, c0, c1, c2, c3, d, kw)
        for r in range(n_rows):
            if kind[r] == 0:
                continue
            t0, t1, t2, t3 = zero, zero, zero, zero
            for dd in range(d):
                qv = q[r, dd]
                if narrow(k):
                    t0 += qv * kw[0, dd]
                    t1 += qv * kw[1, dd]
                    t2 += qv * kw[2, dd]
                    t3 += qv * kw[3, dd]
                else:
                    ud = _U(dd)
                    t0 += qv * widen(k[c0 + ud])
                    t1 += qv * widen(k[c1 + ud])
                    t2 += qv * widen(k[c2 + ud])
                    t3 += qv * widen(k[c3 + ud])
            s[r, jj], s[r, j1], s[r, j2], s[r, j3] = t0, t1, t2, t3
    for jj in range(4 * quarter, nb):
        c0 = _U(base + jj * step)
        for r in range(n_rows):
            if kind[r] == 0:
                continue
            t = zero
            for dd in range(d):
                t += q[r, dd] * widen(k[c0 + _U(dd)])
            s[r, jj] = t


def _micro(rows: Any, out: Any, keys: Any) -> bool:
    """Whether the register-tile micro-kernels (``workers.fused_micro``, ``workers.fused_dots``) serve a
    product: float32 rows over 16-bit keys (values), C-contiguous.

    For 16-bit keys they widen each element once for four rows, where the loops below widen it
    once per row: the resident layout read 1.6-1.8x faster, the inline one 1.3-1.45x. For float32
    keys the loops measured as fast or faster on the hosts of 2026-12-02 (0.94-0.97x inline;
    benchmarks/results/2026-12-02/NOTES.md, "Register tiles" and "Inline scores as register tiles"),
    so inline float32 ``p @ v`` on eight lanes stays on them; the resident layout and the inline
    scores take float32 keys on the tiles (:func:`_dense_choice`).
    """
    return (all(a.layout == "C" for a in (rows, out, keys)) and rows.dtype == types.float32
            and keys.dtype in (types.uint16, types.int16))


def _dense_choice(rows: Any, out: Any, keys: Any) -> bool:
    """Whether a product of the resident layout (d-major keys, value rows ``d_v`` apart), or the
    inline layout's scores, runs on the register tiles: where :func:`_micro` says, and for float32
    keys (values) too.

    The inline scores' tiles read a pair of keys, every head, in address order and prefetch the
    pair's values alongside; on a Zen 4 they read the whole inline float32 decode 1.18-1.29x faster
    than the loop at 2 threads (15.4-15.6 against 12.1-13.2 GB/s, 256K keys, two alternating runs;
    benchmarks/results/2026-12-07/NOTES.md, "A Zen 4 host, and keys packed for many rows").

    The resident layout's runs are contiguous, which the tiles read side by side and prefetch
    along (``workers.fused_micro``); there the tiles ran float32 ``p @ v`` at 1.5x the loop in
    cache, and the whole float32 decode 1.09x faster at one thread and 1.05-1.20x at two with
    the scores on them too (benchmarks/results/2026-12-05/NOTES.md, "A Zen 1 host" and "Scores prefetch along their
    own runs"). The inline layout's value rows are a whole key apart (``h_kv d_v`` elements, 4 KiB
    for float32 at h_kv = 8, d_v = 128): 32 of them side by side fall in the same L1 sets, and on
    eight lanes float32 ``p @ v`` stays on the loop there; on sixteen lanes, prefetching into L2,
    the tiles read the inline float32 decode 1.2x faster (:func:`_pv_choice`).
    """
    return _micro(rows, out, keys) or (all(a.layout == "C" for a in (rows, out, keys))
                                       and rows.dtype == out.dtype == keys.dtype == types.float32)


def scores_dmajor(q: Any, kind: Any, d: int, k: Any, base: int, step: int, s: Any, nb: int) -> None:
    """The block's scores over d-major keys (numba only): the micro-kernel where
    :func:`_dense_choice` says, else the loop."""
    raise NotImplementedError  # pragma: no cover


@overload(scores_dmajor)
def _scores_dmajor_impl(q: Any, kind: Any, d: int, k: Any, base: int, step: int, s: Any,
                        nb: int) -> Any:  # pragma: no cover - compiled
    if _dense_choice(q, s, k):
        def micro(q: Any, kind: Any, d: int, k: Any, base: int, step: int, s: Any, nb: int) -> None:
            scores_dmajor_f32(q, kind, d, k, base, step, s, nb)
        return micro

    def loop(q: Any, kind: Any, d: int, k: Any, base: int, step: int, s: Any, nb: int) -> None:
        _scores_dmajor(q, kind, d, k, base, step, s, nb)
    return loop


def scores_rows(q: Any, kind: Any, d: int, k: Any, base: int, sk0: int, sk1: int, s: Any, nb: int, kw: Any,
                lanes: Any, v: Any, vbase: int, sv0: int, zero: Any) -> None:
    """A block's scores over keys stored as rows, every kv head (numba only): ``s[h, r, j] =
    q[h, r] . k[base + j*sk0 + h*sk1 :][:d]``; the tiles where :func:`_dense_choice` says, else the loop."""
    raise NotImplementedError  # pragma: no cover


@overload(scores_rows)
def _scores_rows_impl(q: Any, kind: Any, d: int, k: Any, base: int, sk0: int, sk1: int, s: Any, nb: int,
                      kw: Any, lanes: Any, v: Any, vbase: int, sv0: int, zero: Any) -> Any:  # pragma: no cover
    if _dense_choice(q, s, k):
        def tiles(q: Any, kind: Any, d: int, k: Any, base: int, sk0: int, sk1: int, s: Any, nb: int, kw: Any,
                  lanes: Any, v: Any, vbase: int, sv0: int, zero: Any) -> None:
            scores_rows_f32(q, d, k, base, sk0, sk1, s, nb, lanes, v, vbase, sv0)
        return tiles

    def loop(q: Any, kind: Any, d: int, k: Any, base: int, sk0: int, sk1: int, s: Any, nb: int, kw: Any,
             lanes: Any, v: Any, vbase: int, sv0: int, zero: Any) -> None:
        for h in range(q.shape[0]):
            _scores_rows(q[h], kind, d, k, base + h * sk1, sk0, s[h], nb, kw, zero)
    return loop


def pv(s: Any, kind: Any, nb: int, v: Any, base: int, step: int, acc: Any, d_v: int, vw: Any) -> None:
    """``acc += p @ v`` over a block of the inline layout (numba only): the micro-kernel where
    :func:`_pv_choice` says, else the loop."""
    raise NotImplementedError  # pragma: no cover


def pv_dense(s: Any, kind: Any, nb: int, v: Any, base: int, step: int, acc: Any, d_v: int, vw: Any) -> None:
    """``acc += p @ v`` over a block of the resident layout (numba only): the micro-kernel where
    :func:`_dense_choice` says (16-bit values as :func:`pv`, and float32 values too), else the loop."""
    raise NotImplementedError  # pragma: no cover


def _pv_choice(s: Any, acc: Any, v: Any, dense: bool) -> Any:  # pragma: no cover - compiled
    """The implementation :func:`pv` (``dense`` False) or :func:`pv_dense` compiles in: the tiles as
    :func:`_dense_choice` says for the resident layout, and for the inline one at sixteen lanes
    (256K keys, 2 threads: 19.0-19.6 GB/s against 16.0-16.2 on the loop,
    benchmarks/results/2026-12-07/NOTES.md, "Sixteen lanes"); at eight, as :func:`_micro` says."""
    if _dense_choice(s, acc, v) if dense or WIDE == 16 else _micro(s, acc, v):
        def micro(s: Any, kind: Any, nb: int, v: Any, base: int, step: int, acc: Any, d_v: int, vw: Any) -> None:
            pv_f32(s, kind, nb, v, base, step, acc, d_v)
        return micro

    def loop(s: Any, kind: Any, nb: int, v: Any, base: int, step: int, acc: Any, d_v: int, vw: Any) -> None:
        _pv(s, kind, nb, v, base, step, acc, d_v, vw)
    return loop


@overload(pv)
def _pv_impl(s: Any, kind: Any, nb: int, v: Any, base: int, step: int, acc: Any, d_v: int,
             vw: Any) -> Any:  # pragma: no cover - compiled
    return _pv_choice(s, acc, v, False)


@overload(pv_dense)
def _pv_dense_impl(s: Any, kind: Any, nb: int, v: Any, base: int, step: int, acc: Any, d_v: int,
                   vw: Any) -> Any:  # pragma: no cover - compiled
    return _pv_choice(s, acc, v, True)


@numba.njit(parallel=True, fastmath=FASTMATH, nogil=True, cache=True)
def inline_kernel(q: Any, k: Any, sk0: int, sk1: int, v: Any, sv0: int, sv1: int, n_k: int, d_v: int,
                  kpos: Any, arange: bool, kpos0: int, qpos: Any, cap: Any, slope: Any, has_alibi: Any,
                  lo: Any, hi: Any, has_lo: Any, has_hi: Any, masked: bool, block: int, bounds: Any,
                  zero: Any, m_out: Any, l_out: Any, acc_out: Any) -> None:  # pragma: no cover - compiled
    """Keys in the contract layout: key j, head h, dim t at ``k[j*sk0 + h*sk1 + t]`` (v likewise).

    ``q [h_kv, R, d]`` (scaled); chunk c covers keys ``[bounds[c], bounds[c+1])`` of all
    heads and writes ``m_out[c] [h_kv, R]``, ``l_out[c]``, ``acc_out[c] [h_kv, R, d_v]``.
    A block reads the keys ``[b0, b1)`` of every head: one contiguous run of K and of V.
    """
    h_kv, n_rows, d = q.shape
    for c in prange(bounds.shape[0] - 1):
        m, l, acc = m_out[c], l_out[c], acc_out[c]  # [h_kv, R], [h_kv, R], [h_kv, R, d_v]
        s = np.empty((h_kv, n_rows, block), dtype=q.dtype)  # [h_kv, R, B] scores, then p
        kw = np.empty((4, d), dtype=np.float32)  # [4, d] four 16-bit keys, widened (loops)
        lanes = np.empty(h_kv * -(-n_rows // DOT_ROWS) * DOT_ROWS * (block + 1), dtype=np.float32)  # tiles' scores
        vw = np.empty((4, d_v), dtype=np.float32)  # [4, d_v] four 16-bit values, widened
        kind = np.empty(n_rows, dtype=np.int64)
        tmp = np.empty(1, dtype=q.dtype)
        for b0 in range(bounds[c], bounds[c + 1], block):
            b1 = min(b0 + block, bounds[c + 1])
            nb = b1 - b0
            kmin, kmax = 0, 0
            if masked:
                if arange:
                    kmin, kmax = kpos0 + b0, kpos0 + b1 - 1
                else:
                    kmin, kmax = kpos[b0], kpos[b0]
                    for j in range(b0, b1):
                        kmin = min(kmin, kpos[j])
                        kmax = max(kmax, kpos[j])
            for r in range(n_rows):
                kind[r] = _row_kind(r, kmin, kmax, masked, lo, hi, has_lo, has_hi)
            scores_rows(q, kind, d, k, b0 * sk0, sk0, sk1, s, nb, kw, lanes, v, b0 * sv0, sv0, zero)
            for h in range(h_kv):
                for r in range(n_rows):
                    if kind[r] == 0:
                        continue  # no key of this block is visible to row r: its state is unchanged
                    _options(s[h], r, nb, (kpos0 + b0) if arange else b0, kpos, arange, qpos, cap, slope[h],
                             has_alibi, lo, hi, has_lo, has_hi, kind[r] == 2, tmp)
                    _softmax(s[h], r, nb, m[h], l[h], acc[h], d_v, zero)
                pv(s[h], kind, nb, v, b0 * sv0 + h * sv1, sv0, acc[h], d_v, vw)
            # Invariant holds for every row over the keys [bounds[c], b1).


@numba.njit(parallel=True, fastmath=FASTMATH, nogil=True, cache=True)
def resident_kernel(q: Any, k: Any, sk0: int, sk1: int, v: Any, sv0: int, sv1: int, n_k: int, d_v: int,
                    kpos: Any, arange: bool, kpos0: int, qpos: Any, cap: Any, slope: Any, has_alibi: Any,
                    lo: Any, hi: Any, has_lo: Any, has_hi: Any, masked: bool, block: int, bounds: Any,
                    zero: Any, m_out: Any, l_out: Any, acc_out: Any) -> None:  # pragma: no cover - compiled
    """Keys d-major: head h, dim t, key j at ``k[h*sk0 + t*sk1 + j]``; values ``v[h*sv0 + j*sv1 + e]``.

    Work unit ``u = h * n_chunks + c``: one kv head over one key chunk. Scores of a
    block are ``d`` AXPYs over contiguous key runs, in dim order.
    """
    h_kv, n_rows, d = q.shape
    n_chunks = bounds.shape[0] - 1
    for u in prange(h_kv * n_chunks):
        h, c = u // n_chunks, u % n_chunks
        m, l, acc = m_out[c, h], l_out[c, h], acc_out[c, h]  # [R], [R], [R, d_v]
        s = np.empty((n_rows, block), dtype=q.dtype)  # [R, B] scores, then p
        vw = np.empty((4, d_v), dtype=np.float32)  # [4, d_v] four 16-bit values, widened
        kind = np.empty(n_rows, dtype=np.int64)
        tmp = np.empty(1, dtype=q.dtype)
        for b0 in range(bounds[c], bounds[c + 1], block):
            b1 = min(b0 + block, bounds[c + 1])
            nb = b1 - b0
            kmin, kmax = 0, 0
            if masked:
                if arange:
                    kmin, kmax = kpos0 + b0, kpos0 + b1 - 1
                else:
                    kmin, kmax = kpos[b0], kpos[b0]
                    for j in range(b0, b1):
                        kmin = min(kmin, kpos[j])
                        kmax = max(kmax, kpos[j])
            for r in range(n_rows):
                kind[r] = _row_kind(r, kmin, kmax, masked, lo, hi, has_lo, has_hi)
            scores_dmajor(q[h], kind, d, k, h * sk0 + b0, sk1, s, nb)
            for r in range(n_rows):
                if kind[r] == 0:
                    continue  # no key of this block is visible to row r: its state is unchanged
                _options(s, r, nb, (kpos0 + b0) if arange else b0, kpos, arange, qpos, cap, slope[h],
                         has_alibi, lo, hi, has_lo, has_hi, kind[r] == 2, tmp)
                _softmax(s, r, nb, m, l, acc, d_v, zero)
            pv_dense(s, kind, nb, v, h * sv0 + b0 * sv1, sv1, acc, d_v, vw)
            # Invariant holds for every row over the keys [bounds[c], b1).
