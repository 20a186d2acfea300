"""The checks of one attention call, one function per rule, and the checked ``Problem``.

Every caller validates through these functions: the library entry points
(``workers.api``), and the service's request decoder and context writes, which
check a request once where it enters (docs/API.md section 2). Messages name the
argument: "x must be ..., got ...".

Positions are int64 within +-2**61 (``MAX_POSITION``). When none are given, keys
sit at ``0 .. n_k-1``, and queries are the ``n_q`` positions just before the end of
the keys (one past the largest key position): the last ``n_q`` keys' positions by
default (bottom-right alignment).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from merge import array_module
from workers.dtypes import BFLOAT16, accumulation_dtype, check_input_dtype
from workers.errors import InvalidInput
from workers.options import FLOAT32_MAX, MAX_POSITION, AttentionOptions

# -- positions -------------------------------------------------------------------------------

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


def end_of(k_pos: Any, start: int | None = None) -> int:
    """Where default queries end (docs/API.md section 2): one past the largest key position, at least
    ``start`` when given (the contexts' ``next_pos``); with no keys, ``start`` or 0. Negative when
    every key position is."""
    n = k_pos.n if isinstance(k_pos, Arange) else k_pos.shape[0]
    if not n:
        return 0 if start is None else start
    end = k_pos.start + k_pos.n if isinstance(k_pos, Arange) else int(k_pos.max()) + 1
    return end if start is None else max(end, start)


def host_array(name: str, value: Any, shape: str) -> Any:
    """A sequence the caller gave for ``name`` as a NumPy array; one NumPy cannot make a single array of
    (ragged rows) is refused naming ``name`` and the ``shape`` it must have."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError):
        raise InvalidInput(f"{name} must have shape {shape}, got a ragged sequence") from None


def check_positions(name: str, pos: Any, n: int, xp: Any = np) -> Any:
    """Return ``pos`` as an int64 ``[n]`` array of ``xp`` (an :class:`Arange` stays one), or raise naming it."""
    if isinstance(pos, Arange):
        if pos.n != n:
            raise InvalidInput(f"{name} must have shape [{n}], got ({pos.n},)")
        if n and (pos.max() > MAX_POSITION or pos.min() < -MAX_POSITION):
            raise InvalidInput(f"{name} must lie within +-2**61, got values in [{pos.min()}, {pos.max()}]")
        return pos
    if not hasattr(pos, "shape"):
        pos = host_array(name, pos, f"[{n}]")
        if pos.size == 0:  # [] reads as float64: no positions of an empty axis are integers too
            pos = pos.astype(np.int64)
        if pos.dtype == object and pos.ndim == 1 and all(isinstance(x, int) for x in pos.tolist()):
            # Python ints past int64 (NumPy keeps them as objects): out of range, not "not integers".
            raise InvalidInput(f"{name} must lie within +-2**61, got values in [{min(pos.tolist())}, "
                             f"{max(pos.tolist())}]")
    if array_module(pos) is not xp:
        pos = xp.asarray(pos)
    if pos.ndim != 1 or pos.shape[0] != n:
        raise InvalidInput(f"{name} must have shape [{n}], got {tuple(pos.shape)}")
    if np.dtype(pos.dtype).kind not in "iu":
        raise InvalidInput(f"{name} must be an integer array, got dtype {pos.dtype}")
    if n and (int(pos.max()) > MAX_POSITION or int(pos.min()) < -MAX_POSITION):
        raise InvalidInput(f"{name} must lie within +-2**61, got values in [{int(pos.min())}, {int(pos.max())}]")
    return pos.astype(xp.int64, copy=False)


# -- shapes, dtypes, heads ----------------------------------------------------------------------

@dataclass(frozen=True)
class KVDims:
    """The shape of a key/value set: ``k [n_k, h_kv, d]``, ``v [n_k, h_kv, d_v]``."""

    n_k: int
    h_kv: int
    d: int
    d_v: int


@dataclass(frozen=True, eq=False)
class Problem:
    """Checked inputs of one attention call, with the derived sizes."""

    n_q: int
    h_q: int
    h_kv: int
    d: int
    d_v: int
    n_k: int
    acc_dtype: np.dtype
    q_pos: Any  # [n_q] int64
    k_pos: Any  # [n_k] int64 array, or an Arange (the default, never materialised)
    scale: float
    options: AttentionOptions = field(repr=False)

    @property
    def group(self) -> int:
        """Query heads per kv head: query head i reads kv head i // group."""
        return self.h_q // self.h_kv


def check_arrays(**arrays: Any) -> Any:
    """Every argument is a numpy or cupy array, all of one array module; returns it."""
    xp = None
    for name, x in arrays.items():
        if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
            raise InvalidInput(f"{name} must be a numpy or cupy array, got {type(x).__name__}")
        if xp is None:
            xp = array_module(x)
            first = name
        elif array_module(x) is not xp:
            raise InvalidInput(f"{name} must live where {first} lives ({xp.__name__}), got {type(x).__module__}")
    return xp


def check_q(q: Any) -> tuple[int, int, int]:
    """``q [n_q, h_q, d]`` of an input dtype; returns ``(n_q, h_q, d)`` (sizes: :func:`check_heads`)."""
    if q.ndim != 3:
        raise InvalidInput(f"q must be [n_q, h_q, d], got shape {tuple(q.shape)}")
    check_input_dtype("q", q.dtype)
    n_q, h_q, d = (int(s) for s in q.shape)
    return n_q, h_q, d


def check_kv(k: Any, v: Any) -> KVDims:
    """``k [n_k, h_kv, d]`` and ``v [n_k, h_kv, d_v]`` of input dtypes, agreeing on ``n_k, h_kv``."""
    if k.ndim != 3:
        raise InvalidInput(f"k must be [n_k, h_kv, d], got shape {tuple(k.shape)}")
    if v.ndim != 3:
        raise InvalidInput(f"v must be [n_k, h_kv, d_v], got shape {tuple(v.shape)}")
    check_input_dtype("k", k.dtype)
    check_input_dtype("v", v.dtype)
    n_k, h_kv, d = (int(s) for s in k.shape)
    if tuple(v.shape[:2]) != (n_k, h_kv):
        raise InvalidInput(f"v must be [n_k, h_kv, d_v] with [n_k, h_kv] = [{n_k}, {h_kv}] as in k, "
                           f"got {tuple(v.shape)}")
    d_v = int(v.shape[2])
    if d < 1 or d_v < 1:
        raise InvalidInput(f"head dims must be >= 1, got d = {d}, d_v = {d_v}")
    if h_kv < 1:
        raise InvalidInput(f"h_kv must be >= 1, got k of shape {tuple(k.shape)}")
    return KVDims(n_k, h_kv, d, d_v)


def check_heads(h_q: int, d: int, kv: KVDims, keys: str = "k") -> None:
    """Queries of ``h_q`` heads of dim ``d`` can read ``kv`` (named ``keys`` in messages)."""
    if kv.d != d:
        if keys == "k":
            raise InvalidInput(f"k must have head dim d = {d} as q, got {kv.d}")
        raise InvalidInput(f"q must have head dim d = {kv.d} as {keys}, got {d}")
    if h_q < 1 or kv.h_kv < 1 or h_q % kv.h_kv:
        raise InvalidInput(f"h_q must be a positive multiple of h_kv, got h_q = {h_q}, h_kv = {kv.h_kv}"
                         + ("" if keys == "k" else f" of {keys}"))


def check_alibi(slopes: Any, h_q: int) -> None:
    """ALiBi slopes are ``[h_q]`` finite reals within float32's range (the scores' dtype at least: a
    slope that overflowed it would make even the query's own position ``inf * 0``)."""
    if slopes is None:
        return
    if not hasattr(slopes, "shape"):
        slopes = host_array("alibi_slopes", slopes, f"[{h_q}]")
    if slopes.ndim != 1 or slopes.shape[0] != h_q:
        raise InvalidInput(f"alibi_slopes must have shape [{h_q}], got {tuple(slopes.shape)}")
    if np.dtype(slopes.dtype).kind not in "fiu" and np.dtype(slopes.dtype) != BFLOAT16:
        raise InvalidInput(f"alibi_slopes must be a float array, got dtype {slopes.dtype}")
    host = slopes.get() if hasattr(slopes, "get") else slopes
    if not bool(np.all(np.isfinite(np.asarray(host, dtype=np.float64)))):
        raise InvalidInput("alibi_slopes must be finite, got NaN or infinity")
    biggest = float(np.max(np.abs(np.asarray(host, dtype=np.float64)), initial=0.0))
    if biggest > FLOAT32_MAX:
        raise InvalidInput(f"alibi_slopes must lie within +-{FLOAT32_MAX:.4g} (float32's range), got a slope of "
                         f"magnitude {biggest:.4g}")


def check_problem(q: Any, k: Any, v: Any, q_pos: Any, k_pos: Any, options: AttentionOptions) -> Problem:
    """Validate q, k, v (contract layout), positions and options; fill in the defaults."""
    xp = check_arrays(q=q, k=k, v=v)
    return build_problem(q, check_kv(k, v), (k.dtype, v.dtype), q_pos, k_pos, options, xp)


def build_problem(q: Any, kv: KVDims, kv_dtypes: tuple[Any, Any], q_pos: Any, k_pos: Any,
                  options: AttentionOptions, xp: Any) -> Problem:
    """The :class:`Problem` of ``q`` over keys of shape ``kv`` (checked already), in any layout."""
    n_q, h_q, d = check_q(q)
    check_heads(h_q, d, kv)
    k_pos = Arange(0, kv.n_k) if k_pos is None else check_positions("k_pos", k_pos, kv.n_k, xp)
    q_pos = last_positions(n_q, end_of(k_pos), xp) if q_pos is None else check_positions("q_pos", q_pos, n_q, xp)
    check_alibi(options.alibi_slopes, h_q)
    scale = options.scale if options.scale is not None else 1.0 / math.sqrt(d)
    return Problem(
        n_q=n_q, h_q=h_q, h_kv=kv.h_kv, d=d, d_v=kv.d_v, n_k=kv.n_k,
        acc_dtype=accumulation_dtype(q.dtype, *kv_dtypes),
        q_pos=q_pos, k_pos=k_pos, scale=scale, options=options,
    )
