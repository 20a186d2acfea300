"""The repair loop against a real crash: a worker process killed with SIGKILL (not ``ray.kill``)."""

import os
import signal
import time

import httpx
import numpy as np
import psutil
import pytest
from reference import assert_close_to_reference
from server import Server

from service.client import Client

pytestmark = pytest.mark.ray


def shard_worker_pids(root: int) -> list[int]:
    """The ShardWorker processes among ``root``'s descendants (the embedded Ray's workers)."""
    found = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if "ShardWorker" in " ".join(p.cmdline()) or "ShardWorker" in p.name():
                found.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def test_a_worker_process_killed_is_replaced_and_its_replicas_rebuilt(tmp_path):
    srv = Server(tmp_path, args=("--workers", "2"), env={"SPLITKEY_HEAL_INTERVAL_S": "0.5"})
    srv.start()
    try:
        rng = np.random.default_rng(3)
        k = rng.standard_normal((300, 2, 16)).astype(np.float32)
        v = rng.standard_normal((300, 2, 8)).astype(np.float32)
        q = rng.standard_normal((2, 4, 16)).astype(np.float32)
        with Client(srv.url) as c:
            ctx = c.create_context(k, v, replicas=2)["id"]
            pids = shard_worker_pids(srv.proc.pid)
            assert len(pids) == 2, pids
            os.kill(pids[0], signal.SIGKILL)  # a crash: Ray learns of it from the process, not from a kill call
            deadline = time.monotonic() + 60
            desc: dict = {}
            while time.monotonic() < deadline:
                desc = c.get_context(ctx)
                ready = httpx.get(srv.url + "/readyz", timeout=5).status_code == 200
                if ready and desc["state"] == "ready" and sorted(desc["live_replicas"]) == [2]:
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
