"""The blockwise online-softmax loop over one work item (README, "The math").

Array-module neutral: the same code runs on numpy and on cupy (the generic GPU
path). The invariant after each processed block, for every kv head ``h`` of the
item and every row ``r`` (query i, group member j) of its tile, over the keys
J seen so far that row ``r`` is allowed to see:

* ``m[h, r]   = max_{j in J} s_j``               (-inf while J is empty)
* ``l[h, r]   = sum_{j in J} exp(s_j - m[h, r])``
* ``acc[h, r] = sum_{j in J} exp(s_j - m[h, r]) v_j``

Scores are never kept beyond one ``[hb, rows, B]`` tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from merge import NO_SCORE
from workers.masking import BlockKind, TileBounds, visible
from workers.options import AttentionOptions
from workers.problem import as_array


@dataclass(frozen=True, eq=False)
class TileInputs:
    """What every block of one tile needs, prepared once per tile."""

    q: Any  # [hb, rows, d], already multiplied by the score factor
    q_pos: Any  # [rows] int64, the position of each row's query
    slopes: Any  # [hb, rows] ALiBi slope per row, or None
    softcap: float | None  # when set, q was divided by it: s = softcap * tanh(q . k)
    bounds: TileBounds
    options: AttentionOptions


def operand_rows(hb: int, rows: int, itemsize: int) -> int:
    """Rows for which ALiBi and mask operands ``[rows, B]`` are built at once.

    Per row and key they take up to ``16 + (hb + 1) * itemsize`` bytes (an int64
    difference and its absolute value, the cast distance, slope x distance; the
    boolean masks take less); the tile takes ``hb * itemsize``. Half a tile of
    operands at a time is what ``plan.CPU_TILE_HALVES`` budgets.
    """
    per_row = 16 + (hb + 1) * itemsize
    return max(1, min(rows, hb * rows * itemsize // 2 // per_row))


def stream(tile: TileInputs, kv: Any, k_pos_host: Any, k0: int, k1: int, h0: int, h1: int,
           block: int, acc_dtype: Any, xp: Any) -> tuple[Any, Any, Any]:
    """Stream keys ``[k0, k1)`` of kv heads ``[h0, h1)`` through the tile; return (m, l, acc).

    ``k_pos_host`` is a numpy view of the key positions: the block skip reads
    min/max there, so the GPU path does not synchronise on every block.

    Scratch is allocated once per call and reused by every block: the score
    tile ``[hb, rows, B]`` (scores, then probabilities, in place), one
    ``[hb, rows, d_v]`` product and a few ``[hb, rows]`` vectors. On top of
    that, ALiBi and partially masked blocks build their operands a few rows at a
    time (:func:`operand_rows`), and a layout that casts copies one BLAS call's
    keys and values.
    """
    hb, rows = int(tile.q.shape[0]), int(tile.q.shape[1])
    d_v = int(kv.v.shape[-1])
    m = xp.full((hb, rows), NO_SCORE, dtype=acc_dtype)
    l = xp.zeros((hb, rows), dtype=acc_dtype)
    acc = xp.zeros((hb, rows, d_v), dtype=acc_dtype)
    if k1 <= k0:
        return m, l, acc
    width = min(block, k1 - k0)
    s_buf = xp.empty((hb, rows, width), dtype=acc_dtype)  # [hb, rows, B] score tile, reused
    pv = xp.empty((hb, rows, d_v), dtype=acc_dtype)  # [hb, rows, d_v] p @ v of one block
    m_new = xp.empty((hb, rows), dtype=acc_dtype)
    m_ref = xp.empty((hb, rows), dtype=acc_dtype)
    alpha = xp.empty((hb, rows), dtype=acc_dtype)
    l_blk = xp.empty((hb, rows), dtype=acc_dtype)
    ones = xp.ones((width,), dtype=acc_dtype)  # [B]: row sums as a GEMV, faster than a reduction
    # On the CPU each product is cut into BLAS calls of ``kv.call_keys`` keys:
    # a layout that must cast copies one call at a time (at most CALL_KEYS keys,
    # so that scratch is bounded by the call), and one that hands out views
    # takes the call length its memory layout streams best. The block sets only
    # the softmax step and the score tile. CuPy takes the whole block in one
    # call: there a launch costs more than a copy.
    call = None
    if getattr(xp, "__name__", "") == "numpy" and hasattr(kv, "call_keys"):
        call = kv.call_keys(acc_dtype, rows)
    call = call or width
    split = call < width
    op_rows = operand_rows(hb, rows, xp.dtype(acc_dtype).itemsize)
    masked = tile.options.masked
    for start in range(k0, k1, block):
        stop = min(start + block, k1)
        kind = BlockKind.FULL
        if masked:
            kp = k_pos_host[start:stop]
            kind = tile.bounds.classify(int(kp.min()), int(kp.max()))
            if kind is BlockKind.SKIP:
                continue  # no row sees any key here: the state is unchanged
        s = s_buf if stop - start == width else s_buf[:, :, :stop - start]  # [hb, rows, B]
        if not split:
            kt, vb = kv.block(start, stop, h0, h1, acc_dtype)  # [hb, d, B], [hb, B, d_v]
            xp.matmul(tile.q, kt, out=s)  # scores (scale already in q)
        else:
            for c0 in range(start, stop, call):
                c1 = min(c0 + call, stop)
                kt = kv.keys(c0, c1, h0, h1, acc_dtype)  # [hb, d, c1-c0]
                xp.matmul(tile.q, kt, out=s[:, :, c0 - start:c1 - start])  # scores (scale already in q)
        if tile.softcap is not None:
            xp.tanh(s, out=s)
            s *= tile.softcap
        if tile.slopes is not None or kind is BlockKind.PARTIAL:
            kp_dev = as_array(kv.k_pos[start:stop], xp)
            # A few rows at a time: the int64 distances, masks and products stay
            # within half the score tile (plan.CPU_TILE_HALVES), whatever rows is.
            for r0 in range(0, rows, op_rows):
                r1 = min(r0 + op_rows, rows)
                sr = s[:, r0:r1]  # [hb, r1-r0, B] view
                if tile.slopes is not None:
                    dist = xp.abs(tile.q_pos[r0:r1, None] - kp_dev[None, :]).astype(acc_dtype)  # [r1-r0, B]
                    sr -= tile.slopes[:, r0:r1, None] * dist[None]
                if kind is BlockKind.PARTIAL:
                    ok = visible(tile.q_pos[r0:r1], kp_dev, tile.options)  # [r1-r0, B]
                    xp.copyto(sr, NO_SCORE, where=~ok[None])
        s.max(axis=-1, out=m_new)
        xp.maximum(m_new, m, out=m_new)  # [hb, rows]
        # Guard: a row that has seen no visible key has m_new = -inf; measure it
        # against 0 so exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
        xp.copyto(m_ref, m_new)
        xp.copyto(m_ref, 0, where=m_new == NO_SCORE)
        xp.subtract(m, m_ref, out=alpha)
        xp.exp(alpha, out=alpha)  # rescale of the old state; 0 while it was empty
        s -= m_ref[..., None]
        xp.exp(s, out=s)  # s now holds p = exp(s - m_new); masked keys give exactly 0
        xp.matmul(s, ones[:stop - start], out=l_blk)  # [hb, rows] = sum over the block's keys
        l *= alpha
        l += l_blk
        acc *= alpha[..., None]
        if not split:
            xp.matmul(s, vb, out=pv)  # [hb, rows, d_v]
            acc += pv
        else:
            for c0 in range(start, stop, call):
                c1 = min(c0 + call, stop)
                vb = kv.values(c0, c1, h0, h1, acc_dtype)  # [hb, c1-c0, d_v]
                xp.matmul(s[:, :, c0 - start:c1 - start], vb, out=pv)  # [hb, rows, d_v]
                acc += pv
        m, m_new = m_new, m  # m is the new max; the old buffer is scratch for the next block
        # Invariant holds for the keys [k0, stop).
    return m, l, acc
