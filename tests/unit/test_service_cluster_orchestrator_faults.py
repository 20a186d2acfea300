"""The orchestrator's failure rules on the in-process pool (``service.cluster.local.LocalPool``).

Each job runs on real ``ShardWorker`` objects; a worker is told to die, to lose a shard or to raise
(``faulty_pool``). The rules (``service.cluster.orchestrator``): a job whose worker dies or lost its
shard moves to another candidate; none left is ``ContextLost`` (resident) or ``WorkersUnavailable``
(inline); a worker's own exception is ``Internal`` and work past the deadline is 504, neither retried;
the merge is over the fixed tree whichever worker ran each node.
"""

import asyncio

import numpy as np
import pytest
from faulty_pool import FaultyPool, bitwise, kv, read, settings, started, write

from merge import finalize, merge_all
from service.cluster.orchestrator import Job, Orchestrator, shard_bounds
from service.cluster.surface import InlineWork
from service.core import deadline
from service.core.errors import ContextLost, DeadlineExceeded, Internal, WorkersUnavailable
from service.core.metrics import Timings
from workers.api import partial_attention_shard
from workers.options import AttentionOptions
from workers.tasks import ShardQuery

#: A context of this many keys is one shard (context_shard_keys 64): its job runs ``partial_resident``;
#: of MANY, several shards on the same replicas, one call (``partial_resident_many``).
ONE, MANY = 40, 150
COMPUTE = ("partial_resident", "partial_resident_many", "partial")


def q_of(rng):
    return rng.standard_normal((2, 4, 8)).astype(np.float32)


def computed_on(pool):
    return [i for i, m in pool.sent if m in COMPUTE]


@pytest.mark.parametrize("n_k", [ONE, MANY])
def test_a_job_whose_worker_dies_is_retried_on_another_replica(rng, n_k):
    async def main():
        pool, _, contexts = await started(2)
        try:
            k, v = kv(rng, n_k)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            q = q_of(rng)
            before = await read(pool, contexts, [ctx], q)
            del pool.sent[:]
            pool.kill(0)  # not noticed yet: the job is sent there first
            assert bitwise(await read(pool, contexts, [ctx], q), before)
            assert computed_on(pool) == [0, 1]
            assert not pool.slots[0].alive
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_replica_that_lost_its_shard_is_skipped_for_another(rng):
    async def main():
        pool, _, contexts = await started(2)
        try:
            k, v = kv(rng, ONE)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            q = q_of(rng)
            before = await read(pool, contexts, [ctx], q)
            del pool.sent[:]
            pool.lose_shard(0, ctx, 0)
            assert bitwise(await read(pool, contexts, [ctx], q), before)
            assert computed_on(pool) == [0, 1]
            assert pool.slots[0].alive  # a lost shard is not a dead worker
        finally:
            pool.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("fault", ["kill", "lose_shard"])
def test_a_shard_no_live_replica_holds_is_context_lost(rng, fault):
    async def main():
        pool, _, contexts = await started(2)
        try:
            k, v = kv(rng, ONE)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            for i in range(pool.size):
                pool.kill(i) if fault == "kill" else pool.lose_shard(i, ctx, 0)
            with pytest.raises(ContextLost) as lost:
                await read(pool, contexts, [ctx], q_of(rng))
            assert lost.value.status == 503
            assert f"shard 0 of context {ctx} could not be computed" in lost.value.detail
            for slot in pool.slots:  # each replica's reason is named
                assert slot.name in lost.value.detail
            assert computed_on(pool)[-2:] == [0, 1]
        finally:
            pool.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("n_k", [ONE, MANY])
def test_a_worker_that_raises_its_own_error_is_internal_and_not_retried(rng, n_k):
    async def main():
        pool, _, contexts = await started(2)
        try:
            k, v = kv(rng, n_k)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            del pool.sent[:]
            pool.fail_next(0, RuntimeError("a bug in the kernel"))
            with pytest.raises(Internal) as failed:
                await read(pool, contexts, [ctx], q_of(rng))
            assert failed.value.status == 500
            assert "worker splitkey-worker-0 raised RuntimeError" in failed.value.detail
            assert "a bug in the kernel" not in failed.value.detail  # the message stays in the log
            assert computed_on(pool) == [0]
            assert pool.slots[0].alive
        finally:
            pool.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("n_k", [ONE, MANY])
def test_work_started_past_the_deadline_is_504_and_not_retried(rng, n_k):
    async def main():
        pool, _, contexts = await started(2)
        try:
            k, v = kv(rng, n_k)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            del pool.sent[:]
            with deadline.running(0.0), pytest.raises(DeadlineExceeded) as late:
                await read(pool, contexts, [ctx], q_of(rng))
            assert late.value.status == 504 and "splitkey-worker-0" in late.value.detail
            assert computed_on(pool) == [0]
        finally:
            pool.shutdown()

    asyncio.run(main())


async def inline_answer(pool, rng, *, shards, fanin, remote_merge_bytes):
    """``(out, lse)`` through the orchestrator over ``shards`` inline shards, and the in-process answer
    (``workers`` kernels and ``merge.merge_all`` over the same shards, in this thread)."""
    q, (k, v) = q_of(rng), kv(rng, 300)
    k_pos, q_pos = np.arange(300), np.array([298, 299])
    query = ShardQuery(q_pos, AttentionOptions())
    bounds = shard_bounds(300, shards)
    sent_q, *parts = await pool.put(q, *[a for lo, hi in bounds for a in (k[lo:hi], v[lo:hi])])
    jobs = [Job(InlineWork(parts[2 * i], parts[2 * i + 1], k_pos[lo:hi]), None, f"inline shard {i}")
            for i, (lo, hi) in enumerate(bounds)]
    orch = Orchestrator(pool, fanin=fanin, remote_merge_bytes=remote_merge_bytes)
    got = await orch.run(sent_q, query, jobs, Timings(), state_nbytes=2 * 4 * (4 + 2) * 4)
    states = [partial_attention_shard(q, k[lo:hi], v[lo:hi], q_pos=q_pos, k_pos=k_pos[lo:hi],
                                      options=AttentionOptions(), kernel=pool.config.kernel) for lo, hi in bounds]
    return got, finalize(merge_all(states, fanin))


@pytest.mark.parametrize("fanin, shards", [(2, 6), (3, 7), (2, 2)])
@pytest.mark.parametrize("on_workers", [True, False])
def test_a_merge_over_many_shards_is_bitwise_the_in_process_answer(rng, fanin, shards, on_workers):
    async def main():
        pool = await FaultyPool.start(settings(), 3)
        try:
            got, want = await inline_answer(pool, rng, shards=shards, fanin=fanin,
                                            remote_merge_bytes=0 if on_workers else 2**30)
            assert bitwise(got, want)
            merged_remotely = bool(pool.calls_of("merge_states"))
            assert merged_remotely == (on_workers and shards > fanin)
            assert sorted(set(pool.calls_of("partial"))) == list(range(min(shards, 3)))  # spread over the workers
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_merge_node_whose_worker_fails_fails_the_request_503(rng):
    async def main():
        pool = await FaultyPool.start(settings(), 3)
        try:
            for i in range(pool.size):
                pool.fail_next(i, RuntimeError("lost an object"), "merge_states")
            with pytest.raises(WorkersUnavailable, match="the merge tree lost a node"):
                await inline_answer(pool, rng, shards=6, fanin=2, remote_merge_bytes=0)
            assert all(s.outstanding == 0 for s in pool.slots)  # every node's call was counted done
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_an_inline_job_whose_workers_all_died_is_workers_unavailable(rng):
    async def main():
        pool = await FaultyPool.start(settings(), 2)
        try:
            pool.kill(0)
            pool.kill(1)
            with pytest.raises(WorkersUnavailable, match="inline shard 0 could not be computed: worker"):
                await inline_answer(pool, rng, shards=2, fanin=2, remote_merge_bytes=2**30)
        finally:
            pool.shutdown()

    asyncio.run(main())
