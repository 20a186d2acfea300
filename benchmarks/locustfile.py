"""Drive splitkey with Locust: decode queries over a stored context, answers checked (docs/LOADTEST.md, "Locust").

    pip install locust
    locust -f benchmarks/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 60s \
        --splitkey-n-k 65536 --splitkey-dtype bfloat16

At the start of the test one context of ``--splitkey-n-k`` keys is uploaded (in chunks,
from the same seeded numbers ``splitkey loadtest`` uses); every simulated user then
sends decode queries over it as safetensors bodies through Locust's HTTP client, so
Locust's statistics, charts and distributed mode apply as usual. Every
``--splitkey-verify-every``-th answer of a user (its first included) is checked against
the float64 reference and counted as a failure when it differs. The context is deleted
when the test stops.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from locust import HttpUser, events, task

ROOT = Path(__file__).resolve().parents[1]
if sys.path[:1] != [str(ROOT)]:  # first: Locust puts benchmarks/ ahead, whose service.py is not the package
    sys.path.insert(0, str(ROOT))

from service.client import Client
from service.client.loadtest.config import TOLERANCE, Shape, parse_size
from service.client.loadtest.data import Segment, Source
from service.client.loadtest.reference import Expected, answers64, error
from service.client.loadtest.workloads import BASE_STREAM, upload
from service.wire.safetensors import decode_safetensors, encode_safetensors

#: What the test stores at its start: set by ``on_test_start``, read by the users.
STATE: dict[str, Any] = {}


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    parser.add_argument("--splitkey-n-k", default="64K", help="keys of the stored context (default 64K)")
    parser.add_argument("--splitkey-heads", default="32,8,128", help="h_q,h_kv,d (default 32,8,128)")
    parser.add_argument("--splitkey-dtype", default="float32", help="float32, bfloat16, float16 or float64")
    parser.add_argument("--splitkey-n-q", type=int, default=1, help="queries per request (default 1)")
    parser.add_argument("--splitkey-verify-every", type=int, default=10, help="check every Nth answer (default 10)")
    parser.add_argument("--splitkey-api-key", default="", help="bearer token, if the service has one")
    parser.add_argument("--splitkey-seed", type=int, default=0)


@events.test_start.add_listener
def on_test_start(environment: Any, **_kw: Any) -> None:
    opts = environment.parsed_options
    h_q, h_kv, d = (int(x) for x in opts.splitkey_heads.split(","))
    shape = Shape(h_q, h_kv, d, d, opts.splitkey_dtype)
    n_k = parse_size(opts.splitkey_n_k, "--splitkey-n-k")
    source = Source(opts.splitkey_seed, shape)
    with Client(environment.host, api_key=opts.splitkey_api_key or None) as client:
        STATE.update(ctx=upload(client, source, BASE_STREAM, n_k), source=source, n_k=n_k, n_q=opts.splitkey_n_q,
                     every=max(1, opts.splitkey_verify_every), key=opts.splitkey_api_key)


@events.test_stop.add_listener
def on_test_stop(environment: Any, **_kw: Any) -> None:
    ctx = STATE.pop("ctx", None)
    if ctx is not None:
        with Client(environment.host, api_key=STATE.get("key") or None) as client:
            client.delete_context(ctx)


class DecodeUser(HttpUser):
    """Decode queries over the stored context, one after another."""

    def on_start(self) -> None:
        self.sent = 0
        self.headers = {"Content-Type": "application/octet-stream", "Accept": "application/octet-stream"}
        if STATE.get("key"):
            self.headers["Authorization"] = f"Bearer {STATE['key']}"

    @task
    def decode(self) -> None:
        source: Source = STATE["source"]
        n = self.sent = self.sent + 1
        q = source.query(id(self) % 2**20 * 4096 + n % 4096, STATE["n_q"])
        body = b"".join(bytes(b) for b in encode_safetensors({"q": q}))
        with self.client.post(f"/v1/attention?contexts={STATE['ctx']}", data=body, headers=self.headers,
                              name="/v1/attention (decode)", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"{resp.status_code}: {resp.text[:200]}")
                return
            if (n - 1) % STATE["every"]:
                return
            got = decode_safetensors(resp.content, {"out", "lse"})
            asked = Expected(q, np.full(q.shape[0], STATE["n_k"]), (Segment(BASE_STREAM, 0, STATE["n_k"], 0),))
            [(out64, lse64)] = answers64(source, [asked])
            err = error(np.asarray(got["out"]), np.asarray(got["lse"]), out64, lse64)
            if not err <= TOLERANCE:
                resp.failure(f"wrong answer: relative error {err:.3g} against the float64 reference")
