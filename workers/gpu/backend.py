"""The GPU backend: partial attention on cupy arrays (the only module that imports cupy).

Two implementations of README "The math" (design and status: docs/GPU.md),
chosen by ``KernelOptions.gpu_kernels``:

* **generic** (the default): ``workers.blockwise.stream`` on cupy arrays, so
  cuBLAS GEMMs and CuPy elementwise kernels; the same code as the CPU kernel,
  correct by construction.
* **fused** (opt-in, ``GpuKernels.FUSED``): the RawKernels of
  ``workers/gpu/kernels/attention.cu`` through ``workers.gpu.launch``: one launch
  streams every chunk of keys, a second merges the chunk states in chunk order.
  NOT YET VERIFIED ON A GPU; problems they do not cover (float64, mixed dtypes,
  odd head dims, strided k/v) run on the generic path.

bfloat16: CuPy holds ``ml_dtypes.bfloat16`` arrays, but this module never asks
CuPy to compute on them: the kernels read the raw 16 bits (``view(uint16)``),
and the generic path widens the bits exactly (``bits << 16`` as float32).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import cupy
except Exception as exc:  # noqa: BLE001 - without the "gpu" extra, or a broken CUDA install
    cupy = None
    _IMPORT_ERROR: str | None = f"{type(exc).__name__}: {exc}"
else:
    _IMPORT_ERROR = None

from merge import State, empty
from workers.blockwise import TileInputs, stream
from workers.dtypes import BFLOAT16
from workers.gpu.launch import DeviceLimits, FusedUnsupported, KernelKey, Launcher, choose_fused
from workers.gpu.plan import FusedPlan
from workers.layout import NaturalKV, StreamingView
from workers.masking import TileBounds
from workers.options import GpuKernels, KernelOptions
from workers.plan import BLOCK_GRANULE, MIN_BLOCK, TILE_TEMPS, batchable
from workers.problem import Arange, Problem
from workers.rows import prepare_rows, rows_to_state

#: Scratch budget of the generic path: score tile, its temporaries and the block copies.
GPU_SCRATCH_BYTES = 256 * 2**20
#: Largest block of the generic path, in keys (fewer, larger blocks: fewer launches).
GENERIC_MAX_BLOCK = 65536


def unavailable_reason() -> str | None:
    """Why the GPU path cannot run here, or None when it can. Never raises."""
    if cupy is None:
        if _IMPORT_ERROR is not None and _IMPORT_ERROR.startswith("ModuleNotFoundError"):
            return "cupy not installed (pip install 'splitkey[gpu]')"
        return f"cupy failed to import ({_IMPORT_ERROR})"
    try:
        if cupy.is_available():
            return None
        return "no CUDA device (cupy.is_available() is False)"
    except Exception as exc:  # noqa: BLE001 - a driver error is an answer here, not a crash
        return f"no CUDA device ({type(exc).__name__}: {exc})"


def array_module() -> Any:
    """The cupy module, for GPU shard workers (raises ValueError naming why it is unusable)."""
    return _require_cupy()


def _require_cupy() -> Any:
    if cupy is None:
        raise ValueError(f"cupy must be importable for the GPU path, got {unavailable_reason()}")
    return cupy


def run_gpu_many(parts: Sequence[tuple[Any, Problem]], kv: NaturalKV | StreamingView,
                 kopts: KernelOptions) -> list[State]:
    """:func:`run_gpu` for several problems over the same keys (a batch of the shard worker).

    The generic path serves problems that :func:`workers.plan.batchable` lets share a
    pass in one (:func:`run_generic_many`); the fused kernels take one problem a call.
    """
    problems = [p for _, p in parts]
    if len(parts) == 1 or kopts.gpu_kernels is GpuKernels.FUSED or not batchable(problems):
        return [run_gpu(q, kv, p, kopts) for q, p in parts]
    if problems[0].n_q == 0 or problems[0].n_k == 0:
        cp = _require_cupy()
        return [empty(p.n_q, p.h_q, p.d_v, dtype=p.acc_dtype, xp=cp) for p in problems]
    return run_generic_many(parts, kv, kopts)


def run_gpu(q: Any, kv: NaturalKV | StreamingView, problem: Problem, kopts: KernelOptions) -> State:
    """The state of a checked ``problem`` over a key/value source of cupy arrays (a cupy State).

    Called by ``workers.api``; ``kopts.gpu_kernels`` picks the implementation (module doc).
    """
    cp = _require_cupy()
    p = problem
    if p.n_q == 0 or p.n_k == 0:
        return empty(p.n_q, p.h_q, p.d_v, dtype=p.acc_dtype, xp=cp)
    if kopts.gpu_kernels is GpuKernels.FUSED:
        try:
            plan, key = fused_choice(q, kv, p, kopts)
        except FusedUnsupported:
            pass  # e.g. float64 inputs: the generic path covers every problem
        else:
            return launch_fused(q, kv, p, plan, key)
    return run_generic(q, kv, p, kopts)


# ---------------------------------------------------------------- generic path


@dataclass(frozen=True, eq=False)
class _Bf16BitsKV:
    """A KV source over bfloat16 keys and values viewed as uint16: blocks widen exactly."""

    raw: Any  # NaturalKV or StreamingView over the uint16 views
    xp: Any

    @property
    def v(self) -> Any:
        return self.raw.v

    @property
    def k_pos(self) -> Any:
        return self.raw.k_pos

    def block(self, start: int, stop: int, h0: int, h1: int, acc_dtype: Any) -> tuple[Any, Any]:
        kt, vb = self.raw.block(start, stop, h0, h1, np.uint16)  # raw bits: "casting" to uint16 is a no-op
        return _bits_to_float(kt, acc_dtype, self.xp), _bits_to_float(vb, acc_dtype, self.xp)


def _bits_to_float(bits: Any, dtype: Any, xp: Any) -> Any:
    """bfloat16 bits (uint16) to ``dtype``: a bfloat16 is the top half of a float32."""
    wide = (bits.astype(xp.uint32) << 16).view(xp.float32)
    return wide if np.dtype(dtype) == np.float32 else wide.astype(dtype)


def _is_bf16(x: Any) -> bool:
    return np.dtype(x.dtype) == BFLOAT16


def _widened_source(kv: Any, xp: Any) -> Any:
    """``kv`` itself, or a bit-widening wrapper when both keys and values are bfloat16.

    Mixed bfloat16 and other dtypes fall back to the array module's own casts.
    """
    u16 = xp.uint16
    if isinstance(kv, StreamingView) and _is_bf16(kv.kt) and _is_bf16(kv.v):
        return _Bf16BitsKV(StreamingView(kt=kv.kt.view(u16), v=kv.v.view(u16), k_pos=kv.k_pos), xp)
    if isinstance(kv, NaturalKV) and _is_bf16(kv.k) and _is_bf16(kv.v):
        return _Bf16BitsKV(NaturalKV(kv.k.view(u16), kv.v.view(u16), kv.k_pos), xp)
    return kv


def generic_tiles(h_kv: int, n_rows: int, d: int, d_v: int, itemsize: int, kopts: KernelOptions) -> tuple[int, int]:
    """``(row_tile, block)`` of the generic path: the score tile and block copies fit GPU_SCRATCH_BYTES."""
    per_row_key = h_kv * itemsize * TILE_TEMPS  # one score and its temporaries, per head
    per_key = 2 * h_kv * (d + d_v) * itemsize  # the block copies of k and v (and their bf16 staging)
    row_tile = max(1, min(n_rows, GPU_SCRATCH_BYTES // (per_row_key * MIN_BLOCK)))
    if kopts.block_size is not None:
        return row_tile, kopts.block_size
    block = GPU_SCRATCH_BYTES // (per_row_key * row_tile + per_key)
    block = block // BLOCK_GRANULE * BLOCK_GRANULE
    return row_tile, int(min(GENERIC_MAX_BLOCK, max(MIN_BLOCK, block)))


def _host(x: Any) -> np.ndarray:
    """A host (numpy) copy of a small device array, e.g. positions."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def run_generic(q: Any, kv: Any, problem: Problem, kopts: KernelOptions, xp: Any = None) -> State:
    """The generic path: ``workers.blockwise.stream`` over all kv heads, rows in tiles.

    ``xp`` defaults to cupy; the CPU tests pass numpy to run the same code.
    """
    return run_generic_many([(q, problem)], kv, kopts, xp)[0]


def run_generic_many(parts: Sequence[tuple[Any, Problem]], kv: Any, kopts: KernelOptions,
                     xp: Any = None) -> list[State]:
    """:func:`run_generic` for problems over the same keys that :func:`workers.plan.batchable` lets
    share a pass: each row tile streams the keys once through one tile per problem, each tile
    going through the calls it would alone (``workers.blockwise.stream``)."""
    cp = _require_cupy() if xp is None else xp
    p0 = parts[0][1]
    n_rows = p0.n_q * p0.group  # of each problem (batchable: all equal)
    source = _widened_source(kv, cp)
    row_tile, block = generic_tiles(p0.h_kv, n_rows, p0.d, p0.d_v, p0.acc_dtype.itemsize, kopts)
    # Host copies of the positions: the block skip reads them without a device sync per block.
    k_pos_host = p0.k_pos if isinstance(p0.k_pos, Arange) else _host(p0.k_pos)
    rows = []  # per problem: [h_kv, n_rows, d], [n_rows], [h_kv, n_rows] or None, and [n_rows] on the host
    for q, p in parts:
        q_wide = _bits_to_float(q.view(cp.uint16), p.acc_dtype, cp) if _is_bf16(q) else q
        rows.append((*prepare_rows(q_wide, p, cp), np.repeat(_host(p.q_pos), p.group)))
    per_tile = []  # per row tile: (m, l, acc) of each problem
    for r0 in range(0, n_rows, row_tile):
        r1 = min(r0 + row_tile, n_rows)
        tiles = [TileInputs(
            q=q_rows[:, r0:r1],
            q_pos=q_pos_rows[r0:r1],
            slopes=None if slopes_rows is None else slopes_rows[:, r0:r1],
            softcap=p.options.softcap,
            bounds=TileBounds.of(int(q_pos_host[r0:r1].min()), int(q_pos_host[r0:r1].max()), p.options),
            options=p.options,
        ) for (q_rows, q_pos_rows, slopes_rows, q_pos_host), (_, p) in zip(rows, parts)]
        per_tile.append(stream(tiles, source, k_pos_host, 0, p0.n_k, 0, p0.h_kv, block, p0.acc_dtype, cp))
    states = []
    for i, (_, p) in enumerate(parts):
        m, l, acc = (cp.concatenate([tile[i][j] for tile in per_tile], axis=1) for j in range(3))  # [h_kv, n_rows(, d_v)]
        states.append(rows_to_state(m, l, acc, p, cp))
    return states


# ---------------------------------------------------------------- fused path

def device_limits() -> DeviceLimits:
    """Multiprocessors, shared memory and compute capability of the current device (cached)."""
    return _device_limits(_require_cupy().cuda.Device().id)


@functools.cache
def _device_limits(device_id: int) -> DeviceLimits:
    rt = cupy.cuda.runtime
    return DeviceLimits(
        sm_count=int(rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, device_id)),
        max_shared_bytes=int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id)),
        compute_capability=int(cupy.cuda.Device(device_id).compute_capability),
    )


@functools.lru_cache(maxsize=1)
def _launcher() -> Launcher:
    """One launcher per process: it keeps the compiled kernels by template arguments."""
    return Launcher(_require_cupy())


def _arrays(kv: Any) -> tuple[Any, Any, bool]:
    """``(k_array, v_array, dmajor)`` of a KV source."""
    if isinstance(kv, StreamingView):
        return kv.kt, kv.v, True  # [h_kv, d, n_k], [h_kv, n_k, d_v]
    return kv.k, kv.v, False  # [n_k, h_kv, d], [n_k, h_kv, d_v]


def fused_choice(q: Any, kv: Any, problem: Problem, kopts: KernelOptions) -> tuple[FusedPlan, KernelKey]:
    """The fused plan and kernel for this call; raises ``FusedUnsupported`` saying why not.

    ``kopts.block_size``, when given, is the keys per chunk (per thread block).
    """
    p = problem
    k_arr, v_arr, dmajor = _arrays(kv)
    unit_last = k_arr.strides[2] == k_arr.itemsize and v_arr.strides[2] == v_arr.itemsize
    return choose_fused((q.dtype, k_arr.dtype, v_arr.dtype), p.d, p.d_v, p.n_q * p.group, p.h_kv, p.n_k,
                        dmajor, unit_last, device_limits(), chunk_keys=kopts.block_size)


def _el(x: Any, axis: int) -> int:
    """Stride of ``axis`` in elements."""
    return int(x.strides[axis]) // int(x.itemsize)


def _raw(x: Any, xp: Any) -> Any:
    """16-bit inputs as their raw bits (the kernels widen them); float32 as is."""
    return x.view(xp.uint16) if x.itemsize == 2 else x


def _vec_ok(x: Any, strides: tuple[int, ...]) -> int:
    """1 when 16-byte vector loads are aligned for every head and key of ``x``."""
    vec = 16 // int(x.itemsize)
    address = x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr  # numpy (CPU tests), cupy
    return int(address % 16 == 0 and all(s % vec == 0 for s in strides))


def launch_fused(q: Any, kv: Any, p: Problem, plan: FusedPlan, key: KernelKey, xp: Any = None,
                 launcher: Launcher | None = None) -> State:
    """Run ``plan`` with kernel ``key``: chunk states, then their merge in chunk order.

    ``xp`` and ``launcher`` default to cupy and the process's launcher; the CPU
    tests pass numpy and a launcher over CPU-emulated kernels.
    """
    cp = cupy if xp is None else xp
    launcher = _launcher() if launcher is None else launcher
    f32 = cp.float32
    opts = p.options
    g, n_rows = p.group, p.n_q * p.group
    q = q if q.strides[2] == q.itemsize else cp.ascontiguousarray(q)
    k_arr, v_arr, dmajor = _arrays(kv)
    # Element strides: natural k [n_k, h_kv, d] (head, key); d-major kt [h_kv, d, n_k] (head, dim).
    k_sh, k_stride = (_el(k_arr, 0), _el(k_arr, 1)) if dmajor else (_el(k_arr, 1), _el(k_arr, 0))
    v_sh, v_sn = (_el(v_arr, 0), _el(v_arr, 1)) if dmajor else (_el(v_arr, 1), _el(v_arr, 0))
    int_dummy = cp.zeros(1, dtype=cp.int64)
    k_pos_given = not isinstance(p.k_pos, Arange)
    slopes = (cp.ascontiguousarray(cp.asarray(opts.alibi_slopes, dtype=f32)) if opts.alibi_slopes is not None
              else cp.zeros(1, dtype=f32))
    m_c = cp.empty((plan.n_chunks, p.h_kv, n_rows), dtype=f32)
    l_c = cp.empty((plan.n_chunks, p.h_kv, n_rows), dtype=f32)
    acc_c = cp.empty((plan.n_chunks, p.h_kv, n_rows, p.d_v), dtype=f32)
    launcher.attend(key, plan, dict(
        q=_raw(q, cp), q_sn=_el(q, 0), q_sh=_el(q, 1),
        k=_raw(k_arr, cp), k_sh=k_sh, k_stride=k_stride, k_vec=_vec_ok(k_arr, (k_sh, k_stride)),
        v=_raw(v_arr, cp), v_sh=v_sh, v_sn=v_sn, v_vec=_vec_ok(v_arr, (v_sh, v_sn)),
        q_pos=cp.ascontiguousarray(p.q_pos, dtype=cp.int64),
        k_pos=cp.ascontiguousarray(p.k_pos, dtype=cp.int64) if k_pos_given else int_dummy,
        k_pos_given=int(k_pos_given), k_pos_start=0 if k_pos_given else p.k_pos.start,
        slopes=slopes, has_alibi=int(opts.alibi_slopes is not None),
        factor=p.scale / opts.softcap if opts.softcap is not None else p.scale,
        has_softcap=int(opts.softcap is not None), softcap=opts.softcap or 0.0,
        has_left=int(opts.left is not None), left=opts.left or 0,
        has_right=int(opts.right is not None), right=opts.right or 0,
        n_q=p.n_q, g=g, n_k=p.n_k, chunk_keys=plan.chunk_keys,
        m_out=m_c, l_out=l_c, acc_out=acc_c,
    ))
    m = cp.empty((p.n_q, p.h_q), dtype=f32)
    l = cp.empty((p.n_q, p.h_q), dtype=f32)  # noqa: E741
    acc = cp.empty((p.n_q, p.h_q, p.d_v), dtype=f32)
    launcher.combine(n_rows, p.h_kv, dict(m_c=m_c, l_c=l_c, acc_c=acc_c, n_chunks=plan.n_chunks,
                                           n_rows=n_rows, g=g, dv=p.d_v, m=m, l=l, acc=acc))
    return State(m=m, l=l, acc=acc)
