"""ContextService on the in-process pool and directory: writes, leases, degraded and lost contexts.

Real ``ShardWorker`` objects behind ``service.cluster.local.LocalPool``, a real ``DirectoryActor``
behind ``LocalDirectory``; faults injected (``faulty_pool``). No Ray, no server, no socket.
"""

import asyncio

import numpy as np
import pytest
from faulty_pool import bitwise, kv, read, restart_directory, started, write
from reference import assert_close_to_reference

from service.contexts.service import ContextService
from service.core.errors import ContextLost, ContextNotFound, InsufficientCapacity, InvalidOption, WorkersUnavailable
from service.core.metrics import Timings
from workers.store import CapacityError


def q_of(rng, n_q=2, h_q=4, d=8):
    return rng.standard_normal((n_q, h_q, d)).astype(np.float32)


def test_a_context_created_appended_and_deleted_answers_over_exactly_its_keys(rng):
    async def main():
        pool, _, contexts = await started(3)
        try:
            k, v = kv(rng, 200)
            desc = await contexts.create(write(k, v, replicas=2), Timings())
            ctx = desc["id"]
            assert desc["length"] == 200 and desc["replicas"] == 2 and desc["state"] == "ready"
            k2, v2 = kv(rng, 90)
            desc = await contexts.append(ctx, write(k2, v2, after=200), Timings())
            assert desc["length"] == 290 and sum(desc["shard_lengths"]) == 290
            q = q_of(rng)
            out, lse = await read(pool, contexts, [ctx], q)
            assert_close_to_reference(out, lse, q, np.concatenate([k, k2]), np.concatenate([v, v2]),
                                      q_pos=np.arange(288, 290), k_pos=np.arange(290))
            assert {h["context_id"] for i in range(pool.size) for h in await pool.held(i)} == {ctx}
            await contexts.delete(ctx)
            assert [h for i in range(pool.size) for h in await pool.held(i)] == []
            with pytest.raises(ContextNotFound):
                await contexts.get(ctx)
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_create_that_does_not_fit_one_worker_leaves_nothing_on_the_others(rng):
    async def main():
        pool, directory, contexts = await started(2)
        try:
            pool.fail_next(1, CapacityError("worker splitkey-worker-1 has no room"), "create_shards")
            k, v = kv(rng, 200)
            with pytest.raises(InsufficientCapacity, match="no room"):
                await contexts.create(write(k, v, replicas=2), Timings())
            assert pool.calls_of("create_shards") == [0, 1]
            assert [h for i in range(pool.size) for h in await pool.held(i)] == []
            assert await directory.all() == []
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_an_append_waits_for_the_lease_another_front_end_holds(rng):
    async def main():
        pool, directory, first = await started(2)
        second = ContextService(first.settings, pool, directory)  # another front end on the same cluster
        try:
            k0, v0 = kv(rng, 100)
            ctx = (await first.create(write(k0, v0, replicas=2), Timings()))["id"]
            for i in range(pool.size):
                pool.hang(i, "append_shard", "create_shards")
            k1, v1 = kv(rng, 40)
            k2, v2 = kv(rng, 30)
            one = asyncio.create_task(first.append(ctx, write(k1, v1), Timings()))
            while not pool.calls_of("append_shard") and not pool.calls_of("create_shards")[2:]:
                await asyncio.sleep(0.01)  # the first append holds the lease and writes
            written = len(pool.sent)
            two = asyncio.create_task(second.append(ctx, write(k2, v2), Timings()))
            await asyncio.sleep(0.3)
            assert not two.done()
            assert not [m for _, m in pool.sent[written:] if m in ("append_shard", "create_shards")]
            for i in range(pool.size):
                pool.release(i)
            assert (await one)["length"] == 140
            assert (await two)["length"] == 170  # after the first's keys: it read the record the first committed
            q = q_of(rng)
            out, lse = await read(pool, first, [ctx], q)
            assert_close_to_reference(out, lse, q, np.concatenate([k0, k1, k2]), np.concatenate([v0, v1, v2]),
                                      q_pos=np.arange(168, 170), k_pos=np.arange(170))
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_context_that_lost_a_replica_is_degraded_and_answers_bitwise_as_before(rng):
    async def main():
        pool, _, contexts = await started(3)
        try:
            k, v = kv(rng, 150)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            q = q_of(rng)
            before = await read(pool, contexts, [ctx], q)
            record = await contexts.record(ctx)
            holder = pool.indexes(record["shards"][0]["workers"])[0]
            pool.kill(holder)
            await pool.refresh()
            desc = await contexts.get(ctx)
            assert desc["state"] == "degraded" and desc["degraded_shards"] and not desc["lost_shards"]
            assert bitwise(await read(pool, contexts, [ctx], q), before)
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_context_whose_every_replica_of_a_shard_is_gone_is_context_lost_503(rng):
    async def main():
        pool, _, contexts = await started(2)
        try:
            k, v = kv(rng, 150)
            ctx = (await contexts.create(write(k, v, replicas=1), Timings()))["id"]
            record = await contexts.record(ctx)
            assert len({w for s in record["shards"] for w in s["workers"]}) == 2  # spread over both workers
            pool.kill(0)
            await pool.refresh()
            desc = await contexts.get(ctx)
            assert desc["state"] == "lost" and desc["lost_shards"]
            held = await pool.held(1)
            with pytest.raises(ContextLost) as query_error:
                await read(pool, contexts, [ctx], q_of(rng))
            assert query_error.value.status == 503 and query_error.value.code == "context_lost"
            k2, v2 = kv(rng, 10)
            with pytest.raises(ContextLost, match="lost shards"):
                await contexts.append(ctx, write(k2, v2), Timings())
            assert await pool.held(1) == held  # the refused append stored nothing
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_an_append_whose_commit_a_directory_restart_lost_is_refused_as_not_stored(rng):
    async def main():
        pool, directory, contexts = await started(2)
        try:
            k, v = kv(rng, 100)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            for i in range(pool.size):
                pool.hang(i, "note_context")
            k2, v2 = kv(rng, 20)
            noted = len(pool.calls_of("note_context"))  # the create's
            append = asyncio.create_task(contexts.append(ctx, write(k2, v2), Timings()))
            while len(pool.calls_of("note_context")) < noted + 2:
                await asyncio.sleep(0.01)  # committed; the holders are not told yet
            restart_directory(directory, pool)  # the directory dies now: rebuilt without the append
            for i in range(pool.size):
                pool.release(i)
            with pytest.raises(WorkersUnavailable, match="was not stored"):
                await append
            assert (await contexts.get(ctx))["length"] == 100
            q = q_of(rng)
            out, lse = await read(pool, contexts, [ctx], q)
            assert_close_to_reference(out, lse, q, k, v, q_pos=np.arange(98, 100), k_pos=np.arange(100))
            assert (await contexts.append(ctx, write(k2, v2), Timings()))["length"] == 120  # sent again: once
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_an_append_refused_by_one_replica_leaves_every_worker_holding_what_it_held(rng):
    async def main():
        pool, _, contexts = await started(2)
        try:
            k, v = kv(rng, 100)
            ctx = (await contexts.create(write(k, v, replicas=2, shards=1), Timings()))["id"]

            async def held():
                return [sum(h["nbytes"] for h in await pool.held(i)) for i in range(pool.size)]

            before = await held()
            pool.fail_next(1, CapacityError("worker splitkey-worker-1 has no room"), "append_shard")
            k2, v2 = kv(rng, 9000)  # pages past the shard's first ones, on the worker that takes them
            with pytest.raises(InsufficientCapacity, match="no room"):
                await contexts.append(ctx, write(k2, v2), Timings())
            assert await held() == before  # the undone replica gave its new pages back
            desc = await contexts.append(ctx, write(k2[:5], v2[:5]), Timings())
            assert desc["length"] == 105
            q = q_of(rng)
            out, lse = await read(pool, contexts, [ctx], q)
            assert_close_to_reference(out, lse, q, np.concatenate([k, k2[:5]]), np.concatenate([v, v2[:5]]),
                                      q_pos=np.arange(103, 105), k_pos=np.arange(105))
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_create_with_more_replicas_than_live_workers_is_503_and_more_than_workers_is_422(rng):
    async def main():
        pool, _, contexts = await started(2)
        try:
            k, v = kv(rng, 20)
            pool.kill(1)
            await pool.refresh()
            with pytest.raises(WorkersUnavailable, match="replicas=2 needs 2 live workers, 1 of 2 are live now"):
                await contexts.create(write(k, v, replicas=2), Timings())
            with pytest.raises(InvalidOption, match=r"replicas must be in \[1, 2\] \(workers\), got 3"):
                await contexts.create(write(k, v, replicas=3), Timings())
        finally:
            pool.shutdown()

    asyncio.run(main())
