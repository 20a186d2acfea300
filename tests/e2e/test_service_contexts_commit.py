"""An append is answered as stored only if it is, whenever the directory restarts around its commit.

In-process: a real Ray, a real shard worker and the real directory actor behind a
``ContextService``, as the front end runs them. A lease of no time makes every commit under it
refused (``LeaseLost``), as a lease lapsed or lost with a directory restart is. The directory is
really killed and rebuilt by Ray from what the workers keep: after a refused commit, right after
an append's commit (before the workers are told of it), and after they are told.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
from reference import assert_close_to_reference

from service.core.errors import WorkersUnavailable
from service.core.metrics import Timings
from service.wire.request import ContextWrite, InlineKV
from workers.options import AttentionOptions
from workers.problem import KVDims
from workers.tasks import ShardQuery

NAMESPACE = "commit-test"


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    yield ray
    ray.shutdown()


def write(k: np.ndarray, expected_length: int | None = None) -> ContextWrite:
    return ContextWrite(InlineKV(k, k, None, KVDims(k.shape[0], k.shape[1], k.shape[2], k.shape[2])),
                        replicas=None, shards=None, expected_length=expected_length)


async def started(settings):
    from service.cluster.pool import WorkerPool
    from service.contexts.directory import Directory
    from service.contexts.service import ContextService

    pool = await WorkerPool.start(settings, detached=False)
    directory = await Directory.connect(settings, [s.name for s in pool.slots], detached=False)
    return pool, directory, ContextService(settings, pool, directory)


async def restart(ray, directory) -> None:
    """Kill the directory actor; Ray restarts it, rebuilt from what the workers keep."""
    ray.kill(directory.handle, no_restart=False)
    await asyncio.sleep(1.0)
    assert (await directory.ping())["rebuilt_from"] >= 1  # rebuilt: from the workers that hold shards


async def read_all(pool, contexts, ctx, q, k_pos_q):
    from service.cluster.orchestrator import Orchestrator

    resolved = await contexts.resolve([ctx], fresh=True)
    query = ShardQuery(k_pos_q, AttentionOptions(causal=True))
    return await Orchestrator(pool, fanin=2, remote_merge_bytes=2**30).run(
        q, query, resolved.jobs(pool, 2), Timings(), state_nbytes=q.shape[0] * q.shape[1] * 64 * 4)


def test_an_append_whose_lease_lapsed_is_refused_never_taken_by_a_rebuild_and_its_shard_reused(ray_cluster,
                                                                                               monkeypatch, rng):
    import service.contexts.service as contexts_service
    from service.core.settings import ServiceSettings

    settings = ServiceSettings(workers=2, worker_cpus=0.5, context_shard_keys=4, ray_namespace=NAMESPACE)
    k = rng.standard_normal((10, 1, 8)).astype(np.float32)  # [n_k, h_kv, d]
    q = rng.standard_normal((2, 2, 8)).astype(np.float32)  # [n_q, h_q, d]

    async def run() -> None:
        pool, directory, contexts = await started(settings)
        try:
            # One shard of 4 keys (context_shard_keys): an append past them opens a second, on the other worker.
            ctx = (await contexts.create(write(k[:4]), Timings()))["id"]
            committed = copy.deepcopy(await directory.get(ctx))
            with monkeypatch.context() as m:
                m.setattr(contexts_service, "LEASE_TTL_S", 0.0)  # lapsed as soon as taken
                with pytest.raises(WorkersUnavailable, match=f"the write to context {ctx} was not stored: its "
                                                             "lease lapsed before the commit"):
                    await contexts.append(ctx, write(k[4:6]), Timings())  # it opens shard 1 on the worker
            assert await directory.get(ctx) == committed
            # Killed, the directory comes back rebuilt from what the worker keeps: the committed record,
            # not the refused append's (before 2026-12-06 the new shard's worker kept that one, and a
            # rebuild took an append its client was told had failed).
            await restart(ray_cluster, directory)
            assert await directory.get(ctx) == committed
            # The next append opens shard 1 again: the refused append's leftover gives way to it.
            desc = await contexts.append(ctx, write(k[4:10]), Timings())
            assert desc["length"] == 10 and desc["shard_lengths"] == [5, 5]  # shard 1 opened, then levelled
            # A query reads exactly the 10 committed keys (the orchestrator's path, over the shards' replicas).
            out, lse = await read_all(pool, contexts, ctx, q, np.arange(8, 10))
            assert_close_to_reference(out, lse, q, k, k, causal=True)
        finally:
            ray_cluster.kill(directory.handle)  # for good: the next test starts its own
            pool.shutdown()

    asyncio.run(run())


def test_an_append_whose_directory_restarted_before_the_workers_were_told_is_not_acknowledged(ray_cluster, rng):
    """The directory dies right after an append's commit, before any holder keeps the new record: the
    rebuilt directory has the record before the append. The append must not be answered as stored
    (before 2026-12-06 it was: an acknowledged append the context did not hold)."""
    from service.core.settings import ServiceSettings

    settings = ServiceSettings(workers=2, worker_cpus=0.5, context_shard_keys=4, ray_namespace=NAMESPACE)
    k = rng.standard_normal((10, 1, 8)).astype(np.float32)  # [n_k, h_kv, d]
    q = rng.standard_normal((2, 2, 8)).astype(np.float32)  # [n_q, h_q, d]

    async def run() -> None:
        pool, directory, contexts = await started(settings)
        try:
            ctx = (await contexts.create(write(k[:3]), Timings()))["id"]
            committed = copy.deepcopy(await directory.get(ctx))
            commit = directory.commit

            async def commit_then_die(record, owner):  # once: the append's commit
                directory.commit = commit
                incarnation = await commit(record, owner)
                await restart(ray_cluster, directory)
                return incarnation

            directory.commit = commit_then_die
            with pytest.raises(WorkersUnavailable, match=f"the append to context {ctx} was not stored: the "
                                                         "contexts directory restarted between its commit"):
                await contexts.append(ctx, write(k[3:6]), Timings())  # it opens shard 1
            # The record before the append, committed again above the append's version 2: a holder told of
            # the append keeps this one instead, and a later rebuild cannot take the append.
            now = await directory.get(ctx)
            assert now["version"] == 3 and {**now, "version": 1, "writer": None} == {**committed, "writer": None}
            await restart(ray_cluster, directory)
            assert await directory.get(ctx) == now
            out, lse = await read_all(pool, contexts, ctx, q, np.arange(1, 3))
            assert_close_to_reference(out, lse, q, k[:3], k[:3], causal=True)
            # Sent again after the context's length, it is stored once.
            desc = await contexts.append(ctx, write(k[3:10]), Timings())
            assert desc["length"] == 10
            out, lse = await read_all(pool, contexts, ctx, q, np.arange(8, 10))
            assert_close_to_reference(out, lse, q, k, k, causal=True)
        finally:
            ray_cluster.kill(directory.handle)  # for good: the next test starts its own
            pool.shutdown()

    asyncio.run(run())


def test_an_append_whose_directory_restarted_after_the_workers_were_told_stands(ray_cluster, rng):
    """The directory dies after every holder keeps the append's record, before the lease is given back:
    the rebuilt directory takes the append from the holders, and the append is answered as stored."""
    from service.core.settings import ServiceSettings

    settings = ServiceSettings(workers=1, worker_cpus=1, context_shard_keys=4, ray_namespace=NAMESPACE)
    k = rng.standard_normal((9, 1, 8)).astype(np.float32)  # [n_k, h_kv, d]
    q = rng.standard_normal((2, 2, 8)).astype(np.float32)  # [n_q, h_q, d]

    async def run() -> None:
        pool, directory, contexts = await started(settings)
        try:
            ctx = (await contexts.create(write(k[:3]), Timings()))["id"]
            release = directory.release
            channels = []

            async def die_then_release(ctx_id, owner):  # once: the append's release
                directory.release = release
                channels.append(directory._channel)  # the lease and the commit went over the direct channel
                await restart(ray_cluster, directory)
                return await release(ctx_id, owner)

            directory.release = die_then_release
            desc = await contexts.append(ctx, write(k[3:9]), Timings())
            assert desc["length"] == 9 and (await directory.get(ctx))["version"] == 2
            # The restart closed that channel; the release opened one to the new directory.
            assert channels[0] is not None and channels[0].closed
            assert directory._channel is not channels[0] and not directory._channel.closed
            out, lse = await read_all(pool, contexts, ctx, q, np.arange(7, 9))
            assert_close_to_reference(out, lse, q, k, k, causal=True)
        finally:
            ray_cluster.kill(directory.handle)  # for good: the next test starts its own
            pool.shutdown()

    asyncio.run(run())
