"""Several Ray nodes on one machine (ray.cluster_utils.Cluster) behind front ends that join them.

Placement across nodes, a restarted or second front end, a restarted directory,
and killed workers, all with exact answers or the contract's error.
"""

import time

import httpx
import numpy as np
import pytest
import ray
from reference import assert_close_to_reference
from server import Server, three_nodes

from service.client import Client, SplitkeyError

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

NAMESPACE = "splitkey"


@pytest.fixture(scope="module")
def cluster():
    """Three one-CPU nodes on loopback, with Ray's token auth on (conftest sets the token)."""
    with three_nodes(NAMESPACE) as c:
        yield c


def front_end(cluster, tmp_path_factory, name, **env):
    """A front end joining the cluster at its address (it inherits the token from the environment)."""
    srv = Server(tmp_path_factory.mktemp(name), args=("--ray-address", cluster.address, "--workers", "3"),
                 env={"SPLITKEY_CONTEXT_SHARD_KEYS": "128", "SPLITKEY_HEAL_INTERVAL_S": "0.5", **env})
    return srv.start()


def directory_record(ctx_id: str) -> dict:
    """The context's record as the directory actor holds it."""
    return ray.get(ray.get_actor("splitkey-directory", namespace=NAMESPACE).get.remote(ctx_id))


def kv(rng, n):
    return rng.standard_normal((n, 2, 16)).astype(np.float32), rng.standard_normal((n, 2, 8)).astype(np.float32)


def test_replicas_land_on_distinct_nodes(cluster, tmp_path_factory):
    srv = front_end(cluster, tmp_path_factory, "fe-placement")
    try:
        with Client(srv.url) as c:
            info = c.cluster()
            assert len(info["nodes"]) == 3
            node_of = {w["name"]: w["node_id"] for w in info["workers"]}
            rng = np.random.default_rng(1)
            k, v = kv(rng, 600)
            ctx = c.create_context(k, v, replicas=2, shards=3)
            record = directory_record(ctx["id"])
            for shard in record["shards"]:
                nodes = [node_of[w] for w in shard["workers"]]
                assert len(set(nodes)) == 2, shard
            c.delete_context(ctx["id"])
    finally:
        srv.stop()


def test_a_restarted_or_second_front_end_sees_the_same_contexts(cluster, tmp_path_factory):
    rng = np.random.default_rng(2)
    k, v = kv(rng, 500)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    first = front_end(cluster, tmp_path_factory, "fe-first")
    with Client(first.url) as c:
        ctx = c.create_context(k, v, replicas=2)
    first.stop()
    second = front_end(cluster, tmp_path_factory, "fe-second")
    # Other worker settings: the running workers keep theirs, and the front end says so.
    third = front_end(cluster, tmp_path_factory, "fe-third", SPLITKEY_WORKER_MEMORY_BYTES=str(2**30))
    try:
        assert "keeps the settings it was started with" not in second.log()
        assert ("worker splitkey-worker-0 was running already and keeps the settings it was started with: "
                "memory_budget_bytes 4294967296 (this front end: 1073741824)") in third.log()
        for srv in (second, third):
            with Client(srv.url) as c:
                assert ctx["id"] in [x["id"] for x in c.list_contexts()]
                out, lse = c.attention(q, contexts=[ctx["id"]], causal=True)
                assert_close_to_reference(out, lse, q, k, v, causal=True)
        with Client(third.url) as c:
            c.delete_context(ctx["id"])
        with Client(second.url) as c, pytest.raises(SplitkeyError) as err:
            c.get_context(ctx["id"])
        assert err.value.status == 404
    finally:
        second.stop()
        third.stop()


def test_a_restarted_directory_rebuilds_from_the_workers(cluster, tmp_path_factory):
    rng = np.random.default_rng(3)
    k, v = kv(rng, 400)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    srv = front_end(cluster, tmp_path_factory, "fe-directory")
    try:
        with Client(srv.url) as c:
            ctx = c.create_context(k[:300], v[:300], replicas=2, shards=2)
            c.append(ctx["id"], k[300:], v[300:])
            directory = ray.get_actor("splitkey-directory", namespace=NAMESPACE)
            ray.kill(directory, no_restart=False)
            deadline = time.monotonic() + 60
            while True:
                try:
                    desc = c.get_context(ctx["id"])
                    break
                except SplitkeyError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            assert desc["length"] == 400 and desc["replicas"] == 2
            out, lse = c.attention(q, contexts=[ctx["id"]])
            assert_close_to_reference(out, lse, q, k, v)
            c.delete_context(ctx["id"])
    finally:
        srv.stop()


def test_killing_a_worker_leaves_every_answer_exact_with_two_replicas(cluster, tmp_path_factory):
    rng = np.random.default_rng(4)
    k, v = kv(rng, 900)
    srv = front_end(cluster, tmp_path_factory, "fe-kill")
    try:
        with Client(srv.url) as c:
            ctx = c.create_context(k, v, replicas=2, shards=3)
            qs = [rng.standard_normal((1, 4, 16)).astype(np.float32) for _ in range(12)]
            for i, q in enumerate(qs):
                if i == 4:
                    ray.kill(ray.get_actor("splitkey-worker-1", namespace=NAMESPACE))
                out, lse = c.attention(q, contexts=[ctx["id"]], causal=True)
                assert_close_to_reference(out, lse, q, k, v, causal=True)
            # The pool replaces the dead worker (empty); readiness comes back.
            deadline = time.monotonic() + 60
            while httpx.get(srv.url + "/readyz").status_code != 200:
                assert time.monotonic() < deadline, "the pool did not heal"
                time.sleep(0.5)
            out, lse = c.attention(qs[0], contexts=[ctx["id"]], causal=True)
            assert_close_to_reference(out, lse, qs[0], k, v, causal=True)
            c.delete_context(ctx["id"])
    finally:
        srv.stop()


def test_a_context_whose_only_replica_died_answers_503_context_lost(cluster, tmp_path_factory):
    rng = np.random.default_rng(5)
    k, v = kv(rng, 100)
    srv = front_end(cluster, tmp_path_factory, "fe-lost")
    try:
        with Client(srv.url, retries=0) as c:  # the server's own 503, not sent again
            ctx = c.create_context(k, v, replicas=1, shards=1)
            record = directory_record(ctx["id"])
            holder = record["shards"][0]["workers"][0]
            ray.kill(ray.get_actor(holder, namespace=NAMESPACE))
            # Dead once the front end sees it so (a query sent at once may reach the process before the kill
            # does, over the channel the create opened, and be answered).
            wait_for(lambda: c.get_context(ctx["id"])["state"] == "lost")
            with pytest.raises(SplitkeyError) as err:
                c.attention(rng.standard_normal((1, 2, 16)).astype(np.float32), contexts=[ctx["id"]])
            assert err.value.status == 503 and err.value.code == "context_lost"
            assert holder in err.value.detail or "shard 0" in err.value.detail
            c.delete_context(ctx["id"])
    finally:
        srv.stop()


def test_inline_request_retries_a_dead_worker_and_fails_503_when_none_is_left(cluster, tmp_path_factory):
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    k, v = kv(rng, 20000)  # 20000 keys: more than one inline shard
    srv = Server(tmp_path_factory.mktemp("fe-inline"), args=("--ray-address", cluster.address, "--workers", "3"),
                 env={"SPLITKEY_HEAL_INTERVAL_S": "3600", "SPLITKEY_MIN_SHARD_KEYS": "1000"}).start()
    try:
        with Client(srv.url, retries=0) as c:  # the server's own 503, not sent again
            ray.kill(ray.get_actor("splitkey-worker-0", namespace=NAMESPACE))
            out, lse = c.attention(q, k, v)  # the dead worker's shard moves to a live one
            assert_close_to_reference(out, lse, q, k, v)
            for name in ("splitkey-worker-1", "splitkey-worker-2"):
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            with pytest.raises(SplitkeyError) as err:
                c.attention(q, k, v)
            assert err.value.status == 503 and err.value.code == "workers_unavailable"
            assert "could not be computed" in err.value.detail
    finally:
        srv.stop()


def wait_for(predicate, timeout_s=60.0, poll_s=0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"not true within {timeout_s} s")


def test_a_killed_replica_is_forgotten_and_rebuilt_while_the_context_keeps_answering(cluster, tmp_path_factory):
    rng = np.random.default_rng(7)
    k, v = kv(rng, 900)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    srv = front_end(cluster, tmp_path_factory, "fe-repair")
    try:
        with Client(srv.url) as c:
            ctx = c.create_context(k[:600], v[:600], replicas=2, shards=3)
            assert ctx["state"] == "ready" and ctx["live_replicas"] == [2, 2, 2]
            record = directory_record(ctx["id"])
            victim = record["shards"][0]["workers"][0]
            ray.kill(ray.get_actor(victim, namespace=NAMESPACE))
            # Queries keep answering from the replica left, exactly.
            out, lse = c.attention(q, contexts=[ctx["id"]])
            assert_close_to_reference(out, lse, q, k[:600], v[:600])
            # The loop forgets the dead replica, replaces the worker and copies the shards back to 2
            # replicas. (Until the loop's next ping the context still reads "ready": wait for the repair.)
            wait_for(lambda: (r := c.cluster()["repair"])["workers_replaced"] >= 1 and r["replicas_rebuilt"] >= 1)
            desc = wait_for(lambda: (d := c.get_context(ctx["id"]))["state"] == "ready" and d)
            assert desc["live_replicas"] == [2, 2, 2] and desc["degraded_shards"] == [] and desc["lost_shards"] == []
            # The loop counts shards once a round (repair.py, _count): the round that rebuilt them may
            # have counted before its copies landed, so the next round's count is the one to read.
            repair = wait_for(lambda: (r := c.cluster()["repair"])["under_replicated_shards"] == 0
                              and r["lost_shards"] == 0 and r)
            metrics = httpx.get(srv.url + "/metrics").text
            assert 'splitkey_context_shards{state="lost"} 0.0' in metrics
            [rounds] = [float(line.split()[1]) for line in metrics.splitlines() if line.startswith("splitkey_repair_rounds_total ")]
            assert rounds >= repair["rounds"] >= 1  # the loop's rounds, read a moment later
            # Appends reach every replica again, the rebuilt ones included, and answers stay exact.
            c.append(ctx["id"], k[600:], v[600:])
            out, lse = c.attention(q, contexts=[ctx["id"]])
            assert_close_to_reference(out, lse, q, k, v)
            c.delete_context(ctx["id"])
    finally:
        srv.stop()


def test_a_context_whose_only_replica_died_reports_lost_and_refuses_appends(cluster, tmp_path_factory):
    rng = np.random.default_rng(8)
    k, v = kv(rng, 300)
    srv = front_end(cluster, tmp_path_factory, "fe-lost-state")
    try:
        with Client(srv.url, retries=0) as c:  # the server's own 503, not sent again
            ctx = c.create_context(k[:200], v[:200], replicas=1, shards=2)
            record = directory_record(ctx["id"])
            holder = record["shards"][1]["workers"][0]
            # Placement favours the worker holding the fewest bytes: both shards may be on the holder.
            lost = [s["index"] for s in record["shards"] if s["workers"] == [holder]]
            ray.kill(ray.get_actor(holder, namespace=NAMESPACE))
            desc = wait_for(lambda: (d := c.get_context(ctx["id"]))["state"] == "lost" and d)
            assert desc["lost_shards"] == lost and desc["live_replicas"][1] == 0 and desc["length"] == 200
            time.sleep(1.5)  # the replacement is up: it must not count as a replica
            assert c.get_context(ctx["id"])["state"] == "lost"
            with pytest.raises(SplitkeyError) as err:
                c.append(ctx["id"], k[200:], v[200:])
            assert err.value.status == 503 and err.value.code == "context_lost" and str(lost) in err.value.detail
            with pytest.raises(SplitkeyError) as err:
                c.attention(rng.standard_normal((1, 4, 16)).astype(np.float32), contexts=[ctx["id"]])
            assert err.value.status == 503 and err.value.code == "context_lost"
            assert c.get_context(ctx["id"])["length"] == 200  # nothing was half-written
            c.delete_context(ctx["id"])
    finally:
        srv.stop()


def cache_metric(url: str, series: str) -> float:
    """One series of the record cache's metrics, e.g. ``lookups_total{result="hit"}`` or ``stale_total``."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"splitkey_record_cache_{series} "):
            return float(line.split()[-1])
    raise AssertionError(f"no splitkey_record_cache_{series} in /metrics")


def test_a_front_end_never_answers_from_a_record_another_front_end_changed(cluster, tmp_path_factory):
    """A's cached record goes stale when B appends (new shards on other workers) and deletes: the
    workers refuse the old version, A reads the directory again, and answers as of B's writes."""
    rng = np.random.default_rng(5)
    k, v = kv(rng, 900)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    a = front_end(cluster, tmp_path_factory, "fe-cache-a")
    b = front_end(cluster, tmp_path_factory, "fe-cache-b")
    try:
        with Client(a.url) as ca, Client(b.url) as cb:
            ctx = ca.create_context(k[:200], v[:200])
            for _ in range(2):  # the second is answered from A's cache
                out, lse = ca.attention(q, contexts=[ctx["id"]], causal=True)
                assert_close_to_reference(out, lse, q, k[:200], v[:200], causal=True)
            assert cache_metric(a.url, 'lookups_total{result="hit"}') >= 1
            stale = cache_metric(a.url, "stale_total")
            assert cb.append(ctx["id"], k[200:], v[200:])["length"] == 900  # shards of 128 keys: new ones open
            out, lse = ca.attention(q, contexts=[ctx["id"]], causal=True)
            assert_close_to_reference(out, lse, q, k, v, causal=True)
            assert cache_metric(a.url, "stale_total") == stale + 1
            (out, lse), = ca.attention_batch([{"q": q, "contexts": [ctx["id"]], "causal": True}])
            assert_close_to_reference(out, lse, q, k, v, causal=True)
            cb.delete_context(ctx["id"])
            with pytest.raises(SplitkeyError) as info:
                ca.attention(q, contexts=[ctx["id"]])
            assert info.value.status == 404 and info.value.code == "context_not_found"
            err, = ca.attention_batch([{"q": q, "contexts": [ctx["id"]]}])
            assert isinstance(err, SplitkeyError) and err.status == 404
    finally:
        a.stop()
        b.stop()
