"""The app as a Ray Serve application (service.serve): exact answers through Serve's proxy, and
a context created through one replica is seen and used through another, that second replica
added by Serve's autoscaling under load (from 1 to 2, with a target of 0.1 request each). Serve
asks each replica's check_health as it starts (one failing there fails the deploy: the fixture
sees it exit) and every 10 s after (one failing then is replaced, and would answer under a new
X-Splitkey-Frontend); what it checks: tests/unit/test_service_serve.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from reference import assert_close_to_reference
from server import ROOT, free_port, stop_front_end

from service.client import Client

pytestmark = [pytest.mark.ray,
              pytest.mark.skipif(importlib.util.find_spec("grpc") is None, reason="Ray Serve (ray[serve]) not installed")]


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory):
    home = tmp_path_factory.mktemp("serve-home")
    port = free_port()
    env = {**os.environ, "HOME": str(home), "SPLITKEY_WORKERS": "2", "SPLITKEY_WORKER_CPUS": "0.5",
           "SPLITKEY_MIN_SHARD_KEYS": "64", "SPLITKEY_CONTEXT_SHARD_KEYS": "256"}
    with (home / "serve.log").open("w") as log:
        # Autoscaled from 1 replica to 2 as soon as requests wait (the defaults: docs/DEPLOY.md "Ray Serve").
        autoscaling = ("--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "0.1",
                       "--upscale-delay-s", "0")
        proc = subprocess.Popen([sys.executable, "-m", "service.serve", "--port", str(port), *autoscaling],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, (home / "serve.log").read_text()
                assert time.monotonic() < deadline, "Serve did not become ready:\n" + (home / "serve.log").read_text()
                try:
                    if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            yield url
        finally:
            stop_front_end(proc, timeout_s=60)


def test_answers_through_serves_proxy_are_exact(serve_url, rng):
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    k = rng.standard_normal((300, 2, 16)).astype(np.float32)
    v = rng.standard_normal((300, 2, 8)).astype(np.float32)
    with Client(serve_url) as c:
        out, lse = c.attention(q, k, v, causal=True)
    assert_close_to_reference(out, lse, q, k, v, causal=True)
    r = httpx.get(serve_url + "/v1/contexts/ctx_none")
    assert r.status_code == 404 and r.json()["request_id"] == r.headers["x-request-id"]  # one id, Serve's


def test_a_context_created_through_one_replica_is_used_through_another(serve_url, rng):
    k = rng.standard_normal((600, 2, 16)).astype(np.float32)
    v = rng.standard_normal((600, 2, 8)).astype(np.float32)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    created = httpx.post(serve_url + "/v1/contexts", json={"k": k.tolist(), "v": v.tolist()}, timeout=60)
    assert created.status_code == 201, created.text
    ctx, creator = created.json()["id"], created.headers["x-splitkey-frontend"]
    answers: dict[str, bytes] = {}

    def ask(_: int) -> httpx.Response:
        return httpx.post(serve_url + "/v1/attention", json={"q": q.tolist(), "contexts": [ctx]}, timeout=60,
                          headers={"Accept": "application/json"})

    # Requests in flight make Serve add the second replica (a target of 0.1 each), then
    # reach both (Serve sends each to the replica with the shorter queue). Ask until both have answered.
    deadline = time.monotonic() + 120
    with ThreadPoolExecutor(8) as pool:
        while time.monotonic() < deadline:
            for r in pool.map(ask, range(16)):
                assert r.status_code == 200, r.text
                answers.setdefault(r.headers["x-splitkey-frontend"], r.content)
            if len(answers) == 2:
                break
    assert creator in answers and len(answers) == 2, f"only {list(answers)} answered"  # none replaced
    first, second = answers.values()
    assert first == second  # the same answer, bit for bit, whichever replica computed it
    with Client(serve_url) as c:
        out, lse = c.attention(q, contexts=[ctx])
    assert_close_to_reference(out, lse, q, k, v)
