"""`splitkey serve --persist-dir`: a context deleted while one of its holders was dead stays deleted when
that worker is replaced (it loads the dead one's folder) and when the whole service restarts."""

import os
import signal
import time

import numpy as np
import psutil
import pytest
from reference import assert_close_to_reference
from server import Server
from server import shard_worker_pids

from service.client import Client, SplitkeyError

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def serve(home, store) -> Server:
    return Server(home, args=("--workers", "2", "--persist-dir", str(store)),
                  env={"SPLITKEY_CONTEXT_SHARD_KEYS": "256", "SPLITKEY_MIN_SHARD_KEYS": "64",
                       "SPLITKEY_HEAL_INTERVAL_S": "3", "SPLITKEY_TOMBSTONE_HORIZON_S": "0"}).start()


def files_of(store, ctx_id) -> list:
    """The files and folders of a context under the store (its tombstones, ``.deleted/<id>``, are not)."""
    return [p for p in store.rglob("*") if ctx_id in p.parts and ".deleted" not in p.parts]


def tombstones_of(store, ctx_id) -> list:
    return list(store.glob(f"*/.deleted/{ctx_id}"))


def test_a_context_deleted_while_a_holder_was_dead_stays_deleted_after_its_replacement_and_a_restart(tmp_path):
    """With a tombstone horizon of 0, its tombstones go too, once the replacement's folder is clean."""
    rng = np.random.default_rng(11)
    k, v = rng.standard_normal((200, 2, 16)).astype(np.float32), rng.standard_normal((200, 2, 8)).astype(np.float32)
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    store = tmp_path / "store"
    srv = serve(tmp_path / "a", store)
    try:
        with Client(srv.url) as c:
            gone = c.create_context(k, v, replicas=2)["id"]  # one shard, on both workers
            kept = c.create_context(k, v, replicas=2)["id"]
            before = c.attention(q, contexts=[kept])
            assert len(files_of(store, gone)) > 0
            pids = shard_worker_pids(srv.proc.pid)
            assert len(pids) == 2, pids
            killed = psutil.Process(pids[0])  # before the kill: the pid may be reaped at once
            os.kill(pids[0], signal.SIGKILL)
            killed.wait(timeout=30)
            c.delete_context(gone)  # its folder on the dead worker is out of reach: the delete answers all the same
            with pytest.raises(SplitkeyError) as err:
                c.get_context(gone)
            assert err.value.status == 404
            deadline = time.monotonic() + 90
            cluster: dict = {}
            while time.monotonic() < deadline:
                cluster = c.cluster()
                workers = cluster["workers"]
                if cluster["repair"]["workers_replaced"] >= 1 and all(w["alive"] for w in workers) \
                        and [w["shards"] for w in workers] == [1, 1] and not files_of(store, gone) \
                        and cluster["repair"]["tombstones_forgotten"] >= 1 and not tombstones_of(store, gone):
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"the replacement still holds the deleted context, or its tombstones are left, after "
                            f"90 s: {cluster}, files {files_of(store, gone)}, tombstones {tombstones_of(store, gone)}")
            with pytest.raises(SplitkeyError) as err:
                c.get_context(gone)
            assert err.value.status == 404
    finally:
        srv.stop()
    srv = serve(tmp_path / "b", store)
    try:
        with Client(srv.url) as c:
            assert [d["id"] for d in c.list_contexts()] == [kept]
            with pytest.raises(SplitkeyError) as err:
                c.get_context(gone)
            assert err.value.status == 404
            out, lse = c.attention(q, contexts=[kept])
            assert out.tobytes() == before[0].tobytes() and lse.tobytes() == before[1].tobytes()
            assert_close_to_reference(out, lse, q, k, v)
        assert not files_of(store, gone), files_of(store, gone)
    finally:
        srv.stop()
