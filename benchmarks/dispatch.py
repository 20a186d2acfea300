"""What the app's dispatch costs per request, in process: the hot routes' direct dispatch against FastAPI's.

Run from the repository root::

    .venv/bin/python benchmarks/dispatch.py --calls 3000 --repeats 5 --out /tmp/dispatch.md

The app of ``service.app.create_app`` (no lifespan: no Ray, no workers) is called as an ASGI
callable, request after request in one event loop, no sockets: ``POST /v1/attention`` answers
503 ``workers_unavailable`` through the app's exception handlers, once through the hot routes'
direct dispatch (``service.hot_routes``) and once with that table emptied, so FastAPI's
routing, dependency solving and exception middleware dispatch it; ``GET /healthz`` goes
through FastAPI in both; a bare ASGI callable that answers the same 503 is the floor. The
difference between the first two rows is what the direct dispatch saves per request in a hot
loop (inside a server that also reads sockets and sleeps between requests it costs more).
The last variant is a decode query answered 200: ``q [1, 32, 128]`` float32 as safetensors over
a context id, ``Accept`` as ``Client`` sends it, the compute stubbed (the runtime's attention
service returns a fixed ``out, lse``): everything the front end does in Python for a decode
call but the worker's round trip (read the body, parse, negotiate, encode, Server-Timing,
metrics). Medians of ``--calls`` requests; each ``--repeats`` alternates the variants.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np

from benchmarks import common
from service.app import create_app
from service.hot_routes import HotRoutes
from service.core.metrics import Timings
from service.core.settings import ServiceSettings
from service.wire.safetensors import encode_safetensors, to_bytes

VARIANTS = ("POST /v1/attention, hot routes", "POST /v1/attention, FastAPI's dispatch", "GET /healthz, FastAPI",
            "bare ASGI callable", "POST /v1/attention answered, compute stubbed")

#: The answered variant's query and answer (decode shape).
Q = np.random.default_rng(1).standard_normal((1, 32, 128), dtype=np.float32)
Q_BODY = to_bytes(encode_safetensors({"q": Q}))
OUT, LSE = np.zeros((1, 32, 128), np.float32), np.zeros((1, 32), np.float32)


def scope(method: str, path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"splitkey"), (b"content-type", b"application/octet-stream"),
                        (b"content-length", b"0")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}


async def receive() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


def query_scope() -> dict:
    """A decode query over a context, as ``Client`` sends it."""
    s = scope("POST", "/v1/attention")
    s["query_string"] = b"contexts=0123456789abcdef"
    s["headers"] = [(b"host", b"splitkey"), (b"content-type", b"application/octet-stream"),
                    (b"content-length", str(len(Q_BODY)).encode()),
                    (b"accept", b"application/octet-stream, application/json")]
    return s


async def receive_query() -> dict:
    return {"type": "http.request", "body": Q_BODY, "more_body": False}


class StubAttention:
    """The runtime's attention service with the compute stubbed: a fixed answer, no workers."""

    async def attention(self, req: Any, timings: Timings, json_limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        timings.add("compute", 0.0)
        return OUT, LSE


async def bare(scope: dict, receive: Any, send: Any) -> None:
    body = b'{"detail":"workers unavailable","code":"workers_unavailable"}'
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def median_us(app: Any, method: str, path: str, calls: int, status: int,
                    make_scope: Callable[[], dict] | None = None,
                    body: Callable[[], Awaitable[dict]] = receive) -> float:
    answers: list[dict] = []

    async def send(message: dict) -> None:
        answers.append(message)

    seconds = []
    for _ in range(calls):
        sc = make_scope() if make_scope is not None else scope(method, path)
        t = time.perf_counter()
        await app(sc, body, send)
        seconds.append(time.perf_counter() - t)
        if answers[0]["status"] != status:
            raise RuntimeError(f"{method} {path} must answer {status}, got {answers[0]['status']}")
        answers.clear()
    return statistics.median(seconds) * 1e6


async def measure(calls: int, repeats: int) -> list[list[float]]:
    app = create_app(ServiceSettings())
    await median_us(app, "GET", "/healthz", 10, 200)  # builds the middleware stack
    node: Any = app.middleware_stack
    while not isinstance(node, HotRoutes):
        node = node.app
    hot = dict(node.routes)
    rows: list[list[float]] = []
    for _ in range(repeats):
        node.routes = hot
        direct = await median_us(app, "POST", "/v1/attention", calls, 503)
        node.routes = {}
        fastapi = await median_us(app, "POST", "/v1/attention", calls, 503)
        node.routes = hot
        row = [direct, fastapi, await median_us(app, "GET", "/healthz", calls, 200),
               await median_us(bare, "POST", "/v1/attention", calls, 503)]
        app.state.splitkey.runtime = SimpleNamespace(attention=StubAttention())
        try:
            row.append(await median_us(app, "POST", "/v1/attention", calls, 200, query_scope, receive_query))
        finally:
            app.state.splitkey.runtime = None
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=common.positive, default=3000)
    p.add_argument("--repeats", type=common.positive, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = asyncio.run(measure(args.calls, args.repeats))
    medians = [statistics.median(col) for col in zip(*rows)]
    text = "\n".join([
        f"### The app's dispatch in process (us per request, medians of {args.calls} requests)", "",
        "Command: `.venv/bin/python benchmarks/dispatch.py " + " ".join(argv if argv is not None else sys.argv[1:])
        + "`", "",
        common.markdown_table(["repeat", *VARIANTS],
                              [[str(i + 1), *(f"{v:.1f}" for v in row)] for i, row in enumerate(rows)]
                              + [["median", *(f"{v:.1f}" for v in medians)]]),
        "", f"The direct dispatch saves {medians[1] - medians[0]:.1f} us per request here.", ""])
    common.emit_report(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
