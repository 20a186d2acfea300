"""The front end's end of the direct channel (service.cluster.channel) and the pool's use of it.

The first tests talk to a shard worker in this process (its listener on loopback); the
last ones to real Ray actors, through ``WorkerPool`` as the service runs it: a query goes
over the channel, and one whose channel broke goes through Ray with the same answer.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.cluster.channel import ChannelClosed, WorkerChannel
from workers.actor import ShardWorker
from workers.config import WorkerConfig
from workers.frames import RemoteError
from workers.options import AttentionOptions
from workers.store import ShardMissing
from workers.tasks import ShardQuery, ShardRead, ShardWrite, arrive, carry

N_K, H_KV, H_Q, D = 500, 2, 4, 16


def same(a, b) -> bool:
    return all(x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in ((a.m, b.m), (a.l, b.l), (a.acc, b.acc)))


def keys(rng, dtype=np.float32):
    return (rng.standard_normal((N_K, H_KV, D)).astype(dtype), rng.standard_normal((N_K, H_KV, D)).astype(dtype))


@pytest.fixture
def worker(rng):
    w = ShardWorker(WorkerConfig(memory_budget_bytes=2**24), "w-test")
    w.create_shard(ShardWrite("ctx", 0, "float32", N_K, np.arange(N_K)), *keys(rng), {"version": 1})
    w.note_context("ctx", {"version": 1})  # committed: reads of version 1 are vouched for
    yield w
    w.listener.close()


def queries(rng, n: int, dtype=np.float32) -> list[tuple]:
    out = []
    for i in range(n):
        n_q = 1 + i % 3
        opts = AttentionOptions(causal=bool(i % 2), softcap=None if i % 3 else 20.0,
                                alibi_slopes=np.linspace(0.1, 1.0, H_Q) if i % 4 == 1 else None)
        out.append((carry(rng.standard_normal((n_q, H_Q, D)).astype(dtype)),
                    ShardQuery(np.arange(N_K - n_q, N_K), opts)))
    return out


def test_concurrent_queries_on_one_connection_each_get_their_own_exact_answer(worker, rng):
    reads = (ShardRead("ctx", 0, N_K, 1),)
    qs = queries(rng, 8)

    async def run() -> list:
        lane = await WorkerChannel.open("w-test", worker.channel())
        try:
            return await asyncio.gather(*(lane.resident(q, sq, reads, 2) for q, sq in qs))
        finally:
            lane.close()

    got = asyncio.run(run())
    for (q, sq), (status, st) in zip(qs, got):
        assert status.worker == "w-test"
        assert same(st, worker.partial_resident(q, sq, reads, 2)[1])


def test_a_worker_side_error_comes_back_as_its_own_class_and_the_channel_stays_open(worker, rng):
    (q, sq), = queries(rng, 1)

    async def run() -> None:
        lane = await WorkerChannel.open("w-test", worker.channel())
        try:
            with pytest.raises(ShardMissing):  # by its own class, as through Ray
                await lane.resident(q, sq, (ShardRead("ctx", 5, 10, 0),), 2)
            assert not lane.closed
            await lane.resident(q, sq, (ShardRead("ctx", 0, N_K, 1),), 2)
        finally:
            lane.close()

    asyncio.run(run())


def test_a_batch_over_the_channel_answers_each_item_as_the_ray_method_does(worker, rng):
    from workers.tasks import ResidentQuery

    good = (ShardRead("ctx", 0, N_K, 1),)
    items = [ResidentQuery(q, sq, good if i != 2 else (ShardRead("gone", 0, 3, 0),))
             for i, (q, sq) in enumerate(queries(rng, 5, dtype=np.float16))]

    async def run() -> list:
        lane = await WorkerChannel.open("w-test", worker.channel())
        try:
            return await lane.many(items)
        finally:
            lane.close()

    got = asyncio.run(run())
    want = worker.partial_resident_many(items)
    assert isinstance(got[2], RemoteError) and got[2].kind == "ShardMissing" and isinstance(want[2], Exception)
    for i in (0, 1, 3, 4):
        assert len(got[i][1]) == 1 and same(got[i][1][0], want[i][1][0])


def test_opening_with_a_wrong_token_fails_as_channel_closed(worker):
    async def run() -> None:
        with pytest.raises(ChannelClosed, match="could not be opened"):
            await WorkerChannel.open("w-test", {**worker.channel(), "token": "wrong"}, timeout_s=5)

    asyncio.run(run())


def test_calls_waiting_on_a_connection_that_breaks_fail_as_channel_closed(worker, rng):
    reads = (ShardRead("ctx", 0, N_K, 1),)
    qs = queries(rng, 4)

    async def run() -> None:
        lane = await WorkerChannel.open("w-test", worker.channel())
        calls = [asyncio.ensure_future(lane.resident(q, sq, reads, 2)) for q, sq in qs]
        lane._writer.transport.abort()  # the socket goes, as when the worker's process ends
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, ChannelClosed) for r in results)
        assert lane.closed
        with pytest.raises(ChannelClosed):
            await lane.resident(*qs[0], reads, 2)

    asyncio.run(run())


# -- the pool, with real Ray actors --------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="channel-test")
    yield ray
    ray.shutdown()


def pool_call(ray_cluster, rng, channel: bool, act) -> None:
    """Start a one-worker pool, store a shard on it, run ``act(pool, q, query, work, want)`` in its loop."""
    from service.cluster.pool import ResidentWork, WorkerPool
    from service.core.settings import ServiceSettings

    settings = ServiceSettings(workers=1, worker_cpus=1, worker_channel=channel, ray_namespace="channel-test")
    k, v = keys(rng)
    q = rng.standard_normal((2, H_Q, D)).astype(np.float32)
    query = ShardQuery(np.array([N_K - 1, N_K]), AttentionOptions(causal=True))
    work = ResidentWork((ShardRead("ctx", 0, N_K, 1),), 2)

    async def run() -> None:
        pool = await WorkerPool.start(settings, detached=False)
        try:
            h = pool.slots[0].handle
            await h.create_shard.remote(ShardWrite("ctx", 0, "float32", N_K, np.arange(N_K)), k, v, {"version": 1})
            await h.note_context.remote("ctx", {"version": 1})
            _, want = await h.partial_resident.remote(q, query, work.reads, work.fanin)
            await act(pool, q, query, work, want)
        finally:
            pool.shutdown()

    asyncio.run(run())


def channel_calls(pool) -> int:
    return int(pool.slots[0].handle.ping.remote().future().result()["channel_calls"])


def test_the_pool_sends_resident_queries_over_the_channel_with_the_ray_answer(ray_cluster, rng):
    async def act(pool, q, query, work, want) -> None:
        for _ in range(3):
            _, st = await pool.compute(0, q, query, work, keep_state=False, state_nbytes=1024)
            assert same(st, want)
        assert channel_calls(pool) == 3 and pool.slots[0].channel is not None
        # A state kept on the worker (a merge on the workers) still goes through Ray.
        _, ref = await pool.compute(0, q, query, work, keep_state=True, state_nbytes=1024)
        assert same(await ref, want) and channel_calls(pool) == 3

    pool_call(ray_cluster, rng, True, act)


def test_a_query_whose_channel_broke_goes_through_ray_and_the_next_opens_a_new_one(ray_cluster, rng):
    async def act(pool, q, query, work, want) -> None:
        await pool.compute(0, q, query, work, keep_state=False, state_nbytes=1024)
        first = pool.slots[0].channel
        first._writer.transport.abort()  # broken under the pool, which has not noticed yet
        _, st = await pool.compute(0, q, query, work, keep_state=False, state_nbytes=1024)
        assert same(st, want)
        assert channel_calls(pool) == 1  # the second query went through Ray
        _, st = await pool.compute(0, q, query, work, keep_state=False, state_nbytes=1024)
        assert same(st, want) and channel_calls(pool) == 2
        assert pool.slots[0].channel is not first and pool.slots[0].outstanding == 0

    pool_call(ray_cluster, rng, True, act)


def test_with_the_channel_off_every_query_goes_through_ray(ray_cluster, rng):
    async def act(pool, q, query, work, want) -> None:
        for _ in range(2):
            _, st = await pool.compute(0, q, query, work, keep_state=False, state_nbytes=1024)
            assert same(st, want)
        assert channel_calls(pool) == 0 and pool.slots[0].channel is None

    pool_call(ray_cluster, rng, False, act)


def test_the_pool_sends_a_batch_over_the_channel_with_the_ray_answer(ray_cluster, rng):
    from workers.store import ShardMissing
    from workers.tasks import ResidentQuery

    async def act(pool, q, query, work, want) -> None:
        items = [ResidentQuery(carry(q), query, work.reads), ResidentQuery(carry(q), query, (ShardRead("x", 0, 2, 0),))]
        ray_answer = await pool.slots[0].handle.partial_resident_many.remote(items)
        got = await pool.compute_many(0, items)
        assert channel_calls(pool) == 1
        assert isinstance(got[1], ShardMissing) and isinstance(ray_answer[1], ShardMissing)
        assert same(got[0][1][0], ray_answer[0][1][0])

    pool_call(ray_cluster, rng, True, act)


def test_a_shard_the_worker_does_not_hold_raises_shard_missing_as_over_ray(ray_cluster, rng):
    from service.cluster.pool import ResidentWork
    from workers.store import ShardMissing

    async def act(pool, q, query, work, want) -> None:
        with pytest.raises(ShardMissing):
            await pool.compute(0, q, query, ResidentWork((ShardRead("nope", 0, 5, 0),), 2), keep_state=False,
                               state_nbytes=1024)
        assert channel_calls(pool) == 1

    pool_call(ray_cluster, rng, True, act)


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "ray"])
def test_work_sent_with_no_time_left_is_not_computed_and_the_request_gets_deadline_exceeded(ray_cluster, rng,
                                                                                            channel):
    """Calls sent once the request's deadline passed (budget 0) are refused by the worker, over the channel
    and over Ray alike (inline shards, resident queries, batch items); the orchestrator answers 504."""
    from service.core import deadline
    from service.cluster.orchestrator import Job, Orchestrator
    from service.cluster.pool import InlineWork
    from service.core.errors import DeadlineExceeded
    from service.core.metrics import Timings
    from workers.store import Expired
    from workers.tasks import ResidentQuery

    async def act(pool, q, query, work, want) -> None:
        k, v = keys(rng)
        orch = Orchestrator(pool, fanin=2, remote_merge_bytes=2**30)
        with deadline.running(0.0):  # the request's time is out when its calls are sent
            with pytest.raises(Expired):
                await pool.compute(0, q, query, work, keep_state=False, state_nbytes=1024)
            with pytest.raises(Expired):
                await pool.compute(0, q, query, InlineWork(k, v, np.arange(N_K)), keep_state=False)
            with pytest.raises(DeadlineExceeded, match="got past it before worker splitkey-worker-0 could start"):
                await orch.run(q, query, [Job(work, (0,), "shard 0 of ctx")], Timings(), 1024)
            assert isinstance((await pool.compute_many(0, [ResidentQuery(carry(q), query, work.reads)]))[0], Expired)
        with deadline.running(60.0):
            _, st = await pool.compute(0, q, query, work, keep_state=False, state_nbytes=1024)
        assert same(st, want)
        info = await pool.slots[0].handle.ping.remote()
        assert info["expired"] == 4 and info["batches"] == 2  # computed: want (before act) and the last query
        assert info["channel_calls"] == (4 if channel else 0)

    pool_call(ray_cluster, rng, channel, act)


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "ray"])
def test_a_query_the_worker_fails_is_a_500_naming_the_worker_not_a_lost_context(ray_cluster, rng, channel):
    """A worker that answers with an exception of its own (here: queries of the wrong head size, which
    the front end's checks never let through) is alive and holds its shards: the request fails with
    Internal (500) naming the worker and the exception, over the channel and Ray alike, for one read,
    several reads and an inline shard; not ContextLost (503, "retry"), and the worker still serves."""
    from service.cluster.orchestrator import Job, Orchestrator
    from service.cluster.pool import InlineWork, ResidentWork
    from service.core.errors import ERRORS, Internal
    from service.core.metrics import Timings

    async def act(pool, q, query, work, want) -> None:
        k, v = keys(rng)
        bad = np.zeros((q.shape[0], H_Q, D + 3), np.float32)  # [n_q, h_q, d + 3]: not the shard's d
        orch = Orchestrator(pool, fanin=2, remote_merge_bytes=2**30)
        two = ResidentWork(work.reads * 2, work.fanin)
        for job in (Job(work, (0,), "shard 0 of ctx"), Job(two, (0,), "shards 0 and 0 of ctx"),
                    Job(InlineWork(k, v, np.arange(N_K)), None, "inline shard 0")):
            with pytest.raises(Internal, match="worker splitkey-worker-0 raised InvalidInput; the server log") as err:
                await orch.run(bad, query, [job], Timings(), 1024)
            assert ERRORS[type(err.value)].status == 500
        assert pool.slots[0].alive and pool.slots[0].outstanding == 0
        _, st = await pool.compute(0, q, query, work, keep_state=False, state_nbytes=1024)
        assert same(st, want)

    pool_call(ray_cluster, rng, channel, act)


def test_the_pool_sends_notes_over_the_channel_as_ray_keeps_them(ray_cluster, rng):
    async def act(pool, q, query, work, want) -> None:
        record = {"id": "ctx", "version": 5, "shards": [{"index": 0, "length": N_K, "workers": ["w"]}]}
        await pool.note_context(0, "ctx", record)
        assert pool.slots[0].channel is not None  # opened for the note
        held = await pool.slots[0].handle.held.remote()
        assert held[0]["context"] == record
        # A channel that broke before the answer: the note goes through Ray (it is safe to run twice).
        pool.slots[0].channel._writer.transport.abort()
        newer = {**record, "version": 6}
        await pool.note_context(0, "ctx", newer)
        assert (await pool.slots[0].handle.held.remote())[0]["context"] == newer and pool.slots[0].outstanding == 0

    pool_call(ray_cluster, rng, True, act)


@pytest.mark.parametrize("channel", [True, False])
def test_context_writes_go_over_the_write_channel_and_store_what_ray_stores(ray_cluster, rng, channel):
    """Issue 47: within staged_writes the pool keeps a write's arrays here and sends them over a write channel
    of their own (an append in parts, only its span); with the channel off, through Ray as before."""
    from service.cluster.channel import staged_writes
    from service.cluster.pool import Staged

    n = 90
    k = rng.standard_normal((n, H_KV, D)).astype(np.float32)
    v = rng.standard_normal((n, H_KV, D)).astype(np.float32)

    async def act(pool, q, query, work, want) -> None:
        with staged_writes():
            sk, sv = await pool.put(k, v)
        assert isinstance(sk, Staged) == channel
        before = channel_calls(pool)
        create = ShardWrite("new", 0, "float32", 256, np.arange(40), reserve=256, span=(0, 40))
        [info] = await pool.create_shards(0, [create], sk, sv, {"version": 1})
        info = await pool.append_shard(0, ShardWrite("new", 0, "float32", 256, np.arange(40, n), span=(40, n)),
                                       sk, sv, 40)
        assert info["length"] == n
        assert channel_calls(pool) - before == (2 if channel else 0)
        assert (pool.slots[0].write_channel is not None) == channel
        got_k, got_v, _ = await pool.export_shard(0, "new", 0, n)
        assert np.asarray(arrive(await got_k)).tobytes() == k.tobytes()
        assert np.asarray(arrive(await got_v)).tobytes() == v.tobytes()

    pool_call(ray_cluster, rng, channel, act)
