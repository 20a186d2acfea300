"""The fused CPU kernel: query rows in one pass per key block (``workers.fused_kernels``).

The NumPy kernel (``workers.blockwise``) issues separate BLAS calls and softmax
passes per block, re-reading each score tile; for decode, where reading K and V
is the whole cost, a compiled loop that reads each key and value once per block
and keeps m, l, acc in L1 streams closer to the memory bandwidth
(docs/BENCHMARKS.md, "CPU kernels (issues 2 and 16)").

* **Selection** (:func:`choose`): ``KernelOptions.cpu_kernels`` says which kernel
  is wanted; the fused one runs decode and, on the resident layout, prefill of any
  length (many rows take packed key tiles: ``workers.fused_micro.PACK_ROWS``), for key
  arrays whose innermost axis is contiguous, K and V of one
  dtype accumulated as that dtype implies (the kernels :func:`warm` compiles), and
  when numba loaded. Everything else runs on the NumPy kernel, which stays the
  reference. A call of many rows (a prefill, a large batch of decode queries) runs them
  in tiles of :data:`ROW_TILE`, each merged over its key chunks as it finishes.
* **Fallback**: when numba cannot be imported or a kernel fails to compile, one
  log line says so and the NumPy kernel answers; a failed call never leaves a
  partial result behind (outputs are fresh arrays).
* **Compilation**: numba caches the machine code on disk (``cache=True``), next
  to this file, or, where the package directory is read-only, in numba's
  user-wide cache; ``NUMBA_CACHE_DIR`` sets a directory explicitly (containers).
  :func:`warm` compiles or loads the kernels for the given dtypes at worker start.
* **Batching**: the rows of several requests over the same keys run as one
  tile; each row's arithmetic depends on that row alone, so a request's state is
  bitwise what it gets alone. Key chunks (the split over threads) depend only on
  ``n_k``, the block size and ``threads``: the result is bitwise reproducible for
  a fixed thread count.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from merge import NO_SCORE, State, merge_group
from workers.cutoff import Cut, check
from workers.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, accumulation_dtype
from workers.layout import NaturalKV, StreamingView
from workers.options import CpuKernels, KernelOptions
from workers.plan import DECODE_ROWS
from workers.problem import Arange, Problem
from workers.rows import prepare_rows, rows_to_state

log = logging.getLogger(__name__)

#: Keys per block when ``KernelOptions.block_size`` is None: the contract layout
#: reads a block of every head at once (``h_kv * B`` rows of K), the resident one
#: a block of one head: ``d`` runs of ``B`` keys, and longer runs stream better
#: (a 1 KiB run, 256 float32 keys, read K at about half the rate of a 4 KiB one:
#: benchmarks/results/2026-12-01/NOTES.md, "Longer resident blocks and four value streams"). Fixed, never a function of the
#: rows in a call: the block sets each row's order of arithmetic, which must not depend
#: on the other rows of a batch.
INLINE_BLOCK, RESIDENT_BLOCK = 64, 1024
#: Work units per thread (key chunks, x kv heads for the resident layout): load balance.
UNITS_PER_THREAD = 4
#: Rows per kernel call at most: a prefill-shaped call runs its rows in tiles of this many, so that
#: each unit's score scratch ``[rows, block]`` (1 MiB of float32 at the resident block) stays in L2.
#: Each row's arithmetic depends on that row alone, so the tiles change no bit. Work whose deadline
#: has passed stops between tiles (``workers.cutoff``).
ROW_TILE = 256
#: The dtypes of K and V the fused kernel serves, each compiled at worker start (:func:`warm`).
WARM_DTYPES = ("float32", "bfloat16", "float16", "float64")


class CpuPath(enum.Enum):
    """Which CPU kernel serves a call (:func:`choose`)."""

    NUMPY = "numpy"
    FUSED = "fused"


_state: dict[str, Any] = {"broken": False, "ready_at": None}


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled kernels' module, or None (one log line) where numba cannot be loaded."""
    try:
        import workers.fused_kernels  # numba loads here, on first use, not at import
    except Exception as exc:  # noqa: BLE001 - any import failure means: no fused path
        log.warning("fused CPU kernel unavailable, using the NumPy kernel: cannot import numba kernels (%s: %s)",
                    type(exc).__name__, exc)
        return None
    import numba

    # With the JIT disabled the kernels would run as Python, where their intrinsics cannot.
    if numba.config.DISABLE_JIT:  # type: ignore[attr-defined]
        log.warning("fused CPU kernel unavailable, using the NumPy kernel: numba's JIT is disabled "
                    "(NUMBA_DISABLE_JIT)")
        return None
    return workers.fused_kernels


def available() -> bool:
    """Whether the fused kernel can run in this process (numba loaded, no failed compile)."""
    return not _state["broken"] and kernels() is not None


def ready_at() -> float | None:
    """When (``time.time()``) :func:`warm` finished every dtype in this process, or None: what
    ``CpuKernels.AUTO`` waits for before it picks the fused kernel. None again once it broke."""
    return None if _state["broken"] else _state["ready_at"]


def _kernel_dtype(dt: Any) -> np.dtype | None:
    """The dtype the kernel reads an input dtype as (16-bit as bits; the type names the format), or None."""
    dt = np.dtype(dt)
    if dt in (FLOAT32, FLOAT64):
        return dt
    if dt == BFLOAT16:
        return np.dtype(np.uint16)
    if dt == FLOAT16:
        return np.dtype(np.int16)
    return None


def _flat(a: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]] | None:
    """``a`` as a flat contiguous array over the span it covers, read-only (:func:`_read_only`), and its
    strides in elements.

    None when the innermost axis is not contiguous or a stride is negative or
    not a whole number of elements (those views run on the NumPy kernel).
    """
    kd = _kernel_dtype(a.dtype)
    if kd is None or a.size == 0:
        return None
    item = a.itemsize
    if a.strides[-1] != item or any(s < 0 or s % item for s in a.strides):
        return None
    strides = tuple(s // item for s in a.strides)
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, strides))
    return as_strided(a.view(kd), shape=(span,), strides=(item,), writeable=False), strides


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a``: what the kernels are handed for every array they only read.

    numba compiles a kernel per argument type, and read-only is part of an array's type: a
    request's keys arrive read-only (views of its body), a shard's and :func:`warm`'s are
    writable. Handed both as they come, the first request of each dtype compiled a kernel of
    its own on the worker's compute thread, 12-13 s here, after the worker had said it was
    ready. Read-only always, :func:`warm` compiles the one kernel every call runs.
    """
    view = a.view()
    view.flags.writeable = False
    return view


def choose(problems: Sequence[Problem], kv: Any, kopts: KernelOptions) -> CpuPath:
    """The kernel that serves these problems (one batch over the same keys) on the CPU."""
    mode = kopts.cpu_kernels
    # Never once the compiled path broke; for AUTO, only once warm() has made every dtype ready (ready_at()).
    if mode is CpuKernels.NUMPY or _state["broken"] or (mode is CpuKernels.AUTO and _state["ready_at"] is None):
        return CpuPath.NUMPY
    p0 = problems[0]
    if p0.n_q == 0 or p0.n_k == 0:
        return CpuPath.NUMPY  # nothing to stream
    if isinstance(kv, NaturalKV):
        if p0.n_q * p0.group > DECODE_ROWS:
            return CpuPath.NUMPY  # prefill over the contract layout: its dot loop is no faster than BLAS
        arrays = (kv.k, kv.v)
    elif isinstance(kv, StreamingView):
        arrays = (kv.kt, kv.v)  # decode and prefill of any length: the tiles (PACK_ROWS for many rows)
    else:
        return CpuPath.NUMPY
    if any(not isinstance(a, np.ndarray) or _flat(a) is None for a in arrays):
        return CpuPath.NUMPY
    # Only the kernels warm() compiles: K and V of one dtype of WARM_DTYPES, accumulated in the dtype they
    # imply (float64 for float64 keys, float32 otherwise). Any other mix (a float64 query over 16-bit or
    # float32 keys; K and V of different dtypes) would be a kernel of its own, compiled on the request that
    # first asks for it (half a minute on 2 cores); those run on the NumPy kernel instead, which is as exact.
    k_dtype = arrays[0].dtype
    if k_dtype != arrays[1].dtype or k_dtype.name not in WARM_DTYPES or p0.acc_dtype != accumulation_dtype(k_dtype):
        return CpuPath.NUMPY
    return CpuPath.FUSED if kernels() is not None else CpuPath.NUMPY  # numba loaded (available())


def _chunks(n_k: int, block: int, units_per_chunk: int, threads: int) -> np.ndarray:
    """Key chunk bounds ``[C + 1]``, on block boundaries; a function of ``n_k``, block and threads only."""
    n_blocks = -(-n_k // block)
    want = 1 if threads == 1 else -(-UNITS_PER_THREAD * threads // units_per_chunk)
    n_chunks = max(1, min(n_blocks, want))
    per = -(-n_blocks // n_chunks) * block
    return np.array([min(c * per, n_k) for c in range(n_chunks)] + [n_k], dtype=np.int64)


def run_fused(parts: Sequence[tuple[Any, Problem]], kv: NaturalKV | StreamingView,
              kopts: KernelOptions) -> list[State]:
    """The state of each ``(q, problem)`` over the same keys, their rows stacked in one fused pass.

    The caller checked :func:`choose` (and, for several parts, ``plan.batchable``).
    Raises whatever the compiled kernel raises (the caller falls back).
    """
    mod = kernels()
    if mod is None:
        raise RuntimeError("the fused CPU kernel is unavailable")
    p0 = parts[0][1]
    acc_dt = p0.acc_dtype
    h_kv, d_v = p0.h_kv, p0.d_v
    # Per request: q_rows [h_kv, n_rows, d], q_pos_rows [n_rows], slopes_rows [h_kv, n_rows] or None.
    rows = [prepare_rows(q, p, np) for q, p in parts]
    sizes = [int(r[1].shape[0]) for r in rows]
    n_rows = sum(sizes)
    q_all = np.ascontiguousarray(np.concatenate([r[0] for r in rows], axis=1))  # [h_kv, R, d]
    qpos = np.ascontiguousarray(np.concatenate([r[1] for r in rows]), dtype=np.int64)  # [R]
    slope = np.zeros((h_kv, n_rows), dtype=acc_dt)  # [h_kv, R]
    cap = np.zeros(n_rows, dtype=acc_dt)  # [R], 0: no softcap
    has_alibi = np.zeros(n_rows, dtype=np.bool_)
    lo = np.zeros(n_rows, dtype=np.int64)  # [R] a row sees keys with positions in [lo, hi]
    hi = np.zeros(n_rows, dtype=np.int64)
    has_lo = np.zeros(n_rows, dtype=np.bool_)
    has_hi = np.zeros(n_rows, dtype=np.bool_)
    r0 = 0
    for (_, qp, sl), (_, p), n in zip(rows, parts, sizes):
        o = p.options
        if sl is not None:
            slope[:, r0:r0 + n] = sl
            has_alibi[r0:r0 + n] = True
        if o.softcap is not None:
            cap[r0:r0 + n] = o.softcap
        if o.left is not None:
            lo[r0:r0 + n] = qp - o.left
            has_lo[r0:r0 + n] = True
        if o.right is not None:
            hi[r0:r0 + n] = qp + o.right
            has_hi[r0:r0 + n] = True
        r0 += n
    masked = bool(has_lo.any() or has_hi.any())
    if isinstance(kv.k_pos, Arange):
        kpos, arange, kpos0 = np.zeros(1, dtype=np.int64), True, kv.k_pos.start
    else:
        kpos, arange, kpos0 = np.ascontiguousarray(kv.k_pos, dtype=np.int64), False, 0
    kpos = _read_only(kpos)  # [n_k] (or [1] unused): read-only as the keys are (_read_only)
    resident = isinstance(kv, StreamingView)
    k_arr = kv.kt if isinstance(kv, StreamingView) else kv.k
    v_arr = kv.v
    (k_flat, ks), (v_flat, vs) = _flat(k_arr), _flat(v_arr)  # type: ignore[misc]  # choose() checked
    n_k = p0.n_k
    # The kernels size their scratch by the block: a block longer than the keys is their length
    # (the same single block), so any block_size >= 1 the options allow runs.
    block = min(kopts.block_size or (RESIDENT_BLOCK if resident else INLINE_BLOCK), max(n_k, 1))
    bounds = _chunks(n_k, block, h_kv if resident else 1, kopts.threads)
    n_chunks = int(bounds.shape[0]) - 1
    fn = mod.resident_kernel if resident else mod.inline_kernel
    import numba  # loaded: kernels() imported it

    numba.set_num_threads(max(1, min(kopts.threads, numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
    # The call's states, m [h_kv, R], l [h_kv, R], acc [h_kv, R, d_v], filled a tile of ROW_TILE rows at a time:
    # each tile's chunk states m [C, h_kv, T], l [C, h_kv, T], acc [C, h_kv, T, d_v] (from the empty state)
    # merge in key order into its rows, so that a long prefill holds C states of one tile, not of all its rows.
    m_all = np.empty((h_kv, n_rows), dtype=acc_dt)
    l_all = np.empty((h_kv, n_rows), dtype=acc_dt)
    acc_all = np.empty((h_kv, n_rows, d_v), dtype=acc_dt)
    for t0 in range(0, n_rows, ROW_TILE):
        if n_rows > ROW_TILE:
            check()  # a prefill past its deadline stops between tiles (a tile is one compiled call)
        t1 = min(t0 + ROW_TILE, n_rows)
        m_t = np.full((n_chunks, h_kv, t1 - t0), NO_SCORE, dtype=acc_dt)
        l_t = np.zeros((n_chunks, h_kv, t1 - t0), dtype=acc_dt)
        acc_t = np.zeros((n_chunks, h_kv, t1 - t0, d_v), dtype=acc_dt)
        fn(np.ascontiguousarray(q_all[:, t0:t1]), k_flat, ks[0], ks[1], v_flat, vs[0], vs[1], n_k, d_v, kpos,
           arange, kpos0, qpos[t0:t1], cap[t0:t1], np.ascontiguousarray(slope[:, t0:t1]), has_alibi[t0:t1],
           lo[t0:t1], hi[t0:t1], has_lo[t0:t1], has_hi[t0:t1], masked, block, bounds, acc_dt.type(0),
           m_t, l_t, acc_t)
        # A [h_kv, rows] state is a State of "n_q" = h_kv and "h_q" = rows for the merge algebra.
        st = merge_group([State(m_t[c], l_t[c], acc_t[c]) for c in range(n_chunks)])
        m_all[:, t0:t1], l_all[:, t0:t1], acc_all[:, t0:t1] = st.m, st.l, st.acc
    states = []
    r0 = 0
    for (_, p), n in zip(parts, sizes):
        states.append(rows_to_state(m_all[:, r0:r0 + n], l_all[:, r0:r0 + n], acc_all[:, r0:r0 + n], p, np))
        r0 += n
    return states


def try_fused(parts: Sequence[tuple[Any, Problem]], kv: Any, kopts: KernelOptions) -> list[State] | None:
    """:func:`run_fused`, or None after one log line when the compiled path fails (the caller runs NumPy)."""
    try:
        return run_fused(parts, kv, kopts)
    except Cut:
        raise  # the request's deadline passed: not a failure of the kernel
    except MemoryError:
        # Out of memory for this call's states or scratch, not a broken kernel: NumPy's blocks
        # take less, and the next call tries the fused path again.
        log.warning("fused CPU kernel out of memory for this call, using the NumPy kernel for it")
        return None
    except Exception as exc:  # noqa: BLE001 - a broken compiled path must not fail the request
        if not _state["broken"]:
            log.warning("fused CPU kernel failed, using the NumPy kernel from now on (%s: %s)",
                        type(exc).__name__, exc)
        _state["broken"] = True
        return None


def warm(dtypes: Sequence[str] = WARM_DTYPES, threads: int = 1) -> dict[str, float]:
    """Compile (or load from the disk cache) the kernels for keys and values of ``dtypes``, both layouts.

    Called at worker start with every dtype :func:`choose` sends to the fused kernel, so that no
    request pays for compilation. Returns the seconds each dtype took; empty when the fused path
    is unavailable.
    """
    from workers.dtypes import dtype_of
    from workers.layout import StreamingKV
    from workers.options import AttentionOptions
    from workers.problem import check_problem

    if not available():
        return {}
    kopts = KernelOptions(threads=threads, cpu_kernels=CpuKernels.FUSED)
    opts = AttentionOptions()
    took: dict[str, float] = {}
    for name in dtypes:
        dt = dtype_of(name)
        t0 = time.perf_counter()
        q = np.zeros((1, 2, 4), dtype=dt)  # [n_q, h_q, d]
        k = np.zeros((3, 1, 4), dtype=dt)  # [n_k, h_kv, d]
        p = check_problem(q, k, k, np.array([2]), None, opts)
        for kv in (NaturalKV(k, k, p.k_pos), StreamingKV.from_arrays(k, k, np.arange(3)).snapshot()):
            if try_fused([(q, p)], kv, kopts) is None:
                return took  # the compiled path is broken (logged): NumPy serves
        took[name] = time.perf_counter() - t0
    if set(WARM_DTYPES) <= set(took) and _state["ready_at"] is None:
        _state["ready_at"] = time.time()
    return took


#: Seconds a background compile (:func:`warm_in_background`) may take before it is given up: a cold
#: compile of every dtype took 1.5-3 minutes on a loaded 2-core machine (docs/BENCHMARKS.md "Start-up").
COMPILE_APART_S = 900.0
#: Its scheduling priority (``nice``): below every query and write of the worker.
COMPILE_NICE = 19


def warm_in_background(threads: int = 1) -> threading.Thread:
    """``CpuKernels.AUTO``: make the fused kernels ready without holding up a call; returns the thread.

    A cold compile holds Python's lock for a minute or more, which would stall every request of
    the process meanwhile; so a child process at the lowest priority compiles the kernels into
    numba's disk cache first, and only then does this process load them from there (about a
    second, :func:`warm`). From then on :func:`choose` picks the fused kernel for ``AUTO``. A
    child that fails or times out leaves the NumPy kernel serving (one log line).
    """
    def run() -> None:
        # One child compiles at a time on a machine (a lock file): the workers' other children wait, then
        # load what it wrote into the cache instead of compiling the same kernels again beside it.
        lock = os.path.join(tempfile.gettempdir(), f"splitkey-fused-warm-{os.getuid()}.lock")
        code = (f"import fcntl, os, sys; os.nice({COMPILE_NICE}); f = open({lock!r}, 'a'); "
                f"fcntl.flock(f, fcntl.LOCK_EX); from workers.fused import warm; "
                f"sys.exit(0 if len(warm(threads={threads})) == {len(WARM_DTYPES)} else 1)")
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=COMPILE_APART_S,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("fused CPU kernel not compiled in the background (%s): the NumPy kernel serves", exc)
            return
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            log.warning("fused CPU kernel not compiled in the background (exit %d: %s): the NumPy kernel serves",
                        done.returncode, tail[0])
            return
        took = warm(threads=threads)  # from the disk cache now
        if ready_at() is not None:
            log.info("fused CPU kernel ready (loaded in %.1f s): it serves the calls it can from now on",
                     sum(took.values()))

    thread = threading.Thread(target=run, name="splitkey-fused-warm", daemon=True)
    thread.start()
    return thread
