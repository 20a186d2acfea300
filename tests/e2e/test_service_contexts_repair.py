"""The repair loop against a real crash: a worker process killed with SIGKILL (not ``ray.kill``)."""

import os
import signal
import time

import httpx
import numpy as np
import pytest
from reference import assert_close_to_reference
from server import Server, shard_worker_pids

from service.client import Client

pytestmark = pytest.mark.ray




def problem(seed: int, n_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [2, 4, 16], k [n_k, 2, 16], v [n_k, 2, 8], float32."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n_k, 2, 16)).astype(np.float32)
    v = rng.standard_normal((n_k, 2, 8)).astype(np.float32)
    return rng.standard_normal((2, 4, 16)).astype(np.float32), k, v


def test_a_worker_process_killed_is_replaced_and_its_replicas_rebuilt(tmp_path):
    srv = Server(tmp_path, args=("--workers", "2"), env={"SPLITKEY_HEAL_INTERVAL_S": "0.5"})
    srv.start()
    try:
        q, k, v = problem(3, 300)
        with Client(srv.url) as c:
            ctx = c.create_context(k, v, replicas=2)["id"]
            pids = shard_worker_pids(srv.proc.pid)
            assert len(pids) == 2, pids
            os.kill(pids[0], signal.SIGKILL)  # a crash: Ray learns of it from the process, not from a kill call
            deadline = time.monotonic() + 60
            desc: dict = {}
            while time.monotonic() < deadline:
                desc = c.get_context(ctx)
                ready = httpx.get(srv.url + "/readyz", timeout=5)  # ready throughout; degraded until replaced
                whole = ready.status_code == 200 and not ready.json()["degraded"]
                replaced = c.cluster()["repair"]["workers_replaced"] >= 1
                if whole and replaced and desc["state"] == "ready" and sorted(desc["live_replicas"]) == [2]:
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"not repaired in 60 s: {desc}, repair {c.cluster()['repair']}")
            assert c.cluster()["repair"]["workers_replaced"] >= 1
            assert pids[0] not in shard_worker_pids(srv.proc.pid)
            # The rebuilt replica is sized as the original (its keys: no expected_length), not for a
            # whole --context-shard-keys: both workers hold the same bytes once the pings catch up.
            held: list = []
            while time.monotonic() < deadline + 30:
                held = [w["bytes_held"] for w in c.cluster()["workers"]]
                if len(set(held)) == 1:
                    break
                time.sleep(0.5)
            assert len(set(held)) == 1 and held[0] > 0, held
            out, lse = c.attention(q, contexts=[ctx])
            assert_close_to_reference(out, lse, q, k, v)
    finally:
        srv.stop()


def test_a_worker_that_misses_a_ping_or_two_keeps_its_replicas(tmp_path):
    """A paused worker (SIGSTOP: alive, not answering) for longer than one 5 s ping is not counted
    dead: counting it dead would forget the only replica of its shards and lose the context."""
    srv = Server(tmp_path, args=("--workers", "1"), env={"SPLITKEY_HEAL_INTERVAL_S": "0.5"})
    srv.start()
    try:
        q, k, v = problem(4, 200)
        with Client(srv.url) as c:
            ctx = c.create_context(k, v)["id"]
            [pid] = shard_worker_pids(srv.proc.pid)
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(8.0)  # one round's ping times out (5 s), the next is under way
            finally:
                os.kill(pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while "did not answer a ping" not in srv.log() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "did not answer a ping within 5 s (1 in a row; dead at 3)" in srv.log(), srv.log()[-2000:]
            time.sleep(6.0)  # the rounds after the pause: answered again
            assert "counted dead" not in srv.log() and "died" not in srv.log(), srv.log()[-2000:]
            assert c.cluster()["repair"]["workers_replaced"] == 0
            assert c.get_context(ctx)["state"] == "ready"
            out, lse = c.attention(q, contexts=[ctx])
            assert_close_to_reference(out, lse, q, k, v)
    finally:
        srv.stop()


def test_a_dead_worker_is_listed_holding_nothing(tmp_path):
    """Until it is replaced, a dead worker shows in /v1/cluster and /metrics as dead and holding no
    bytes or shards (its replicas are forgotten), and the total counts only the live ones."""
    srv = Server(tmp_path, args=("--workers", "2"), env={"SPLITKEY_HEAL_INTERVAL_S": "3600"})
    srv.start()
    try:
        _, k, v = problem(5, 300)
        with Client(srv.url) as c:
            c.create_context(k, v, replicas=2)
            before = c.cluster()["workers"]
            assert all(w["alive"] and w["bytes_held"] > 0 and w["shards"] > 0 for w in before), before
            pids = shard_worker_pids(srv.proc.pid)
            assert len(pids) == 2, pids
            os.kill(pids[0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            cluster: dict = {}
            while time.monotonic() < deadline:
                cluster = c.cluster()
                if sum(not w["alive"] for w in cluster["workers"]) == 1:
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"the killed worker was not seen dead in 60 s: {cluster}")
            [dead] = [w for w in cluster["workers"] if not w["alive"]]
            [live] = [w for w in cluster["workers"] if w["alive"]]
            assert dead["bytes_held"] == 0 and dead["shards"] == 0 and dead["calls"] == 0, dead
            assert live["bytes_held"] > 0 and cluster["bytes_held"] == live["bytes_held"], cluster
            metrics = httpx.get(srv.url + "/metrics", timeout=10).text
            assert f'splitkey_worker_held_bytes{{worker="{dead["name"]}"}} 0.0' in metrics
    finally:
        srv.stop()


def test_a_lost_shard_reloaded_from_disk_by_its_restarted_worker_is_served_again_within_seconds(tmp_path):
    """Issue 50, finding 1: with --persist-dir, a SIGKILLed only holder comes back (Ray restarts it) holding
    its shard from disk; the context was kept `lost` (appends told to delete it) until a full restart."""
    srv = Server(tmp_path, args=("--workers", "2", "--persist-dir", str(tmp_path / "store")),
                 env={"SPLITKEY_HEAL_INTERVAL_S": "0.5"})
    srv.start()
    try:
        q, k, v = problem(5, 400)
        with Client(srv.url) as c:
            ctx = c.create_context(k[:300], v[:300], shards=2)["id"]  # replicas 1: a shard on each worker
            c.append(ctx, k[300:], v[300:])
            before = c.attention(q, contexts=[ctx])
            pids = shard_worker_pids(srv.proc.pid)
            assert len(pids) == 2, pids
            os.kill(pids[0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            desc: dict = {}
            seen_lost = False
            while time.monotonic() < deadline:
                desc = c.get_context(ctx)
                seen_lost = seen_lost or desc["state"] == "lost"
                if seen_lost and desc["state"] == "ready":
                    break
                time.sleep(0.25)
            else:
                pytest.fail(f"not served again in 60 s: {desc}, repair {c.cluster()['repair']}")
            assert c.cluster()["repair"]["replicas_readopted"] >= 1
            out, lse = c.attention(q, contexts=[ctx])
            assert out.tobytes() == before[0].tobytes() and lse.tobytes() == before[1].tobytes()
            assert c.append(ctx, k[:3], v[:3])["length"] == 403  # writable again
    finally:
        srv.stop()
