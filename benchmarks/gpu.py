"""GPU benchmark of one shard: decode bandwidth and prefill throughput, against a device copy and torch SDPA.

Run through ``bash benchmarks/gpu.sh [OUT_DIR]`` on a CUDA machine with CuPy and
PyTorch (see docs/GPU.md); or ``python benchmarks/gpu.py --out DIR``. Cases:

* decode: ``n_q = 1, h_q = 32, h_kv = 8, d = 128``, ``n_k`` in 128K, 1M, 4M keys,
  bfloat16 and float16. Effective bandwidth = K+V bytes / time, next to the
  device-to-device copy bandwidth measured in the same run (bytes read + written
  / time) and to torch SDPA (flash backend, ``enable_gqa``) on the same arrays;
* prefill: ``n_q = 2048`` over 32K keys, same heads, against SDPA (TFLOP/s).

Paths: ``generic`` and ``fused`` (workers.gpu.backend), ``sdpa``. Each time is the median
of several CUDA-event-timed runs after warm-up (which includes compiling). Each
result also carries the largest difference of ``out`` from SDPA's, since the
fused kernels are not yet verified elsewhere. Results are written after every
case to ``OUT/gpu_bench.json`` and ``OUT/gpu_bench.md``, so a run cut short keeps
what it measured.

Argument parsing and the report are plain Python: this module imports without
cupy or torch (tests/unit/test_workers_gpu_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEADS = {"h_q": 32, "h_kv": 8, "d": 128}
DECODE_KEYS = (128 * 1024, 1024 * 1024, 4 * 1024 * 1024)
PREFILL = {"n_q": 2048, "n_k": 32 * 1024}
DTYPES = ("bfloat16", "float16")
PATHS = ("fused", "sdpa", "generic")
COPY_BYTES = 2 * 1024**3


@dataclass
class Result:
    case: str  # "decode" or "prefill"
    dtype: str
    path: str
    n_q: int
    n_k: int
    ms_median: float | None = None
    ms_runs: list[float] = field(default_factory=list)
    gb_per_s: float | None = None  # K+V bytes / time
    tflop_per_s: float | None = None  # 4 n_q h_q n_k d / time
    of_copy: float | None = None  # gb_per_s / device copy bandwidth
    of_sdpa: float | None = None  # sdpa time / this time (> 1: faster than SDPA)
    max_abs_diff_vs_sdpa: float | None = None
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-bench", help="folder for the results (default $OUT)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per case at most (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (the first compiles)")
    p.add_argument("--case-seconds", type=float, default=3.0, help="stop timing a path after this much")
    p.add_argument("--budget-seconds", type=float, default=110.0, help="skip the remaining cases after this much")
    p.add_argument("--decode-keys", type=int, nargs="+", default=list(DECODE_KEYS))
    p.add_argument("--prefill-keys", type=int, default=PREFILL["n_k"])
    p.add_argument("--prefill-queries", type=int, default=PREFILL["n_q"])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"repeats must be >= 1 and warmup >= 0, got {args.repeats} and {args.warmup}")
    return args


def kv_bytes(n_k: int, itemsize: int = 2) -> int:
    return 2 * n_k * HEADS["h_kv"] * HEADS["d"] * itemsize


def flops(n_q: int, n_k: int) -> int:
    return 4 * n_q * HEADS["h_q"] * n_k * HEADS["d"]


def summarize(r: Result, copy_gb_per_s: float | None, sdpa_ms: float | None) -> Result:
    """Fill the derived numbers of ``r`` from its runs."""
    if not r.ms_runs:
        return r
    r.ms_median = statistics.median(r.ms_runs)
    seconds = r.ms_median / 1e3
    r.gb_per_s = kv_bytes(r.n_k) / seconds / 1e9
    r.tflop_per_s = flops(r.n_q, r.n_k) / seconds / 1e12
    if copy_gb_per_s:
        r.of_copy = r.gb_per_s / copy_gb_per_s
    if sdpa_ms:
        r.of_sdpa = sdpa_ms / r.ms_median
    return r


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_markdown(env: dict[str, Any], copy_gb_per_s: float | None, results: list[Result]) -> str:
    lines = ["# GPU benchmark (benchmarks/gpu.py)", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- device-to-device copy: {_num(copy_gb_per_s, '.0f')} GB/s (bytes read + written / time)", ""]
    lines += ["| case | dtype | n_q | n_k | path | median ms | GB/s (K+V) | of copy | TFLOP/s | SDPA time / this "
              "| max abs diff vs SDPA | error |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r.case} | {r.dtype} | {r.n_q} | {r.n_k} | {r.path} | {_num(r.ms_median, '.3f')} "
                     f"| {_num(r.gb_per_s, '.0f')} | {_num(r.of_copy, '.2f')} | {_num(r.tflop_per_s, '.1f')} "
                     f"| {_num(r.of_sdpa, '.2f')} | {_num(r.max_abs_diff_vs_sdpa, '.2e')} | {r.error or ''} |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, env: dict[str, Any], copy_gb_per_s: float | None, results: list[Result]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"env": env, "copy_gb_per_s": copy_gb_per_s, "results": [asdict(r) for r in results]}
    (out / "gpu_bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "gpu_bench.md").write_text(format_markdown(env, copy_gb_per_s, results))


# ---------------------------------------------------------------- on the GPU


def time_ms(fn: Any, event: Any, elapsed: Any, repeats: int, warmup: int, seconds: float) -> list[float]:
    """CUDA-event times of ``fn()``: ``warmup`` untimed calls, then up to ``repeats`` (within ``seconds``)."""
    for _ in range(warmup):
        fn()
    runs: list[float] = []
    t0 = time.monotonic()
    while len(runs) < repeats and (not runs or time.monotonic() - t0 < seconds):
        start, stop = event(), event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        runs.append(float(elapsed(start, stop)))
    return runs


def measure_copy(cp: Any, args: argparse.Namespace) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (GB/s)."""
    src = cp.ones(COPY_BYTES // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    runs = time_ms(lambda: dst.data.copy_from_device_async(src.data, COPY_BYTES), cp.cuda.Event,
                   cp.cuda.get_elapsed_time, args.repeats, args.warmup, args.case_seconds)
    return 2 * COPY_BYTES / (statistics.median(runs) / 1e3) / 1e9


def random_16bit(cp: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """Normal random numbers as bfloat16 bits (uint16) or float16, filled in slices to bound the scratch."""
    out = cp.empty(shape, dtype=cp.uint16 if dtype == "bfloat16" else cp.float16)
    step = max(1, (1 << 26) // max(1, out[0].size))
    for a in range(0, shape[0], step):
        x = cp.random.standard_normal((min(step, shape[0] - a), *shape[1:]), dtype=cp.float32)
        out[a:a + step] = (x.view(cp.uint32) >> 16).astype(cp.uint16) if dtype == "bfloat16" else x.astype(cp.float16)
    return out


def run_case(case: str, dtype: str, n_q: int, n_k: int, args: argparse.Namespace, ctx: dict[str, Any],
             copy_gb_per_s: float | None) -> list[Result]:
    """Every path on one set of inputs; SDPA first, as the reference for time and output."""
    cp, torch, gpu, bf16 = ctx["cp"], ctx["torch"], ctx["gpu"], ctx["bf16"]
    from merge import finalize
    from workers.layout import NaturalKV
    from workers.options import AttentionOptions, GpuKernels, KernelOptions
    from workers.problem import check_problem

    h_q, h_kv, d = HEADS["h_q"], HEADS["h_kv"], HEADS["d"]
    raw = [random_16bit(cp, shape, dtype) for shape in ((n_q, h_q, d), (n_k, h_kv, d), (n_k, h_kv, d))]
    q, k, v = (x.view(bf16) for x in raw) if dtype == "bfloat16" else raw
    problem = check_problem(q, k, v, None, None, AttentionOptions())
    cp.cuda.Device().synchronize()  # inputs ready before torch's events start timing
    if torch is not None:
        tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float16
        tq, tk, tv = (torch.from_dlpack(x).view(tdtype).permute(1, 0, 2).unsqueeze(0) for x in raw)  # [1, h, n, d]
    outs: dict[str, Any] = {}

    def sdpa() -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            outs["sdpa"] = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

    def ours(kernels: Any) -> Any:
        def fn() -> None:
            outs[kernels.value] = gpu.run_gpu(q, NaturalKV(k, v, problem.k_pos), problem, KernelOptions(gpu_kernels=kernels))
        return fn

    results, sdpa_ms = [], None
    for path in sorted(args.paths, key=lambda p: p != "sdpa"):
        r = Result(case=case, dtype=dtype, path=path, n_q=n_q, n_k=n_k)
        try:
            if path == "sdpa":
                r.ms_runs = time_ms(sdpa, lambda: torch.cuda.Event(enable_timing=True),
                                    lambda a, b: a.elapsed_time(b), args.repeats, args.warmup, args.case_seconds)
                sdpa_ms = statistics.median(r.ms_runs)
            else:
                kernels = GpuKernels(path)
                r.ms_runs = time_ms(ours(kernels), cp.cuda.Event, cp.cuda.get_elapsed_time, args.repeats,
                                    args.warmup, args.case_seconds)
                if "sdpa" in outs:
                    out, _ = finalize(outs.pop(path))  # [n_q, h_q, d]
                    ref = cp.asarray(outs["sdpa"][0].permute(1, 0, 2).float().contiguous())  # [n_q, h_q, d]
                    r.max_abs_diff_vs_sdpa = float(cp.max(cp.abs(out - ref)))
        except Exception as exc:  # noqa: BLE001 - record and go on: one failing path must not end the run
            r.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(summarize(r, copy_gb_per_s, sdpa_ms if path != "sdpa" else None))
    return results


def environment(cp: Any, torch: Any) -> dict[str, Any]:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {"device": name, "multiprocessors": props["multiProcessorCount"], "cupy": cp.__version__,
            "torch": None if torch is None else torch.__version__, "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    sys.path.insert(0, str(ROOT))
    from workers import BFLOAT16  # after the sys.path entry above
    from workers.gpu import backend as gpu

    reason = gpu.unavailable_reason()
    if reason is not None:
        write_report(out, {"error": reason}, None, [])
        print(f"no GPU benchmark: {reason}", file=sys.stderr)
        return 2
    import cupy as cp  # the GPU part only

    try:
        import torch
    except ImportError as exc:
        print(f"torch unavailable ({exc}): no SDPA comparison", file=sys.stderr)
        torch, args.paths = None, [p for p in args.paths if p != "sdpa"]
    ctx = {"cp": cp, "torch": torch, "gpu": gpu, "bf16": BFLOAT16}
    t0 = time.monotonic()
    env = environment(cp, torch)
    copy_gb_per_s = measure_copy(cp, args)
    results: list[Result] = []
    write_report(out, env, copy_gb_per_s, results)
    cases = [("decode", dt, 1, n_k) for dt in args.dtypes for n_k in args.decode_keys]
    cases += [("prefill", dt, args.prefill_queries, args.prefill_keys) for dt in args.dtypes]
    for case, dtype, n_q, n_k in cases:
        if time.monotonic() - t0 > args.budget_seconds:
            results.append(Result(case=case, dtype=dtype, path="-", n_q=n_q, n_k=n_k,
                                  error=f"skipped: over the {args.budget_seconds:.0f} s budget"))
        else:
            results += run_case(case, dtype, n_q, n_k, args, ctx, copy_gb_per_s)
            cp.get_default_memory_pool().free_all_blocks()  # the next case's inputs may be 16 GB
        write_report(out, env, copy_gb_per_s, results)
    print(format_markdown(env, copy_gb_per_s, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
