"""End-to-end benchmark of the HTTP service (issue 3): inline latency, overhead, ingest, small requests.

Run from the repository root (``pip install -e '.[bench]'``; curl on the PATH)::

    .venv/bin/python benchmarks/service.py --repeat 5 --out /tmp/service_bench.md
    .venv/bin/python benchmarks/service.py --quick          # smoke run, tiny sizes, about 15 s

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

Before measuring it waits (up to 20 minutes, polling every 30 s) until no
``benchmarks/kernel.py`` runs on this shared machine and the CPUs are at most
25% busy, and the report says whether it had to measure anyway. Every service
answer is compared with the in-process one, so a fast wrong path cannot pass.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
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

from service.client import Client
from service.client.loadtest import Level, run_level
from service.wire.safetensors import encode_safetensors
from workers import attention as inprocess_attention

KIB, MIB, GIB = 2**10, 2**20, 2**30
SEED = 20261129
STAGES = ("parse", "scatter", "compute", "merge", "encode", "total")
QUIET_PATTERN = "benchmarks/kernel.py"


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
INGEST_MIB = (256, 512)
#: The bare app as started (glibc defaults), and with glibc keeping freed heap memory instead of
#: trimming it and mapping large blocks afresh: the service process (Ray loaded) behaves like the
#: second, which reads a body 1.5x faster on this VM (0.67 against 1.01 GB/s with the allocation).
BARE_VARIANTS = {"bare": {}, "bare, heap kept": {"MALLOC_TRIM_THRESHOLD_": str(256 * MIB),
                                                  "MALLOC_MMAP_THRESHOLD_": str(4 * MIB)}}
QUICK_INGEST_MIB = (8, 16)
SMALL_TARGET_S = 0.005
INGEST_TARGET = 0.80


def size_label(n: int) -> str:
    """1024 -> "1K", 2**20 -> "1M", 3000 -> "3000"."""
    if n >= MIB and n % MIB == 0:
        return f"{n // MIB}M"
    if n >= KIB and n % KIB == 0:
        return f"{n // KIB}K"
    return str(n)


def bytes_label(n: float) -> str:
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if n >= unit:
            return f"{n / unit:.4g} {name}"
    return f"{int(n)} B"


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


# ------------------------------------------------------------------ statistics and formatting


@dataclass(frozen=True)
class Summary:
    """Percentiles and range of a list of seconds."""

    n: int
    p50: float
    p90: float
    lo: float
    hi: float


def summarize(seconds: Sequence[float]) -> Summary:
    if not seconds:
        nan = float("nan")
        return Summary(0, nan, nan, nan, nan)
    a = np.asarray(seconds, dtype=np.float64)
    return Summary(len(a), float(np.percentile(a, 50)), float(np.percentile(a, 90)), float(a.min()), float(a.max()))


def ms(seconds: float) -> str:
    """Seconds as milliseconds with 3 significant digits (at least one decimal below 100)."""
    if np.isnan(seconds):
        return "-"
    v = seconds * 1000
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def ms_spread(s: Summary) -> str:
    """``"p50 (min-max)"`` in milliseconds."""
    return "-" if s.n == 0 else f"{ms(s.p50)} ({ms(s.lo)}-{ms(s.hi)})"


def gbs(nbytes: float, seconds: float) -> float:
    """Decimal GB/s (10^9 bytes per second), as the field notes quote them."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def overhead(service_s: float, inprocess_s: float) -> tuple[float, float]:
    """``(ratio, difference in seconds)`` of the service's time over the in-process one."""
    return service_s / inprocess_s, service_s - inprocess_s


def met(ok: bool) -> str:
    return "met" if ok else "missed"


def parse_server_timing(header: str | None) -> dict[str, float]:
    """``"parse;dur=1.5, total;dur=2"`` -> ``{"parse": 0.0015, "total": 0.002}`` (seconds)."""
    stages: dict[str, float] = {}
    for part in (header or "").split(","):
        name, _, params = part.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if name and key == "dur":
                with contextlib.suppress(ValueError):
                    stages[name] = float(value) / 1000
    return stages


def median_stages(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """Median of each stage over the records that have it."""
    names = {n for r in records for n in r}
    return {n: statistics.median(r[n] for r in records if n in r) for n in names}


def stage_cells(stages: dict[str, float]) -> list[str]:
    """One cell per stage of STAGES, in milliseconds (a dash when absent)."""
    return [ms(stages[s]) if s in stages else "-" for s in STAGES]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; every row must have one cell per header."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"rows must have {len(headers)} cells as the headers, got {len(row)}: {row!r}")
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------ the machine


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def meminfo(field_name: str) -> int | None:
    """A /proc/meminfo field in bytes (e.g. "MemAvailable"), or None."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return None


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def machine_lines() -> list[str]:
    total = meminfo("MemTotal")
    return [(f"- CPU: {cpu_model()}, {os.cpu_count()} cores; memory {bytes_label(total or 0)}; "
             f"Python {platform.python_version()}, numpy {np.__version__}")]


def others_running(pattern: str = QUIET_PATTERN) -> bool:
    """True while a process whose command line contains ``pattern`` runs (pgrep -f)."""
    try:
        return subprocess.run(["pgrep", "-f", pattern], capture_output=True, check=False).returncode == 0
    except FileNotFoundError:
        return False


def cpu_times() -> tuple[int, int] | None:
    """``(idle, total)`` jiffies of all CPUs from /proc/stat, or None."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields[:8])
    return None


def busy_fraction(a: tuple[int, int] | None, b: tuple[int, int] | None) -> float:
    """Share of CPU time not idle between two ``cpu_times`` samples (0 when unknown)."""
    if a is None or b is None or b[1] <= a[1]:
        return 0.0
    return 1.0 - (b[0] - a[0]) / (b[1] - a[1])


def cpu_busy(sample_s: float = 5.0) -> float:
    a = cpu_times()
    time.sleep(sample_s)
    return busy_fraction(a, cpu_times())


def wait_for_quiet(enabled: bool, poll_s: float = 30.0, max_s: float = 1200.0, pattern: str = QUIET_PATTERN,
                   max_busy: float = 0.25) -> str:
    """Wait until no ``pattern`` process runs and the CPUs are mostly idle; returns a line for the report."""
    if not enabled:
        return "- waiting for other benchmarks: skipped (--no-wait)"
    t0 = time.monotonic()
    while True:
        running, busy = others_running(pattern), cpu_busy()
        waited = time.monotonic() - t0
        if not running and busy <= max_busy:
            return (f"- machine quiet when measuring: no {pattern}, CPUs {busy:.0%} busy over 5 s "
                    f"(waited {waited:.0f} s)")
        if waited >= max_s:
            return (f"- **machine still busy after {waited:.0f} s ({pattern} running: {running}, CPUs {busy:.0%} "
                    "busy): measured anyway, numbers are pessimistic**")
        print(f"waiting for a quiet machine: {pattern} running: {running}, CPUs {busy:.0%} busy", file=sys.stderr)
        time.sleep(poll_s)


# ------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """GET ``url``'s status, or None if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


@contextlib.contextmanager
def served(cmd: Sequence[str], env: dict[str, str], ready_url: str, log: Path,
           startup_s: float = 180.0) -> Iterator[None]:
    """Run ``cmd`` in its own process group until ``ready_url`` answers 200; always stop it."""
    with log.open("w") as out:
        proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + startup_s
            while http_status(ready_url) != 200:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd[:4]} not ready in {startup_s} s:\n{log.read_text()[-4000:]}")
                time.sleep(0.25)
            yield
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it if it is still there after 30 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def splitkey_server(workdir: Path, workers: int = 2, args: Sequence[str] = (),
                    env: dict[str, str] | None = None) -> Iterator[str]:
    """``splitkey serve`` (embedded Ray, its own HOME under ``workdir``) on a free loopback port; yields its URL."""
    port = free_port()
    home = workdir / f"home-{port}"
    home.mkdir(parents=True)
    full_env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--workers", str(workers), *args]
    url = f"http://127.0.0.1:{port}"
    with served(cmd, full_env, url + "/readyz", workdir / f"splitkey-{port}.log"):
        yield url


@contextlib.contextmanager
def bare_server(workdir: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """``benchmarks/bare_asgi.py`` under uvicorn (its defaults, as ``splitkey serve``); yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(HERE), "bare_asgi:app", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", "--timeout-keep-alive", "30"]
    url = f"http://127.0.0.1:{port}"
    with served(cmd, {**os.environ, **(env or {})}, url + "/", workdir / f"bare-{port}.log", startup_s=30):
        yield url


def raise_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so every ``finally`` (server stops) runs."""
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


# ------------------------------------------------------------------ clients


class RecordingConnection(http.client.HTTPConnection):
    """An HTTPConnection that keeps the last response's Server-Timing header."""

    last_timing = ""

    def getresponse(self) -> http.client.HTTPResponse:  # type: ignore[override]
        resp = super().getresponse()
        self.last_timing = resp.getheader("Server-Timing", "")
        return resp


class TimedClient(Client):
    """``service.client.Client`` (same encode and transport) that exposes the Server-Timing stages."""

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = RecordingConnection(self.host, self.port, timeout=self.timeout)
        return self._conn

    def last_stages(self) -> dict[str, float]:
        conn = self._conn
        return parse_server_timing(conn.last_timing if isinstance(conn, RecordingConnection) else "")


@dataclass
class Record:
    """One request: client-side seconds and the server's stages (seconds)."""

    seconds: float
    stages: dict[str, float] = field(default_factory=dict)


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

    level = run_level(lambda: TimedClient(url), request, concurrency, requests, max_s)
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


def blas_threads(n: int) -> contextlib.AbstractContextManager:
    """Limit BLAS to ``n`` threads (threadpoolctl), as each Ray worker runs."""
    try:
        from threadpoolctl import threadpool_limits  # optional: the [bench] extra
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


def time_calls(fn: Callable[[], Any], repeat: int) -> tuple[list[float], Any]:
    """One warm-up call, then ``repeat`` timed calls; the timings and the last result."""
    result = fn()
    seconds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - t0)
    return seconds, result


def inprocess(q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """``workers.attention`` over the same cores as two Ray workers: ``threads`` threads, BLAS at one."""
    with blas_threads(1):
        return inprocess_attention(q, k, v, threads=threads)


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def check_same(name: str, got: np.ndarray, want: np.ndarray) -> float:
    """Largest |got - want|; raises when the service answered something else."""
    diff = max_diff(got, want)
    if not diff <= 1e-3 * max(1.0, float(np.max(np.abs(want)))):
        raise RuntimeError(f"{name}: the service's out differs from the in-process one by {diff:.3g}")
    return diff


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
    """What ran, how many times, on which shapes."""
    server = (f"- server: `splitkey serve --workers {args.workers}` (embedded Ray, 1 CPU and 1 BLAS thread per "
              "worker; default min_shard_keys 4096, so below 8K keys an inline request is one shard on one worker); "
              "client and curl run on the same 2 cores")
    inproc = (f"- in-process: `workers.attention(q, k, v, threads=2)` with BLAS at 1 thread, median of "
              f"{args.repeat} after a warm-up, measured before any server starts")
    service = (f"- service: {args.repeat} closed-loop requests at concurrency 1 after a checked warm-up "
               f"(p50, p90, min-max), then {2 * args.repeat} at concurrency 2 for requests/s")
    return [server, inproc, service, *[f"- shape `{n}`: {SHAPES[n].describe()}" for n in shapes]]


def report(args: argparse.Namespace, sweep: list[InlineCase], small: list[InlineCase], ingest: list[IngestCase],
           notes: list[str]) -> str:
    shapes = sorted({c.shape.name for c in sweep + small})
    command = " ".join([".venv/bin/python", "benchmarks/service.py", *args.argv])
    lines = [f"### Service benchmark, {datetime.date.today().isoformat()}", "", f"Command: `{command}`", "",
             *machine_lines(), *setup_lines(args, shapes), *notes, "",
             "#### Inline requests: latency, throughput, overhead against in-process", "", *inline_tables(sweep), "",
             f"#### Small requests (n_k = 1K, {args.small_requests} requests at concurrency 1)", "",
             *small_table(small), "",
             f"#### Ingest ({args.repeat} requests per cell, curl `--data-binary @file`, decode shape)", "",
             *ingest_tables(ingest), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def parse_keys(text: str) -> list[int]:
    """``"64K,1M"`` (or plain integers) to key counts."""
    sizes = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = {"K": KIB, "M": MIB}.get(part[-1:], 1)
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or int(digits) < 1:
            raise argparse.ArgumentTypeError(f"sizes must be positive key counts like 64K or 1M, got {part!r}")
        sizes.append(int(digits) * scale)
    return sizes


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return n


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats: a smoke run")
    p.add_argument("--repeat", type=positive, default=5, help="timed requests per cell (default 5)")
    p.add_argument("--small-requests", type=positive, default=100, help="requests per small case (default 100)")
    p.add_argument("--workers", type=positive, default=2, help="shard workers of the server (default 2)")
    p.add_argument("--ingest-mib", type=parse_keys, default=None, help="ingest body sizes in MiB (default 256,512)")
    p.add_argument("--no-wait", action="store_true", help="do not wait for benchmarks/kernel.py to finish")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", default=None, help="also write the markdown report here")
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


def run(args: argparse.Namespace, workdir: Path) -> str:
    notes = [wait_for_quiet(not args.no_wait and not args.quick), f"- load average before: {load_average()}"]
    sweep = [InlineCase(SHAPES[s], n) for s, n in args.sweep]
    small = [InlineCase(SHAPES[s], n) for s, n in SMALL_CASES]
    ingest = [IngestCase(m) for m in args.ingest_mib]
    measure_inprocess(sweep + small, args.repeat, args.seed)
    bodies = {c.mib: workdir / f"body-{c.mib}MiB.safetensors" for c in ingest}
    with splitkey_server(workdir, args.workers) as url:
        for case in sweep:
            measure_service_case(url, case, args.repeat, args.seed, c2=True)
        for case in small:
            measure_service_case(url, case, args.small_requests, args.seed, c2=False)
        for case in ingest:
            measure_ingest_service(url, case, bodies[case.mib], args.repeat, args.seed)
    for variant, env in BARE_VARIANTS.items():
        with bare_server(workdir, env) as url:
            for case in ingest:
                measure_ingest_bare(url, variant, case, bodies[case.mib], args.repeat)
    notes.append(f"- load average after: {load_average()}")
    return report(args, sweep, small, ingest, notes)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raise_on_sigterm()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="splitkey-bench-") as tmp:
        text = run(args, Path(tmp))
    text += f"\nWhole run: {time.monotonic() - t0:.0f} s.\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
