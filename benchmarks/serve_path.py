"""Ray Serve's proxy against uvicorn direct (issue 13): the same app, the same workers' settings,
side by side in one run.

Run from the repository root::

    .venv/bin/python benchmarks/serve_path.py --rounds 5 --out /tmp/serve_path.md
    .venv/bin/python benchmarks/serve_path.py --quick        # smoke run

Two services run at once on this machine: ``splitkey serve --workers 2`` (uvicorn, the
default) and ``python -m service.serve --replicas 2`` (two front-end replicas behind Serve's
HTTP proxy), each with its own embedded Ray and two workers of half a CPU. Each round
alternates between them and measures, on one keep-alive connection:

* a small request: decode-shaped inline attention, ``q [1, 8, 64]`` over 256 keys
  (``h_kv=2``, float32, safetensors both ways), ``--small`` requests; median latency;
* a large inline request: ``q [1, 8, 64]`` over ``--large-keys`` keys (default 64K:
  a 64 MiB body), ``--large`` requests; median seconds and body GB/s.

Answers are compared bitwise between the two paths. Medians over rounds of the
per-round medians are reported, with the spread (min-max of the rounds).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common
from service.client import Client

WORKER_ENV = {"SPLITKEY_WORKER_CPUS": "0.5", "PYTHONUNBUFFERED": "1"}


@contextmanager
def serve_app(workdir: Path, replicas: int) -> Iterator[str]:
    """``python -m service.serve`` on a free loopback port, two workers; yields its URL."""
    port = common.free_port()
    home = workdir / f"serve-home-{port}"
    home.mkdir(parents=True)
    env = {**os.environ, "HOME": str(home), "SPLITKEY_WORKERS": "2", **WORKER_ENV}
    cmd = [sys.executable, "-m", "service.serve", "--port", str(port), "--replicas", str(replicas)]
    url = f"http://127.0.0.1:{port}"
    with common.served(cmd, env, url + "/readyz", workdir / f"serve-{port}.log"):
        yield url


def problem(n_k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 8, 64), dtype=np.float32)
    k = rng.standard_normal((n_k, 2, 64), dtype=np.float32)
    v = rng.standard_normal((n_k, 2, 64), dtype=np.float32)
    return q, k, v


def timed(url: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """Median seconds of ``n`` requests (after one warm-up) and the answer."""
    with Client(url, timeout=300) as c:
        out, _ = c.attention(q, k, v)
        seconds = []
        for _ in range(n):
            t0 = time.perf_counter()
            out, _ = c.attention(q, k, v)
            seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), out


def run(args: argparse.Namespace) -> str:
    small = problem(256, 1)
    large = problem(args.large_keys, 2)
    large_bytes = sum(a.nbytes for a in large)
    results: dict[str, dict[str, list[float]]] = {p: {"small": [], "large": []} for p in ("uvicorn", "serve")}
    mismatches = 0
    with tempfile.TemporaryDirectory(prefix="serve-path-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        urls = {"uvicorn": stack.enter_context(common.splitkey_server(work, workers=2, env=WORKER_ENV)),
                "serve": stack.enter_context(serve_app(work, replicas=2))}
        for r in range(args.rounds):
            answers = {}
            for path in (("uvicorn", "serve") if r % 2 == 0 else ("serve", "uvicorn")):
                s, out_small = timed(urls[path], *small, args.small)
                g, out_large = timed(urls[path], *large, args.large)
                results[path]["small"].append(s)
                results[path]["large"].append(g)
                answers[path] = (out_small.tobytes(), out_large.tobytes())
            mismatches += answers["uvicorn"] != answers["serve"]
    rows = []
    for path in ("uvicorn", "serve"):
        s, g = common.summarize(results[path]["small"]), common.summarize(results[path]["large"])
        rows.append([path, common.ms_spread(s), common.ms_spread(g), f"{large_bytes / g.p50 / 1e9:.2f}"])
    ratio_small = statistics.median(results["serve"]["small"]) / statistics.median(results["uvicorn"]["small"])
    ratio_large = statistics.median(results["serve"]["large"]) / statistics.median(results["uvicorn"]["large"])
    lines = [
        f"# Ray Serve's proxy against uvicorn direct ({datetime.date.today()})", "",
        *common.machine_lines(),
        f"- command: `{' '.join(['.venv/bin/python', 'benchmarks/serve_path.py', *sys.argv[1:]])}`",
        (f"- {args.rounds} rounds, alternating; small: {args.small} requests of q [1, 8, 64] over 256 keys; "
         f"large: {args.large} requests over {common.size_label(args.large_keys)} keys "
         f"({common.bytes_label(large_bytes)} body); two workers each; Serve with two replicas"), "",
        common.markdown_table(["path", "small p50 ms (spread)", "large ms (spread)", "large body GB/s"], rows),
        "",
        (f"Serve / uvicorn: small {ratio_small:.2f}x, large {ratio_large:.2f}x; "
         f"answers bitwise equal in {args.rounds - mismatches} of {args.rounds} rounds."),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=common.positive, default=5)
    p.add_argument("--small", type=common.positive, default=200, help="small requests per round (default 200)")
    p.add_argument("--large", type=common.positive, default=5, help="large requests per round (default 5)")
    p.add_argument("--large-keys", type=common.parse_keys, default=[65536], help="keys of the large request (64K)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, few requests, 4K keys")
    p.add_argument("--out", help="also write the report here")
    args = p.parse_args(argv)
    args.large_keys = args.large_keys[0]
    if args.quick:
        args.rounds, args.small, args.large, args.large_keys = 1, 10, 2, 4096
    common.raise_on_sigterm()
    common.emit_report(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
