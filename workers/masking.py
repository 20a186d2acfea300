"""Masks as key-position intervals, and the block skip (docs/API.md section 3).

A query at position p sees the keys with positions in ``[p - left, p + right]``
(either bound may be unbounded; causal means right = 0). Over a tile of queries
and a block of keys that gives three cases, decided from the block's min and max
key position alone, before any score is computed:

* ``SKIP``: no query of the tile sees any key of the block;
* ``FULL``: every query sees every key, no mask needed;
* ``PARTIAL``: build the boolean mask for this tile and block.

The classification is conservative: ``SKIP`` and ``FULL`` are only claimed when
true for every pair, so arbitrary (unsorted) key positions stay exact.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from merge import array_module
from workers.options import AttentionOptions
from workers.problem import Arange


class BlockKind(enum.Enum):
    SKIP = "skip"
    FULL = "full"
    PARTIAL = "partial"


@dataclass(frozen=True)
class TileBounds:
    """Bounds of the visible key interval over a tile of query rows.

    ``lo_min``/``lo_max`` are the min/max over rows of ``q_pos - left`` (``None``
    when left is unbounded); ``hi_min``/``hi_max`` likewise for ``q_pos + right``.
    """

    lo_min: int | None
    lo_max: int | None
    hi_min: int | None
    hi_max: int | None

    @classmethod
    def of(cls, q_pos_min: int, q_pos_max: int, options: AttentionOptions) -> TileBounds:
        left, right = options.left, options.right
        return cls(
            lo_min=None if left is None else q_pos_min - left,
            lo_max=None if left is None else q_pos_max - left,
            hi_min=None if right is None else q_pos_min + right,
            hi_max=None if right is None else q_pos_max + right,
        )

    def classify(self, k_min: int, k_max: int) -> BlockKind:
        """Which case a block with key positions in ``[k_min, k_max]`` is, for this tile."""
        # Every key right of every query's window, or left of every query's window.
        if self.hi_max is not None and k_min > self.hi_max:
            return BlockKind.SKIP
        if self.lo_min is not None and k_max < self.lo_min:
            return BlockKind.SKIP
        left_ok = self.lo_max is None or k_min >= self.lo_max
        right_ok = self.hi_min is None or k_max <= self.hi_min
        return BlockKind.FULL if left_ok and right_ok else BlockKind.PARTIAL


def visible(q_pos_rows: Any, k_pos_block: Any, options: AttentionOptions) -> Any:
    """Boolean ``[rows, B]``: True where the query row sees the key."""
    diff = q_pos_rows[:, None] - k_pos_block[None, :]  # [rows, B] = q_pos - k_pos
    ok = None
    if options.left is not None:
        ok = diff <= options.left
    if options.right is not None:
        r = diff >= -options.right
        ok = r if ok is None else ok & r
    if ok is None:
        raise ValueError("visible() needs a mask, got options with no causal and no window")
    return ok


def sees_a_key(q_pos: Any, k_pos: Any, options: AttentionOptions) -> Any:
    """Boolean ``[n_q]``: True where the query at ``q_pos`` sees at least one key at ``k_pos`` (an int64
    array in any order, or a ``workers.problem.Arange``), by the mask alone, whatever the scores.

    A row sees keys in ``[q - left, q + right]`` (either bound unbounded). That interval must meet
    the keys' ``[min, max]``: over contiguous positions that decides it; over any others it is
    enough to rule a row out (a causal row before a shard's first key, the common case, costs no
    sort), and the rows it leaves are decided by one binary search on each side of the sorted
    positions, which counts the keys inside the interval.
    """
    xp = array_module(q_pos, "q_pos")
    left, right = options.left, options.right
    n_k = len(k_pos)
    if n_k == 0:
        return xp.zeros(q_pos.shape, dtype=bool)
    k_min, k_max = int(k_pos.min()), int(k_pos.max())
    meets = xp.ones(q_pos.shape, dtype=bool)  # [n_q]: the row's interval meets [k_min, k_max]
    if left is not None:
        meets &= q_pos - left <= k_max  # the interval's low end at or below the last key
    if right is not None:
        meets &= q_pos + right >= k_min
    if isinstance(k_pos, Arange) or not bool(meets.any()):
        return meets
    keys = xp.sort(k_pos)  # [n_k]
    first = xp.zeros(q_pos.shape, dtype=xp.int64) if left is None else xp.searchsorted(keys, q_pos - left, "left")
    past = xp.full(q_pos.shape, n_k, dtype=xp.int64) if right is None else xp.searchsorted(keys, q_pos + right, "right")
    return past > first
