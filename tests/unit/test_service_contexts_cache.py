"""service.contexts.cache.RecordCache: what a front end may answer from without asking the directory."""

import pytest

from service.contexts.cache import RecordCache


def record(ctx_id, version=1, lengths=(10,)):
    return {"id": ctx_id, "version": version, "shards": [{"index": i, "length": n, "workers": ["w"]}
                                                         for i, n in enumerate(lengths)]}


def test_cache_answers_only_when_every_record_is_held_and_holds_keys():
    c = RecordCache(8)
    c.put(record("a"))
    c.put(record("empty", lengths=(0, 0)))
    assert c.servable(["a"]) == [record("a")] and c.hits == 1
    assert c.servable(["a", "b"]) is None and c.misses == 1  # one not held
    assert c.servable(["empty"]) is None and c.misses == 2  # no worker would see the query: never from the cache


def test_cache_keeps_the_newest_version_of_a_record():
    c = RecordCache(8)
    c.put(record("a", version=3))
    c.put(record("a", version=2, lengths=(5,)))
    assert c.servable(["a"])[0]["version"] == 3
    c.put(record("a", version=4, lengths=(20,)))
    assert c.servable(["a"])[0]["shards"][0]["length"] == 20


def test_cache_evicts_the_least_recently_used_beyond_its_capacity():
    c = RecordCache(2)
    c.put(record("a"))
    c.put(record("b"))
    c.servable(["a"])  # a is used: b is the oldest
    c.put(record("c"))
    assert len(c) == 2 and c.servable(["b"]) is None and c.servable(["a", "c"]) is not None


def test_cache_of_capacity_zero_holds_nothing_and_drops_count_stale_reads():
    off = RecordCache(0)
    off.put(record("a"))
    assert len(off) == 0 and off.servable(["a"]) is None
    c = RecordCache(4)
    c.put(record("a"))
    c.drop_stale(["a", "never-held"])
    assert c.stale == 1 and c.servable(["a"]) is None
    with pytest.raises(ValueError, match="capacity"):
        RecordCache(-1)
