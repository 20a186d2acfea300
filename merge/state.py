"""The partial softmax-attention state and its conversions.

The math of the state (what ``m``, ``l`` and ``acc`` hold) is written once, in
README.md, section "The math". This module holds the container and the two ends
of its life: :func:`empty` (the identity of the merge) and :func:`finalize`
(state -> ``out``, ``lse``), plus :func:`from_lse` for interop with
FlashAttention / FlashInfer style ``(out, lse)`` pairs (natural log).

Imports only the standard library and numpy; CuPy arrays are accepted through
:func:`array_module`, which finds CuPy in ``sys.modules`` without importing it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

#: The score of a key that does not take part (masked, or no key at all).
NO_SCORE = -np.inf

#: Dtypes a state may hold. Inputs in float16/bfloat16/float32 accumulate in
#: float32; float64 inputs accumulate in float64 (docs/API.md section 2).
STATE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def array_module(x: Any, name: str = "array") -> ModuleType:
    """Return ``numpy`` or ``cupy``, whichever owns ``x`` (else ValueError naming it as ``name``).

    CuPy is looked up in ``sys.modules`` instead of imported: if the caller holds a
    CuPy array, CuPy is already imported; if not, we must not import it.
    """
    if isinstance(x, np.ndarray):
        return np
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy
    raise ValueError(f"{name} must be a numpy or cupy array, got {type(x).__name__}")


@dataclass(frozen=True)
class State:
    """Online-softmax state of attention for ``n_q`` queries and ``h_q`` heads.

    For each (query, head) over the set of keys J seen so far (README, "The math"):

    * ``m``   ``[n_q, h_q]``       max_j s_j, ``-inf`` when J is empty or fully masked
    * ``l``   ``[n_q, h_q]``       sum_j exp(s_j - m), ``0`` then
    * ``acc`` ``[n_q, h_q, d_v]``  sum_j exp(s_j - m) v_j, ``0`` then

    All three share one dtype (float32 or float64) and one array module. A row whose every
    visible score overflowed towards -inf has ``m`` = the dtype's lowest finite value and ``l = 0``
    (``workers.api``): merges carry it (it weighs nothing beside a finite score), ``finalize``
    makes it NaN (docs/API.md section 4, "Overflow").
    """

    m: Any
    l: Any  # named as in the math (README)
    acc: Any

    def __post_init__(self) -> None:
        xp = array_module(self.m, "State.m")
        for name in ("l", "acc"):
            if array_module(getattr(self, name), f"State.{name}") is not xp:
                raise ValueError(f"State.{name} must live in the same array module as m, got {type(getattr(self, name)).__name__}")
        if self.m.ndim != 2:
            raise ValueError(f"State.m must be [n_q, h_q], got shape {tuple(self.m.shape)}")
        if tuple(self.l.shape) != tuple(self.m.shape):
            raise ValueError(f"State.l must have the shape of m {tuple(self.m.shape)}, got {tuple(self.l.shape)}")
        if self.acc.ndim != 3 or tuple(self.acc.shape[:2]) != tuple(self.m.shape):
            raise ValueError(f"State.acc must be [n_q, h_q, d_v] with [n_q, h_q] = {tuple(self.m.shape)}, got {tuple(self.acc.shape)}")
        dt = np.dtype(self.m.dtype)
        if dt not in STATE_DTYPES:
            raise ValueError(f"State dtype must be float32 or float64, got {dt}")
        if np.dtype(self.l.dtype) != dt or np.dtype(self.acc.dtype) != dt:
            raise ValueError(f"State.m, l and acc must share one dtype, got {dt}, {self.l.dtype}, {self.acc.dtype}")

    @property
    def n_q(self) -> int:
        return int(self.m.shape[0])

    @property
    def h_q(self) -> int:
        return int(self.m.shape[1])

    @property
    def d_v(self) -> int:
        return int(self.acc.shape[2])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.m.dtype)

    @property
    def xp(self) -> ModuleType:
        return array_module(self.m)

    @property
    def nbytes(self) -> int:
        return int(self.m.nbytes + self.l.nbytes + self.acc.nbytes)


def _check_state_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if dt not in STATE_DTYPES:
        raise ValueError(f"dtype must be float32 or float64, got {dt}")
    return dt


def empty(n_q: int, h_q: int, d_v: int, dtype: Any = np.float32, xp: ModuleType = np) -> State:
    """The state over no keys: ``m = -inf``, ``l = 0``, ``acc = 0``; the merge identity."""
    for name, val in (("n_q", n_q), ("h_q", h_q), ("d_v", d_v)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 0:
            raise ValueError(f"{name} must be a non-negative int, got {val!r}")
    dt = _check_state_dtype(dtype)
    if not all(callable(getattr(xp, f, None)) for f in ("full", "zeros")):
        raise ValueError(f"xp must be the numpy or cupy module, got {xp!r}")
    return State(
        m=xp.full((n_q, h_q), NO_SCORE, dtype=dt),
        l=xp.zeros((n_q, h_q), dtype=dt),
        acc=xp.zeros((n_q, h_q, d_v), dtype=dt),
    )


def finalize(state: State) -> tuple[Any, Any]:
    """``out = acc / l`` and ``lse = m + ln(l)``; a row that saw no key (``m = -inf``, ``l = 0``) gives
    0 and -inf, a row whose scores overflowed (``l = 0`` with a finite ``m``, or NaN) NaN and NaN."""
    if not isinstance(state, State):
        raise ValueError(f"state must be a State, got {type(state).__name__}")
    xp = array_module(state.m)
    # l == 0, not "not l > 0": a row whose state overflowed (l NaN) stays NaN, never reads as empty.
    seen = state.l != 0
    # l == 0 with m finite is no row that saw no key: every key it saw scored below the dtype's range
    # (marked so by workers.api; a row that saw a finite score has l >= 1): NaN, never 0 / -inf.
    overflowed = ~seen & (state.m != NO_SCORE)
    # Guard: rows with no visible key have l == 0; divide by 1 there instead of
    # producing 0/0, then the where() below writes the contract's 0 / -inf.
    l_safe = xp.where(seen, state.l, 1)
    out = state.acc / l_safe[..., None]  # [n_q, h_q, d_v]
    lse = xp.where(seen, state.m + xp.log(l_safe), NO_SCORE)
    if bool(overflowed.any()):
        out = xp.where(overflowed[..., None], xp.nan, out)
        lse = xp.where(overflowed, xp.nan, lse)
    return out, lse


def from_lse(out: Any, lse: Any) -> State:
    """Build a state from a finished ``(out [n_q, h_q, d_v], lse [n_q, h_q])`` pair.

    ``lse`` is a natural log. The state chooses ``m = lse`` so that ``l = 1`` and
    ``acc = out``; a row with ``lse = -inf`` becomes the empty row (m = -inf,
    l = 0, acc = 0), whatever its ``out`` holds, and so does ``lse = +inf``:
    FlashAttention's value for a row that saw no key (a row that saw keys has a
    finite ``lse``, so +inf can mean nothing else).
    """
    xp = array_module(out, "out")
    if array_module(lse, "lse") is not xp:
        raise ValueError("lse must live in the same array module as out, got a mix of numpy and cupy")
    if out.ndim != 3:
        raise ValueError(f"out must be [n_q, h_q, d_v], got shape {tuple(out.shape)}")
    if tuple(lse.shape) != tuple(out.shape[:2]):
        raise ValueError(f"lse must be [n_q, h_q] = {tuple(out.shape[:2])}, got {tuple(lse.shape)}")
    for name, arr in (("out", out), ("lse", lse)):
        # bfloat16 (ml_dtypes, kind "V") is a float too: other kernels often return out in it.
        if np.dtype(arr.dtype).kind != "f" and np.dtype(arr.dtype).name != "bfloat16":
            raise ValueError(f"{name} must be a floating array, got dtype {arr.dtype}")
    wide = np.float64 in (np.dtype(out.dtype), np.dtype(lse.dtype))
    dt = np.dtype(np.float64 if wide else np.float32)
    lse = lse.astype(dt)
    if bool(xp.any(xp.isnan(lse))):
        raise ValueError("lse must be a number or +-inf for a row with no key, got NaN")
    seen = xp.isfinite(lse)
    l = seen.astype(dt)
    acc = xp.where(seen[..., None], out.astype(dt), 0)
    return State(m=xp.where(seen, lse, NO_SCORE).astype(dt), l=l, acc=acc.astype(dt))
