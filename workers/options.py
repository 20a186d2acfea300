"""Typed options: what the scores are, and how a kernel walks the keys (docs/API.md section 3).

:class:`AttentionOptions` holds what changes the scores (scale, softcap, ALiBi,
masks); it is built once where a request enters (the library call, or the
service's request decoder) and travels as is to every shard. :class:`KernelOptions`
holds how the kernel walks the keys (block size, scratch budget, threads, which
GPU kernels), which never changes the math beyond rounding.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workers.errors import InvalidAttentionOption

#: Positions lie within +-2**61 and window bounds within [0, 2**62], so that every
#: difference the kernels form stays inside int64: q_pos - k_pos (causal, ALiBi's
#: distance) within +-2**62, q_pos - left and q_pos + right within +-3 * 2**61.
MAX_POSITION = 2**61
#: The largest window bound (see MAX_POSITION).
MAX_WINDOW = 2**62
#: The largest softcap and the largest ALiBi slope magnitude (workers.problem): float32's largest
#: finite value, as the scores are multiplied by both in float32 at least (docs/API.md section 2).
FLOAT32_MAX = float(np.finfo(np.float32).max)

#: Default scratch budget of the CPU kernel: the score tile and its temporaries.
DEFAULT_SCRATCH_BYTES = 8 * 2**20

#: Default bound on the stacked score tile of requests served in one pass (``workers.batch``).
DEFAULT_BATCH_SCRATCH_BYTES = 64 * 2**20


def is_int(x: Any) -> bool:
    """An integer that is not a bool (Python's ``True`` is an ``int``)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def short_repr(x: Any, limit: int = 60) -> str:
    """``repr(x)`` cut to ``limit`` characters, for "got ..." (a client may send a 4000-digit int)."""
    try:
        text = repr(x)
    except ValueError:  # an int beyond Python's digit limit for str()
        text = f"an {type(x).__name__} too long to print"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_real(name: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise InvalidAttentionOption(f"{name} must be a finite number, got {short_repr(x)}")
    try:
        value = float(x)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        value = math.inf
    if not math.isfinite(value):
        raise InvalidAttentionOption(f"{name} must be a finite number, got {short_repr(x)}")
    return value


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """What the scores are (docs/API.md section 3). ``None`` means "not used".

    * ``scale``: multiplies q.k; ``None`` means 1/sqrt(d).
    * ``causal``: mask keys with k_pos > q_pos.
    * ``window``: ``(left, right)``, each ``None`` (unbounded) or an int >= 0;
      mask where q_pos - k_pos > left or k_pos - q_pos > right.
    * ``softcap``: s -> softcap * tanh(s / softcap); ``None`` or 0 disables it.
    * ``alibi_slopes``: ``[h_q]`` floats; s -> s - slope[h] * |q_pos - k_pos|
      (its shape is checked against ``h_q`` with the tensors: ``check_alibi``).
    """

    scale: float | None = None
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    alibi_slopes: Any = None
    #: Derived from ``window`` and ``causal`` (set once here, read per call by the kernels): keys may be at most
    #: ``left`` positions before the query and ``right`` after it (causal: 0), None for unbounded;
    #: ``masked`` when either bound is set.
    left: int | None = field(init=False, repr=False)
    right: int | None = field(init=False, repr=False)
    masked: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.scale is not None:
            s = _check_real("scale", self.scale)
            if s <= 0:
                raise InvalidAttentionOption(f"scale must be a finite number > 0, got {short_repr(self.scale)}")
            if s > FLOAT32_MAX:  # the scores are multiplied by it in float32: past the range, every score is inf
                raise InvalidAttentionOption(f"scale must be at most {FLOAT32_MAX:.4g} (float32's range), got "
                                             f"{short_repr(self.scale)}")
            object.__setattr__(self, "scale", s)
        if not isinstance(self.causal, (bool, np.bool_)):
            raise InvalidAttentionOption(f"causal must be a bool, got {short_repr(self.causal)}")
        object.__setattr__(self, "causal", bool(self.causal))
        if self.window is not None:
            w = self.window
            if not isinstance(w, (tuple, list)) or len(w) != 2 or any(
                    b is not None and (not is_int(b) or not 0 <= b <= MAX_WINDOW) for b in w):
                shown = short_repr(list(w) if isinstance(w, (tuple, list)) else w)
                raise InvalidAttentionOption(f"window must be [left, right], each null or an int in [0, 2**62], "
                                             f"got {shown}")
            object.__setattr__(self, "window", (None if w[0] is None else int(w[0]), None if w[1] is None else int(w[1])))
        if self.softcap is not None:
            c = _check_real("softcap", self.softcap)
            if c < 0:
                raise InvalidAttentionOption(f"softcap must be a finite number >= 0, got {short_repr(self.softcap)}")
            if c > FLOAT32_MAX:  # the scores' tanh is multiplied by it in float32: past the range, inf * tanh
                raise InvalidAttentionOption(f"softcap must be at most {FLOAT32_MAX:.4g} (float32's range), got "
                                             f"{short_repr(self.softcap)}")
            object.__setattr__(self, "softcap", c if c > 0 else None)
        left, right = self.window if self.window is not None else (None, None)
        if self.causal:
            right = 0 if right is None else min(right, 0)
        object.__setattr__(self, "left", left)
        object.__setattr__(self, "right", right)
        object.__setattr__(self, "masked", left is not None or right is not None)


class GpuKernels(enum.Enum):
    """Which GPU implementation runs (docs/GPU.md); the one type of this setting everywhere."""

    #: CuPy array ops + cuBLAS over ``workers.blockwise.stream``: the default.
    GENERIC = "generic"
    #: The RawKernels of ``workers/gpu/kernels/attention.cu`` where the problem
    #: allows, generic elsewhere. Opt-in: not yet verified on hardware.
    FUSED = "fused"


def gpu_kernels_of(value: GpuKernels | str) -> GpuKernels:
    """:class:`GpuKernels` from itself or its value (``"generic"``, ``"fused"``), or raise naming it."""
    if isinstance(value, GpuKernels):
        return value
    try:
        return GpuKernels(value)
    except ValueError:
        names = ", ".join(repr(k.value) for k in GpuKernels)
        raise ValueError(f"gpu_kernels must be one of {names}, got {value!r}") from None


class CpuKernels(enum.Enum):
    """Which CPU implementation runs (``workers.fused``); the one type of this setting everywhere."""

    #: The blockwise NumPy/BLAS kernel (``workers.blockwise``): the reference, and the library's default.
    NUMPY = "numpy"
    #: The numba kernel of ``workers.fused`` for decode and for prefill over resident keys (one
    #: pass per key block), NumPy elsewhere and wherever numba is unavailable; compiled on first use.
    FUSED = "fused"
    #: FUSED once this process has compiled (or loaded) the fused kernels (``workers.fused.warm``),
    #: NUMPY until then: a call never waits for a compile. A worker's default: it serves at once
    #: and compiles in the background (``workers.fused.warm_in_background``).
    AUTO = "auto"


def cpu_kernels_of(value: CpuKernels | str) -> CpuKernels:
    """:class:`CpuKernels` from itself or its value (``"numpy"``, ``"fused"``, ``"auto"``), or raise naming it."""
    if isinstance(value, CpuKernels):
        return value
    try:
        return CpuKernels(value)
    except ValueError:
        names = ", ".join(repr(k.value) for k in CpuKernels)
        raise ValueError(f"cpu_kernels must be one of {names}, got {value!r}") from None


@dataclass(frozen=True)
class KernelOptions:
    """How the kernel walks the keys; does not change the result beyond rounding.

    * ``block_size``: keys per block; ``None`` picks one from the scratch budget.
    * ``scratch_bytes``: bound on the score tile and its temporaries per thread.
    * ``batch_scratch_bytes``: bound on the score tile of requests that share a pass
      over the keys (``workers.cpu.run_cpu_many``); more requests take more passes.
    * ``threads``: worker threads; work is split over heads, query tiles and,
      when there is too little of that, over key ranges (split-K).
    * ``gpu_kernels``: :class:`GpuKernels` (or its value); ignored on the CPU.
    * ``cpu_kernels``: :class:`CpuKernels` (or its value); ignored on the GPU.
    """

    block_size: int | None = None
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES
    batch_scratch_bytes: int = DEFAULT_BATCH_SCRATCH_BYTES
    threads: int = 1
    gpu_kernels: GpuKernels = GpuKernels.GENERIC
    cpu_kernels: CpuKernels = CpuKernels.NUMPY

    def __post_init__(self) -> None:
        if self.block_size is not None and (not is_int(self.block_size) or self.block_size < 1):
            raise ValueError(f"block_size must be null or an int >= 1, got {self.block_size!r}")
        if not is_int(self.scratch_bytes) or self.scratch_bytes < 1:
            raise ValueError(f"scratch_bytes must be an int >= 1, got {self.scratch_bytes!r}")
        if not is_int(self.batch_scratch_bytes) or self.batch_scratch_bytes < 1:
            raise ValueError(f"batch_scratch_bytes must be an int >= 1, got {self.batch_scratch_bytes!r}")
        if not is_int(self.threads) or self.threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {self.threads!r}")
        object.__setattr__(self, "gpu_kernels", gpu_kernels_of(self.gpu_kernels))
        object.__setattr__(self, "cpu_kernels", cpu_kernels_of(self.cpu_kernels))
