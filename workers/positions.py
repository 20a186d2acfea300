"""Query and key positions: the default alignment, a lazy ``arange``, and their checks.

Positions are int64 within +-2**62 (``MAX_POSITION``). When none are given, keys
sit at ``0 .. n_k-1``, and queries are the ``n_q`` positions just before the end of
the keys (one past the largest key position): the last ``n_q`` keys' positions by
default (bottom-right alignment, docs/API.md section 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from merge import array_module
from workers.options import MAX_POSITION


@dataclass(frozen=True)
class Arange:
    """Positions ``start, start+1, ..., start+n-1`` without storing them.

    The default key positions are ``arange(n_k)``; materialising them would cost
    8 bytes per key, which the streaming kernel must not spend. Slicing stays
    lazy; :meth:`materialize` makes the few positions of one block when a mask or
    ALiBi needs them.
    """

    start: int
    n: int

    @property
    def shape(self) -> tuple[int]:
        return (self.n,)

    ndim = 1
    dtype = np.dtype(np.int64)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: slice) -> Arange:
        if not isinstance(index, slice):
            raise ValueError(f"index must be a slice, got {type(index).__name__}")
        a, b, step = index.indices(self.n)
        if step != 1:
            raise ValueError(f"index step must be 1, got {step}")
        return Arange(self.start + a, max(b - a, 0))

    def min(self) -> int:
        return self.start

    def max(self) -> int:
        return self.start + self.n - 1

    def materialize(self, xp: Any = np) -> Any:
        return xp.arange(self.start, self.start + self.n, dtype=xp.int64)


def as_array(pos: Any, xp: Any = np) -> Any:
    """Positions as an ``xp`` int64 array (materialises an :class:`Arange`)."""
    return pos.materialize(xp) if isinstance(pos, Arange) else pos


def last_positions(n_q: int, end: int, xp: Any = np) -> Any:
    """``[n_q]`` int64: the ``n_q`` positions just before ``end`` (the default query positions)."""
    return xp.arange(end - n_q, end, dtype=xp.int64)


def end_of(k_pos: Any, start: int = 0) -> int:
    """One past the largest key position, at least ``start``: where default queries end."""
    if isinstance(k_pos, Arange):
        return max(k_pos.start + k_pos.n, start)
    return max(int(k_pos.max()) + 1 if k_pos.shape[0] else 0, start)


def check_positions(name: str, pos: Any, n: int, xp: Any = np) -> Any:
    """Return ``pos`` as an int64 ``[n]`` array of ``xp`` (an :class:`Arange` stays one), or raise naming it."""
    if isinstance(pos, Arange):
        if pos.n != n:
            raise ValueError(f"{name} must have shape [{n}], got ({pos.n},)")
        if n and (pos.max() > MAX_POSITION or pos.min() < -MAX_POSITION):
            raise ValueError(f"{name} must lie within +-2**62, got values in [{pos.min()}, {pos.max()}]")
        return pos
    if not hasattr(pos, "shape"):
        pos = np.asarray(pos)
    if array_module(pos) is not xp:
        pos = xp.asarray(pos)
    if pos.ndim != 1 or pos.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}], got {tuple(pos.shape)}")
    if np.dtype(pos.dtype).kind not in "iu":
        raise ValueError(f"{name} must be an integer array, got dtype {pos.dtype}")
    if n and (int(pos.max()) > MAX_POSITION or int(pos.min()) < -MAX_POSITION):
        raise ValueError(f"{name} must lie within +-2**62, got values in [{int(pos.min())}, {int(pos.max())}]")
    return pos.astype(xp.int64, copy=False)
