"""CPU benchmark of the splitkey kernel against the machine's limits, naive NumPy and PyTorch SDPA.

Run from the repository root (``pip install -e '.[bench]'``; ``pip install torch``
for the SDPA column, which is skipped cleanly without it)::

    python benchmarks/kernel.py --threads 2 --repeat 5 --out docs/kernel_bench.md

Everything runs in one process with the same number of threads for everyone:

* limits: read bandwidth of a large float32 GEMV and sgemm FLOP/s, BLAS at
  ``T`` threads (and the GEMV at one thread, the per-core figure); in every
  decode case's interleaved rounds, a GEMV over 256 MiB at ``T`` BLAS threads
  ("GEMV beside"): this VM's bandwidth moves by 1.5-2x within minutes, so each
  case's share of GEMV is taken against the GEMV of the same minutes, not the
  run's first; and in the same rounds the **in-cache roof**: the fused kernel
  itself over keys and values whose memory repeats every quarter of the L2
  cache (``benchmarks.common.aliased``), so that it streams them from cache at
  the case's shape, strides and dtype (at most ``ROOF_KEYS`` keys): the rate its
  own arithmetic allows on this host. Decode's roof is the lower of the two
  (:func:`decode_roof`): the memory bound or the compute bound, whichever binds;
* splitkey: ``threads=T`` worker threads with BLAS at one thread each (the
  kernel splits the work itself; README, "Library use"), on the resident
  streaming layout (``StreamingKV.from_arrays(...).snapshot()`` +
  ``partial_attention_resident``) and on the contract layout
  (``partial_attention``: inline requests);
* the fused kernel (``cpu_kernels="fused"``, workers/fused.py): numba threads =
  ``T``, on both layouts for decode; for prefill on the resident layout only
  (prefill over the contract layout runs the NumPy kernel whatever the option says);
* naive NumPy: scores materialised per kv head, softmax, ``p @ v``; BLAS at ``T``;
* PyTorch SDPA on CPU: ``torch.set_num_threads(T)``; q ``[1, h_q, n_q, d]``, k
  and v in SDPA's layout ``[1, h_kv, n_k, d]`` with ``enable_gqa=True`` (no
  repeated kv heads: at 1M keys those would need 32 GiB).

Decode (``n_q=1, h_q=32, h_kv=8, d=128``) runs for each of ``--dtypes`` (float32,
bfloat16, float16: K and V stored in that dtype, q float32) and reports GB/s of
the K+V bytes in their own storage (2 bytes an element for 16-bit); naive NumPy
and SDPA run for float32 only; prefill (``n_q=256`` over 32K keys) reports GFLOP/s counting
``4 n_q h_q n_k d`` (QK and PV; causal counts the same). Each cell is the median
of ``--repeat`` timed runs with the min-max range; the implementations are
timed in interleaved rounds, each timed call right after a pause and an
untimed call (see :func:`measure`). Every
implementation's ``out`` is compared with the resident kernel's, and the run
stops if they disagree, so the table cannot compare different computations.

Memory: K and V are generated in chunks from a fixed seed, never all at once,
into the resident layout plus SDPA's copy of K (SDPA reads the resident values
in place: they are already ``[h_kv, n_k, d]``) and into the contract layout:
2.5x the K+V bytes. When that does not fit in the available memory (1M keys:
20 GiB), the resident kernel and SDPA are timed first and freed, then the
contract layout is generated again from the same seed for the inline kernel and
naive NumPy: the peak is 1.5x the K+V bytes (12 GiB at 1M keys), and the report
marks the size. A size that does not fit even so is skipped, and the report says so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The repository's packages, also when run as a script from elsewhere.
from benchmarks.common import (
    GIB,
    aliased,
    blas_threads,
    cpu_model,
    emit_report,
    l2_bytes,
    meminfo,
    parse_keys,
    positive,
)
from merge import finalize
from workers import StreamingKV, partial_attention_resident, partial_attention_shard
from workers.dtypes import dtype_of
from workers.layout import StreamingView
from workers.options import AttentionOptions, CpuKernels, KernelOptions

HEADS = {"h_q": 32, "h_kv": 8, "d": 128}
DECODE_KEYS = (64 * 1024, 256 * 1024, 1024 * 1024)
PREFILL = {"n_q": 256, "n_k": 32 * 1024}
QUICK_DECODE_KEYS = (4 * 1024, 16 * 1024)
QUICK_PREFILL = {"n_q": 32, "n_k": 2 * 1024}
#: Keys per generated chunk: bounds the generator's temporaries.
GEN_CHUNK = 64 * 1024
#: Largest ``out`` difference from the resident kernel's, relative to its largest |out|.
AGREE_RTOL = 1e-3
SEED = 20261129
#: The GEMV timed beside each decode case: [rows, cols] float32, 256 MiB (8x this VM's L3), 32 MiB quick.
GEMV_BESIDE = (16384, 4096)
QUICK_GEMV_BESIDE = (2048, 4096)
#: Keys of the in-cache roof's operands at most: their memory repeats (``aliased``), but every page
#: of the range has its own page-table entry, which a million keys would push out of cache.
ROOF_KEYS = 64 * 1024
#: Pause before each implementation's calls (see :func:`measure`).
SETTLE_S = 0.3


# ------------------------------------------------------------------ arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=positive, default=2, help="threads for every implementation (default 2)")
    p.add_argument("--repeat", type=positive, default=5, help="timed runs per cell; the median is reported")
    p.add_argument("--sizes", type=parse_keys, default=None, help="decode key counts, e.g. 64K,256K,1M")
    p.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats: a smoke run")
    p.add_argument("--causal", action="store_true", help="also run the prefill case with a causal mask")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch SDPA column")
    p.add_argument("--dtypes", default="float32,bfloat16,float16",
                   help="decode K/V dtypes, comma-separated (default float32,bfloat16,float16)")
    p.add_argument("--out", default=None, help="also write the markdown report here (e.g. docs/kernel_bench.md)")
    p.add_argument("--json", default=None, help="also write the raw timings here (benchmarks/model.py reads them)")
    args = p.parse_args(argv)
    args.dtypes = [dtype_of(name.strip()).name for name in args.dtypes.split(",") if name.strip()]
    if args.quick:
        args.sizes = args.sizes or list(QUICK_DECODE_KEYS)
        args.repeat = min(args.repeat, 2)
        args.prefill = dict(QUICK_PREFILL)
    else:
        args.sizes = args.sizes or list(DECODE_KEYS)
        args.prefill = dict(PREFILL)
    return args


# ------------------------------------------------------------------ threads and timing


def load_torch(enabled: bool, threads: int) -> Any:
    """The torch module with ``threads`` intra-op threads, or None (not installed or not wanted)."""
    if not enabled:
        return None
    try:
        import torch  # optional peer, never a dependency
    except ImportError:
        return None
    torch.set_num_threads(threads)
    return torch


@dataclass
class Cell:
    """Repeated timings of one implementation on one case."""

    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def measure(fns: dict[str, Callable[[], Any]], repeat: int) -> tuple[dict[str, Cell], dict[str, Any]]:
    """Time implementations side by side, in ``repeat`` interleaved rounds.

    Interleaving makes a burst of load from elsewhere on the machine hit all
    implementations alike instead of one. In each round every implementation
    waits ``SETTLE_S``, then runs twice, and only the second call is timed. The
    wait lets the previous one's idle threads stop spinning (OpenBLAS workers
    spin on a core for a while after a multithreaded call: our 64K decode ran at
    60% speed right after naive NumPy's, even after one untimed call); the first
    call absorbs switching BLAS thread counts (several ms in OpenBLAS) and warms
    the caches. Returns the timings and each one's last result.
    """
    cells = {name: Cell() for name in fns}
    results: dict[str, Any] = {}
    for _ in range(repeat):
        for name, fn in fns.items():
            time.sleep(SETTLE_S)
            fn()
            t0 = time.perf_counter()
            results[name] = fn()
            cells[name].seconds.append(time.perf_counter() - t0)
    return cells, results


def rate(work: float, cell: Cell | None, unit: float = 1e9) -> str:
    """``"median (min-max)"`` of ``work / seconds`` in ``unit``; a dash when not measured."""
    if cell is None or not cell.seconds:
        return "-"
    rates = [work / s / unit for s in cell.seconds]
    return f"{work / cell.median / unit:.1f} ({min(rates):.1f}-{max(rates):.1f})"


def ratio(a: Cell | None, b: Cell | None, work_b_over_a: float = 1.0) -> str:
    """How many times faster ``a`` is than ``b`` (medians); a dash when either is missing."""
    if a is None or b is None:
        return "-"
    return f"{b.median / a.median * work_b_over_a:.2f}x"


# ------------------------------------------------------------------ inputs


def kv_chunks(n_k: int, h_kv: int, d: int, d_v: int, seed: int,
              dtype: Any = np.float32) -> Iterator[tuple[int, int, Any, Any]]:
    """``(a, b, k [b-a, h_kv, d], v [b-a, h_kv, d_v])`` chunks in ``dtype``, the same for the same seed."""
    rng = np.random.default_rng(seed)
    for a in range(0, n_k, GEN_CHUNK):
        b = min(a + GEN_CHUNK, n_k)
        k = rng.standard_normal((b - a, h_kv, d), dtype=np.float32).astype(dtype, copy=False)
        v = rng.standard_normal((b - a, h_kv, d_v), dtype=np.float32).astype(dtype, copy=False)
        yield a, b, k, v


def contract_kv(n_k: int, h_kv: int, d: int, d_v: int, seed: int, dtype: Any = np.float32) -> tuple[Any, Any]:
    """K ``[n_k, h_kv, d]`` and V ``[n_k, h_kv, d_v]`` in the contract layout."""
    k = np.empty((n_k, h_kv, d), dtype=dtype)
    v = np.empty((n_k, h_kv, d_v), dtype=dtype)
    for a, b, kc, vc in kv_chunks(n_k, h_kv, d, d_v, seed, dtype):
        k[a:b], v[a:b] = kc, vc
    return k, v


def resident_kv(n_k: int, h_kv: int, d: int, d_v: int, seed: int, torch: Any,
                dtype: Any = np.float32) -> tuple[Any, Any]:
    """The resident view of the same keys, and SDPA's ``k [1, h_kv, n_k, d]`` (None without torch or
    for 16-bit keys: SDPA runs on float32 only)."""
    store = StreamingKV(h_kv, d, d_v, dtype, capacity=n_k)
    if np.dtype(dtype) != np.float32:
        torch = None
    k_sdpa = None if torch is None else torch.empty((1, h_kv, n_k, d), dtype=torch.float32)
    for a, b, kc, vc in kv_chunks(n_k, h_kv, d, d_v, seed, dtype):
        store.append(kc, vc, np.arange(a, b))
        if k_sdpa is not None:
            k_sdpa[0, :, a:b] = torch.from_numpy(kc).permute(1, 0, 2)  # [h_kv, b-a, d]
    return store.snapshot(), k_sdpa


def in_cache_kv(n_k: int, h_kv: int, d: int, d_v: int, dtype: Any) -> tuple[StreamingView, Any, Any]:
    """The in-cache roof's operands: a resident view and contract-layout K and V of ``n_k`` keys whose
    memory repeats every quarter of the L2 cache (``benchmarks.common.aliased``): each layout's K and V
    together stay within half of it while the kernel streams all ``n_k`` keys."""
    period = l2_bytes() // 4
    kt = aliased((h_kv, d, n_k), dtype, period, SEED + 7)  # [h_kv, d, n_k]
    v = aliased((h_kv, n_k, d_v), dtype, period, SEED + 8)  # [h_kv, n_k, d_v]
    k_contract = aliased((n_k, h_kv, d), dtype, period, SEED + 9)  # [n_k, h_kv, d]
    v_contract = aliased((n_k, h_kv, d_v), dtype, period, SEED + 10)  # [n_k, h_kv, d_v]
    return StreamingView(kt, v, np.arange(n_k)), k_contract, v_contract


def queries(n_q: int, h_q: int, d: int, seed: int) -> Any:
    return np.random.default_rng(seed + 1).standard_normal((n_q, h_q, d), dtype=np.float32)  # [n_q, h_q, d]


# ------------------------------------------------------------------ implementations
# Each returns (out [n_q, h_q, d_v], lse [n_q, h_q] or None) as float32 numpy arrays.


def ours_resident(q: Any, view: Any, causal: bool, threads: int,
                  kernels: CpuKernels = CpuKernels.NUMPY) -> tuple[Any, Any]:
    n_k = int(view.k_pos.shape[0])
    q_pos = np.arange(n_k - q.shape[0], n_k)  # bottom-right aligned, as the inline default
    with blas_threads(1):
        state = partial_attention_resident(q, view, q_pos=q_pos, options=AttentionOptions(causal=causal),
                                           kernel=KernelOptions(threads=threads, cpu_kernels=kernels))
    return finalize(state)


def ours_inline(q: Any, k: Any, v: Any, causal: bool, threads: int,
                kernels: CpuKernels = CpuKernels.NUMPY) -> tuple[Any, Any]:
    with blas_threads(1):
        state = partial_attention_shard(q, k, v, q_pos=None, k_pos=None, options=AttentionOptions(causal=causal),
                                        kernel=KernelOptions(threads=threads, cpu_kernels=kernels))
    return finalize(state)


def naive_numpy(q: Any, k: Any, v: Any, causal: bool, threads: int) -> tuple[Any, Any]:
    """Materialise each kv head's scores ``[n_q*g, n_k]``, softmax them, multiply by v."""
    n_q, h_q, d = q.shape
    n_k, h_kv, d_v = v.shape
    g = h_q // h_kv
    out = np.empty((n_q, h_q, d_v), dtype=np.float32)
    lse = np.empty((n_q, h_q), dtype=np.float32)
    q_rows = (q * np.float32(1 / math.sqrt(d))).reshape(n_q, h_kv, g, d)  # [n_q, h_kv, g, d]
    with blas_threads(threads):
        for h in range(h_kv):
            qh = q_rows[:, h].reshape(n_q * g, d)  # [n_q*g, d], row i*g + j
            s = qh @ k[:, h].T  # [n_q*g, n_k]
            if causal:
                q_pos = np.repeat(np.arange(n_k - n_q, n_k), g)  # [n_q*g]
                s[np.arange(n_k)[None, :] > q_pos[:, None]] = -np.inf
            m = s.max(axis=1, keepdims=True)  # [n_q*g, 1]
            p = np.exp(s - m)  # [n_q*g, n_k]
            l = p.sum(axis=1, keepdims=True)
            out[:, h * g:(h + 1) * g] = ((p @ v[:, h]) / l).reshape(n_q, g, d_v)  # [n_q, g, d_v]
            lse[:, h * g:(h + 1) * g] = (m + np.log(l)).reshape(n_q, g)
    return out, lse


def sdpa(torch: Any, q: Any, k_sdpa: Any, v_sdpa: Any, causal: bool) -> tuple[Any, None]:
    """PyTorch SDPA with ``enable_gqa``; causal as a bottom-right boolean mask (its own is top-left)."""
    n_q = q.shape[0]
    n_k = int(k_sdpa.shape[2])
    qt = torch.from_numpy(np.ascontiguousarray(q.transpose(1, 0, 2)))[None]  # [1, h_q, n_q, d]
    mask = None
    if causal:
        mask = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]  # [n_q, n_k], True: attend
    with torch.inference_mode():
        out = torch.nn.functional.scaled_dot_product_attention(qt, k_sdpa, v_sdpa, attn_mask=mask, enable_gqa=True)
    return out[0].permute(1, 0, 2).numpy(), None  # [n_q, h_q, d_v]


def check_agree(name: str, out: Any, ref: Any) -> float:
    """Largest |out - ref|; raises when it exceeds AGREE_RTOL of the largest |ref|."""
    diff = float(np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64))))
    scale = float(np.max(np.abs(ref)))
    if not diff <= AGREE_RTOL * scale:
        raise RuntimeError(f"{name} disagrees with the resident kernel: "
                           f"max |diff| = {diff:.3g}, max |out| = {scale:.3g}")
    return diff


# ------------------------------------------------------------------ cases


@dataclass
class Row:
    """One decode size or prefill case: timings per implementation, work, notes."""

    label: str
    work: float  # bytes (decode) or flops (prefill)
    dtype: str = "float32"  # of K and V
    cells: dict[str, Cell] = field(default_factory=dict)
    max_diff: float = 0.0
    skipped: str = ""  # why the case was not run
    two_phases: bool = False  # the layouts did not fit in memory together
    gemv_bytes: float = 0.0  # of the GEMV timed beside the case (its "gemv" cell), 0 when none was
    roof_bytes: float = 0.0  # K+V bytes of the in-cache roof's calls ("roof_*" cells), 0 when not timed

    def gemv_gbs(self) -> float | None:
        """The GEMV's read rate in the case's own rounds, GB/s (None when not measured)."""
        cell = self.cells.get("gemv")
        return self.gemv_bytes / cell.median / 1e9 if cell is not None and self.gemv_bytes else None

    def roof_gbs(self, layout: str) -> float | None:
        """The fused kernel's in-cache rate on ``layout`` ("resident" or "inline"), GB/s (None when not measured)."""
        cell = self.cells.get(f"roof_{layout}")
        return self.roof_bytes / cell.median / 1e9 if cell is not None and self.roof_bytes else None


IMPLS = ("resident", "fused_resident", "inline", "naive", "sdpa")
#: Decode adds the fused kernel on both layouts.
DECODE_IMPLS = ("resident", "inline", "fused_resident", "fused_inline", "naive", "sdpa")
FUSED = CpuKernels.FUSED


def run_limits(threads: int, repeat: int, quick: bool) -> dict[str, tuple[float, Cell]]:
    """``{name: (work, cell)}``: GEMV read bytes at T and 1 BLAS threads, sgemm flops at T."""
    rng = np.random.default_rng(SEED)
    rows, cols = (2048, 4096) if quick else (16384, 16384)  # 32 MiB or 1 GiB of float32
    a = rng.standard_normal((rows, cols), dtype=np.float32)
    x = rng.standard_normal(cols, dtype=np.float32)
    n = 512 if quick else 4096
    b = rng.standard_normal((n, n), dtype=np.float32)

    # One at a time, each under its own BLAS thread count: OpenBLAS takes
    # several ms to change it, and a ceiling should be measured at its best.
    limits = {}
    for name, work, fn, n_threads in (("gemv", a.nbytes, lambda: a @ x, threads), ("gemv1", a.nbytes, lambda: a @ x, 1),
                                      ("sgemm", 2.0 * n**3, lambda: b @ b, threads)):
        with blas_threads(n_threads):
            cells, _ = measure({name: fn}, repeat)
        limits[name] = (float(work), cells[name])
    return limits


@functools.cache
def gemv_operands(quick: bool) -> tuple[Any, Any]:
    """``a [rows, cols]`` and ``x [cols]`` float32 of the GEMV timed beside each decode case."""
    rng = np.random.default_rng(SEED + 1)
    rows, cols = QUICK_GEMV_BESIDE if quick else GEMV_BESIDE
    return rng.standard_normal((rows, cols), dtype=np.float32), rng.standard_normal(cols, dtype=np.float32)


def gemv(a: Any, x: Any, threads: int) -> tuple[None, None]:
    """``a @ x`` with BLAS at ``threads`` (the first call of each round absorbs the switch; see measure)."""
    with blas_threads(threads):
        a @ x
    return None, None


def run_case(row: Row, n_q: int, n_k: int, causal: bool, args: argparse.Namespace, torch: Any,
             fused: bool = False) -> Row:
    """Time the four implementations on one case and check that they agree.

    When the resident layout, SDPA's K and the contract layout fit in memory
    together, all four are timed side by side; otherwise the first two, then
    (after freeing them) the last two.
    """
    h_q, h_kv, d = HEADS["h_q"], HEADS["h_kv"], HEADS["d"]
    dt = dtype_of(row.dtype)
    kv_bytes = 2 * n_k * h_kv * d * dt.itemsize
    if dt != np.float32:
        torch = None  # SDPA and naive NumPy: float32 only
    a, x = gemv_operands(args.quick)  # made once per run, timed beside decode cases only
    apart = kv_bytes * (1.5 if torch is not None else 1.0)
    avail = meminfo("MemAvailable")
    if avail is not None and apart + GIB > avail:
        row.skipped = f"skipped: needs about {apart / GIB:.1f} GiB, {avail / GIB:.1f} GiB available"
        return row
    # Side by side only with room to spare: the machine is shared.
    together = avail is None or apart + kv_bytes + 4 * GIB <= avail
    q = queries(n_q, h_q, d, SEED)
    seed = SEED + n_k
    view, k_sdpa = resident_kv(n_k, h_kv, d, d, seed, torch, dt)
    first: dict[str, Callable[[], Any]] = {"resident": lambda: ours_resident(q, view, causal, args.threads)}
    if fused:
        first["fused_resident"] = lambda: ours_resident(q, view, causal, args.threads, FUSED)
        first["gemv"] = lambda: gemv(a, x, args.threads)  # beside the kernels, in the same rounds
        row.gemv_bytes = float(a.nbytes)
        n_roof = min(n_k, ROOF_KEYS)
        roof_view, roof_k, roof_v = in_cache_kv(n_roof, h_kv, d, d, dt)
        first["roof_resident"] = lambda: ours_resident(q, roof_view, causal, args.threads, FUSED)
        first["roof_inline"] = lambda: ours_inline(q, roof_k, roof_v, causal, args.threads, FUSED)
        row.roof_bytes = float(2 * n_roof * h_kv * d * dt.itemsize)
    if n_q > 1:  # prefill: the fused kernel on the resident layout (workers.fused.choose)
        first["fused_resident"] = lambda: ours_resident(q, view, causal, args.threads, FUSED)
    if torch is not None:
        v_sdpa = torch.from_numpy(view.v)[None]  # [1, h_kv, n_k, d], each head contiguous
        first["sdpa"] = lambda: sdpa(torch, q, k_sdpa, v_sdpa, causal)

    def contract() -> dict[str, Callable[[], Any]]:
        k, v = contract_kv(n_k, h_kv, d, d, seed, dt)
        fns: dict[str, Callable[[], Any]] = {"inline": lambda: ours_inline(q, k, v, causal, args.threads)}
        if fused:
            fns["fused_inline"] = lambda: ours_inline(q, k, v, causal, args.threads, FUSED)
            if not together:  # the second phase's own minutes: its GEMV beside it too
                fns["gemv_inline"] = lambda: gemv(a, x, args.threads)
        if dt == np.float32:
            fns["naive"] = lambda: naive_numpy(q, k, v, causal, args.threads)
        return fns

    if together:
        cells, outs = measure({**first, **contract()}, args.repeat)
    else:
        cells, outs = measure(first, args.repeat)
        first.clear()
        del view, k_sdpa
        v_sdpa = None
        gc.collect()
        more_cells, more_outs = measure(contract(), args.repeat)
        cells.update(more_cells)
        outs.update(more_outs)
    row.cells = cells
    ref = outs["resident"][0]
    for name, label in (("sdpa", "SDPA"), ("inline", "inline kernel"), ("naive", "naive NumPy"),
                        ("fused_resident", "fused kernel, resident"), ("fused_inline", "fused kernel, inline")):
        if name in outs:
            row.max_diff = max(row.max_diff, check_agree(label, outs[name][0], ref))
    row.two_phases = not together
    return row


def run_decode(n_k: int, args: argparse.Namespace, torch: Any, dtype: str = "float32") -> Row:
    kv_bytes = 2 * n_k * HEADS["h_kv"] * HEADS["d"] * dtype_of(dtype).itemsize
    row = Row(label=f"{n_k // 1024}K" if n_k < 2**20 else f"{n_k / 2**20:g}M", work=float(kv_bytes), dtype=dtype)
    return run_case(row, 1, n_k, False, args, torch, fused=True)


def run_prefill(causal: bool, args: argparse.Namespace, torch: Any) -> Row:
    n_q, n_k = args.prefill["n_q"], args.prefill["n_k"]
    row = Row(label=f"{n_q} x {n_k // 1024}K" + (" causal" if causal else ""),
              work=4.0 * n_q * HEADS["h_q"] * n_k * HEADS["d"])
    return run_case(row, n_q, n_k, causal, args, torch)


# ------------------------------------------------------------------ report


def machine(torch: Any) -> list[str]:
    """Lines describing the machine and the libraries."""
    blas = "unknown (threadpoolctl not installed)"
    with contextlib.suppress(ImportError):
        from threadpoolctl import threadpool_info

        libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        blas = ", ".join(f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture')})" for i in libs) or blas
    coretype = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
    return [
        f"- CPU: {cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}",
        f"- numpy {np.__version__}, BLAS: {blas}; OPENBLAS_CORETYPE/L2_SIZE: {coretype or 'not set'}",
        f"- torch: {torch.__version__ if torch is not None else 'not installed or skipped: no SDPA column'}",
        instruction_sets(),
    ]


def decode_flop_per_byte(dtype: str, n_q: int = 1) -> float:
    """Flops of a decode call per byte of K+V it reads: ``2 n_q g / itemsize``.

    Each key of a kv head costs ``g n_q d`` multiply-adds for the scores and
    ``g n_q d_v`` for ``p @ v`` (``g = h_q / h_kv``; 2 flops each) and is read
    once, ``(d + d_v) itemsize`` bytes: float32 decode at g = 4 is 2 flop per
    byte, 16-bit 4 (twice the work per byte read).
    """
    g = HEADS["h_q"] // HEADS["h_kv"]
    return 2.0 * n_q * g / dtype_of(dtype).itemsize


def decode_roof(gemv_gbs: float, in_cache_gbs: float) -> tuple[float, str]:
    """``(roof_gbs, bound)``: the rate a decode kernel can reach at best, the lower of what memory
    streams (the GEMV's read rate) and what the kernel's own arithmetic allows (its rate on the
    same shape in cache), and which of the two it is ("memory" or "compute")."""
    return (gemv_gbs, "memory") if gemv_gbs <= in_cache_gbs else (in_cache_gbs, "compute")


def instruction_sets() -> str:
    """What the host offers and what the fused kernel is compiled for: numba's target CPU, the
    vector features LLVM may use there, and the width of the kernel's own vectors."""
    import llvmlite.binding as llvm

    from workers.fused_simd import LANES, WIDE

    features = llvm.get_host_cpu_features()
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bf16", "avx512fp16", "amx-bf16")
    used = " ".join(f for f in wanted if features.get(f, False)) or "none of " + " ".join(wanted)
    return (f"- fused kernel: numba for `{llvm.get_host_cpu_name()}` (LLVM may use: {used}); its register "
            f"tiles are {WIDE} float32 lanes ({32 * WIDE}-bit vectors) in the resident scores and in p @ v, "
            f"{LANES} in the inline scores; 16-bit keys widened to float32")


def table_row(head: list[str], row: Row, limit: float) -> str:
    """``head`` cells, then rates of the five implementations, ratios to SDPA and to ``limit``, the diff."""
    c = row.cells
    ours = ("resident", "fused_resident", "inline")
    share = [f"{row.work / c[n].median / 1e9 / limit:.0%}" if n in c else "-" for n in ours]
    cells = [*head, *(rate(row.work, c.get(n)) for n in IMPLS),
             *(ratio(c.get(n), c.get("sdpa")) for n in ours), *share, f"{row.max_diff:.1e}"]
    return "| " + " | ".join(cells) + " |"


def decode_row(row: Row, run_gemv_gbs: float) -> str:
    """A decode row: rates of every implementation, the GEMV and the in-cache roofs beside them, the fused
    kernel against SDPA, each kernel against that GEMV (the run's first, ``run_gemv_gbs``, when none was
    timed beside), and the fused kernels against their roof (:func:`decode_roof` of that GEMV and the
    layout's in-cache rate). When the layouts were timed in two phases, the inline kernels are compared
    with the second phase's GEMV."""
    c = row.cells
    beside = row.gemv_gbs() or run_gemv_gbs
    second = row.gemv_bytes / c["gemv_inline"].median / 1e9 if "gemv_inline" in c else beside
    limit = {"resident": beside, "fused_resident": beside, "inline": second, "fused_inline": second}
    share = [f"{row.work / c[n].median / 1e9 / limit[n]:.0%}" if n in c else "-"
             for n in ("resident", "inline", "fused_resident", "fused_inline")]
    for layout in ("resident", "inline"):
        name, in_cache = f"fused_{layout}", row.roof_gbs(layout)
        if name in c and in_cache is not None:
            roof, bound = decode_roof(limit[name], in_cache)
            share.append(f"{row.work / c[name].median / 1e9 / roof:.0%} ({bound})")
        else:
            share.append("-")
    cells = [row.label + " *" * row.two_phases, f"{row.work / GIB:.2f} GiB",
             *(rate(row.work, c.get(n)) for n in DECODE_IMPLS), rate(row.gemv_bytes, c.get("gemv")),
             rate(row.roof_bytes, c.get("roof_resident")), rate(row.roof_bytes, c.get("roof_inline")),
             ratio(c.get("fused_resident"), c.get("sdpa")), ratio(c.get("fused_inline"), c.get("sdpa")), *share,
             f"{row.max_diff:.1e}"]
    return "| " + " | ".join(cells) + " |"


def report(args: argparse.Namespace, argv: list[str], limits: dict[str, tuple[float, Cell]],
           decode: list[Row], prefill: list[Row], torch: Any) -> str:
    t = args.threads
    gemv_work, gemv = limits["gemv"]
    sgemm_work, sgemm = limits["sgemm"]
    gemv_gbs = gemv_work / gemv.median / 1e9
    sgemm_gfs = sgemm_work / sgemm.median / 1e9
    lines = [
        f"Date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"Command: `{' '.join(['python', 'benchmarks/kernel.py', *argv])}`",
        "",
        *machine(torch),
        (f"- threads: {t} for everyone (splitkey: {t} worker threads, BLAS at 1 each; naive NumPy and the limits: "
         f"BLAS at {t}; SDPA: torch.set_num_threads({t})); {args.repeat} interleaved rounds, each timed call "
         f"right after a {SETTLE_S:g} s pause and an untimed call"),
        "",
        "Cells: median (min-max over the runs).",
        "",
        "### Limits measured in the same run",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| float32 GEMV read, {t} BLAS threads (GB/s) | {rate(gemv_work, gemv)} |",
        f"| float32 GEMV read, 1 BLAS thread (GB/s) | {rate(*limits['gemv1'])} |",
        f"| sgemm {t} BLAS threads (GFLOP/s) | {rate(sgemm_work, sgemm)} |",
        "",
        ("Decode's roof: the lower of the GEMV beside each case (what memory streams) and the fused kernel's "
         "**in-cache** rate on the same shape and layout (what its own arithmetic allows: keys and values whose "
         f"memory repeats every quarter of this host's {l2_bytes() // 1024} KiB L2, at most {ROOF_KEYS // 1024}K keys, "
         "timed in the same rounds). \"/ roof\" says which of the two binds."),
        "",
        "### Decode: n_q=1, h_q={h_q}, h_kv={h_kv}, d={d} (GB/s of K+V in their own dtype)".format(**HEADS),
        "",
        ("\"resident\"/\"inline\": the NumPy kernel on the resident layout and on the contract layout; "
         "\"fused\": the same calls with `cpu_kernels=\"fused\"`. Naive NumPy and SDPA: float32 only. "
         f"\"GEMV beside\": float32 GEMV over {gemv_operands(args.quick)[0].nbytes / 2**20:.0f} MiB at {t} BLAS "
         "threads, timed in the case's own interleaved rounds; every \"/ GEMV\" share is taken against it. "
         "\"in-cache\": the fused kernel over operands that stay in cache (the roof above); \"/ roof\": the "
         "fused kernel against the lower of the GEMV beside and its layout's in-cache rate."),
    ]
    for dtype in args.dtypes:
        lines += [
            "",
            f"#### K and V {dtype}",
            "",
            ("| n_k | K+V | resident | inline | fused resident | fused inline | naive NumPy | SDPA | GEMV beside "
             "| in-cache resident | in-cache inline "
             "| fused resident / SDPA | fused inline / SDPA | resident / GEMV | inline / GEMV "
             "| fused resident / GEMV | fused inline / GEMV | fused resident / roof | fused inline / roof "
             "| max abs diff |"),
            "| --- " * 20 + "|",
        ]
        for row in decode:
            if row.dtype != dtype:
                continue
            if row.skipped:
                lines.append("| " + " | ".join([row.label, f"{row.work / GIB:.2f} GiB", row.skipped] + ["-"] * 17)
                             + " |")
            else:
                lines.append(decode_row(row, gemv_gbs))
    n_q, n_k = args.prefill["n_q"], args.prefill["n_k"]
    lines += [
        "",
        f"### Prefill: n_q={n_q}, n_k={n_k}, same heads, float32 (GFLOP/s, 4 n_q h_q n_k d)",
        "",
        ("| case | splitkey resident | fused resident | splitkey inline | naive NumPy | SDPA | resident / SDPA "
         "| fused resident / SDPA | inline / SDPA | resident / sgemm | fused resident / sgemm | inline / sgemm "
         "| max abs diff |"),
        "| --- " * 13 + "|",
    ]
    for row in prefill:
        lines.append(table_row([row.label + " *" * row.two_phases], row, sgemm_gfs))
    lines += [
        "",
        ("max abs diff: largest |out - out of the resident kernel| over the other implementations "
         f"(the run stops above {AGREE_RTOL:g} x max |out|). Implementations are timed in interleaved rounds; "
         "a size marked * did not fit in memory with all layouts at once: resident and SDPA were timed side "
         "by side, then freed, then inline and naive NumPy on the same keys generated again."),
    ]
    return "\n".join(lines) + "\n"


def row_json(row: Row, **extra: Any) -> dict[str, Any]:
    """One case's raw timings (seconds per implementation) and the resident kernel's median."""
    resident = row.cells.get("resident")
    return {"label": row.label, "work": row.work, **extra, "skipped": row.skipped, "two_phases": row.two_phases,
            "max_diff": row.max_diff, "gemv_bytes": row.gemv_bytes, "roof_bytes": row.roof_bytes,
            "seconds": {name: cell.seconds for name, cell in row.cells.items()},
            "resident_s": resident.median if resident is not None else None}


def to_json(args: argparse.Namespace, argv: list[str], limits: dict[str, tuple[float, Cell]], decode: list[Row],
            prefill: list[Row], torch: Any) -> dict[str, Any]:
    """Everything the report shows, raw: ``kv_bytes`` of each decode case, ``flops`` of each prefill case."""
    return {"benchmark": "kernel", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(["benchmarks/kernel.py", *argv]), "machine": machine(torch), "threads": args.threads,
            "repeat": args.repeat,
            "limits": {name: {"work": work, "seconds": cell.seconds} for name, (work, cell) in limits.items()},
            "decode": [row_json(r, n_k=n_k, kv_bytes=r.work) for n_k, r in zip(args.sizes, decode)],
            "prefill": [row_json(r, n_q=args.prefill["n_q"], n_k=args.prefill["n_k"], flops=r.work) for r in prefill]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch = load_torch(not args.no_torch, args.threads)
    t0 = time.perf_counter()
    limits = run_limits(args.threads, args.repeat, args.quick)
    decode = []
    for dtype in args.dtypes:
        for n_k in args.sizes:
            decode.append(run_decode(n_k, args, torch, dtype))
            print(f"decode {dtype} {decode[-1].label} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    prefill = [run_prefill(False, args, torch)]
    if args.causal:
        prefill.append(run_prefill(True, args, torch))
    text = report(args, argv, limits, decode, prefill, torch)
    text += f"\nTotal run time: {time.perf_counter() - t0:.0f} s.\n"
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(to_json(args, argv, limits, decode, prefill, torch), indent=1))
    emit_report(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
