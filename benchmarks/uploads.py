"""Uploads of long contexts (issue 9): the client's chunked upload against inline ingest of the same bodies.

Run from the repository root (``pip install -e '.[bench]'``)::

    .venv/bin/python benchmarks/uploads.py --rounds 3 --out /tmp/uploads.md
    .venv/bin/python benchmarks/uploads.py --quick          # smoke run, a 64K-key context

One ``splitkey serve --workers 2`` (embedded Ray, a worker budget that holds the
context) serves every step, in this order, ``--rounds`` times:

1. **idle probe**: a small context (4K keys) is queried by one client in a closed
   loop (``--probe-requests`` decode queries): p50 and p99 at rest;
2. **inline ingest**: ``--repeat`` ``Client.attention(q, k, v)`` requests whose k, v
   are one upload chunk (the chunk the client picks from ``/v1/limits``, 16 MiB of
   K+V): bytes of K+V per second of each request, and its Server-Timing stages;
3. **upload**: ``Client.create_context(k, v)`` of the whole context (default 1M keys
   of ``h_kv=8, d=128``, bfloat16: 4 GiB), chunked by the client, while the probe
   loop keeps querying the small context: bytes per second of the whole upload,
   Server-Timing stages of every chunk, and the probe's p50 and p99 during it.
   The context is deleted before the next round.

4. **raw socket** (issue 47): the same k and v bytes sent over a loopback TCP socket to a
   receiver process that reads them into freshly allocated memory (``np.empty``, so its page
   faults count, as a worker's fresh shard memory does), best of ``--raw-tries`` (3): the
   wire's own rate on this machine now, which swings with its load.

Targets: upload >= 0.8 x inline ingest; upload >= 0.5 x the raw socket (issue 47); probe p99
during the upload <= 3 x idle. Every number is the median over rounds; inputs are generated once.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common
from benchmarks.service import TimedClient
from service.client import Client
from service.client.upload import chunk_keys
from workers import DTYPES
from workers.layout import bytes_per_key

HEADS = {"h_q": 32, "h_kv": 8, "d": 128}
#: Stages of a context write (service.core.metrics.STAGES) and of an attention request, as reported.
WRITE_STAGES = ("parse", "place", "put", "store", "commit", "total")
INLINE_STAGES = ("parse", "scatter", "compute", "merge", "encode", "total")
PROBE_KEYS = 4096
SEED = 20261201
UPLOAD_TARGET, PROBE_TARGET = 0.8, 3.0
#: Issue 47: an upload moves at least this fraction of the raw socket's rate.
RAW_TARGET = 0.5
#: The raw socket's receiver: reads each transfer's length (8 bytes), then that many bytes into a
#: fresh array, and answers one byte once all arrived; the array is freed before the next one.
RECEIVER = """
import socket, sys
import numpy as np
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
for _ in range(int(sys.argv[1])):
    conn, _ = srv.accept()
    with conn:
        head = b""
        while len(head) < 8:
            head += conn.recv(8 - len(head))
        n = int.from_bytes(head, "little")
        buf = np.empty(n, np.uint8)
        view, got = memoryview(buf), 0
        while got < n:
            got += conn.recv_into(view[got:], min(n - got, 1 << 22))
        conn.sendall(b"k")
        del buf, view
"""


@dataclass
class Round:
    idle: list[float] = field(default_factory=list)  # probe seconds at rest
    during: list[float] = field(default_factory=list)  # probe seconds while the upload ran
    inline: list[common.Record] = field(default_factory=list)
    upload_s: float = float("nan")  # alone
    probed_upload_s: float = float("nan")  # while the probe ran
    chunks: list[dict[str, float]] = field(default_factory=list)  # Server-Timing of each chunk
    raw_s: list[float] = field(default_factory=list)  # each raw socket transfer of the same bytes


def kv_arrays(n_k: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (n_k, HEADS["h_kv"], HEADS["d"])
    k, v = np.empty(shape, DTYPES[dtype]), np.empty(shape, DTYPES[dtype])
    step = 65536
    for a in range(0, n_k, step):  # generated in float32 a slice at a time: no float32 copy of the whole
        b = min(a + step, n_k)
        k[a:b] = rng.standard_normal((b - a, *shape[1:]), dtype=np.float32)
        v[a:b] = rng.standard_normal((b - a, *shape[1:]), dtype=np.float32)
    return k, v


def query(seed: int, dtype: str) -> np.ndarray:
    q = np.random.default_rng(seed).standard_normal((1, HEADS["h_q"], HEADS["d"]), dtype=np.float32)
    return q.astype(DTYPES[dtype])


def percentile(seconds: Sequence[float], p: float) -> float:
    return float(np.percentile(seconds, p)) if seconds else float("nan")


class Probe:
    """One client querying a small context in a closed loop; each latency is kept with its start time."""

    def __init__(self, url: str, ctx_id: str, q: np.ndarray) -> None:
        self.url, self.ctx_id, self.q = url, ctx_id, q
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with Client(self.url) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                c.attention(self.q, contexts=[self.ctx_id])
                self.samples.append((t0, time.perf_counter() - t0))

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> list[float]:
        return [dt for start, dt in self.samples if t0 <= start and start + dt <= t1]


def run_round(url: str, k: np.ndarray, v: np.ndarray, q: np.ndarray, probe_id: str, args: argparse.Namespace) -> Round:
    r = Round()
    with Client(url) as c:
        for _ in range(args.probe_requests):  # idle
            t0 = time.perf_counter()
            c.attention(q, contexts=[probe_id])
            r.idle.append(time.perf_counter() - t0)
        n = chunk_keys(c.limits(), k, v)
    with TimedClient(url) as tc:
        for _ in range(args.repeat):  # inline ingest of one chunk's keys
            t0 = time.perf_counter()
            tc.attention(q, k[:n], v[:n])
            r.inline.append(common.Record(time.perf_counter() - t0, tc.last_stages()))
    with TimedClient(url) as tc:  # the upload alone: its speed and stages
        t0 = time.perf_counter()
        desc = tc.create_context(k, v, pipeline=args.pipeline,
                                 progress=lambda done, total: r.chunks.append(tc.last_stages()))
        r.upload_s = time.perf_counter() - t0
    check_and_delete(url, desc, len(k))
    with Client(url) as c, Probe(url, probe_id, q) as probe:  # again, with the probe querying meanwhile
        t0 = time.perf_counter()
        desc = c.create_context(k, v, pipeline=args.pipeline)
        t1 = time.perf_counter()
    r.probed_upload_s = t1 - t0
    r.during = probe.between(t0, t1)
    check_and_delete(url, desc, len(k))
    r.raw_s = raw_socket([k, v], args.raw_tries)
    return r


def raw_socket(arrays: Sequence[np.ndarray], tries: int) -> list[float]:
    """Seconds of each of ``tries`` loopback TCP transfers of ``arrays``' bytes into fresh memory of
    another process (:data:`RECEIVER`), from the connect to the receiver's answer."""
    nbytes = sum(a.nbytes for a in arrays)
    views = [memoryview(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) for a in arrays]
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(tries)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        seconds = []
        for _ in range(tries):
            t0 = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(nbytes.to_bytes(8, "little"))
                for view in views:
                    s.sendall(view)
                if s.recv(1) != b"k":
                    raise RuntimeError("the raw socket's receiver did not answer")
            seconds.append(time.perf_counter() - t0)
        proc.wait(timeout=30)
        return seconds
    finally:
        if proc.poll() is None:
            proc.kill()


def check_and_delete(url: str, desc: dict, n_k: int) -> None:
    if desc["length"] != n_k:
        raise RuntimeError(f"the upload stored {desc['length']} keys, not {n_k}")
    with Client(url) as c:
        c.delete_context(desc["id"])


def gbs(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def report(args: argparse.Namespace, rounds: list[Round], chunk: int, notes: list[str]) -> str:
    kv_bytes = 2 * args.n_k * HEADS["h_kv"] * HEADS["d"] * DTYPES[args.dtype].itemsize
    chunk_bytes = 2 * chunk * HEADS["h_kv"] * HEADS["d"] * DTYPES[args.dtype].itemsize
    inline = [gbs(chunk_bytes, statistics.median(x.seconds for x in r.inline)) for r in rounds]
    upload = [gbs(kv_bytes, r.upload_s) for r in rounds]
    raw = [gbs(kv_bytes, min(r.raw_s)) for r in rounds]
    raw_ratio = statistics.median(u / w for u, w in zip(upload, raw))
    probed = [gbs(kv_bytes, r.probed_upload_s) for r in rounds]
    idle99 = [percentile(r.idle, 99) for r in rounds]
    during99 = [percentile(r.during, 99) for r in rounds]
    ratio = statistics.median(upload) / statistics.median(inline)
    slow = statistics.median(during99) / statistics.median(idle99)
    rows = [[i + 1, f"{inline[i]:.3f}", f"{upload[i]:.3f}", f"{upload[i] / inline[i]:.2f}",
             f"{raw[i]:.3f}", f"{upload[i] / raw[i]:.2f}", f"{probed[i]:.3f}",
             common.ms(percentile(r.idle, 50)), common.ms(idle99[i]), common.ms(percentile(r.during, 50)),
             common.ms(during99[i]), len(r.during)] for i, r in enumerate(rounds)]
    rows.append(["median", f"{statistics.median(inline):.3f}", f"{statistics.median(upload):.3f}", f"{ratio:.2f}",
                 f"{statistics.median(raw):.3f}", f"{raw_ratio:.2f}", f"{statistics.median(probed):.3f}",
                 "", common.ms(statistics.median(idle99)), "", common.ms(statistics.median(during99)), ""])
    table = common.markdown_table(["round", "inline GB/s", "upload GB/s", "upload / inline",
                                   "raw socket GB/s (best of 3)", "upload / raw", "upload with probes GB/s", "probe idle p50 ms",
                                   "idle p99 ms", "during p50 ms", "during p99 ms", "probes during"], rows)
    inline_st = common.median_stages([x.stages for r in rounds for x in r.inline])
    chunk_st = common.median_stages([s for r in rounds for s in r.chunks])
    stages = common.markdown_table(
        ["request (one chunk)", "stages, median ms"],
        [["inline /v1/attention", ", ".join(f"{s} {common.ms(inline_st[s])}" for s in INLINE_STAGES if s in inline_st)],
         ["upload chunk", ", ".join(f"{s} {common.ms(chunk_st[s])}" for s in WRITE_STAGES if s in chunk_st)]])
    command = " ".join([".venv/bin/python", "benchmarks/uploads.py", *args.argv])
    lines = [f"### Upload benchmark, {datetime.date.today().isoformat()}", "", f"Command: `{command}`", "",
             *common.machine_lines(),
             (f"- context: {common.size_label(args.n_k)} keys of h_kv={HEADS['h_kv']}, d={HEADS['d']}, {args.dtype} "
              f"({common.bytes_label(kv_bytes)} of K+V); chunk: {common.size_label(chunk)} keys "
              f"({common.bytes_label(chunk_bytes)}); {args.rounds} rounds, {args.repeat} inline requests and "
              f"{args.probe_requests} idle probes per round; probe: decode over a {PROBE_KEYS}-key context; "
              f"{args.pipeline} chunks in flight"),
             *notes, "", table, "",
             (f"Targets: upload >= {UPLOAD_TARGET} x inline ingest: {ratio:.2f} ({common.met(ratio >= UPLOAD_TARGET)}); "
              f"upload >= {RAW_TARGET} x the raw socket: {raw_ratio:.2f} ({common.met(raw_ratio >= RAW_TARGET)}); "
              f"probe p99 during the upload <= {PROBE_TARGET:g} x idle: {slow:.2f} "
              f"({common.met(slow <= PROBE_TARGET)})"),
             "", "Server-Timing:", "", stages, ""]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a 64K-key context, one round: a smoke run")
    p.add_argument("--n-k", type=common.parse_keys, default=[1024 * common.KIB], help="context keys (default 1M)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--rounds", type=common.positive, default=3)
    p.add_argument("--repeat", type=common.positive, default=8, help="inline requests per round (default 8)")
    p.add_argument("--probe-requests", type=common.positive, default=100, help="idle probes per round (default 100)")
    p.add_argument("--pipeline", type=common.positive, default=2, help="chunks in flight (Client.create_context)")
    p.add_argument("--workers", type=common.positive, default=2)
    p.add_argument("--raw-tries", type=common.positive, default=3, help="raw socket transfers per round (best kept)")
    p.add_argument("--no-wait", action="store_true", help="do not wait for benchmarks/kernel.py to finish")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.n_k = args.n_k[0]
    if args.quick:
        args.n_k, args.rounds, args.repeat, args.probe_requests = 64 * common.KIB, 1, 2, 10
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    common.raise_on_sigterm()
    notes = [common.wait_for_quiet(not args.no_wait and not args.quick)]
    t0 = time.monotonic()
    k, v = kv_arrays(args.n_k, args.dtype, SEED)
    q = query(SEED, args.dtype)
    per_worker = bytes_per_key(HEADS["h_kv"], HEADS["d"], HEADS["d"], DTYPES[args.dtype]) * (args.n_k // args.workers + 1)
    env = {"SPLITKEY_WORKER_MEMORY_BYTES": str(int(per_worker * 1.1) + 256 * common.MIB)}
    with tempfile.TemporaryDirectory(prefix="splitkey-upload-bench-") as tmp, \
            common.splitkey_server(Path(tmp), workers=args.workers, env=env) as url:
        with Client(url) as c:
            probe_id = c.create_context(k[:PROBE_KEYS], v[:PROBE_KEYS])["id"]
            chunk = chunk_keys(c.limits(), k, v)
        rounds = [run_round(url, k, v, q, probe_id, args) for _ in range(args.rounds)]
    notes += [f"- load average after: {common.load_average()}", f"- whole run: {time.monotonic() - t0:.0f} s"]
    common.emit_report(report(args, rounds, chunk, notes), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
