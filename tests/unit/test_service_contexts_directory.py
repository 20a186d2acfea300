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
    assert d.forget_worker("w1", "inc-a") == 2
    assert d.get("c")["shards"][0]["workers"] == ["w0"] and d.get("c")["version"] == 2
    assert [s["workers"] for s in d.get("e")["shards"]] == [[], ["w2"]] and d.get("e")["version"] == 5
    assert d.forget_worker("w1", "inc-b") == 0 and d.get("c")["version"] == 2  # nothing left to forget: untouched


def test_a_dead_worker_is_forgotten_once_so_its_replacements_replicas_stay():
    """Two front ends see the same death; the first forgets and replaces the worker, whose replacement then
    gets replicas under the same name. The second front end's late ask must leave them listed: the
    replacement holds them and would never be told of the appends after (docs/RELIABILITY.md)."""
    d = DirectoryActor([], "ns")
    d.commit(record("c"))
    assert d.forget_worker("w1", "inc-a") == 1
    d.acquire("c", "repair", 60)
    d.commit({**record("c", 3), "shards": [{"index": 0, "length": 5, "workers": ["w0", "w1"]}]}, owner="repair")
    assert d.forget_worker("w1", "inc-a") == 0
    assert d.get("c")["shards"][0]["workers"] == ["w0", "w1"] and d.get("c")["version"] == 3
    assert d.forget_worker("w1", "inc-b") == 1  # the replacement's own death is forgotten in its turn
    assert d.get("c")["shards"][0]["workers"] == ["w0"]


def test_a_rebuilt_directory_forgets_no_death_older_than_the_worker_that_reported_to_it():
    """The directory restarted after a front end forgot a dead worker (that memory went with it) and was
    rebuilt from the reports of the worker's replacement: a late ask about the dead one changes nothing."""
    held = [{"context_id": "c", "index": 0, "length": 5, "context": record("c", 3)}]
    reports = {"w0": (held, [], [], "inc-0"), "w1": (held, [], [], "inc-new")}
    d = DirectoryActor(["w0", "w1"], "ns", reporter=reports.get)
    assert d.get("c")["shards"][0]["workers"] == ["w0", "w1"]
    assert d.forget_worker("w1", "inc-old") == 0 and d.get("c")["shards"][0]["workers"] == ["w0", "w1"]
    assert d.forget_worker("w1", "inc-new") == 1 and d.get("c")["shards"][0]["workers"] == ["w0"]


def test_a_commit_from_before_a_forget_under_the_same_lease_is_refused():
    """An append read the record, a worker's replicas were forgotten (without the lease), then the append
    commits: it would list the dead name again under the version the forget gave another record."""
    d = DirectoryActor([], "ns")
    d.commit(record("c"))
    assert d.acquire("c", "writer", 60)
    before = d.get("c")
    d.forget_worker("w1", "inc-a")
    longer = {**before, "version": before["version"] + 1,
              "shards": [{"index": 0, "length": 9, "workers": ["w0", "w1"]}]}
    with pytest.raises(ValueError, match="changed under the lease"):
        d.commit(longer, owner="writer")
    assert d.get("c")["shards"][0] == {"index": 0, "length": 5, "workers": ["w0"]}


def test_a_commit_sent_again_is_stored_once_and_answered_again():
    """A commit whose answer was lost with the direct channel goes again through Ray: the same record, accepted."""
    d = DirectoryActor([], "ns")
    d.commit(record("c"))
    assert d.acquire("c", "writer", 60)
    again = record("c", 2)
    assert d.commit(again, owner="writer") == d.commit(again, owner="writer") == d.incarnation
    assert d.get("c") == again


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


class FakeHandle:
    """A Ray actor handle's shape over a DirectoryActor in this process: ``h.op.remote(*args)``; counts calls."""

    def __init__(self, actor):
        self.actor, self.calls = actor, []

    def __getattr__(self, op):
        handle = self

        class Method:
            @staticmethod
            async def remote(*args):
                handle.calls.append(op)
                return getattr(handle.actor, op)(*args)
        return Method


class FakeChannel:
    """The direct channel without a socket: frames encoded, handed to the actor's channel, the reply decoded."""

    closed = False

    def __init__(self, actor, broken=False):
        self.actor, self.broken, self.calls = actor, broken, []

    async def write(self, frame):
        from service.cluster.channel import ChannelClosed
        from workers import frames

        if self.broken:
            raise ChannelClosed("the directory's channel closed")
        data = b"".join(bytes(b) for b in frame(1))
        header_len, _ = frames.sizes(data[:frames.PREFIX.size])
        header, arrays = frames.decode(data[frames.PREFIX.size:frames.PREFIX.size + header_len],
                                       bytearray(data[frames.PREFIX.size + header_len:]))
        self.calls.append(header["op"])
        try:
            reply = self.actor._channel_submit(header, arrays).result()
        except Exception as exc:  # noqa: BLE001 - as the listener answers it
            reply = frames.error_frame(1, exc)
        data = b"".join(bytes(b) for b in reply)
        header_len, _ = frames.sizes(data[:frames.PREFIX.size])
        header, _ = frames.decode(data[frames.PREFIX.size:frames.PREFIX.size + header_len], b"")
        if header["op"] == "error":
            raise frames.parse_error(header)
        return frames.parse_done(header)

    def close(self):
        self.closed = True


def over_channel(broken=False):
    """A directory actor holding context c, and a ``Directory`` whose channel is open to it (or broken)."""
    from service.contexts.directory import Directory

    actor = DirectoryActor([], "ns")
    actor.commit(record("c"))
    handle, channel = FakeHandle(actor), FakeChannel(actor, broken=broken)
    d = Directory(handle, channel=True)
    d._channel = channel
    return actor, handle, channel, d


def test_a_writes_directory_calls_go_over_the_channel_with_ray_s_answers():
    import asyncio

    from service.core.errors import WorkersUnavailable

    actor, handle, channel, d = over_channel()

    async def run():
        assert await d.begin("c", "a", 60) == (True, record("c"))
        assert await d.begin("c", "b", 60) == (False, None)
        incarnation = await d.commit(record("c", 2), "a")
        assert incarnation == actor.incarnation == await d.release("c", "a")
        with pytest.raises(WorkersUnavailable, match="the write to context c was not stored: its lease lapsed"):
            await d.commit(record("c", 3), "a")  # released: LeaseLost, as from Ray
        assert await d.commit(record("n"), None) == actor.incarnation  # a create's commit: through Ray

    asyncio.run(run())
    assert channel.calls == ["begin", "begin", "commit", "release", "commit"] and handle.calls == ["commit"]
    assert actor.get("c")["version"] == 2


def test_a_call_whose_channel_broke_goes_through_ray():
    import asyncio

    actor, handle, channel, d = over_channel(broken=True)
    d._channel_retry_at = float("inf")  # no new channel: the next calls go through Ray

    async def run():
        assert await d.begin("c", "a", 60) == (True, record("c"))
        assert await d.release("c", "a") == actor.incarnation

    asyncio.run(run())
    assert channel.closed and handle.calls == ["begin", "release"]


def test_a_closed_directory_answers_shutting_down_without_calling_ray():
    """The lifespan closes the directory before it leaves Ray: a write the second signal left
    running gets ShuttingDown (503) from its next call, never a call into a Ray that is gone."""
    import asyncio

    from service.core.errors import ShuttingDown

    actor, handle, channel, d = over_channel()

    async def run():
        assert (await d.begin("c", "a", 60))[0]
        d.close()
        for call in (d.release("c", "a"), d.get("c"), d.commit(record("c", 2), "a")):
            with pytest.raises(ShuttingDown, match="the server is stopping"):
                await call

    asyncio.run(run())
    assert channel.closed and channel.calls == ["begin"] and handle.calls == []


def test_a_call_the_channel_cannot_carry_goes_through_ray():
    import asyncio

    import numpy as np

    actor, handle, channel, d = over_channel()

    async def run():
        assert (await d.begin("c", "a", 60))[0]
        await d.commit({**record("c", 2), "next_pos": np.int64(7)}, "a")  # not JSON: through Ray

    asyncio.run(run())
    assert channel.calls == ["begin"] and handle.calls == ["commit"] and not channel.closed
    assert actor.get("c")["next_pos"] == 7


def test_the_channel_serves_only_a_writes_calls():
    from workers import frames

    d = DirectoryActor([], "ns")
    for header in ({"id": 1, "op": "remove", "args": ["c"]}, {"id": 1, "op": "begin", "args": "c"}):
        with pytest.raises(frames.FrameError, match="op must be one of begin, commit, release"):
            d._channel_submit(header, [])
    assert d.channel() is None  # not listening: started without listen
