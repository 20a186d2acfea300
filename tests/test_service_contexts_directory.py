"""The directory actor's records and leases, without Ray."""

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
