"""``splitkey loadtest``: decode load against a running service over long contexts.

Stores one context of ``--n-k`` keys (uploaded in chunks, with a progress line on
stderr when it takes several; or sends them inline with ``--mode inline``), then
for each concurrency level runs closed-loop clients (one ``Client`` per thread) for
a bounded number of requests and a bounded time, and reports latency percentiles
and throughput. ``--check`` compares one answer
with an in-process float64 computation and fails the run (exit 1) past
``--tolerance``, so a fast wrong service cannot pass.
Loopback or your own hosts only: it stops by itself.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TextIO

import numpy as np

from service.client.errors import SplitkeyError, UploadError
from service.client.sync import Client
from workers.dtypes import DTYPES

#: Largest |out - float64 reference| ``--check`` accepts by default: the service
#: accumulates in float32 over inputs the reference reads exactly, so its error is
#: rounding of order 1e-6 for outputs of order 1.
CHECK_TOLERANCE = 1e-4
#: Keys generated at a time: K and V are drawn in float32 and cast chunk by chunk, so no
#: float32 copy of the whole context is ever made.
GENERATE_KEYS = 65536


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="service URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--mode", choices=["context", "inline"], default="context",
                   help="query a stored context (default) or send the keys with every request")
    p.add_argument("--n-k", type=int, default=65536, help="keys in the context (default 65536)")
    p.add_argument("--n-q", type=int, default=1, help="queries per request (default 1: decode)")
    p.add_argument("--h-q", type=int, default=32)
    p.add_argument("--h-kv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels (default 1,4,16)")
    p.add_argument("--requests", type=int, default=200, help="requests per level at most (default 200)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per level at most (default 30)")
    p.add_argument("--api-key-file", default=None)
    p.add_argument("--check", action="store_true", help="check one answer against a float64 computation; "
                   "exit 1 if it differs by more than --tolerance")
    p.add_argument("--tolerance", type=float, default=CHECK_TOLERANCE,
                   help=f"largest max |out - reference| --check accepts (default {CHECK_TOLERANCE:g})")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--seed", type=int, default=0)


@dataclass
class Level:
    concurrency: int
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    per_second: float


def random_kv(rng: np.random.Generator, n: int, h: int, d: int, dtype: np.dtype) -> np.ndarray:
    """``[n, h, d]`` standard normals in ``dtype`` (the same values as one float32 draw cast at once)."""
    out = np.empty((n, h, d), dtype)
    for lo in range(0, n, GENERATE_KEYS):
        hi = min(lo + GENERATE_KEYS, n)
        out[lo:hi] = rng.standard_normal((hi - lo, h, d), dtype=np.float32)
    return out


class UploadProgress:
    """``progress(done, total)`` of an upload, on ``stream`` (default stderr): percent, keys and GB/s.

    On a terminal one line rewrites itself; otherwise a line is written each time
    another tenth is done. An upload done in one chunk writes nothing.
    """

    def __init__(self, key_bytes: int, stream: TextIO | None = None) -> None:
        self.key_bytes = key_bytes
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.calls = 0
        self.tenths = 0  # tenths written so far (not on a terminal)

    def __call__(self, done: int, total: int) -> None:
        self.calls += 1
        if self.calls == 1 and done >= total:
            return
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        line = (f"upload {100 * done / total:5.1f}%  {done}/{total} keys  "
                f"{done * self.key_bytes / seconds / 1e9:.2f} GB/s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
        elif 10 * done // total > self.tenths:
            self.tenths = 10 * done // total
            self.stream.write(line + "\n")
        self.stream.flush()


def upload_failed(exc: SplitkeyError, dtype: str) -> str:
    """What to tell the user when the upload of a ``dtype`` context stopped."""
    hint = ""
    if exc.status == 507:
        smaller = "--dtype bfloat16 (half the bytes of float32), " if DTYPES[dtype].itemsize > 2 else ""
        hint = (f"; the workers' memory cannot hold the context: try {smaller}fewer keys (--n-k), or a server "
                "with more workers or a larger --worker-memory-bytes")
    return f"splitkey loadtest: the context upload failed: {exc}{hint}"


def run_level(make_client: Callable[[], Client], request: Callable[[Client], object], concurrency: int,
              max_requests: int, max_seconds: float) -> Level:
    """Closed loop: ``concurrency`` threads issue requests until either bound is hit."""
    lat: list[float] = []
    errors = [0]
    lock = threading.Lock()
    issued = [0]
    deadline = time.perf_counter() + max_seconds

    def worker() -> None:
        client = make_client()
        try:
            while True:
                with lock:
                    if issued[0] >= max_requests or time.perf_counter() > deadline:
                        return
                    issued[0] += 1
                t0 = time.perf_counter()
                try:
                    request(client)
                    dt = time.perf_counter() - t0
                    with lock:
                        lat.append(dt)
                except (SplitkeyError, OSError):
                    with lock:
                        errors[0] += 1
        finally:
            client.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ms = np.array(lat) * 1000 if lat else np.array([np.nan])
    return Level(concurrency, len(lat), errors[0], wall, float(np.percentile(ms, 50)), float(np.percentile(ms, 90)),
                 float(np.percentile(ms, 99)), len(lat) / wall if wall else 0.0)


def exact_check(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray) -> float:
    """Max abs difference between ``out`` and a float64 softmax attention of the same inputs."""
    g = q.shape[1] // k.shape[1]
    k64 = np.repeat(k.astype(np.float64), g, axis=1)  # [n_k, h_q, d]
    v64 = np.repeat(v.astype(np.float64), g, axis=1)  # [n_k, h_q, d_v]
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k64) / np.sqrt(q.shape[2])  # [h_q, n_q, n_k]
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hqk,khd->qhd", p, v64) / p.sum(-1).T[..., None]
    return float(np.max(np.abs(out - ref)))


def main(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if not levels or min(levels) < 1:
        print(f"splitkey loadtest: --concurrency must list ints >= 1, got {args.concurrency!r}", file=sys.stderr)
        return 2
    key = pathlib.Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    rng = np.random.default_rng(args.seed)
    dt = DTYPES[args.dtype]
    k = random_kv(rng, args.n_k, args.h_kv, args.d, dt)
    v = random_kv(rng, args.n_k, args.h_kv, args.d, dt)
    q = rng.standard_normal((args.n_q, args.h_q, args.d), dtype=np.float32).astype(dt)

    def make_client() -> Client:
        return Client(args.url, api_key=key)

    admin = make_client()
    ctx_id = None
    check_error = None
    try:
        if args.mode == "context":
            try:
                ctx_id = admin.create_context(k, v, replicas=args.replicas,
                                              progress=UploadProgress(k[:1].nbytes + v[:1].nbytes))["id"]
            except UploadError as exc:
                ctx_id = exc.context_id  # deleted below: a prefix of the keys
                print(upload_failed(exc, args.dtype), file=sys.stderr)
                return 1

            def request(c: Client) -> None:
                c.attention(q, contexts=[ctx_id])
        else:
            def request(c: Client) -> None:
                c.attention(q, k, v)

        if args.check:
            out, _ = (admin.attention(q, contexts=[ctx_id]) if ctx_id else admin.attention(q, k, v))
            check_error = exact_check(q, k, v, out)
            print(f"check: max |out - float64 reference| = {check_error:.3g} (tolerance {args.tolerance:g})")
        results = [run_level(make_client, request, c, args.requests, args.duration) for c in levels]
    finally:
        if ctx_id is not None:
            admin.delete_context(ctx_id)
        admin.close()
    kv_bytes = k.nbytes + v.nbytes
    print(f"{args.mode} n_k={args.n_k} n_q={args.n_q} h_q={args.h_q} h_kv={args.h_kv} d={args.d} {args.dtype} "
          f"({kv_bytes / 2**20:.0f} MiB of K+V)")
    print("concurrency  requests  errors  p50 ms  p90 ms  p99 ms  req/s")
    for r in results:
        print(f"{r.concurrency:11d}  {r.requests:8d}  {r.errors:6d}  {r.p50_ms:6.2f}  {r.p90_ms:6.2f}  {r.p99_ms:6.2f}  "
              f"{r.per_second:5.1f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "levels": [asdict(r) for r in results]},
                                                      indent=2, default=str))
    if check_error is not None and not check_error <= args.tolerance:
        print(f"splitkey loadtest: the checked answer must be within {args.tolerance:g} of the float64 reference, "
              f"got {check_error:.3g}", file=sys.stderr)
        return 1
    return 1 if any(r.errors for r in results) else 0
