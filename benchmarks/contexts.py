"""Decode over resident contexts (issue 4): the service against the in-process kernel on the same cores.

Run from the repository root (``pip install -e '.[bench]'``)::

    .venv/bin/python benchmarks/contexts.py --repeat 10 --out /tmp/contexts_bench.md
    .venv/bin/python benchmarks/contexts.py --quick         # smoke run, tiny contexts

For each context size (64K, 256K and 1M keys of ``h_kv=8, d=128``; float32,
8 KiB of K+V per key, so 1M keys = 8 GiB; a size whose float32 copy does not fit
in the memory available falls back to bfloat16, and the report says so):

1. **in-process, no server running**: the keys in the resident streaming layout
   (``StreamingKV`` filled chunk by chunk, as ``from_arrays`` does, then
   ``snapshot()``), ``partial_attention_resident(q, view, q_pos=[n_k - 1],
   options=AttentionOptions(), kernel=KernelOptions(threads=2))`` + ``merge.finalize``
   with BLAS at one thread; then ``workers.attention(q, k, v, threads=2)`` on the
   contract layout. Median of ``--repeat`` after a warm-up; only one copy of the
   keys exists at a time. The resident kernel runs again after step 2; the
   baseline is the lower of the two medians (this VM is shared: another
   tenant's load only slows a run down).
2. **service**: ``splitkey serve --workers 2`` started for this size, with
   ``SPLITKEY_CONTEXT_SHARD_KEYS = n_k / 2`` and a worker memory budget that fits
   half the context (growth included). The context is created from the first
   chunk (``shards=1``) and appended chunk by chunk (64K keys, 512 MiB, per
   request: a single body would exceed the 2 GiB body limit and hold the keys
   twice more in memory), which leaves two shards of n_k / 2 keys on the two
   workers: the layout a single create gives. Decode queries
   ``Client.attention(q, contexts=[id])`` (only ``q``, 16 KiB, travels): warm-up
   checked against the in-process answer, ``--repeat`` requests at concurrency 1
   (p50/p90, Server-Timing stages), then closed loops at concurrency 1, 4 and 16.
   The context is deleted and the server stopped before the next size.

Target: service p50 <= 1.25 x in-process (resident baseline) + 3 ms.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
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
from benchmarks.service import closed_loop
from merge import finalize
from service.client import Client
from service.client.loadtest import Level
from workers import DTYPES, StreamingKV, partial_attention_resident
from workers import attention as inprocess_attention
from workers.layout import bytes_per_key
from workers.options import AttentionOptions, KernelOptions

HEADS = {"h_q": 32, "h_kv": 8, "d": 128}
SIZES = (64 * common.KIB, 256 * common.KIB, 1024 * common.KIB)
QUICK_SIZES = (8 * common.KIB, 32 * common.KIB)
LEVELS = (1, 4, 16)
CHUNK = 64 * common.KIB  # keys per upload request and per generated chunk
SEED = 20261130
TARGET_RATIO, TARGET_PLUS_S = 1.25, 0.003
#: Bytes kept free beyond the estimated peak before choosing float32.
HEADROOM = 3 * common.GIB
#: The dtypes a context can be measured in (float32, or bfloat16 when float32 does not fit).
CHOICES = ("bfloat16", "float32")


# ------------------------------------------------------------------ pure helpers


def kv_bytes(n_k: int, dtype: str) -> int:
    """K+V bytes of a decode-shape context."""
    return 2 * n_k * HEADS["h_kv"] * HEADS["d"] * DTYPES[dtype].itemsize


def peak_bytes(n_k: int, dtype: str) -> int:
    """Estimated peak while the service holds the context: both shards, one growing (old + new), a chunk in flight."""
    half = kv_bytes(n_k, dtype) / 2
    return int(half + 1.5 * half + 4 * kv_bytes(min(CHUNK, n_k), dtype))


def choose_dtype(n_k: int, available: int | None, wanted: str = "float32") -> str:
    """``wanted`` if its peak fits in ``available`` bytes with headroom, else bfloat16 (half the bytes)."""
    if available is None or wanted == "bfloat16" or peak_bytes(n_k, wanted) + HEADROOM <= available:
        return wanted
    return "bfloat16"


def worker_budget(n_k: int, dtype: str) -> int:
    """A per-worker budget that fits one shard of n_k / 2 keys while it grows (old + new reserved)."""
    per_key = bytes_per_key(HEADS["h_kv"], HEADS["d"], HEADS["d"], DTYPES[dtype])
    return int(1.6 * (n_k // 2) * per_key) + 256 * common.MIB


def target_s(inprocess_s: float) -> float:
    """The issue-4 bound on the service's p50 for an in-process time."""
    return TARGET_RATIO * inprocess_s + TARGET_PLUS_S


def baseline_s(*runs: Sequence[float]) -> float:
    """The lowest median of the non-empty runs (NaN when there is none)."""
    medians = [statistics.median(r) for r in runs if r]
    return min(medians) if medians else float("nan")


def upload_plan(n_k: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """Key ranges of the create (first) and the appends: at most ``chunk`` and at most n_k / 2 keys each."""
    step = max(1, min(chunk, n_k // 2))
    return [(a, min(a + step, n_k)) for a in range(0, n_k, step)]


# ------------------------------------------------------------------ inputs


def chunks(n_k: int, dtype: str, seed: int) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """``(a, b, k [b-a, h_kv, d], v [b-a, h_kv, d])`` in ``dtype``, the same for the same seed."""
    rng = np.random.default_rng(seed + n_k)
    shape = (HEADS["h_kv"], HEADS["d"])
    for a, b in upload_plan(n_k, CHUNK):
        k = rng.standard_normal((b - a, *shape), dtype=np.float32).astype(DTYPES[dtype], copy=False)
        v = rng.standard_normal((b - a, *shape), dtype=np.float32).astype(DTYPES[dtype], copy=False)
        yield a, b, k, v


def query(seed: int, dtype: str) -> np.ndarray:
    """The decode query ``q [1, h_q, d]``."""
    q = np.random.default_rng(seed).standard_normal((1, HEADS["h_q"], HEADS["d"]), dtype=np.float32)
    return q.astype(DTYPES[dtype], copy=False)


def resident_view(n_k: int, dtype: str, seed: int) -> Any:
    store = StreamingKV(HEADS["h_kv"], HEADS["d"], HEADS["d"], DTYPES[dtype], capacity=n_k)
    for a, b, k, v in chunks(n_k, dtype, seed):
        store.append(k, v, np.arange(a, b))
    return store.snapshot()


def contract_kv(n_k: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (n_k, HEADS["h_kv"], HEADS["d"])
    k, v = np.empty(shape, DTYPES[dtype]), np.empty(shape, DTYPES[dtype])
    for a, b, kc, vc in chunks(n_k, dtype, seed):
        k[a:b], v[a:b] = kc, vc
    return k, v


# ------------------------------------------------------------------ measurements


@dataclass
class SizeResult:
    n_k: int
    dtype: str
    resident_before: list[float] = field(default_factory=list)
    resident_after: list[float] = field(default_factory=list)
    natural: list[float] = field(default_factory=list)
    reference: Any = None
    upload_s: list[float] = field(default_factory=list)  # one per request: the create, then the appends
    placement: str = ""
    c1: list[common.Record] = field(default_factory=list)
    levels: list[Level] = field(default_factory=list)
    diff: float = float("nan")

    @property
    def label(self) -> str:
        return common.size_label(self.n_k)

    @property
    def resident(self) -> list[float]:
        """Every in-process resident timing, before and after the service ran."""
        return self.resident_before + self.resident_after

    @property
    def baseline(self) -> float:
        """The in-process time the target is measured against: the lower of the before and after
        medians (another tenant's load only ever slows a run down)."""
        return baseline_s(self.resident_before, self.resident_after)


def time_resident(n_k: int, dtype: str, repeat: int, seed: int) -> tuple[list[float], np.ndarray]:
    """The resident streaming kernel in-process (2 threads, BLAS at 1): timings and ``out``."""
    q = query(seed, dtype)
    q_pos = np.array([n_k - 1])
    view = resident_view(n_k, dtype, seed)

    def resident() -> tuple[Any, Any]:
        with common.blas_threads(1):
            return finalize(partial_attention_resident(q, view, q_pos=q_pos, options=AttentionOptions(),
                                                       kernel=KernelOptions(threads=2)))

    seconds, (out, _) = common.time_calls(resident, repeat)
    return seconds, out


def measure_inprocess(res: SizeResult, repeat: int, seed: int) -> None:
    """Resident streaming kernel, then workers.attention on the contract layout; one copy at a time."""
    res.resident_before, res.reference = time_resident(res.n_k, res.dtype, repeat, seed)
    gc.collect()  # the resident copy is gone before the contract-layout one exists
    q = query(seed, res.dtype)
    k, v = contract_kv(res.n_k, res.dtype, seed)

    def natural() -> tuple[Any, Any]:
        with common.blas_threads(1):
            return inprocess_attention(q, k, v, threads=2)

    res.natural, (out, _) = common.time_calls(natural, repeat)
    common.check_same(f"workers.attention {res.label}", out, res.reference)
    print(f"in-process {res.label} {res.dtype}: resident {common.ms(statistics.median(res.resident_before))} ms, "
          f"attention {common.ms(statistics.median(res.natural))} ms", file=sys.stderr)


def measure_inprocess_after(res: SizeResult, repeat: int, seed: int) -> None:
    """The resident kernel again once the server is gone: the machine may have drifted meanwhile."""
    res.resident_after, out = time_resident(res.n_k, res.dtype, repeat, seed)
    common.check_same(f"resident kernel {res.label}", out, res.reference)
    print(f"in-process {res.label} after: resident {common.ms(statistics.median(res.resident_after))} ms",
          file=sys.stderr)


def upload(c: Client, res: SizeResult, seed: int) -> str:
    """Create the context from the first chunk, append the rest; its id."""
    ctx_id = None
    for _, _, k, v in chunks(res.n_k, res.dtype, seed):  # generating a chunk is not timed
        t0 = time.perf_counter()
        if ctx_id is None:
            ctx_id = c.create_context(k, v, shards=1)["id"]
        else:
            c.append(ctx_id, k, v)
        res.upload_s.append(time.perf_counter() - t0)
    desc = c.get_context(ctx_id)
    held = [w.get("bytes_held", 0) for w in c.cluster().get("workers", [])]
    res.placement = f"shards {desc['shard_lengths']}, bytes held per worker {[common.bytes_label(h) for h in held]}"
    if desc["length"] != res.n_k:
        raise RuntimeError(f"context must hold {res.n_k} keys, got {desc['length']}")
    return ctx_id


def measure_service(url: str, res: SizeResult, repeat: int, seed: int, levels: Sequence[int],
                    level_s: float) -> None:
    q = query(seed, res.dtype)
    with Client(url) as c:
        ctx_id = upload(c, res, seed)
        try:
            out, _ = c.attention(q, contexts=[ctx_id])
            res.diff = common.check_same(f"context {res.label}", out, res.reference)

            def send(client: Client) -> None:
                client.attention(q, contexts=[ctx_id])

            res.c1, _ = closed_loop(url, send, 1, repeat, 300)
            res.levels = [closed_loop(url, send, n, max(4 * n, repeat), level_s)[1] for n in levels]
        finally:
            c.delete_context(ctx_id)
    p50 = common.summarize([r.seconds for r in res.c1]).p50
    print(f"service {res.label}: p50 {common.ms(p50)} ms, upload {sum(res.upload_s):.1f} s", file=sys.stderr)


def run_size(n_k: int, args: argparse.Namespace, workdir: Path) -> SizeResult:
    res = SizeResult(n_k, choose_dtype(n_k, common.meminfo("MemAvailable"), args.dtype))
    measure_inprocess(res, args.repeat, args.seed)
    env = {"SPLITKEY_CONTEXT_SHARD_KEYS": str(max(1, n_k // 2))}
    server_args = ["--worker-memory-bytes", str(worker_budget(n_k, res.dtype))]
    with common.splitkey_server(workdir, args.workers, server_args, env) as url:
        measure_service(url, res, args.repeat, args.seed, args.levels, args.level_seconds)
    gc.collect()
    measure_inprocess_after(res, args.repeat, args.seed)
    return res


# ------------------------------------------------------------------ report


def latency_table(results: list[SizeResult]) -> str:
    head = ["context", "dtype", "K+V bytes", "in-process resident ms, before", "after", "baseline",
            "in-process workers.attention ms", "service p50 ms (min-max)", "p90 ms", "ratio", "+ms", "bound 1.25x+3ms",
            "target", "max abs diff"]
    rows = []
    for r in results:
        s = common.summarize([x.seconds for x in r.c1])
        base = r.baseline
        ratio, diff = common.overhead(s.p50, base)
        rows.append([r.label, r.dtype, common.bytes_label(kv_bytes(r.n_k, r.dtype)),
                     common.ms_spread(common.summarize(r.resident_before)),
                     common.ms_spread(common.summarize(r.resident_after)), common.ms(base),
                     common.ms_spread(common.summarize(r.natural)), common.ms_spread(s), common.ms(s.p90),
                     f"{ratio:.2f}x", common.ms(diff), common.ms(target_s(base)), common.met(s.p50 <= target_s(base)),
                     f"{r.diff:.1e}"])
    return common.markdown_table(head, rows)


def stage_table(results: list[SizeResult]) -> str:
    rows = [[r.label, *common.stage_cells(common.median_stages([x.stages for x in r.c1])),
             common.ms(common.summarize([x.seconds for x in r.c1]).p50)] for r in results]
    return common.markdown_table(["context", *common.STAGES, "client p50"], rows)


def level_table(results: list[SizeResult]) -> str:
    head = ["context", "concurrency", "requests", "errors", "p50 ms", "p90 ms", "req/s", "GB/s of K+V scanned"]
    rows = [[r.label, lv.concurrency, lv.requests, lv.errors, common.ms(lv.p50_ms / 1000), common.ms(lv.p90_ms / 1000),
             f"{lv.per_second:.2f}", f"{lv.per_second * kv_bytes(r.n_k, r.dtype) / 1e9:.1f}"]
            for r in results for lv in r.levels]
    return common.markdown_table(head, rows)


def upload_table(results: list[SizeResult]) -> str:
    rows = []
    for r in results:
        total = sum(r.upload_s)
        chunk_bytes = kv_bytes(r.n_k, r.dtype) / max(1, len(r.upload_s))
        rows.append([r.label, common.bytes_label(kv_bytes(r.n_k, r.dtype)), len(r.upload_s),
                     common.bytes_label(chunk_bytes),
                     f"{total:.1f}", f"{kv_bytes(r.n_k, r.dtype) / total / 1e9:.2f}" if total else "-",
                     common.ms_spread(common.summarize(r.upload_s)), r.placement])
    return common.markdown_table(["context", "K+V bytes", "requests", "per request", "seconds", "GB/s",
                                  "ms per request (min-max)", "placement"], rows)


def setup_lines(args: argparse.Namespace) -> list[str]:
    shape = f"n_q=1, h_q={HEADS['h_q']}, h_kv={HEADS['h_kv']}, d={HEADS['d']}"
    return [(f"- decode query `{shape}`; server `splitkey serve --workers {args.workers}` (1 CPU, 1 BLAS thread per "
             "worker), one shard of n_k/2 keys per worker; in-process: 2 threads, BLAS at 1, with no server running: "
             "the resident kernel before and again after the service's turn; the baseline is the lower median"),
            (f"- {args.repeat} requests at concurrency 1 after a checked warm-up; closed loops of at most "
             f"max(4 x concurrency, {args.repeat}) requests or {args.level_seconds:g} s per level")]


def report(args: argparse.Namespace, results: list[SizeResult], notes: list[str]) -> str:
    command = " ".join([".venv/bin/python", "benchmarks/contexts.py", *args.argv])
    lines = [f"### Resident-context benchmark, {datetime.date.today().isoformat()}", "", f"Command: `{command}`", "",
             *common.machine_lines(), *setup_lines(args), *notes, "",
             "Latency (median and min-max; target: service p50 <= 1.25 x baseline + 3 ms):", "",
             latency_table(results), "", "Server-Timing, median ms per stage (concurrency 1):", "",
             stage_table(results), "", "Closed-loop throughput:", "", level_table(results), "",
             "Upload (the create, then appends, of min(64K, n_k/2) keys per request; client-side time of the requests only):", "", upload_table(results), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny contexts, 2 repeats, short levels: a smoke run")
    p.add_argument("--repeat", type=common.positive, default=10,
                   help="requests at concurrency 1 and in-process runs (default 10)")
    p.add_argument("--sizes", type=common.parse_keys, default=None, help="context sizes in keys, e.g. 64K,256K,1M")
    p.add_argument("--dtype", choices=CHOICES, default="float32",
                   help="context dtype (default float32; a size that does not fit falls back to bfloat16)")
    p.add_argument("--levels", default=",".join(map(str, LEVELS)), help="closed-loop concurrencies (default 1,4,16)")
    p.add_argument("--level-seconds", type=float, default=20.0, help="seconds per closed-loop level at most")
    p.add_argument("--workers", type=common.positive, default=2)
    p.add_argument("--no-wait", action="store_true", help="do not wait for benchmarks/kernel.py to finish")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", default=None, help="also write the markdown report here")
    p.add_argument("--json", default=None, help="also write the raw results here (every request, every stage)")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.levels = [common.positive(x) for x in args.levels.split(",") if x.strip()]
    if args.quick:
        args.repeat = min(args.repeat, 2)
        args.sizes = args.sizes or list(QUICK_SIZES)
        args.level_seconds = min(args.level_seconds, 3.0)
    else:
        args.sizes = args.sizes or list(SIZES)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    common.raise_on_sigterm()
    t0 = time.monotonic()
    notes = [f"- load average before: {common.load_average()}"]
    results = []
    with tempfile.TemporaryDirectory(prefix="splitkey-ctx-bench-") as tmp:
        for n_k in args.sizes:
            quiet = common.wait_for_quiet(not args.no_wait and not args.quick)
            notes.append(f"- before {common.size_label(n_k)}: {quiet.removeprefix('- ')}")
            results.append(run_size(n_k, args, Path(tmp)))
    notes += [f"- load average after: {common.load_average()}", f"- whole run: {time.monotonic() - t0:.0f} s"]
    notes += [f"- {r.label}: {r.dtype} (float32 would need about "
              f"{common.bytes_label(peak_bytes(r.n_k, 'float32') + HEADROOM)} free)"
              for r in results if r.dtype != args.dtype]
    if args.json:
        common.write_json(args.json, {"benchmark": "contexts", "command": " ".join(["benchmarks/contexts.py", *args.argv]),
                                      "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                                      "machine": common.machine_lines(), "notes": notes, "results": results})
    common.emit_report(report(args, results, notes), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
