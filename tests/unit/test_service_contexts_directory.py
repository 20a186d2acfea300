"""The directory actor's records and leases, without Ray."""

import pytest

from service.contexts.directory import DirectoryActor


def record(ctx_id, version=1):
    return {"id": ctx_id, "version": version, "shards": [{"index": 0, "length": 5, "workers": ["w0", "w1"]}]}


def test_leases_exclude_other_owners_until_released():
    d = DirectoryActor([], "ns")
    assert d.acquire("c", "a", 60) and d.acquire("c", "a", 60)
    assert not d.acquire("c", "b", 60)
    d.release("c", "b")  # not the holder: no effect
    assert not d.acquire("c", "b", 60)
    d.release("c", "a")
    assert d.acquire("c", "b", 60)


def test_expired_leases_can_be_taken():
    d = DirectoryActor([], "ns")
    assert d.acquire("c", "a", -1)
    assert d.acquire("c", "b", 60)


def test_commit_to_an_existing_context_needs_the_lease():
    d = DirectoryActor([], "ns")
    d.commit(record("c"))
    d.acquire("c", "a", 60)
    try:
        d.commit(record("c", 2), owner="b")
        raise AssertionError("commit without the lease must fail")
    except ValueError as exc:
        assert "lease on c must be held by b" in str(exc)
    d.commit(record("c", 2), owner="a")
    assert d.get("c")["version"] == 2


def test_records_are_listed_in_id_order_and_removed_with_their_lease():
    d = DirectoryActor([], "ns")
    d.commit(record("c"))
    d.commit(record("a"))
    assert [r["id"] for r in d.all()] == ["a", "c"] and d.get_many(["c", "x"]) == [record("c"), None]
    assert d.acquire("c", "owner", 60)
    assert d.remove("c")["id"] == "c" and d.get("c") is None and [r["id"] for r in d.all()] == ["a"]
    assert d.acquire("c", "another", 60)  # the lease went with the record


def test_a_forgotten_worker_leaves_every_shard_and_each_record_is_versioned_again():
    d = DirectoryActor([], "ns")
    d.commit(record("c"))
    d.commit({"id": "e", "version": 4, "shards": [{"index": 0, "length": 5, "workers": ["w1"]},
                                                  {"index": 1, "length": 2, "workers": ["w2"]}]})
    assert d.forget_worker("w1") == 2
    assert d.get("c")["shards"][0]["workers"] == ["w0"] and d.get("c")["version"] == 2
    assert [s["workers"] for s in d.get("e")["shards"]] == [[], ["w2"]] and d.get("e")["version"] == 5
    assert d.forget_worker("w1") == 0 and d.get("c")["version"] == 2  # nothing left to forget: untouched


def test_a_replacement_keeps_the_replicas_it_reports_holding_in_full():
    """Another front end replaced the worker and rebuilt some replicas on it already: those stay."""
    d = DirectoryActor([], "ns")
    d.commit({"id": "e", "version": 1, "shards": [{"index": 0, "length": 5, "workers": ["w0", "w1"]},
                                                  {"index": 1, "length": 8, "workers": ["w0", "w1"]},
                                                  {"index": 2, "length": 0, "workers": ["w0", "w1"]}]})
    # Shard 0 rebuilt in full, shard 1 only partly (a stale copy), shard 2 empty and held.
    assert d.forget_worker("w1", {"e/0": 5, "e/1": 3, "e/2": 0}) == 1
    assert [s["workers"] for s in d.get("e")["shards"]] == [["w0", "w1"], ["w0"], ["w0", "w1"]]
    assert d.get("e")["version"] == 2


def test_health_says_ready_degraded_or_lost_from_the_live_workers():
    from service.contexts.records import health

    rec = {"id": "c", "replicas": 2, "shards": [{"index": 0, "length": 5, "workers": ["w0", "w1"]},
                                                {"index": 1, "length": 5, "workers": ["w1", "w2"]}]}
    assert health(rec, {"w0", "w1", "w2"}) == {"state": "ready", "live_replicas": [2, 2], "degraded_shards": [],
                                               "lost_shards": []}
    assert health(rec, {"w0", "w2"})["state"] == "degraded"
    assert health(rec, {"w0", "w2"})["degraded_shards"] == [0, 1]
    lost = health(rec, {"w0"})
    assert lost["state"] == "lost" and lost["lost_shards"] == [1] and lost["degraded_shards"] == [0]


def test_begin_takes_the_lease_and_reads_the_record_in_one_call():
    d = DirectoryActor([], "ns")
    d.commit(record("c"))
    assert d.begin("c", "a", 60) == (True, record("c"))
    assert d.begin("c", "b", 60) == (False, None)  # held by a
    assert d.begin("new", "b", 60) == (True, None)  # no such context (yet): the lease all the same
