"""Thin launcher for ``workers/gpu/kernels/attention.cu``: kernel choice, arguments, launch.

Does not import cupy: :class:`Launcher` receives the cupy module from
``workers.gpu.backend``, so everything else here (which kernel, which template
arguments, shared-memory bytes, argument packing) is plain Python that the CPU
tests check against the .cu source. Design: docs/GPU.md.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workers.dtypes import BFLOAT16, FLOAT16, FLOAT32
from workers.gpu.plan import KEY_TILE, THREADS, FusedPlan, make_fused_plan

SOURCE_PATH = Path(__file__).resolve().parent / "kernels" / "attention.cu"
#: NVRTC options (CuPy adds the architecture of the device).
NVRTC_OPTIONS = ("--std=c++17",)
#: Storage format codes of attention.cu's ``FMT_*`` enum.
FORMATS = {FLOAT16: 0, BFLOAT16: 1, FLOAT32: 2}
#: Head dims the fused kernels are instantiated for at most (shared memory grows with them).
MAX_HEAD_DIM = 256
#: Oldest compute capability the fused kernels are written for (mma.sync m16n8k16, bf16).
MIN_COMPUTE_CAPABILITY = 80
#: Dynamic shared memory a kernel may use without opting in.
DEFAULT_SHARED_BYTES = 48 * 1024
#: Grid limits of CUDA: x up to 2**31 - 1, y and z up to 65535.
MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535


class FusedUnsupported(ValueError):
    """The fused kernels cannot run this problem; the message says why."""


def load_source() -> str:
    return SOURCE_PATH.read_text()


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class KernelKey:
    """Template arguments of one ``attend_chunks`` instantiation."""

    fmt: int  # FORMATS value
    d: int
    d_v: int
    rows: int
    dmajor: bool  # keys stored d-major ([h_kv, d, n_k], resident contexts)
    mma: bool  # q.k on tensor cores (prefill, 16-bit inputs)

    @property
    def itemsize(self) -> int:
        return 4 if self.fmt == FORMATS[FLOAT32] else 2

    def name(self) -> str:
        """The C++ name expression NVRTC instantiates and CuPy looks up."""
        return f"attend_chunks<{self.fmt}, {self.d}, {self.d_v}, {self.rows}, {int(self.dmajor)}, {int(self.mma)}>"

    def shared_bytes(self) -> int:
        """Dynamic shared memory of the instantiation: ``Layout<...>::BYTES`` in attention.cu."""
        esz = self.itemsize
        vec = 16 // esz
        k_rows, k_ld = (self.d, KEY_TILE + vec) if self.dmajor else (KEY_TILE, self.d + vec)
        q_ld, q_esz = (self.d + vec, esz) if self.mma else (self.d, 4)
        s_ld = KEY_TILE + 4
        return (_align16(k_rows * k_ld * esz) + _align16(KEY_TILE * (self.d_v + vec) * esz)
                + _align16(self.rows * q_ld * q_esz) + _align16(self.rows * s_ld * 4)
                + _align16(4 * self.rows * 4) + _align16(self.rows * 8) + _align16(KEY_TILE * 8))


@dataclass(frozen=True)
class DeviceLimits:
    """What the fused path needs to know about the device."""

    sm_count: int
    max_shared_bytes: int  # opt-in maximum of dynamic shared memory per block
    compute_capability: int  # e.g. 90


def choose_fused(dtypes: tuple[Any, Any, Any], d: int, d_v: int, n_rows: int, h_kv: int, n_k: int,
                 dmajor: bool, unit_last: bool, limits: DeviceLimits,
                 chunk_keys: int | None = None) -> tuple[FusedPlan, KernelKey]:
    """The plan and kernel for a problem, or raise :class:`FusedUnsupported` saying why.

    ``dtypes`` are those of q, k, v; ``unit_last`` says whether k and v have unit
    stride in their last axis (d for natural keys, keys for d-major ones, d_v for v).
    """
    dts = tuple(np.dtype(t) for t in dtypes)
    if len(set(dts)) != 1 or dts[0] not in FORMATS:
        raise FusedUnsupported(f"fused kernels need q, k, v of one dtype float16, bfloat16 or float32, "
                               f"got {', '.join(t.name for t in dts)}")
    fmt = FORMATS[dts[0]]
    vec = 16 // dts[0].itemsize
    for name, n in (("d", d), ("d_v", d_v)):
        if n % vec or not 0 < n <= MAX_HEAD_DIM:
            raise FusedUnsupported(f"fused kernels need {name} a multiple of {vec} up to {MAX_HEAD_DIM} "
                                   f"for {dts[0].name}, got {n}")
    if not unit_last:
        raise FusedUnsupported("fused kernels need k and v with unit stride in their last axis, got strided views")
    if limits.compute_capability < MIN_COMPUTE_CAPABILITY:
        raise FusedUnsupported(f"fused kernels need compute capability >= {MIN_COMPUTE_CAPABILITY}, "
                               f"got {limits.compute_capability}")
    if n_rows >= 2**31 or h_kv > MAX_GRID_YZ:
        raise FusedUnsupported(f"fused kernels need n_q * g < 2**31 and h_kv <= {MAX_GRID_YZ}, "
                               f"got {n_rows} rows and h_kv = {h_kv}")
    plan = make_fused_plan(n_rows, h_kv, n_k, limits.sm_count, chunk_keys=chunk_keys)
    if plan.row_tiles > MAX_GRID_YZ or plan.n_chunks > MAX_GRID_X:
        raise FusedUnsupported(f"fused kernels need at most {MAX_GRID_YZ} row tiles and {MAX_GRID_X} chunks, "
                               f"got {plan.row_tiles} and {plan.n_chunks}")
    mma = plan.kernel == "prefill" and fmt != FORMATS[FLOAT32] and d % 16 == 0
    key = KernelKey(fmt=fmt, d=d, d_v=d_v, rows=plan.rows_per_block, dmajor=dmajor, mma=mma)
    if key.shared_bytes() > limits.max_shared_bytes:
        raise FusedUnsupported(f"fused kernel needs {key.shared_bytes()} bytes of shared memory per block, "
                               f"the device allows {limits.max_shared_bytes}")
    return plan, key


# Kernel parameters in order, as declared in attention.cu (tests/unit/test_workers_gpu_launch.py
# parses the source and compares): "ptr" is a device array, the rest C scalars.
ATTEND_PARAMS = (
    ("q", "ptr"), ("q_sn", "i64"), ("q_sh", "i64"),
    ("k", "ptr"), ("k_sh", "i64"), ("k_stride", "i64"), ("k_vec", "int"),
    ("v", "ptr"), ("v_sh", "i64"), ("v_sn", "i64"), ("v_vec", "int"),
    ("q_pos", "ptr"), ("k_pos", "ptr"), ("k_pos_given", "int"), ("k_pos_start", "i64"),
    ("slopes", "ptr"), ("has_alibi", "int"), ("factor", "float"), ("has_softcap", "int"), ("softcap", "float"),
    ("has_left", "int"), ("left", "i64"), ("has_right", "int"), ("right", "i64"),
    ("n_q", "int"), ("g", "int"), ("n_k", "i64"), ("chunk_keys", "i64"),
    ("m_out", "ptr"), ("l_out", "ptr"), ("acc_out", "ptr"),
)
COMBINE_PARAMS = (
    ("m_c", "ptr"), ("l_c", "ptr"), ("acc_c", "ptr"),
    ("n_chunks", "int"), ("n_rows", "int"), ("g", "int"), ("dv", "int"),
    ("m", "ptr"), ("l", "ptr"), ("acc", "ptr"),
)
_SCALARS = {"int": np.int32, "i64": np.int64, "float": np.float32}
_INT_RANGES = {"int": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1)}


def pack(params: tuple[tuple[str, str], ...], values: dict[str, Any]) -> tuple[Any, ...]:
    """Kernel arguments in declaration order, each scalar as the numpy type of its C type.

    CuPy passes a numpy scalar by its own size, so a Python int where the kernel
    declares ``int`` would shift every later argument: never pass one unconverted.
    """
    names = [n for n, _ in params]
    if set(values) != set(names):
        missing, extra = sorted(set(names) - set(values)), sorted(set(values) - set(names))
        raise ValueError(f"kernel arguments must be exactly the declared ones, got missing {missing}, extra {extra}")
    out = []
    for name, kind in params:
        x = values[name]
        if kind == "ptr":
            if isinstance(x, numbers.Number):
                raise ValueError(f"{name} must be a device array, got {type(x).__name__}")
            out.append(x)
            continue
        if kind == "float":
            if isinstance(x, bool) or not isinstance(x, numbers.Real):
                raise ValueError(f"{name} must be a real number, got {x!r}")
        else:
            if not isinstance(x, numbers.Integral):
                raise ValueError(f"{name} must be an integer, got {x!r}")
            low, high = _INT_RANGES[kind]
            if not low <= int(x) <= high:
                raise ValueError(f"{name} must fit a C {kind}, got {x}")
        out.append(_SCALARS[kind](x))
    return tuple(out)


class Launcher:
    """Compiles ``attend_chunks`` instantiations on first use (CuPy's NVRTC) and launches them."""

    def __init__(self, cp: Any, source: str | None = None) -> None:
        self._cp = cp
        self._source = load_source() if source is None else source
        self._attend: dict[KernelKey, Any] = {}
        self._combine: Any = None

    def _attend_function(self, key: KernelKey) -> Any:
        fn = self._attend.get(key)
        if fn is None:
            module = self._cp.RawModule(code=self._source, options=NVRTC_OPTIONS, name_expressions=(key.name(),))
            fn = module.get_function(key.name())
            if key.shared_bytes() > DEFAULT_SHARED_BYTES:
                fn.max_dynamic_shared_size_bytes = key.shared_bytes()
            self._attend[key] = fn
        return fn

    def attend(self, key: KernelKey, plan: FusedPlan, values: dict[str, Any]) -> None:
        """One launch over the plan's grid; writes the chunk states into ``values``' outputs."""
        fn = self._attend_function(key)
        fn(plan.grid, (THREADS,), pack(ATTEND_PARAMS, values), shared_mem=key.shared_bytes())

    def combine(self, n_rows: int, h_kv: int, values: dict[str, Any]) -> None:
        """Merge the chunk states of every (head, row) in chunk order into the contract layout."""
        if self._combine is None:
            self._combine = self._cp.RawModule(code=self._source, options=NVRTC_OPTIONS).get_function("combine_chunks")
        self._combine((n_rows, h_kv), (THREADS,), pack(COMBINE_PARAMS, values))
