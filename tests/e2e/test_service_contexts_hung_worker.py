"""A worker process paused (SIGSTOP) during an append: the write's deadline fences it (issue 50).

Until 2026-12-06 the append waited for the paused worker for as long as it was paused (60 s and
more: it answered only after SIGCONT), and the paused worker, counted dead at its third missed
ping, was never replaced: it held its name. Now the append answers 503 within the write's bound,
the paused worker is killed and replaced, and the append sent again is stored once.
"""

import os
import signal
import threading
import time

import httpx
import numpy as np
import psutil
import pytest
from reference import assert_close_to_reference
from server import Server, shard_worker_pids

from service.client import Client
from service.client.errors import UploadError

pytestmark = pytest.mark.ray

#: --write-timeout for this test; a write to a hung worker answers within 4 x this (docs/CONTEXTS.md).
WRITE_TIMEOUT_S = 2.0
#: Room for the shared 2-core machine on top of that bound.
SLACK_S = 10.0
#: deploy/k8s/frontend.yaml's readiness probe timeout: a probe must answer within it.
PROBE_TIMEOUT_S = 3.0


def problem(seed: int, n_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [2, 4, 16], k [n_k, 2, 16], v [n_k, 2, 8], float32."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n_k, 2, 16)).astype(np.float32)
    v = rng.standard_normal((n_k, 2, 8)).astype(np.float32)
    return rng.standard_normal((2, 4, 16)).astype(np.float32), k, v


def timed_append(c: Client, ctx: str, k: np.ndarray, v: np.ndarray, bound_s: float) -> tuple[object, float]:
    """The append's description or its UploadError, and its seconds; None for an append still waiting past
    ``bound_s`` (it is left to finish in its thread)."""
    outcome: list[object] = []

    def send() -> None:
        try:
            outcome.append(c.append(ctx, k, v, retries=0))
        except UploadError as exc:
            outcome.append(exc)

    began = time.monotonic()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(bound_s)
    return (outcome[0] if outcome else None), time.monotonic() - began


def gone(pid: int) -> str:
    """"gone" once the process ended, else its state."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"
    return "gone" if status == psutil.STATUS_ZOMBIE else status


def test_an_append_to_a_paused_holder_answers_503_in_time_and_the_worker_is_replaced(tmp_path):
    srv = Server(tmp_path, args=("--workers", "2", "--write-timeout", str(WRITE_TIMEOUT_S)),
                 env={"SPLITKEY_HEAL_INTERVAL_S": "0.5"})
    srv.start()
    paused = None
    try:
        q, k, v = problem(5, 310)
        with Client(srv.url, timeout=120) as c:
            ctx = c.create_context(k[:300], v[:300], replicas=2)["id"]  # both workers hold every shard
            paused = shard_worker_pids(srv.proc.pid)[0]
            os.kill(paused, signal.SIGSTOP)
            outcome, took = timed_append(c, ctx, k[300:], v[300:], 4 * WRITE_TIMEOUT_S + SLACK_S)
            assert outcome is not None, f"the append did not answer in {took:.1f} s: it waits for the paused worker"
            assert isinstance(outcome, UploadError) and outcome.status == 503, outcome
            assert outcome.code == "workers_unavailable" and "send it again" in outcome.detail, outcome
            print(f"append answered {outcome.status} {took:.1f} s after the SIGSTOP")
            assert "answered neither a context write nor a ping" in srv.log(), srv.log()[-3000:]
            assert c.get_context(ctx)["length"] == 300  # not stored
            # Sent again (with after = the length read): stored once, on the replica left.
            assert c.append(ctx, k[300:], v[300:], chunk_keys=5)["length"] == 310
            deadline = time.monotonic() + 90
            desc: dict = {}
            while time.monotonic() < deadline:
                desc = c.get_context(ctx)
                if c.cluster()["repair"]["workers_replaced"] >= 1 and desc["live_replicas"] == [2] * len(
                        desc["live_replicas"]):
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"not replaced and rebuilt in 90 s: {desc}, repair {c.cluster()['repair']}, "
                            f"workers {c.cluster()['workers']}, the paused one {gone(paused)}")
            assert gone(paused) == "gone"
            out, lse = c.attention(q, contexts=[ctx])
            assert_close_to_reference(out, lse, q, k, v)  # every key once: the paused worker's write never ran
    finally:
        if paused is not None and psutil.pid_exists(paused):
            os.kill(paused, signal.SIGCONT)
        srv.stop()


def test_a_worker_paused_without_a_write_is_counted_dead_then_killed_and_replaced(tmp_path):
    """Counted dead at its third missed ping, a paused worker still holds its name: its replacement
    kills it first (until 2026-12-06 every round logged "its name is still held" and none came).

    Meanwhile the probes answer within an orchestrator's probe timeout and say ready: until 2026-12-07
    each waited 5 s for the paused worker's ping, past deploy/k8s/frontend.yaml's 3 s, so one hung
    worker took every front end out of its Service."""
    srv = Server(tmp_path, args=("--workers", "2"), env={"SPLITKEY_HEAL_INTERVAL_S": "0.5"})
    srv.start()
    paused = None
    try:
        q, k, v = problem(6, 200)
        with Client(srv.url, timeout=120) as c:
            ctx = c.create_context(k, v, replicas=2)["id"]
            paused = shard_worker_pids(srv.proc.pid)[0]
            os.kill(paused, signal.SIGSTOP)
            deadline = time.monotonic() + 120
            desc: dict = {}
            probes: list[tuple[str, int, float]] = []  # (path, status, seconds)
            while time.monotonic() < deadline:
                for path in ("/readyz", "/v2/health/ready", "/v1/cluster"):
                    began = time.monotonic()
                    status = httpx.get(srv.url + path, timeout=30).status_code
                    probes.append((path, status, time.monotonic() - began))
                desc = c.get_context(ctx)
                if c.cluster()["repair"]["workers_replaced"] >= 1 and desc["live_replicas"] == [2] * len(
                        desc["live_replicas"]):
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"not replaced and rebuilt in 120 s: {desc}, repair {c.cluster()['repair']}, "
                            f"the paused one {gone(paused)}")
            assert gone(paused) == "gone"
            slow = [p for p in probes if p[2] > PROBE_TIMEOUT_S or p[1] != 200]
            assert not slow, f"probes past {PROBE_TIMEOUT_S} s or not ready while a worker was paused: {slow}"
            out, lse = c.attention(q, contexts=[ctx])
            assert_close_to_reference(out, lse, q, k, v)
    finally:
        if paused is not None and psutil.pid_exists(paused):
            os.kill(paused, signal.SIGCONT)
        srv.stop()
