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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from merge import NO_SCORE
from workers.cutoff import check
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


@dataclass(eq=False)
class _Running:
    """One tile's state and scratch while keys stream through it (the invariant: module doc)."""

    tile: TileInputs
    m: Any  # [hb, rows]
    l: Any  # [hb, rows]
    acc: Any  # [hb, rows, d_v]
    s_buf: Any  # [hb, rows, B] score tile, reused by every block
    pv: Any  # [hb, rows, d_v] p @ v of one call
    m_new: Any  # [hb, rows]
    m_ref: Any  # [hb, rows]
    alpha: Any  # [hb, rows]
    l_blk: Any  # [hb, rows]
    op_rows: int
    s: Any = None  # this block's part of s_buf
    kind: BlockKind = BlockKind.FULL  # how this block's keys meet the tile's mask

    @classmethod
    def start(cls, tile: TileInputs, width: int, d_v: int, acc_dtype: Any, xp: Any) -> _Running:
        hb, rows = int(tile.q.shape[0]), int(tile.q.shape[1])

        def vec() -> Any:
            return xp.empty((hb, rows), dtype=acc_dtype)

        return cls(tile=tile, m=xp.full((hb, rows), NO_SCORE, dtype=acc_dtype), l=xp.zeros((hb, rows), dtype=acc_dtype),
                   acc=xp.zeros((hb, rows, d_v), dtype=acc_dtype), s_buf=xp.empty((hb, rows, width), dtype=acc_dtype),
                   pv=xp.empty((hb, rows, d_v), dtype=acc_dtype), m_new=vec(), m_ref=vec(), alpha=vec(), l_blk=vec(),
                   op_rows=operand_rows(hb, rows, xp.dtype(acc_dtype).itemsize))

    def softmax_step(self, kv: Any, start: int, stop: int, ones: Any, xp: Any, acc_dtype: Any) -> None:
        """Scores of this block (in ``self.s``) to probabilities; m, l rescaled and grown, acc rescaled."""
        tile, s = self.tile, self.s
        if tile.softcap is not None:
            xp.tanh(s, out=s)
            s *= tile.softcap
        if tile.slopes is not None or self.kind is BlockKind.PARTIAL:
            kp_dev = as_array(kv.k_pos[start:stop], xp)
            # A few rows at a time: the int64 distances, masks and products stay
            # within half the score tile (plan.CPU_TILE_HALVES), whatever rows is.
            rows = int(s.shape[1])
            for r0 in range(0, rows, self.op_rows):
                r1 = min(r0 + self.op_rows, rows)
                sr = s[:, r0:r1]  # [hb, r1-r0, B] view
                if tile.slopes is not None:
                    dist = xp.abs(tile.q_pos[r0:r1, None] - kp_dev[None, :]).astype(acc_dtype)  # [r1-r0, B]
                    sr -= tile.slopes[:, r0:r1, None] * dist[None]
                if self.kind is BlockKind.PARTIAL:
                    ok = visible(tile.q_pos[r0:r1], kp_dev, tile.options)  # [r1-r0, B]
                    xp.copyto(sr, NO_SCORE, where=~ok[None])
        m, m_new, m_ref, alpha = self.m, self.m_new, self.m_ref, self.alpha
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
        xp.matmul(s, ones[:stop - start], out=self.l_blk)  # [hb, rows] = sum over the block's keys
        self.l *= alpha
        self.l += self.l_blk
        self.acc *= alpha[..., None]
        # m_new is the new max; acc still lacks this block's p @ v (added by the caller).

    def finish_block(self) -> None:
        """The block's products are in: m takes the new max, the old buffer is scratch for the next block."""
        self.m, self.m_new = self.m_new, self.m


def stream(tiles: Sequence[TileInputs], kv: Any, k_pos_host: Any, k0: int, k1: int, h0: int, h1: int,
           block: int, acc_dtype: Any, xp: Any) -> list[tuple[Any, Any, Any]]:
    """Stream keys ``[k0, k1)`` of kv heads ``[h0, h1)`` through each tile; return (m, l, acc) per tile.

    Several tiles are requests over the same keys served in one pass
    (``workers.batch``): each block of keys is fetched (and, for 16-bit keys,
    widened) once, and every BLAS call's keys are still in cache for the next
    tile. Each tile goes through exactly the calls, on exactly the operands, it
    would alone (the tiles' arithmetic never mixes), so a tile's state is
    bitwise the same alone or in any batch, on any BLAS.

    ``k_pos_host`` is a numpy view of the key positions: the block skip reads
    min/max there, so the GPU path does not synchronise on every block.

    Scratch is allocated once per call and reused by every block: per tile the
    score tile ``[hb, rows, B]`` (scores, then probabilities, in place), one
    ``[hb, rows, d_v]`` product and a few ``[hb, rows]`` vectors. On top of
    that, ALiBi and partially masked blocks build their operands a few rows at a
    time (:func:`operand_rows`), and a layout that casts copies one BLAS call's
    keys and values.
    """
    d_v = int(kv.v.shape[-1])
    hb = h1 - h0
    if k1 <= k0:
        return [(xp.full((hb, int(t.q.shape[1])), NO_SCORE, dtype=acc_dtype),
                 xp.zeros((hb, int(t.q.shape[1])), dtype=acc_dtype),
                 xp.zeros((hb, int(t.q.shape[1]), d_v), dtype=acc_dtype)) for t in tiles]
    width = min(block, k1 - k0)
    running = [_Running.start(t, width, d_v, acc_dtype, xp) for t in tiles]
    ones = xp.ones((width,), dtype=acc_dtype)  # [B]: row sums as a GEMV, faster than a reduction
    # On the CPU each product is cut into BLAS calls of ``kv.call_keys`` keys:
    # a layout that must cast copies one call at a time (at most CALL_KEYS keys,
    # so that scratch is bounded by the call), and one that hands out views
    # takes the call length its memory layout streams best. The block sets only
    # the softmax step and the score tile. CuPy takes the whole block in one
    # call: there a launch costs more than a copy. The call length depends on the
    # tile's rows only, so tiles that share a pass have equal rows (plan.batchable).
    call = None
    if getattr(xp, "__name__", "") == "numpy" and hasattr(kv, "call_keys"):
        call = kv.call_keys(acc_dtype, int(tiles[0].q.shape[1]))
    call = call or width
    split = call < width
    for start in range(k0, k1, block):
        check()  # a request whose deadline passed stops here (workers.cutoff)
        stop = min(start + block, k1)
        live = []
        kp_range = None  # (min, max) of the block's key positions, read once when a mask asks
        for r in running:
            r.kind = BlockKind.FULL
            if r.tile.options.masked:
                if kp_range is None:
                    kp = k_pos_host[start:stop]
                    kp_range = int(kp.min()), int(kp.max())
                r.kind = r.tile.bounds.classify(*kp_range)
                if r.kind is BlockKind.SKIP:
                    continue  # no row of this tile sees any key here: its state is unchanged
            r.s = r.s_buf if stop - start == width else r.s_buf[:, :, :stop - start]  # [hb, rows, B]
            live.append(r)
        if not live:
            continue
        if not split:
            kt, vb = kv.block(start, stop, h0, h1, acc_dtype)  # [hb, d, B], [hb, B, d_v]
            for r in live:
                xp.matmul(r.tile.q, kt, out=r.s)  # scores (scale already in q)
        else:
            for c0 in range(start, stop, call):
                c1 = min(c0 + call, stop)
                kt = kv.keys(c0, c1, h0, h1, acc_dtype)  # [hb, d, c1-c0]
                for r in live:
                    xp.matmul(r.tile.q, kt, out=r.s[:, :, c0 - start:c1 - start])  # scores (scale already in q)
        for r in live:
            r.softmax_step(kv, start, stop, ones, xp, acc_dtype)
        if not split:
            for r in live:
                xp.matmul(r.s, vb, out=r.pv)  # [hb, rows, d_v]
                r.acc += r.pv
        else:
            for c0 in range(start, stop, call):
                c1 = min(c0 + call, stop)
                vb = kv.values(c0, c1, h0, h1, acc_dtype)  # [hb, c1-c0, d_v]
                for r in live:
                    xp.matmul(r.s[:, :, c0 - start:c1 - start], vb, out=r.pv)  # [hb, rows, d_v]
                    r.acc += r.pv
        for r in live:
            r.finish_block()
            # Invariant holds for this tile over the keys [k0, stop).
    return [(r.m, r.l, r.acc) for r in running]
