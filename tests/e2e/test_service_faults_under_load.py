"""Faults under load on three Ray nodes (docs/RELIABILITY.md): the load test's library drives
decode queries over a two-replica context, every answer checked against float64, while a
worker is killed, a node is removed, the directory is killed, or the front end is stopped."""

import contextlib
import io
import json
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
import ray
from server import Server, three_nodes

from service.client import Client, SplitkeyError
from service.client.loadtest import Shape, SweepConfig, run_sweep

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

NAMESPACE = "splitkey"
#: The load: decode queries over one two-replica context of 4096 keys, 4 clients, every answer checked.
LOAD_S = 10.0


@pytest.fixture(scope="module")
def cluster():
    """Three nodes on loopback (token auth on), one CPU each: one worker per node."""
    with three_nodes(NAMESPACE) as c:
        yield c


def front_end(cluster, home, workers: int = 3) -> Server:
    return Server(home, args=("--ray-address", cluster.address, "--workers", str(workers)),
                  env={"SPLITKEY_CONTEXT_SHARD_KEYS": "1024", "SPLITKEY_HEAL_INTERVAL_S": "0.5",
                       "SPLITKEY_SHUTDOWN_GRACE_S": "30"}).start()


def under_load(url: str, fault, at_s: float = 3.0, wait_for: tuple[str, ...] = ("ready", "replicas")):
    """Run the load for LOAD_S seconds, calling ``fault()`` after ``at_s``: ``(result, point, recovery)``.

    ``recovery``: seconds from the fault until ``/readyz`` is 200 again (``"ready"``) and until a
    witness context (two replicas, three shards, made before the load) is ``ready`` again
    (``"replicas"``: and a repair round that began after the fault has ended, since until the loop
    notices it the context still reads ready). After the load, the keys of ``wait_for`` are waited
    for up to 60 s; a key is missing if that did not happen by then (or was not waited for).
    """
    cfg = SweepConfig(url=url, modes=("decode",), n_k=(4096,), concurrency=(4,), requests=10**6,
                      duration_s=LOAD_S, warmup=1, replicas=2, verify_every=1,
                      shape=Shape(h_q=8, h_kv=2, d=32, d_v=32))
    rng = np.random.default_rng(0)
    with Client(url) as c:
        witness = c.create_context(rng.standard_normal((600, 2, 32)).astype(np.float32),
                                   rng.standard_normal((600, 2, 32)).astype(np.float32), replicas=2, shards=3)["id"]
    faulted: list[float] = []
    recovered: dict[str, float] = {}
    done = threading.Event()

    def inject() -> None:
        faulted.append(time.monotonic())
        fault()
        with Client(url, timeout=5) as c:
            # The witness reads "ready" until the repair loop notices the fault: it counts as back
            # only once a whole round that began after the fault has ended (the round after it began).
            after = None
            while not done.wait(0.2) and len(recovered) < 2:
                with contextlib.suppress(SplitkeyError, OSError, httpx.HTTPError, StopIteration):
                    rounds = repair_rounds(url)  # /metrics: /v1/cluster waits for pending workers' pings
                    after = rounds if after is None else after
                    if "replicas" not in recovered and rounds >= after + 2 \
                            and c.get_context(witness)["state"] == "ready":
                        recovered["replicas"] = time.monotonic() - faulted[0]
                with contextlib.suppress(httpx.HTTPError):  # /readyz pings every worker: seconds if one is pending
                    if "ready" not in recovered and httpx.get(url + "/readyz", timeout=15).status_code == 200:
                        recovered["ready"] = time.monotonic() - faulted[0]

    timer = threading.Timer(at_s, inject)
    timer.start()
    result = run_sweep(cfg, stream=io.StringIO())
    deadline = time.monotonic() + 60
    while not set(wait_for) <= recovered.keys() and timer.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    done.set()
    timer.join()
    with Client(url) as c:
        try:
            c.delete_context(witness)
        except (SplitkeyError, OSError):
            pass
    [point] = result.points
    return result, point, recovered


def repair_rounds(url: str) -> int:
    """The front end's ``splitkey_repair_rounds_total`` counter (rounds its repair loop has begun)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return int(float(next(line.split()[1] for line in text.splitlines()
                          if line.startswith("splitkey_repair_rounds_total "))))


def record(name: str, point, **extra) -> None:
    """With SPLITKEY_RELIABILITY_OUT set, append the scenario's figures there (docs/RELIABILITY.md)."""
    out = os.environ.get("SPLITKEY_RELIABILITY_OUT")
    if out:
        figures = {"scenario": name, "completed": point.completed, "failed": point.failed,
                   "failed_by": point.failed_by, "wrong": point.wrong, "verified": point.verified,
                   "requests_per_s": round(point.requests_per_s, 1), "p50_ms": round(point.latency_p50_ms, 1),
                   "p99_ms": round(point.latency_p99_ms, 1), "max_ms": round(point.latency_max_ms, 1), **extra}
        with open(out, "a") as f:
            f.write(json.dumps(figures) + "\n")


def assert_survived(point, min_success: float = 0.99) -> None:
    total = point.completed + point.failed
    assert point.wrong == 0 and point.verified == point.completed  # every answer checked, none wrong
    assert not any(key.startswith("500") for key in point.failed_by), point.failed_by
    assert point.completed >= min_success * total, (point.completed, total, point.failed_by)
    assert point.completed >= 20  # load was held


def test_a_worker_killed_mid_load(cluster, tmp_path):
    srv = front_end(cluster, tmp_path)
    try:
        victim = "splitkey-worker-1"
        killed: list[float] = []

        def fault() -> None:
            killed.append(time.monotonic())
            ray.kill(ray.get_actor(victim, namespace=NAMESPACE))

        _, point, recovery = under_load(srv.url, fault)
        record("worker killed", point, recovered_s=recovery)
        assert_survived(point)
        assert recovery.get("ready", 99) < 30 and recovery.get("replicas", 99) < 30, recovery
        with Client(srv.url) as c:
            assert c.cluster()["repair"]["workers_replaced"] >= 1
    finally:
        srv.stop()


def test_the_directory_killed_mid_load(cluster, tmp_path):
    srv = front_end(cluster, tmp_path)
    try:
        _, point, recovery = under_load(srv.url, lambda: ray.kill(
            ray.get_actor("splitkey-directory", namespace=NAMESPACE), no_restart=False))
        record("directory killed", point, recovered_s=recovery)
        assert_survived(point)
        assert recovery.get("ready", 99) < 30 and recovery.get("replicas", 99) < 30, recovery
    finally:
        srv.stop()


def test_a_node_removed_mid_load(cluster, tmp_path):
    srv = front_end(cluster, tmp_path)
    try:
        node = cluster.list_all_nodes()[2]

        def fault() -> None:
            cluster.remove_node(node)

        _, point, recovery = under_load(srv.url, fault, wait_for=("replicas",))
        record("node removed", point, recovered_s=recovery)
        assert_survived(point)
        # Replicas come back on the two nodes left. The front end stays ready (it serves every context
        # from them: issue 50, finding 3), and says a worker is missing while the third cannot be placed.
        assert recovery.get("replicas", 99) < 30, recovery
        ready = httpx.get(srv.url + "/readyz", timeout=30)
        assert ready.status_code == 200 and ready.json()["degraded"] and ready.json()["alive"] == 2, ready.text
        with Client(srv.url) as c:  # the lost replicas were rebuilt on the two nodes left
            assert c.cluster()["repair"]["replicas_rebuilt"] >= 1
    finally:
        srv.stop()
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()


def test_the_front_end_stopped_mid_load_drains_without_a_500(cluster, tmp_path):
    srv = front_end(cluster, tmp_path)
    # Nothing comes back after a stop: no recovery is waited for.
    _, point, _ = under_load(srv.url, lambda: os.kill(srv.proc.pid, signal.SIGTERM), wait_for=())
    assert srv.proc.wait(timeout=60) == 0
    record("front end SIGTERM", point)
    assert point.wrong == 0 and point.completed >= 20
    assert not any(key.startswith("500") for key in point.failed_by), point.failed_by
    # After the signal: answers in flight completed; what came later was refused, never half-done.
    assert set(point.failed_by) <= {"503 shutting_down", "0 ConnectionRefusedError", "0 RemoteDisconnected",
                                    "0 ConnectionResetError", "0 BrokenPipeError"}, point.failed_by
    srv.stop()
