"""`splitkey serve --cpu-kernels fused`: the workers compile the fused kernel as they start (a cold
compile takes about a minute here: the start waits for it) and serve decode-shaped queries with it,
inline and over resident contexts, within the one-shot error of the float64 reference."""

import time

import httpx
import numpy as np
import pytest
from reference import assert_close_to_reference
from server import Server

from service.client import Client
from workers import BFLOAT16

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


def test_a_service_started_with_the_fused_kernel_serves_with_it(tmp_path):
    srv = Server(tmp_path, args=("--workers", "1", "--cpu-kernels", "fused"), startup_s=480).start()
    try:
        rng = np.random.default_rng(9)
        with Client(srv.url) as c:
            assert [w["cpu_kernels"] for w in c.cluster()["workers"]] == ["fused"]
            assert "splitkey workers up: 1 cpu workers" in srv.log()
            for dtype in (np.float32, BFLOAT16, np.float16):
                k = rng.standard_normal((700, 2, 32)).astype(dtype)
                v = rng.standard_normal((700, 2, 16)).astype(dtype)
                q = rng.standard_normal((1, 8, 32)).astype(dtype)  # decode: g = 4 query rows per kv head
                out, lse = c.attention(q, k, v)
                assert_close_to_reference(out, lse, q, k, v)
                ctx = c.create_context(k[:400], v[:400])["id"]
                c.append(ctx, k[400:], v[400:])
                out, lse = c.attention(q, contexts=[ctx], causal=True, q_pos=np.array([650]))
                assert_close_to_reference(out, lse, q, k[:651], v[:651])
                c.delete_context(ctx)
    finally:
        srv.stop()


def test_the_default_auto_kernel_switches_each_worker_to_fused_and_says_since_when(tmp_path, rng):
    server = Server(tmp_path, args=("--workers", "2"))
    server.env.pop("SPLITKEY_CPU_KERNELS", None)  # the tests' conftest pins numpy: the default here, auto
    server.start()
    try:
        with Client(server.url) as client:
            auto_switches(client, server, rng)
    finally:
        server.stop()


def auto_switches(client, server, rng):
    k = rng.standard_normal((900, 2, 32)).astype(np.float32)
    v = rng.standard_normal((900, 2, 16)).astype(np.float32)
    q = rng.standard_normal((1, 8, 32)).astype(np.float32)
    ctx = client.create_context(k, v)["id"]
    deadline = time.monotonic() + 300  # a warm disk cache (CI runs `splitkey warm` first): seconds
    while True:
        out, lse = client.attention(q, contexts=[ctx], q_pos=np.array([899]))  # served meanwhile, on either kernel
        assert_close_to_reference(out, lse, q, k, v)
        workers = client.cluster()["workers"]
        if all(w["cpu_kernels"] == "fused" for w in workers) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [w["cpu_kernels"] for w in workers] == ["fused"] * len(workers), workers
    assert all(0 < w["cpu_kernels_since"] <= time.time() for w in workers), workers
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    for w in workers:
        assert f'splitkey_worker_cpu_kernel{{kernel="fused",worker="{w["name"]}"}} 1.0' in metrics
        assert f'splitkey_worker_cpu_kernel{{kernel="numpy",worker="{w["name"]}"}} 0.0' in metrics
        assert f'splitkey_worker_cpu_kernel_since_seconds{{worker="{w["name"]}"}}' in metrics
    client.delete_context(ctx)
