"""A write's deadline: a worker that hangs during a context write is fenced, never waited for (issue 50).

``FaultyPool.hang`` stands for SIGSTOP: with no method named, the worker answers neither its calls nor
its pings until released; fencing it (``LocalPool.fence``, Ray's ``ray.kill`` there) ends its hung calls
without running them. Every test bounds the write it waits for, so that on a service without a write
deadline it fails instead of hanging.
"""

import asyncio
import time

import numpy as np
import pytest
from faulty_pool import FaultyPool, bitwise, kv, read, settings, started, write
from reference import assert_close_to_reference

from service.contexts.repair import Repairer
from service.core.errors import ContextLost, WorkersUnavailable
from service.core.metrics import Timings

#: The write deadline these tests run with, and the bound on a write to a hung worker (docs/CONTEXTS.md).
DEADLINE_S = 0.2
BOUND_S = 4 * DEADLINE_S
#: How long a test waits for a write before it calls the write hung (the bound, with room for a loaded machine).
PATIENCE_S = BOUND_S + 5.0


def q_of(rng):
    return rng.standard_normal((2, 4, 8)).astype(np.float32)


async def timed(write_call):
    """The write's answer or error, and the seconds it took; a write hung past PATIENCE_S fails the test."""
    began = time.monotonic()
    try:
        outcome = await asyncio.wait_for(write_call, PATIENCE_S)
    except WorkersUnavailable as exc:
        outcome = exc
    except TimeoutError:
        pytest.fail(f"the write did not answer in {PATIENCE_S} s: it waits for the hung worker")
    return outcome, time.monotonic() - began


def last_holders(pool, record):
    return pool.indexes(record["shards"][-1]["workers"])


def test_an_append_to_a_replicated_context_with_a_hung_holder_answers_503_in_time_then_once_on_retry(rng):
    async def main():
        pool, directory, contexts = await started(3, write_timeout_s=DEADLINE_S)
        try:
            k0, v0 = kv(rng, 100)
            ctx = (await contexts.create(write(k0, v0, replicas=2), Timings()))["id"]
            hung = last_holders(pool, await contexts.record(ctx))[0]
            pool.hang(hung)  # SIGSTOP: no calls, no pings
            k1, v1 = kv(rng, 10)  # into the last shard: no new shard, no placement
            outcome, took = await timed(contexts.append(ctx, write(k1, v1, after=100), Timings()))
            assert isinstance(outcome, WorkersUnavailable) and outcome.status == 503, outcome
            assert "send it again" in str(outcome) and took < BOUND_S + 1.0, (took, outcome)
            assert not pool.slots[hung].alive  # fenced: counted dead now, not at its third missed ping
            assert (await contexts.get(ctx))["length"] == 100  # nothing committed
            pool.release(hung)  # SIGCONT comes too late: the fenced worker's write never ran
            assert (await contexts.append(ctx, write(k1, v1, after=100), Timings()))["length"] == 110
            q = q_of(rng)
            k, v = np.concatenate([k0, k1]), np.concatenate([v0, v1])
            answer = await read(pool, contexts, [ctx], q)
            assert_close_to_reference(*answer, q, k, v, q_pos=np.arange(108, 110), k_pos=np.arange(110))
            healer = Repairer(pool, directory, contexts)
            await healer.step()  # the fenced worker is replaced and its replicas rebuilt from the others
            assert healer.stats.workers_replaced == 1 and pool.slots[hung].alive
            desc = await contexts.get(ctx)
            assert desc["state"] == "ready" and desc["length"] == 110
            assert bitwise(await read(pool, contexts, [ctx], q), answer)
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_an_append_whose_only_holder_hangs_answers_503_in_time_and_never_applies_later(rng):
    async def main():
        pool, _, contexts = await started(2, write_timeout_s=DEADLINE_S)
        try:
            k0, v0 = kv(rng, 40)
            ctx = (await contexts.create(write(k0, v0, replicas=1, shards=1), Timings()))["id"]
            [hung] = last_holders(pool, await contexts.record(ctx))
            worker = pool.slots[hung].worker  # the hung process's memory, looked at after it is fenced
            pool.hang(hung)
            k1, v1 = kv(rng, 10)
            outcome, took = await timed(contexts.append(ctx, write(k1, v1, after=40), Timings()))
            assert isinstance(outcome, WorkersUnavailable) and took < BOUND_S + 1.0, (took, outcome)
            pool.release(hung)
            await asyncio.sleep(DEADLINE_S)  # were the hung write still pending, it would run now
            assert (await contexts.get(ctx))["length"] == 40
            assert [h["length"] for h in worker.held()] == [40]  # its hung write never ran
            # Its only holder is gone (as it would be at its third missed ping): the retry is told so, at once.
            with pytest.raises(ContextLost) as lost:
                await asyncio.wait_for(contexts.append(ctx, write(k1, v1, after=40), Timings()), PATIENCE_S)
            # Without --persist-dir nothing brings it back: the client is told to create it again.
            assert "without --persist-dir no copy comes back: delete the context" in lost.value.detail
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_holder_that_answers_its_pings_is_waited_for_past_the_deadline_not_fenced(rng):
    async def main():
        pool, _, contexts = await started(2, write_timeout_s=DEADLINE_S)
        try:
            k0, v0 = kv(rng, 40)
            ctx = (await contexts.create(write(k0, v0, replicas=2, shards=1), Timings()))["id"]
            pool.hang(0, "append_shard")  # busy with the write (a large one, a loaded machine), pings answered
            k1, v1 = kv(rng, 10)
            append = asyncio.create_task(contexts.append(ctx, write(k1, v1, after=40), Timings()))
            await asyncio.sleep(3 * BOUND_S)
            assert not append.done() and pool.slots[0].alive
            pool.release(0)
            assert (await asyncio.wait_for(append, PATIENCE_S))["length"] == 50
            assert [s.alive for s in pool.slots] == [True, True]
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_an_append_whose_holder_hangs_after_the_commit_answers_200_in_time_and_fences_it(rng):
    async def main():
        pool, _, contexts = await started(3, write_timeout_s=DEADLINE_S)
        try:
            k0, v0 = kv(rng, 40)
            ctx = (await contexts.create(write(k0, v0, replicas=2, shards=1), Timings()))["id"]
            hung = last_holders(pool, await contexts.record(ctx))[0]
            pool.hang(hung, "note_context", "ping")  # stores the keys, then stops before it is told of the commit
            k1, v1 = kv(rng, 10)
            outcome, took = await timed(contexts.append(ctx, write(k1, v1, after=40), Timings()))
            assert isinstance(outcome, dict) and outcome["length"] == 50 and took < BOUND_S + 1.0, (took, outcome)
            assert not pool.slots[hung].alive
            q = q_of(rng)
            answer = await read(pool, contexts, [ctx], q)  # from the other replica
            assert_close_to_reference(*answer, q, np.concatenate([k0, k1]), np.concatenate([v0, v1]),
                                      q_pos=np.arange(48, 50), k_pos=np.arange(50))
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_create_with_a_hung_worker_answers_503_in_time_and_leaves_nothing_behind(rng):
    async def main():
        pool, directory, contexts = await started(2, write_timeout_s=DEADLINE_S)
        try:
            pool.hang(1)
            k, v = kv(rng, 100)
            outcome, took = await timed(contexts.create(write(k, v, replicas=2), Timings()))
            assert isinstance(outcome, WorkersUnavailable) and took < BOUND_S + 1.0, (took, outcome)
            assert await directory.all() == [] and await pool.held(0) == []
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_slow_kill_comes_off_the_last_wait_so_a_fenced_call_ends_within_three_deadlines():
    """The wait, the ping and the kill's end take 3 x the deadline together: until 2026-12-07 each had a
    deadline of its own, and the time the kill itself took came on top (an outside probe measured a write
    to a hung worker at 4.01-4.02 s against its 4 s bound)."""
    from service.contexts.fencing import Fence

    class SlowKill(FaultyPool):
        async def fence(self, index: int) -> None:
            await asyncio.sleep(DEADLINE_S)  # a kill that takes a whole deadline to be sent
            await super().fence(index)

    async def main():
        pool = SlowKill(settings(write_timeout_s=DEADLINE_S), 2)
        await pool.refresh()
        try:
            pool.hang(0)  # no answer to its call nor its pings
            began = time.monotonic()
            with pytest.raises(WorkersUnavailable, match="it was killed and is being replaced"):
                await Fence(pool, DEADLINE_S).call(0, asyncio.Event().wait())  # a call the kill does not end
            took = time.monotonic() - began
            assert 3 * DEADLINE_S - 0.02 <= took <= 3 * DEADLINE_S + 0.1, took  # 4 x before
        finally:
            pool.shutdown()

    asyncio.run(main())
