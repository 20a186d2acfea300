"""End-to-end benchmark of the HTTP service (issue 3): inline latency, overhead, ingest, small requests.

Run from the repository root (``pip install -e '.[bench]'``; curl on the PATH)::

    .venv/bin/python benchmarks/service.py --repeat 5 --out /tmp/service_bench.md
    .venv/bin/python benchmarks/service.py --quick          # smoke run, tiny sizes, about 15 s
    .venv/bin/python benchmarks/service.py --sections small --small-requests 200   # only the small requests

It starts its own servers on free loopback ports and always stops them:
``splitkey serve --workers 2`` (embedded Ray, its own HOME) and, for the ingest
ceiling, ``benchmarks/bare_asgi.py`` under the same uvicorn. Measured side by side:

* **inline sweep**: ``Client.attention(q, k, v)`` for n_k from 1K up (decode shape
  ``n_q=1, h_q=32, h_kv=8, d=128`` float32, 8 KiB of K+V per key, up to 128K keys =
  1 GiB; a small-head shape ``h_q=8, h_kv=2, d=64`` float32, 1 KiB per key, up to
  1M keys = 1 GiB): p50/p90 latency of ``--repeat`` closed-loop requests at
  concurrency 1, requests/s at concurrency 1 and 2, and the median of each
  ``Server-Timing`` stage;
* **overhead**: the same inputs through ``workers.attention(q, k, v, threads=2)``
  in-process with BLAS at one thread (what each of the two Ray workers gets),
  measured first, before any server runs: ratio and difference of the medians;
* **ingest**: 256 MiB and 512 MiB safetensors bodies (decode shape) written to a
  file and posted with curl to the service and to the bare app: body bytes / time
  of the service's parse stage, of the bare app's allocation + read, and of each
  whole request; the bare app runs twice, as started and with glibc keeping its
  freed heap (``BARE_VARIANTS``: the Ray-loaded service process behaves like the
  second); then the same arrays sent by ``service.client.Client``, against curl;
* **small requests**: n_k = 1K, many requests, for a tiny shape
  (``h_q=2, h_kv=1, d=16``, 128 KiB of K+V) and the decode shape (8 MiB).

``--sections`` runs some of the parts (``sweep``, ``small``, ``ingest``; default
all three): the report has only those, the in-process baselines are measured
only for their cases, and the bare app is started only for ingest.

Before measuring it waits (up to 20 minutes, polling every 30 s) until no
``benchmarks/kernel.py`` runs on this shared machine and the CPUs are at most
25% busy, and the report says whether it had to measure anyway. Every service
answer is compared with the in-process one, so a fast wrong path cannot pass.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Run as a script, this folder comes first on sys.path, and this file would shadow
# the ``service`` package: put the repository root there instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (
    KIB,
    MIB,
    STAGES,
    Record,
    blas_threads,
    bytes_label,
    check_same,
    emit_report,
    free_port,
    load_average,
    machine_lines,
    markdown_table,
    median_stages,
    met,
    ms,
    ms_spread,
    overhead,
    parse_keys,
    positive,
    raise_on_sigterm,
    served,
    size_label,
    splitkey_server,
    stage_cells,
    summarize,
    time_calls,
    wait_for_quiet,
    write_json,
)
from service.client import Client
from service.client.loadtest import Level, run_level
from service.client.timing import parse_server_timing
from service.wire.safetensors import encode_safetensors
from workers import attention as inprocess_attention

SEED = 20261129


# ------------------------------------------------------------------ shapes and cases


@dataclass(frozen=True)
class Shape:
    """Request shape: ``q [n_q, h_q, d]``, ``k, v [n_k, h_kv, d]`` (d_v = d), float32."""

    name: str
    n_q: int
    h_q: int
    h_kv: int
    d: int
    dtype: str = "float32"

    def kv_bytes(self, n_k: int) -> int:
        return 2 * n_k * self.h_kv * self.d * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        return (f"n_q={self.n_q}, h_q={self.h_q}, h_kv={self.h_kv}, d={self.d}, {self.dtype} "
                f"({self.kv_bytes(1)} B of K+V per key)")


SHAPES = {
    "decode": Shape("decode", 1, 32, 8, 128),
    "small": Shape("small", 1, 8, 2, 64),
    "tiny": Shape("tiny", 1, 2, 1, 16),
}
SWEEP = (("decode", 1 * KIB), ("decode", 16 * KIB), ("decode", 64 * KIB), ("decode", 128 * KIB),
         ("small", 1 * KIB), ("small", 64 * KIB), ("small", 256 * KIB), ("small", 1024 * KIB))
QUICK_SWEEP = (("decode", 1 * KIB), ("decode", 4 * KIB), ("small", 1 * KIB), ("small", 16 * KIB))
SMALL_CASES = (("tiny", 1 * KIB), ("decode", 1 * KIB))
#: The parts of the benchmark, in the order they run (``--sections`` picks some).
SECTIONS = ("sweep", "small", "ingest")
INGEST_MIB = (256, 512)
#: The bare app as started (glibc defaults), and with glibc keeping freed heap memory instead of
#: trimming it and mapping large blocks afresh: the service process (Ray loaded) behaves like the
#: second, which reads a body 1.5x faster on this VM (0.67 against 1.01 GB/s with the allocation).
BARE_VARIANTS = {"bare": {}, "bare, heap kept": {"MALLOC_TRIM_THRESHOLD_": str(256 * MIB),
                                                  "MALLOC_MMAP_THRESHOLD_": str(4 * MIB)}}
QUICK_INGEST_MIB = (8, 16)
SMALL_TARGET_S = 0.005
INGEST_TARGET = 0.80


def make_inputs(shape: Shape, n_k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``q [n_q, h_q, d]``, ``k [n_k, h_kv, d]``, ``v [n_k, h_kv, d]``: the same for the same seed."""
    rng = np.random.default_rng(seed + n_k)
    dt = np.dtype(shape.dtype)
    q = np.empty((shape.n_q, shape.h_q, shape.d), dt)
    k = np.empty((n_k, shape.h_kv, shape.d), dt)
    v = np.empty((n_k, shape.h_kv, shape.d), dt)
    for a in (q, k, v):
        rng.standard_normal(dtype=dt, out=a)  # in place: no float64 temporary
    return q, k, v


def ingest_keys(mib: int) -> int:
    """Decode-shape keys whose K+V is ``mib`` MiB."""
    return mib * MIB // SHAPES["decode"].kv_bytes(1)


# ------------------------------------------------------------------ rates and Server-Timing


def gbs(nbytes: float, seconds: float) -> float:
    """Decimal GB/s (10^9 bytes per second), as the field notes quote them."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


# ------------------------------------------------------------------ servers


@contextlib.contextmanager
def bare_server(workdir: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """``benchmarks/bare_asgi.py`` under uvicorn (its defaults, as ``splitkey serve``); yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(HERE), "bare_asgi:app", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", "--timeout-keep-alive", "30"]
    url = f"http://127.0.0.1:{port}"
    with served(cmd, {**os.environ, **(env or {})}, url + "/", workdir / f"bare-{port}.log", startup_s=30):
        yield url


# ------------------------------------------------------------------ clients


class TimedClient(Client):
    """``service.client.Client`` whose last answer's Server-Timing stages are at hand."""

    def last_stages(self) -> dict[str, float]:
        return parse_server_timing(self.last_server_timing)


def closed_loop(url: str, send: Callable[[TimedClient], Any], concurrency: int, requests: int,
                max_s: float) -> tuple[list[Record], Level]:
    """``service.client.loadtest.run_level`` with one TimedClient per thread, recording every request."""
    records: list[Record] = []
    lock = threading.Lock()

    def request(client: TimedClient) -> None:
        t0 = time.perf_counter()
        send(client)
        dt = time.perf_counter() - t0
        with lock:
            records.append(Record(dt, client.last_stages()))

    # retries=0: an error answer is counted as the level's error, not sent again
    level = run_level(lambda: TimedClient(url, retries=0), request, concurrency, requests, max_s)
    return records, level


def curl_post(url: str, body_file: Path, timeout_s: float = 300.0) -> Record:
    """POST ``body_file`` with curl as the brief's command does; time_total and Server-Timing."""
    cmd = ["curl", "-sS", "--max-time", str(timeout_s), "-o", "/dev/null", "-D", "-", "--data-binary",
           f"@{body_file}", "-H", "Content-Type: application/octet-stream", "-w", "\n@@ %{http_code} %{time_total}\n",
           url]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 30, check=False)
    timing, code, total = "", "", float("nan")
    for line in res.stdout.splitlines():
        if line.lower().startswith("server-timing:"):
            timing = line.split(":", 1)[1].strip()
        elif line.startswith("@@ "):
            _, code, total_text = line.split()
            total = float(total_text)
    if res.returncode != 0 or code != "200":
        raise RuntimeError(f"curl to {url} failed (rc {res.returncode}, HTTP {code}): {res.stderr.strip()}")
    return Record(total, parse_server_timing(timing))


def write_body(path: Path, tensors: dict[str, np.ndarray]) -> int:
    """Write the safetensors body the client would send; its size in bytes."""
    with path.open("wb") as f:
        for buf in encode_safetensors(tensors):
            f.write(buf)
    return path.stat().st_size


# ------------------------------------------------------------------ in-process


def inprocess(q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """``workers.attention`` over the same cores as two Ray workers: ``threads`` threads, BLAS at one."""
    with blas_threads(1):
        return inprocess_attention(q, k, v, threads=threads)


# ------------------------------------------------------------------ measurements


@dataclass
class InlineCase:
    shape: Shape
    n_k: int
    inprocess: list[float] = field(default_factory=list)
    reference: Any = None
    c1: list[Record] = field(default_factory=list)
    level1: Level | None = None
    level2: Level | None = None
    diff: float = float("nan")

    @property
    def label(self) -> str:
        return f"{self.shape.name} {size_label(self.n_k)}"


def measure_inprocess(cases: list[InlineCase], repeat: int, seed: int) -> None:
    """In-process medians for every case (no server running yet: a quiet machine)."""
    for case in cases:
        q, k, v = make_inputs(case.shape, case.n_k, seed)
        case.inprocess, (case.reference, _) = time_calls(partial(inprocess, q, k, v), repeat)
        print(f"in-process {case.label}: {ms(statistics.median(case.inprocess))} ms", file=sys.stderr)


def measure_service_case(url: str, case: InlineCase, repeat: int, seed: int, c2: bool) -> None:
    """Warm-up (checked against in-process), ``repeat`` requests at concurrency 1, then 2."""
    q, k, v = make_inputs(case.shape, case.n_k, seed)
    with Client(url) as c:
        out, _ = c.attention(q, k, v)
    case.diff = check_same(case.label, out, case.reference)
    def send(client: Client) -> None:
        client.attention(q, k, v)

    case.c1, case.level1 = closed_loop(url, send, 1, repeat, 600)
    if c2:
        _, case.level2 = closed_loop(url, send, 2, 2 * repeat, 120)
    p50 = summarize([r.seconds for r in case.c1]).p50
    print(f"service {case.label}: p50 {ms(p50)} ms", file=sys.stderr)


@dataclass
class IngestCase:
    mib: int
    body_bytes: int = 0
    service_curl: list[Record] = field(default_factory=list)
    service_client: list[Record] = field(default_factory=list)
    bare: dict[str, list[Record]] = field(default_factory=dict)  # BARE_VARIANTS name -> curl records


def measure_ingest_service(url: str, case: IngestCase, body: Path, repeat: int, seed: int) -> None:
    """curl and our Client sending the same body to the service, alternately."""
    shape = SHAPES["decode"]
    q, k, v = make_inputs(shape, ingest_keys(case.mib), seed)
    case.body_bytes = write_body(body, {"q": q, "k": k, "v": v})
    curl_post(url + "/v1/attention", body)  # warm-up
    with TimedClient(url) as c:
        c.attention(q, k, v)
        for _ in range(repeat):
            case.service_curl.append(curl_post(url + "/v1/attention", body))
            t0 = time.perf_counter()
            c.attention(q, k, v)
            case.service_client.append(Record(time.perf_counter() - t0, c.last_stages()))
    print(f"ingest {case.mib} MiB: service parse {ms(median_stages([r.stages for r in case.service_curl])['parse'])} ms",
          file=sys.stderr)


def measure_ingest_bare(url: str, variant: str, case: IngestCase, body: Path, repeat: int) -> None:
    curl_post(url, body)  # warm-up
    case.bare[variant] = [curl_post(url, body) for _ in range(repeat)]


# ------------------------------------------------------------------ report


def inline_tables(cases: list[InlineCase]) -> list[str]:
    head = ["case", "K+V bytes", "in-process ms", "service p50 ms (min-max)", "p90 ms", "ratio", "+ms",
            "req/s c=1", "req/s c=2", "max abs diff"]
    rows = []
    for c in cases:
        inp = statistics.median(c.inprocess)
        s = summarize([r.seconds for r in c.c1])
        ratio, diff = overhead(s.p50, inp)
        rows.append([c.label, bytes_label(c.shape.kv_bytes(c.n_k)), ms_spread(summarize(c.inprocess)), ms_spread(s),
                     ms(s.p90), f"{ratio:.1f}x", ms(diff),
                     f"{c.level1.per_second:.2f}" if c.level1 else "-",
                     f"{c.level2.per_second:.2f}" if c.level2 else "-", f"{c.diff:.1e}"])
    stage_rows = [[c.label, *stage_cells(median_stages([r.stages for r in c.c1])),
                   f"{gbs(c.shape.kv_bytes(c.n_k), median_stages([r.stages for r in c.c1]).get('parse', float('nan'))):.2f}"]
                  for c in cases]
    errors = sum((c.level1.errors if c.level1 else 0) + (c.level2.errors if c.level2 else 0) for c in cases)
    return [markdown_table(head, rows), "",
            "Server-Timing, median ms per stage (concurrency 1), and the parse stage's rate in GB/s of K+V:", "",
            markdown_table(["case", *STAGES, "parse GB/s"], stage_rows), "",
            f"Errors during the closed loops: {errors}."]


def small_table(cases: list[InlineCase]) -> list[str]:
    head = ["case", "K+V bytes", "requests", "p50 ms (min-max)", "p90 ms", "in-process ms", *STAGES,
            f"p50 <= {ms(SMALL_TARGET_S)} ms"]
    rows = []
    for c in cases:
        s = summarize([r.seconds for r in c.c1])
        rows.append([c.label, bytes_label(c.shape.kv_bytes(c.n_k)), s.n, ms_spread(s), ms(s.p90),
                     ms(statistics.median(c.inprocess)), *stage_cells(median_stages([r.stages for r in c.c1])),
                     met(s.p50 <= SMALL_TARGET_S)])
    return [markdown_table(head, rows)]


def stage_seconds(records: Sequence[Record], *stages: str) -> list[float]:
    """Per record, the sum of the named Server-Timing stages (NaN where one is missing)."""
    return [sum(r.stages.get(st, float("nan")) for st in stages) for r in records]


def ingest_rows(case: IngestCase) -> list[tuple[str, str, list[float], list[float]]]:
    """``(reader, server-side stages, server seconds, whole-request seconds)`` for each way the body was read."""
    rows = []
    for variant, records in case.bare.items():
        whole = [r.seconds for r in records]
        rows.append((variant, "alloc + read", stage_seconds(records, "alloc", "read"), whole))
        rows.append((variant, "read only", stage_seconds(records, "read"), whole))
    rows.append(("service, curl", "parse", stage_seconds(case.service_curl, "parse"),
                 [r.seconds for r in case.service_curl]))
    rows.append(("service, Client", "parse", stage_seconds(case.service_client, "parse"),
                 [r.seconds for r in case.service_client]))
    return rows


def ingest_ratio(case: IngestCase, variant: str) -> float:
    """Service parse rate over the bare variant's alloc + read rate (same work: one buffer, every chunk copied)."""
    bare = stage_seconds(case.bare.get(variant, []), "alloc", "read")
    parse = stage_seconds(case.service_curl, "parse")
    if not bare or not parse:
        return float("nan")
    return statistics.median(bare) / statistics.median(parse)


def target_cell(ratio: float, target: float) -> str:
    """``"88% (met)"``; a dash when the ratio could not be measured."""
    return "-" if np.isnan(ratio) else f"{ratio:.0%} ({met(ratio >= target)})"


def rate_spread(nbytes: int, seconds: Sequence[float]) -> str:
    """``"median (min-max)"`` GB/s."""
    rates = [gbs(nbytes, s) for s in seconds]
    return f"{statistics.median(rates):.2f} ({min(rates):.2f}-{max(rates):.2f})" if rates else "-"


def seconds_spread(seconds: Sequence[float]) -> str:
    s = summarize(seconds)
    return f"{s.p50:.3f} ({s.lo:.3f}-{s.hi:.3f})"


def ingest_tables(cases: list[IngestCase]) -> list[str]:
    rows = [[bytes_label(c.body_bytes), reader, stages, rate_spread(c.body_bytes, server),
             rate_spread(c.body_bytes, whole)]
            for c in cases for reader, stages, server, whole in ingest_rows(c)]
    table = markdown_table(["body", "reader", "server-side stage", "server-side GB/s", "whole request GB/s"], rows)
    target_rows = [[bytes_label(c.body_bytes),
                    *[target_cell(ingest_ratio(c, v), INGEST_TARGET) for v in BARE_VARIANTS]]
                   for c in cases]
    target = markdown_table(["body", *[f"service parse / {v} alloc + read" for v in BARE_VARIANTS]], target_rows)
    client_head = ["body", "curl whole request s", "Client whole request s", "Client / curl",
                   "service stages with curl, median ms: " + " / ".join(STAGES)]
    client_rows = []
    for c in cases:
        curl_s = summarize([x.seconds for x in c.service_curl]).p50
        client_s = summarize([x.seconds for x in c.service_client]).p50
        client_rows.append([bytes_label(c.body_bytes), seconds_spread([x.seconds for x in c.service_curl]),
                            seconds_spread([x.seconds for x in c.service_client]), f"{client_s / curl_s:.2f}",
                            " / ".join(stage_cells(median_stages([x.stages for x in c.service_curl])))])
    return [table, "", f"Target: the service's parse rate at least {INGEST_TARGET:.0%} of the bare app's:", "",
            target, "", "Our Client against curl, same body, same server:", "", markdown_table(client_head, client_rows)]


def setup_lines(args: argparse.Namespace, shapes: Sequence[str]) -> list[str]:
    """What ran, how many times, on which shapes (the in-process and service lines only for the sections using them)."""
    server = (f"- server: `splitkey serve --workers {args.workers}` (embedded Ray, 1 CPU and 1 BLAS thread per "
              "worker; default min_shard_keys 4096, so below 8K keys an inline request is one shard on one worker); "
              "client and curl run on the same 2 cores")
    inproc = (f"- in-process: `workers.attention(q, k, v, threads=2)` with BLAS at 1 thread, median of "
              f"{args.repeat} after a warm-up, measured before any server starts")
    service = (f"- service: {args.repeat} closed-loop requests at concurrency 1 after a checked warm-up "
               f"(p50, p90, min-max), then {2 * args.repeat} at concurrency 2 for requests/s")
    lines = [server]
    if "sweep" in args.sections or "small" in args.sections:
        lines.append(inproc)
    if "sweep" in args.sections:
        lines.append(service)
    return [*lines, *[f"- shape `{n}`: {SHAPES[n].describe()}" for n in shapes]]


def report(args: argparse.Namespace, sweep: list[InlineCase], small: list[InlineCase], ingest: list[IngestCase],
           notes: list[str]) -> str:
    """The markdown report of the sections in ``args.sections``."""
    shapes = sorted({c.shape.name for c in sweep + small} | ({"decode"} if "ingest" in args.sections else set()))
    command = " ".join([".venv/bin/python", "benchmarks/service.py", *args.argv])
    lines = [f"### Service benchmark, {datetime.date.today().isoformat()}", "", f"Command: `{command}`", "",
             *machine_lines(), *setup_lines(args, shapes), *notes, ""]
    if "sweep" in args.sections:
        lines += ["#### Inline requests: latency, throughput, overhead against in-process", "",
                  *inline_tables(sweep), ""]
    if "small" in args.sections:
        lines += [f"#### Small requests (n_k = 1K, {args.small_requests} requests at concurrency 1)", "",
                  *small_table(small), ""]
    if "ingest" in args.sections:
        lines += [f"#### Ingest ({args.repeat} requests per cell, curl `--data-binary @file`, decode shape)", "",
                  *ingest_tables(ingest), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def parse_sections(text: str) -> tuple[str, ...]:
    """``"small,sweep"`` -> ``("sweep", "small")``: a non-empty subset of SECTIONS, in their run order."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    if not names or not names <= set(SECTIONS):
        raise argparse.ArgumentTypeError(f"sections must be a comma-separated subset of {','.join(SECTIONS)}, "
                                         f"got {text!r}")
    return tuple(s for s in SECTIONS if s in names)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats: a smoke run")
    p.add_argument("--repeat", type=positive, default=5, help="timed requests per cell (default 5)")
    p.add_argument("--small-requests", type=positive, default=100, help="requests per small case (default 100)")
    p.add_argument("--workers", type=positive, default=2, help="shard workers of the server (default 2)")
    p.add_argument("--ingest-mib", type=parse_keys, default=None, help="ingest body sizes in MiB (default 256,512)")
    p.add_argument("--sections", type=parse_sections, default=SECTIONS,
                   help=f"what to measure, a comma-separated subset of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--no-wait", action="store_true", help="do not wait for benchmarks/kernel.py to finish")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", default=None, help="also write the markdown report here")
    p.add_argument("--json", default=None, help="also write the raw results here (every request, every stage)")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.repeat = min(args.repeat, 2)
        args.small_requests = min(args.small_requests, 20)
        args.sweep = QUICK_SWEEP
        args.ingest_mib = args.ingest_mib or list(QUICK_INGEST_MIB)
    else:
        args.sweep = SWEEP
        args.ingest_mib = args.ingest_mib or list(INGEST_MIB)
    return args


def plan(args: argparse.Namespace) -> tuple[list[InlineCase], list[InlineCase], list[IngestCase]]:
    """The sweep, small and ingest cases to measure: an empty list for a section not in ``args.sections``."""
    sweep = [InlineCase(SHAPES[s], n) for s, n in args.sweep] if "sweep" in args.sections else []
    small = [InlineCase(SHAPES[s], n) for s, n in SMALL_CASES] if "small" in args.sections else []
    ingest = [IngestCase(m) for m in args.ingest_mib] if "ingest" in args.sections else []
    return sweep, small, ingest


def run(args: argparse.Namespace, workdir: Path, raw: dict[str, Any] | None = None) -> str:
    """Measure the chosen sections, starting only the servers they need; the report. ``raw``, when
    given, receives the raw results (every request, every stage) for ``--json``."""
    notes = [wait_for_quiet(not args.no_wait and not args.quick), f"- load average before: {load_average()}"]
    sweep, small, ingest = plan(args)
    measure_inprocess(sweep + small, args.repeat, args.seed)
    bodies = {c.mib: workdir / f"body-{c.mib}MiB.safetensors" for c in ingest}
    with splitkey_server(workdir, args.workers) as url:  # every section measures the service
        for case in sweep:
            measure_service_case(url, case, args.repeat, args.seed, c2=True)
        for case in small:
            measure_service_case(url, case, args.small_requests, args.seed, c2=False)
        for case in ingest:
            measure_ingest_service(url, case, bodies[case.mib], args.repeat, args.seed)
    if ingest:  # the bare app serves only as the ingest ceiling
        for variant, env in BARE_VARIANTS.items():
            with bare_server(workdir, env) as url:
                for case in ingest:
                    measure_ingest_bare(url, variant, case, bodies[case.mib], args.repeat)
    notes.append(f"- load average after: {load_average()}")
    if raw is not None:
        raw.update({"benchmark": "service", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "command": " ".join(["benchmarks/service.py", *args.argv]), "machine": machine_lines(),
                    "notes": notes, "sweep": sweep, "small": small, "ingest": ingest})
    return report(args, sweep, small, ingest, notes)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raise_on_sigterm()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="splitkey-bench-") as tmp:
        raw: dict[str, Any] = {}
        text = run(args, Path(tmp), raw)
    text += f"\nWhole run: {time.monotonic() - t0:.0f} s.\n"
    if args.json:
        write_json(args.json, raw)
    emit_report(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
