"""Typed attention options and input checks (CONTRACT sections 2 and 3).

:class:`AttentionOptions` holds what changes the scores (scale, softcap, ALiBi,
masks); :class:`KernelOptions` holds how the kernel walks the keys (block size,
scratch budget, threads), which never changes the math beyond rounding.
:func:`check_problem` validates q, k, v and positions once, with messages that
name the argument ("x must be ..., got ...").
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from merge import array_module
from workers.dtypes import accumulation_dtype, check_input_dtype

#: Positions and window bounds are kept within +-2**62 so that q_pos - left and
#: q_pos + right never overflow int64.
MAX_POSITION = 2**62

#: Default scratch budget of the CPU kernel: the score tile and its temporaries.
DEFAULT_SCRATCH_BYTES = 8 * 2**20


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_real(name: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    try:
        value = float(x)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    return value


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """What the scores are (CONTRACT section 3). ``None`` means "not used".

    * ``scale``: multiplies q.k; ``None`` means 1/sqrt(d).
    * ``causal``: mask keys with k_pos > q_pos.
    * ``window``: ``(left, right)``, each ``None`` (unbounded) or an int >= 0;
      mask where q_pos - k_pos > left or k_pos - q_pos > right.
    * ``softcap``: s -> softcap * tanh(s / softcap); ``None`` or 0 disables it.
    * ``alibi_slopes``: ``[h_q]`` floats; s -> s - slope[h] * |q_pos - k_pos|.
    """

    scale: float | None = None
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    alibi_slopes: Any = None

    def __post_init__(self) -> None:
        if self.scale is not None:
            s = _check_real("scale", self.scale)
            if s <= 0:
                raise ValueError(f"scale must be a finite number > 0, got {self.scale!r}")
            object.__setattr__(self, "scale", s)
        if not isinstance(self.causal, (bool, np.bool_)):
            raise ValueError(f"causal must be a bool, got {self.causal!r}")
        object.__setattr__(self, "causal", bool(self.causal))
        if self.window is not None:
            w = self.window
            if isinstance(w, (str, bytes)) or not hasattr(w, "__len__") or len(w) != 2:
                raise ValueError(f"window must be a pair [left, right], got {w!r}")
            for side, b in zip(("left", "right"), w):
                if b is not None and (not _is_int(b) or not 0 <= b <= MAX_POSITION):
                    raise ValueError(f"window {side} must be null or an int in [0, 2**62], got {b!r}")
            object.__setattr__(self, "window", (None if w[0] is None else int(w[0]), None if w[1] is None else int(w[1])))
        if self.softcap is not None:
            c = _check_real("softcap", self.softcap)
            if c < 0:
                raise ValueError(f"softcap must be a finite number >= 0, got {self.softcap!r}")
            object.__setattr__(self, "softcap", c if c > 0 else None)

    @property
    def left(self) -> int | None:
        """Keys may be at most ``left`` positions before the query (None: unbounded)."""
        return None if self.window is None else self.window[0]

    @property
    def right(self) -> int | None:
        """Keys may be at most ``right`` positions after the query; causal means 0."""
        r = None if self.window is None else self.window[1]
        if self.causal:
            return 0 if r is None else min(r, 0)
        return r

    @property
    def masked(self) -> bool:
        return self.left is not None or self.right is not None


@dataclass(frozen=True)
class KernelOptions:
    """How the CPU kernel walks the keys; does not change the result beyond rounding.

    * ``block_size``: keys per block; ``None`` picks one from the scratch budget.
    * ``scratch_bytes``: bound on the score tile and its temporaries per thread.
    * ``threads``: worker threads; work is split over heads, query tiles and,
      when there is too little of that, over key ranges (split-K).
    * ``gpu_kernels``: ``"generic"`` (CuPy ops + cuBLAS, the default) or ``"fused"``
      (the RawKernels of ``workers/kernels/attention.cu``; unverified on hardware,
      docs/GPU.md). Ignored on the CPU.
    """

    block_size: int | None = None
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES
    threads: int = 1
    gpu_kernels: str = "generic"

    def __post_init__(self) -> None:
        if self.block_size is not None and (not _is_int(self.block_size) or self.block_size < 1):
            raise ValueError(f"block_size must be null or an int >= 1, got {self.block_size!r}")
        if not _is_int(self.scratch_bytes) or self.scratch_bytes < 1:
            raise ValueError(f"scratch_bytes must be an int >= 1, got {self.scratch_bytes!r}")
        if not _is_int(self.threads) or self.threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {self.threads!r}")
        if self.gpu_kernels not in ("generic", "fused"):
            raise ValueError(f"gpu_kernels must be 'generic' or 'fused', got {self.gpu_kernels!r}")


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


@dataclass(frozen=True)
class Arange:
    """Positions ``start, start+1, ..., start+n-1`` without storing them.

    The default key positions are ``arange(n_k)``; materialising them would cost
    8 bytes per key, which the streaming kernel must not spend. Slicing stays
    lazy; :meth:`block` makes the few positions of one block when a mask or
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


def default_positions(n_q: int, n_k: int, xp: Any = np) -> tuple[Any, Arange]:
    """Bottom-right alignment: ``k_pos = arange(n_k)``, ``q_pos = arange(n_k - n_q, n_k)``."""
    return xp.arange(n_k - n_q, n_k, dtype=xp.int64), Arange(0, n_k)


def check_positions(name: str, pos: Any, n: int, xp: Any) -> Any:
    """Return ``pos`` as an int64 ``[n]`` array of ``xp``, or raise naming it."""
    if isinstance(pos, Arange):
        if pos.n != n:
            raise ValueError(f"{name} must have shape [{n}], got ({pos.n},)")
        if n and (pos.max() > MAX_POSITION or pos.min() < -MAX_POSITION):
            raise ValueError(f"{name} must lie within +-2**62, got values in [{pos.min()}, {pos.max()}]")
        return pos
    if not hasattr(pos, "shape"):
        pos = np.asarray(pos)
    pos_xp = array_module(pos)
    if pos_xp is not xp:
        pos = xp.asarray(pos)
    if pos.ndim != 1 or pos.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}], got {tuple(pos.shape)}")
    if np.dtype(pos.dtype).kind not in "iu":
        raise ValueError(f"{name} must be an integer array, got dtype {pos.dtype}")
    if n and (int(pos.max()) > MAX_POSITION or int(pos.min()) < -MAX_POSITION):
        raise ValueError(f"{name} must lie within +-2**62, got values in [{int(pos.min())}, {int(pos.max())}]")
    return pos.astype(xp.int64, copy=False)


def check_problem(q: Any, k: Any, v: Any, q_pos: Any, k_pos: Any, options: AttentionOptions) -> Problem:
    """Validate shapes, dtypes, heads and positions; fill in the defaults."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be a numpy or cupy array, got {type(x).__name__}")
    xp = array_module(q)
    for name, x in (("k", k), ("v", v)):
        if array_module(x) is not xp:
            raise ValueError(f"{name} must live where q lives ({xp.__name__}), got {type(x).__module__}")
    if q.ndim != 3:
        raise ValueError(f"q must be [n_q, h_q, d], got shape {tuple(q.shape)}")
    if k.ndim != 3:
        raise ValueError(f"k must be [n_k, h_kv, d], got shape {tuple(k.shape)}")
    if v.ndim != 3:
        raise ValueError(f"v must be [n_k, h_kv, d_v], got shape {tuple(v.shape)}")
    dts = [check_input_dtype(name, x.dtype) for name, x in (("q", q), ("k", k), ("v", v))]
    n_q, h_q, d = (int(s) for s in q.shape)
    n_k, h_kv, d_k = (int(s) for s in k.shape)
    if tuple(v.shape[:2]) != (n_k, h_kv):
        raise ValueError(f"v must be [n_k, h_kv, d_v] with [n_k, h_kv] = [{n_k}, {h_kv}] as in k, got {tuple(v.shape)}")
    d_v = int(v.shape[2])
    if d_k != d:
        raise ValueError(f"k must have head dim d = {d} as q, got {d_k}")
    if d < 1 or d_v < 1:
        raise ValueError(f"head dims must be >= 1, got d = {d}, d_v = {d_v}")
    if h_q < 1 or h_kv < 1 or h_q % h_kv:
        raise ValueError(f"h_q must be a positive multiple of h_kv, got h_q = {h_q}, h_kv = {h_kv}")
    if q_pos is None or k_pos is None:
        default_q, default_k = default_positions(n_q, n_k, xp)
    q_pos = default_q if q_pos is None else check_positions("q_pos", q_pos, n_q, xp)
    k_pos = default_k if k_pos is None else check_positions("k_pos", k_pos, n_k, xp)
    slopes = options.alibi_slopes
    if slopes is not None:
        if not hasattr(slopes, "shape"):
            slopes = np.asarray(slopes)
        if slopes.ndim != 1 or slopes.shape[0] != h_q:
            raise ValueError(f"alibi_slopes must have shape [{h_q}], got {tuple(slopes.shape)}")
        if np.dtype(slopes.dtype).kind not in "fiu":
            raise ValueError(f"alibi_slopes must be a float array, got dtype {slopes.dtype}")
        if not bool(np.all(np.isfinite(np.asarray(slopes.get() if hasattr(slopes, "get") else slopes, dtype=np.float64)))):
            raise ValueError("alibi_slopes must be finite, got NaN or infinity")
    scale = options.scale if options.scale is not None else 1.0 / math.sqrt(d)
    return Problem(
        n_q=n_q, h_q=h_q, h_kv=h_kv, d=d, d_v=d_v, n_k=n_k,
        acc_dtype=accumulation_dtype(*dts),
        q_pos=q_pos, k_pos=k_pos, scale=scale, options=options,
    )
