"""Many decode queries on one long context (issue 9): one pass over the keys for all, per dtype, against the roof.

Run from the repository root (``pip install -e '.[bench]'``)::

    .venv/bin/python benchmarks/batching.py --out /tmp/batching.md
    .venv/bin/python benchmarks/batching.py --quick        # smoke run, small contexts

Decode queries ``q [1, 32, 128]`` over contexts of ``h_kv = 8, d = 128``:

1. **in-process** (no server running), per dtype (float32, bfloat16, float16): a
   resident context of ``--kernel-keys`` keys (default 256K), one thread and BLAS
   at one thread, what each shard worker has: one query alone (median of
   ``--repeat``), then batches of 4, 16 and 32 queries in one
   ``partial_attention_resident_many`` call, each state checked bitwise against
   the query alone. Measured beside them, the limits of the roof: the kernel's
   rate alone (B, GB/s of K+V), the rate of one request's score product with its
   keys in cache (C1, GFLOP/s: what a batched pass runs, one request's calls at a
   time) and of the same product stacked 64 rows high (C64: what BLAS reaches when
   rows share a call). A decode query does f = 2 flop per byte of float32 K+V, 4
   per byte of 16-bit; a batch of n gains at most min(n, C / (f B)). With
   ``--cpu-kernels fused`` the kernel is workers/fused.py and C1 / C64 are its own
   rates with 2K keys in cache (one query; 16 queries in one pass), QK and PV counted.
2. **service**, per dtype in ``--service-dtypes``: ``splitkey serve --workers 2``
   holding one context of ``--n-k`` keys (default 1M: 8 GiB in float32), created
   piece by piece with ``expected_length``; closed loops at concurrency
   ``--levels`` (default 1,2,4,8,16,32) of the same query, with batching (the
   default ``--batch-rows``) and then on a server started with ``--batch-rows 1``
   (each query alone). Requests/s, p50, p99 and the answers' bits: every answer
   must equal the first one bit for bit.

The host's roof (issue 48, point 5) is timed in the same run, one thread: sgemm (its arithmetic)
and a float32 GEMV (its memory); a pass of 16 queries can run no faster than its flops at the one
or its K+V at the other.

Targets: service requests/s at concurrency 16 >= 4 x concurrency 1 (float32);
float16 within 1.2 x bfloat16 (in-process and service p50 at concurrency 1); a 16-query pass
in-process >= 70% of the host's roof of it.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common
from service.client import Client
from service.client.loadtest import Level, run_level
from workers import DTYPES, StreamingKV, partial_attention_resident
from workers.api import partial_attention_resident_many
from workers.layout import bytes_per_key
from workers.options import AttentionOptions, KernelOptions

HEADS = {"h_q": 32, "h_kv": 8, "d": 128}
ALL_DTYPES = ("float32", "bfloat16", "float16")
BATCHES = (4, 16, 32)
LEVELS = (1, 2, 4, 8, 16, 32)
PIECE = 65536  # keys generated and appended at a time
SEED = 20261201
SPEEDUP_TARGET, F16_TARGET = 4.0, 1.2
#: A 16-query pass against the lower of the host's sgemm and GEMV roofs for it (issue 48, point 5).
PASS_TARGET = 0.70


def flop_per_byte(dtype: str) -> float:
    """Of one decode query over K+V: 4 h_q d flop per key over 2 h_kv d itemsize bytes (NOTES: 2 or 4)."""
    return 4 * HEADS["h_q"] / (2 * HEADS["h_kv"] * DTYPES[dtype].itemsize)


def query_flops(n_k: int) -> float:
    """Of one decode query over ``n_k`` keys: QK and PV, 4 h_q n_k d."""
    return 4.0 * HEADS["h_q"] * n_k * HEADS["d"]


def kv_bytes(n_k: int, dtype: str) -> int:
    return 2 * n_k * HEADS["h_kv"] * HEADS["d"] * DTYPES[dtype].itemsize


def pieces(n_k: int, dtype: str, seed: int) -> Any:
    """``(a, b, k, v)`` for keys ``[a, b)``: the same values for the same seed, generated a piece at a time."""
    rng = np.random.default_rng(seed + n_k)
    shape = (HEADS["h_kv"], HEADS["d"])
    for a in range(0, n_k, PIECE):
        b = min(a + PIECE, n_k)
        k = rng.standard_normal((b - a, *shape), dtype=np.float32).astype(DTYPES[dtype])
        v = rng.standard_normal((b - a, *shape), dtype=np.float32).astype(DTYPES[dtype])
        yield a, b, k, v


def queries(count: int, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, HEADS["h_q"], HEADS["d"]), dtype=np.float32).astype(DTYPES[dtype])
            for _ in range(count)]


# ------------------------------------------------------------------ in-process


@dataclass
class KernelResult:
    dtype: str
    alone_s: float = float("nan")
    batch_s: dict[int, float] = field(default_factory=dict)
    bitwise: bool = True
    c1_gflops: float = float("nan")  # one request's score product from cache
    c64_gflops: float = float("nan")  # the same stacked 64 rows high

    def speedup(self, n: int) -> float:
        return n * self.alone_s / self.batch_s[n]

    def roof(self, n: int, gflops: float, n_k: int) -> float:
        b = kv_bytes(n_k, self.dtype) / self.alone_s / 1e9
        return min(n, gflops / (flop_per_byte(self.dtype) * b))

    def pass_gflops(self, n: int, n_k: int) -> float:
        """GFLOP/s of the pass of ``n`` queries (QK and PV, 4 h_q n_k d a query)."""
        return n * query_flops(n_k) / self.batch_s[n] / 1e9


@dataclass
class HostRoof:
    """What one thread of this host can do, timed in the same run (issue 48, point 5): sgemm of
    1024 x 1024 float32 (the arithmetic) and a float32 GEMV over 256 MiB (the memory), BLAS at one thread."""
    sgemm_gflops: float
    gemv_gbs: float

    def of_pass(self, n: int, n_k: int, dtype: str) -> tuple[float, str]:
        """The fastest a pass of ``n`` queries could run, GFLOP/s: its flops at sgemm's rate or its K+V
        at the GEMV's, whichever takes longer; and which binds."""
        compute_s = n * query_flops(n_k) / (self.sgemm_gflops * 1e9)
        memory_s = kv_bytes(n_k, dtype) / (self.gemv_gbs * 1e9)
        return n * query_flops(n_k) / max(compute_s, memory_s) / 1e9, "compute" if compute_s >= memory_s else "memory"


def host_roof(repeat: int, quick: bool) -> HostRoof:
    """:class:`HostRoof`, medians of ``repeat`` timed calls."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((1024, 1024), dtype=np.float32)
    g = rng.standard_normal((2048 if quick else 16384, 4096), dtype=np.float32)  # 32 or 256 MiB
    x = rng.standard_normal(4096, dtype=np.float32)
    with common.blas_threads(1):
        sgemm_s = median_time(lambda: a @ a, repeat)
        gemv_s = median_time(lambda: g @ x, repeat)
    return HostRoof(2 * 1024 ** 3 / sgemm_s / 1e9, g.nbytes / gemv_s / 1e9)


def median_time(fn: Callable[[], Any], repeat: int) -> float:
    seconds, _ = common.time_calls(fn, repeat)
    return statistics.median(seconds)


def product_rates(dtype: str, repeat: int) -> tuple[float, float]:
    """GFLOP/s of ``[h_kv, rows, d] @ [h_kv, d, 1024]`` float32 from cache, rows = 4 (one request) and 64."""
    rng = np.random.default_rng(1)
    kt = rng.standard_normal((HEADS["h_kv"], HEADS["d"], 1024), dtype=np.float32)
    rates = []
    for rows in (HEADS["h_q"] // HEADS["h_kv"], 64):
        q = rng.standard_normal((HEADS["h_kv"], rows, HEADS["d"]), dtype=np.float32)
        out = np.empty((HEADS["h_kv"], rows, 1024), np.float32)
        calls = 50
        t = median_time(lambda: [np.matmul(q, kt, out=out) for _ in range(calls)], repeat)  # noqa: B023
        rates.append(calls * 2 * HEADS["h_kv"] * rows * HEADS["d"] * 1024 / t / 1e9)
    return rates[0], rates[1]


def fused_rates(dtype: str, repeat: int, seed: int) -> tuple[float, float]:
    """GFLOP/s (QK and PV, 4 h_q n_k d a query) of the fused kernel with its keys in cache (2K keys):
    one query (4 rows a kv head), and 16 in one pass (64 rows): its compute roof."""
    n_k = 2048
    kv = StreamingKV(HEADS["h_kv"], HEADS["d"], HEADS["d"], DTYPES[dtype], capacity=n_k)
    for a, b, k, v in pieces(n_k, dtype, seed):
        kv.append(k, v, np.arange(a, b))
    view = kv.snapshot()
    kernel = KernelOptions(threads=1, cpu_kernels="fused")
    qs = [(q, np.array([n_k]), AttentionOptions()) for q in queries(16, dtype, seed)]
    flops = 4.0 * HEADS["h_q"] * n_k * HEADS["d"]
    calls = 20
    t1 = median_time(lambda: [partial_attention_resident(qs[0][0], view, q_pos=qs[0][1], options=qs[0][2],
                                                         kernel=kernel) for _ in range(calls)], repeat)
    t16 = median_time(lambda: [partial_attention_resident_many(qs, view, kernel=kernel) for _ in range(calls)], repeat)
    return calls * flops / t1 / 1e9, calls * 16 * flops / t16 / 1e9


def measure_kernel(dtype: str, n_k: int, repeat: int, seed: int, cpu_kernels: str = "numpy") -> KernelResult:
    res = KernelResult(dtype)
    kv = StreamingKV(HEADS["h_kv"], HEADS["d"], HEADS["d"], DTYPES[dtype], capacity=n_k)
    for a, b, k, v in pieces(n_k, dtype, seed):
        kv.append(k, v, np.arange(a, b))
    view = kv.snapshot()
    kernel = KernelOptions(threads=1, cpu_kernels=cpu_kernels)
    qs = [(q, np.array([n_k]), AttentionOptions()) for q in queries(max(BATCHES), dtype, seed)]
    with common.blas_threads(1):
        alone = [partial_attention_resident(q, view, q_pos=p, options=o, kernel=kernel) for q, p, o in qs]
        res.alone_s = median_time(lambda: partial_attention_resident(qs[0][0], view, q_pos=qs[0][1],
                                                                     options=qs[0][2], kernel=kernel), repeat)
        for n in BATCHES:
            states = partial_attention_resident_many(qs[:n], view, kernel=kernel)
            res.bitwise &= all(s.acc.tobytes() == a.acc.tobytes() and s.m.tobytes() == a.m.tobytes()
                               and s.l.tobytes() == a.l.tobytes() for s, a in zip(states, alone))
            res.batch_s[n] = median_time(lambda: partial_attention_resident_many(qs[:n], view, kernel=kernel),  # noqa: B023
                                         max(2, repeat // 3))
        if cpu_kernels == "fused":
            res.c1_gflops, res.c64_gflops = fused_rates(dtype, max(3, repeat // 2), seed)
        else:
            res.c1_gflops, res.c64_gflops = product_rates(dtype, max(3, repeat // 2))
    return res


# ------------------------------------------------------------------ service


@dataclass
class ServiceResult:
    dtype: str
    batching: bool
    levels: list[Level] = field(default_factory=list)
    mismatches: int = 0


def upload(c: Client, n_k: int, dtype: str, seed: int) -> str:
    ctx_id = ""
    for a, b, k, v in pieces(n_k, dtype, seed):
        if a == 0:
            ctx_id = c.create_context(k, v, expected_length=n_k)["id"]
        else:
            c.append(ctx_id, k, v)
    return ctx_id


def measure_service(dtype: str, batching: bool, args: argparse.Namespace, workdir: Path) -> ServiceResult:
    res = ServiceResult(dtype, batching)
    per_worker = bytes_per_key(HEADS["h_kv"], HEADS["d"], HEADS["d"], DTYPES[dtype]) * (args.n_k // 2 + 1)
    env = {"SPLITKEY_WORKER_MEMORY_BYTES": str(int(per_worker * 1.05) + 256 * common.MIB)}
    extra = [] if batching else ["--batch-rows", "1"]
    q = queries(1, dtype, args.seed)[0]
    with common.splitkey_server(workdir, workers=2, args=extra, env=env) as url, Client(url) as admin:
        ctx_id = upload(admin, args.n_k, dtype, args.seed)
        first = admin.attention(q, contexts=[ctx_id])
        lock = threading.Lock()

        def request(c: Client) -> None:
            out, lse = c.attention(q, contexts=[ctx_id])
            if out.tobytes() != first[0].tobytes() or lse.tobytes() != first[1].tobytes():
                with lock:
                    res.mismatches += 1

        for level in args.levels:
            res.levels.append(run_level(lambda: Client(url, retries=0), request, level, max(4 * level, args.repeat),
                                        args.level_seconds))
        admin.delete_context(ctx_id)
    return res


# ------------------------------------------------------------------ report


def kernel_table(results: list[KernelResult], n_k: int, host: HostRoof) -> str:
    rows = []
    for r in results:
        b = kv_bytes(n_k, r.dtype) / r.alone_s / 1e9
        cells = [r.dtype, common.ms(r.alone_s), f"{b:.1f}"]
        cells += [f"{r.speedup(n):.2f}x" for n in BATCHES]
        roofs = f"{r.roof(16, r.c1_gflops, n_k):.1f}x / {r.roof(16, r.c64_gflops, n_k):.1f}x"
        cells += [f"{r.c1_gflops:.0f} / {r.c64_gflops:.0f}", roofs]
        roof, binds = host.of_pass(16, n_k, r.dtype)
        at16 = r.pass_gflops(16, n_k)
        cells += [f"{at16:.1f}", f"{roof:.1f} ({binds})", f"{at16 / roof:.0%}", "yes" if r.bitwise else "**no**"]
        rows.append(cells)
    return common.markdown_table(["dtype", "alone ms", "B GB/s", *(f"x{n}" for n in BATCHES),
                                  "C1 / C64 GFLOP/s", "roof at 16: C1 / C64", "x16 pass GFLOP/s",
                                  "host roof of that pass", "x16 / host roof", "bitwise"], rows)


def service_table(results: list[ServiceResult]) -> str:
    rows = []
    for r in results:
        base = r.levels[0].per_second if r.levels else float("nan")
        for lv in r.levels:
            rows.append([r.dtype, "on" if r.batching else "off", lv.concurrency, lv.requests, lv.errors,
                         f"{lv.per_second:.2f}", f"{lv.per_second / base:.2f}x", common.ms(lv.p50_ms / 1000),
                         common.ms(lv.p99_ms / 1000), r.mismatches])
    return common.markdown_table(["dtype", "batching", "concurrency", "requests", "errors", "req/s", "vs c1",
                                  "p50 ms", "p99 ms", "answers not bitwise the first"], rows)


def targets(kernel: list[KernelResult], service: list[ServiceResult], host: HostRoof, n_k: int) -> list[str]:
    lines = []
    by = {(r.dtype, r.batching): r for r in service}
    f32 = by.get(("float32", True))
    if f32 and len(f32.levels) > 1:
        at16 = [lv for lv in f32.levels if lv.concurrency == 16]
        if at16:
            ratio = at16[0].per_second / f32.levels[0].per_second
            lines.append(f"- float32 service, req/s at concurrency 16 / concurrency 1: {ratio:.2f} "
                         f"(target {SPEEDUP_TARGET:g}: {common.met(ratio >= SPEEDUP_TARGET)})")
    k = {r.dtype: r for r in kernel}
    for r in kernel:
        if 16 in r.batch_s:
            share = r.pass_gflops(16, n_k) / host.of_pass(16, n_k, r.dtype)[0]
            lines.append(f"- {r.dtype} in-process, a 16-query pass / the host's roof of it: {share:.0%} "
                         f"(target >= {PASS_TARGET:.0%}: {common.met(share >= PASS_TARGET)})")
    if "float16" in k and "bfloat16" in k:
        ratio = k["float16"].alone_s / k["bfloat16"].alone_s
        lines.append(f"- float16 / bfloat16 in-process: {ratio:.2f} (target <= {F16_TARGET}: "
                     f"{common.met(ratio <= F16_TARGET)})")
    s16, sb = by.get(("float16", True)), by.get(("bfloat16", True))
    if s16 and sb and s16.levels and sb.levels:
        ratio = s16.levels[0].p50_ms / sb.levels[0].p50_ms
        lines.append(f"- float16 / bfloat16 service p50 at concurrency 1: {ratio:.2f} (target <= {F16_TARGET}: "
                     f"{common.met(ratio <= F16_TARGET)})")
    return lines


def report(args: argparse.Namespace, kernel: list[KernelResult], service: list[ServiceResult], host: HostRoof,
           notes: list[str]) -> str:
    command = " ".join([".venv/bin/python", "benchmarks/batching.py", *args.argv])
    return "\n".join([
        f"### Batched decode benchmark, {datetime.date.today().isoformat()}", "", f"Command: `{command}`", "",
        *common.machine_lines(), *notes, "",
        (f"In-process ({args.cpu_kernels} kernel), {common.size_label(args.kernel_keys)} keys, one thread "
         "(speed-up per query of a batch over "
         "the query alone; roof min(n, C / (f B)) with f = 2 flop/B for float32, 4 for 16-bit):"), "",
        kernel_table(kernel, args.kernel_keys, host), "",
        (f"The host's roof, one thread, timed in this run: sgemm {host.sgemm_gflops:.1f} GFLOP/s, float32 GEMV "
         f"{host.gemv_gbs:.1f} GB/s; a pass's roof is its flops at the one or its K+V at the other, whichever "
         "takes longer."), "",
        f"Service, {common.size_label(args.n_k)} keys, 2 workers (closed loops of the same query):", "",
        service_table(service), "", "Targets:", "", *targets(kernel, service, host, args.kernel_keys), ""])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small contexts, few requests: a smoke run")
    p.add_argument("--kernel-keys", type=common.parse_keys, default=[256 * common.KIB])
    p.add_argument("--n-k", type=common.parse_keys, default=[1024 * common.KIB], help="service context keys")
    p.add_argument("--kernel-dtypes", default=",".join(ALL_DTYPES))
    p.add_argument("--service-dtypes", default=",".join(ALL_DTYPES))
    p.add_argument("--levels", default=",".join(map(str, LEVELS)))
    p.add_argument("--level-seconds", type=float, default=20.0)
    p.add_argument("--repeat", type=common.positive, default=9)
    p.add_argument("--cpu-kernels", default="numpy", choices=("numpy", "fused"),
                   help="the in-process kernel (workers/fused.py for fused); the service part uses the default")
    p.add_argument("--no-wait", action="store_true", help="do not wait for benchmarks/kernel.py to finish")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.kernel_keys, args.n_k = args.kernel_keys[0], args.n_k[0]
    args.levels = [common.positive(x) for x in args.levels.split(",") if x.strip()]
    for name in ("kernel_dtypes", "service_dtypes"):
        dts = [x for x in getattr(args, name).split(",") if x]
        if any(d not in ALL_DTYPES for d in dts):
            p.error(f"--{name.replace('_', '-')} must list {', '.join(ALL_DTYPES)}, got {getattr(args, name)!r}")
        setattr(args, name, dts)
    if args.quick:
        args.kernel_keys, args.n_k, args.repeat, args.level_seconds = 16 * common.KIB, 32 * common.KIB, 3, 3.0
        args.levels = [1, 4]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    common.raise_on_sigterm()
    notes = [common.wait_for_quiet(not args.no_wait and not args.quick)]
    t0 = time.monotonic()
    host = host_roof(args.repeat, args.quick)
    kernel = [measure_kernel(dt, args.kernel_keys, args.repeat, args.seed, args.cpu_kernels)
              for dt in args.kernel_dtypes]
    service = []
    with tempfile.TemporaryDirectory(prefix="splitkey-batch-bench-") as tmp:
        for dt in args.service_dtypes:
            for batching in (True, False):
                service.append(measure_service(dt, batching, args, Path(tmp)))
    notes += [f"- load average after: {common.load_average()}", f"- whole run: {time.monotonic() - t0:.0f} s"]
    common.emit_report(report(args, kernel, service, host, notes), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
