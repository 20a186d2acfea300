"""The in-process pool itself (``service.cluster.local.LocalPool``): what the code above the seam relies on
of a pool, kept without Ray."""

import asyncio
import threading

import numpy as np
import pytest
from faulty_pool import FaultyPool, kv, settings

from service.core.errors import WorkersUnavailable
from workers.tasks import ShardWrite


def record(ctx, version=1):
    return {"id": ctx, "version": version, "shards": [{"index": 0, "length": 10, "workers": ["splitkey-worker-0"]}]}


def test_its_workers_are_real_shard_workers_without_a_direct_channel():
    async def main():
        pool = await FaultyPool.start(settings(worker_channel=True), 2)
        try:
            assert not pool.config.channel
            assert all(s.worker is not None and s.worker.listener is None for s in pool.slots)
            assert [s.info["name"] for s in pool.slots] == ["splitkey-worker-0", "splitkey-worker-1"]
            assert all(s.alive and s.incarnation for s in pool.slots)
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_call_in_flight_when_its_worker_dies_raises_workers_unavailable(rng):
    async def main():
        pool = await FaultyPool.start(settings(), 2)
        try:
            worker = pool.slots[0].worker
            running, go = threading.Event(), threading.Event()

            def held_slowly():  # the worker's own method, running in its thread when the worker dies
                running.set()
                go.wait(10)
                return type(worker).held(worker)

            worker.held = held_slowly
            call = pool.held(0)
            assert await asyncio.to_thread(running.wait, 10)
            assert pool.slots[0].outstanding == 1
            pool.kill(0)
            go.set()
            with pytest.raises(WorkersUnavailable, match="worker splitkey-worker-0 died"):
                await call
            assert not pool.slots[0].alive and pool.slots[0].outstanding == 0
            assert pool.pick() == 1
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_calls_arguments_are_taken_when_it_is_made(rng):
    async def main():
        pool = await FaultyPool.start(settings(), 1)
        try:
            k, v = kv(rng, 10)
            rec = record("ctx_a")
            write = ShardWrite("ctx_a", 0, "float32", 64, np.arange(10))
            made = pool.create_shard(0, write, *(await pool.put(k, v)), rec)
            rec["version"] = 99  # after the call was made: not what the worker keeps
            await made
            [held] = await pool.held(0)
            assert held["context"]["version"] == 1 and held["length"] == 10
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_hung_worker_is_stopped_by_its_replacement_which_answers(rng):
    # As WorkerPool.replace kills a paused worker first: until 2026-12-06 it held its name for good.
    async def main():
        pool = await FaultyPool.start(settings(), 2)
        try:
            pool.hang(1)
            hung = asyncio.ensure_future(pool.held(1))
            for _ in range(3):
                await pool.refresh(timeout_s=0.02)
            assert not pool.slots[1].alive
            assert pool.replace(pool.slots[1])
            with pytest.raises(WorkersUnavailable):
                await asyncio.wait_for(hung, 5.0)  # ended by the kill, never run
            await pool.refresh()
            assert pool.slots[1].alive and await pool.held(1) == []
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_hung_worker_misses_pings_and_counts_dead_at_the_third(rng):
    async def main():
        pool = await FaultyPool.start(settings(), 2)
        try:
            pool.hang(1)
            for missed in (1, 2):
                await pool.refresh(timeout_s=0.02)
                assert pool.slots[1].alive and pool.slots[1].missed == missed
            await pool.refresh(timeout_s=0.02)
            assert not pool.slots[1].alive and pool.slots[1].held == {}
            pool.release(1)
            await pool.refresh()
            assert pool.slots[1].alive and pool.slots[1].missed == 0
        finally:
            pool.shutdown()

    asyncio.run(main())
