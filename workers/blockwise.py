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
from workers.options import AttentionOptions, as_array


@dataclass(frozen=True, eq=False)
class TileInputs:
    """What every block of one tile needs, prepared once per tile."""

    q: Any  # [hb, rows, d], already multiplied by the score factor
    q_pos: Any  # [rows] int64, the position of each row's query
    slopes: Any  # [hb, rows] ALiBi slope per row, or None
    softcap: float | None  # when set, q was divided by it: s = softcap * tanh(q . k)
    bounds: TileBounds
    options: AttentionOptions


def stream(tile: TileInputs, kv: Any, k_pos_host: Any, k0: int, k1: int, h0: int, h1: int,
           block: int, acc_dtype: Any, xp: Any) -> tuple[Any, Any, Any]:
    """Stream keys ``[k0, k1)`` of kv heads ``[h0, h1)`` through the tile; return (m, l, acc).

    ``k_pos_host`` is a numpy view of the key positions: the block skip reads
    min/max there, so the GPU path does not synchronise on every block.
    """
    hb, rows = int(tile.q.shape[0]), int(tile.q.shape[1])
    d_v = int(kv.v.shape[-1])
    m = xp.full((hb, rows), NO_SCORE, dtype=acc_dtype)
    l = xp.zeros((hb, rows), dtype=acc_dtype)  # noqa: E741
    acc = xp.zeros((hb, rows, d_v), dtype=acc_dtype)
    masked = tile.options.masked
    for start in range(k0, k1, block):
        stop = min(start + block, k1)
        kind = BlockKind.FULL
        if masked:
            kp = k_pos_host[start:stop]
            kind = tile.bounds.classify(int(kp.min()), int(kp.max()))
            if kind is BlockKind.SKIP:
                continue  # no row sees any key here: the state is unchanged
        kt, vb = kv.block(start, stop, h0, h1, acc_dtype)  # [hb, d, B], [hb, B, d_v]
        s = xp.matmul(tile.q, kt)  # [hb, rows, B] scores (scale already in q)
        if tile.softcap is not None:
            xp.tanh(s, out=s)
            s *= tile.softcap
        kp_dev = as_array(kv.k_pos[start:stop], xp) if (tile.slopes is not None or kind is BlockKind.PARTIAL) else None
        if tile.slopes is not None:
            dist = xp.abs(tile.q_pos[:, None] - kp_dev[None, :]).astype(acc_dtype)  # [rows, B]
            s -= tile.slopes[:, :, None] * dist[None]
        if kind is BlockKind.PARTIAL:
            ok = visible(tile.q_pos, kp_dev, tile.options)  # [rows, B]
            s = xp.where(ok[None], s, NO_SCORE)
        m_new = xp.maximum(m, s.max(axis=-1))  # [hb, rows]
        # Guard: a row that has seen no visible key has m_new = -inf; measure it
        # against 0 so exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
        m_ref = xp.where(m_new == NO_SCORE, 0, m_new)
        alpha = xp.exp(m - m_ref)  # rescale of the old state; 0 while it was empty
        s -= m_ref[..., None]
        xp.exp(s, out=s)  # s now holds p = exp(s - m_new); masked keys give exactly 0
        l = l * alpha + s.sum(axis=-1)  # noqa: E741
        acc *= alpha[..., None]
        acc += xp.matmul(s, vb)  # [hb, rows, d_v]
        m = m_new
        # Invariant holds for the keys [k0, stop).
    return m, l, acc
