"""The latency of the traced request (``benchmarks/trace_path.py``) in two checkouts, side by side in one run.

Run from the repository root (``pip install -e '.[test]'``)::

    .venv/bin/python benchmarks/path_latency.py . /tmp/before --rounds 10 --requests 100
    .venv/bin/python benchmarks/path_latency.py . /tmp/before --quick      # smoke run

The request is trace_path's: ``POST /v1/attention?contexts=ID`` with a safetensors body, decode
shape ``q [1, 8, 64]`` over a resident context of 4096 keys (``h_kv = 2``, float32) in two
shards, one per worker. Each checkout runs in a process of its own: its own ``create_app``
with its lifespan (a real embedded Ray whose workers import that checkout, two real shard
workers on the fused CPU kernel), requests through the real ASGI app (``httpx.ASGITransport``:
no socket, so the HTTP server's own time is left out and the code's is what differs).
After 50 untimed requests each, rounds alternate between the checkouts (A B, then B A), each
round ``--requests`` requests in a row. Reported per checkout: the median of the rounds'
medians with their range, the median over every request, and a digest of the answers (the
same digest: bitwise the same answers). The numba cache of each checkout is used as it is: a
checkout without one compiles the fused kernels first (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py

WARMUP = 50


def traced() -> Any:
    """``benchmarks/trace_path.py`` beside this file (not the measured checkout's): the request's shape,
    tensors and body."""
    spec = importlib.util.spec_from_file_location("trace_path", HERE / "trace_path.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"benchmarks/trace_path.py must be beside this script, got none in {HERE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def serve_rounds(root: str) -> None:
    """The child: one checkout's app; after WARMUP requests, answers each line of stdin (a count of
    requests) with one JSON line of their latencies in seconds and the last answer's digest."""
    import httpx
    import ray

    from service.app import create_app
    from service.core.settings import ServiceSettings

    namespace = f"path-latency-{os.getpid()}"
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=namespace, log_to_driver=False,
             logging_level="ERROR", runtime_env={"env_vars": {"PYTHONPATH": root}})
    trace = traced()
    settings = ServiceSettings(workers=2, ray_namespace=namespace, heal_interval_s=3600.0,
                               context_shard_keys=trace.N_K // 2, cpu_kernels="fused")
    app = create_app(settings)
    k, v, q = trace.request_tensors()
    binary, safetensors_body = trace.BINARY, trace.safetensors_body
    transport = httpx.ASGITransport(app=app)
    try:
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=transport, base_url="http://splitkey", timeout=300) as client:
            r = await client.post("/v1/contexts?shards=2", content=safetensors_body({"k": k, "v": v}), headers=binary)
            r.raise_for_status()
            url = f"/v1/attention?contexts={r.json()['id']}"
            body = safetensors_body({"q": q})
            for _ in range(WARMUP):
                (await client.post(url, content=body, headers=binary)).raise_for_status()
            print(json.dumps({"ready": True}), flush=True)
            for line in sys.stdin:
                seconds, digest = [], ""
                for _ in range(int(line)):
                    t0 = time.perf_counter()
                    r = await client.post(url, content=body, headers=binary)
                    seconds.append(time.perf_counter() - t0)
                    r.raise_for_status()
                    digest = hashlib.sha256(r.content).hexdigest()[:16]
                print(json.dumps({"seconds": seconds, "digest": digest}), flush=True)
    finally:
        ray.shutdown()


def compare(roots: list[str], rounds: int, requests: int) -> str:
    """Start both children, alternate their rounds, and the report as Markdown."""
    kids = {}
    for root in roots:
        env = {**os.environ, "PYTHONPATH": root, "SPLITKEY_CPU_KERNELS": "fused"}
        kids[root] = subprocess.Popen([sys.executable, __file__, "--child", root], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env, cwd=root)
    try:
        for root, kid in kids.items():
            line = kid.stdout.readline() if kid.stdout else ""
            if not line or not json.loads(line).get("ready"):
                raise RuntimeError(f"the service of {root} did not start (see its stderr above)")
        every: dict[str, list[float]] = {r: [] for r in roots}
        medians: dict[str, list[float]] = {r: [] for r in roots}
        digests: dict[str, set[str]] = {r: set() for r in roots}
        for i in range(rounds):
            for root in roots if i % 2 == 0 else roots[::-1]:
                kid = kids[root]
                assert kid.stdin is not None and kid.stdout is not None
                kid.stdin.write(f"{requests}\n")
                kid.stdin.flush()
                got = json.loads(kid.stdout.readline())
                every[root] += got["seconds"]
                medians[root].append(statistics.median(got["seconds"]))
                digests[root].add(got["digest"])
    finally:
        for kid in kids.values():
            if kid.stdin is not None:
                kid.stdin.close()
            kid.wait(timeout=300)
    shape = traced()
    lines = [(f"### The traced request's latency, {len(roots)} checkouts side by side "
             f"({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())})"), "",
             f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
             (f"`POST /v1/attention?contexts=ID`, q [1, {shape.H_Q}, {shape.D}] over {shape.N_K} keys "
              f"(h_kv {shape.H_KV}, float32) in two shards, in process through the ASGI app, fused CPU kernel; "
              f"{rounds} rounds of {requests} requests, alternating. Milliseconds."), "",
             "| checkout | median of round medians | rounds' range | median of every request | answers |",
             "| --- | --- | --- | --- | --- |"]
    for root in roots:
        ms = [m * 1e3 for m in medians[root]]
        lines.append(f"| {root} | {statistics.median(ms):.3f} | {min(ms):.3f}-{max(ms):.3f} | "
                     f"{statistics.median(every[root]) * 1e3:.3f} | {', '.join(sorted(digests[root]))} |")
    same = len({frozenset(d) for d in digests.values()}) == 1
    lines += ["", f"Bitwise the same answers in every checkout: {'yes' if same else 'NO'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("roots", nargs="*", help="two checkouts (repository roots) to compare")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--requests", type=int, default=100, help="requests per round")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 10 requests")
    p.add_argument("--out", default=None, help="also write the report here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        sys.path.insert(0, args.child)
        asyncio.run(serve_rounds(args.child))
        return 0
    if len(args.roots) != 2:
        p.error(f"roots must name two checkouts, got {len(args.roots)}")
    roots = [str(Path(r).resolve()) for r in args.roots]
    rounds, requests = (2, 10) if args.quick else (args.rounds, args.requests)
    report = compare(roots, rounds, requests)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
