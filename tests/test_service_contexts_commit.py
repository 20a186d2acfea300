"""An append whose commit is refused is not stored, not even by a directory rebuilt from the workers.

In-process: a real Ray, a real shard worker and the real directory actor behind a
``ContextService``, as the front end runs them. A lease of no time makes every commit under it
refused (``LeaseLost``), as a lease lapsed or lost with a directory restart is; the directory is
then really killed and rebuilt by Ray from what the workers keep.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
from reference import assert_close_to_reference

from service.errors import WorkersUnavailable
from service.metrics import Timings
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


def write(k: np.ndarray) -> ContextWrite:
    return ContextWrite(InlineKV(k, k, None, KVDims(k.shape[0], k.shape[1], k.shape[2], k.shape[2])),
                        replicas=None, shards=None)


def test_an_append_whose_lease_lapsed_is_refused_never_taken_by_a_rebuild_and_its_shard_reused(ray_cluster,
                                                                                               monkeypatch, rng):
    import service.contexts.service as contexts_service
    from service.cluster.orchestrator import Orchestrator
    from service.cluster.pool import WorkerPool
    from service.contexts.directory import Directory
    from service.contexts.service import ContextService
    from service.settings import ServiceSettings

    settings = ServiceSettings(workers=1, worker_cpus=1, context_shard_keys=4, ray_namespace=NAMESPACE)
    k = rng.standard_normal((10, 1, 8)).astype(np.float32)  # [n_k, h_kv, d]
    q = rng.standard_normal((2, 2, 8)).astype(np.float32)  # [n_q, h_q, d]

    async def run() -> None:
        pool = await WorkerPool.start(settings, detached=False)
        try:
            directory = await Directory.connect(settings, [s.name for s in pool.slots], detached=False)
            contexts = ContextService(settings, pool, directory)
            ctx = (await contexts.create(write(k[:4]), Timings()))["id"]  # one full shard of 4 keys
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
            ray_cluster.kill(directory.handle, no_restart=False)
            await asyncio.sleep(1.0)
            assert (await directory.ping())["rebuilt_from"] == 1
            assert await directory.get(ctx) == committed
            # The next append opens shard 1 again: the refused append's leftover gives way to it.
            desc = await contexts.append(ctx, write(k[4:10]), Timings())
            assert desc["length"] == 10 and desc["shard_lengths"] == [4, 4, 2]
            # A query reads exactly the 10 committed keys (the orchestrator's path, over the shards' replicas).
            resolved = await contexts.resolve([ctx])
            query = ShardQuery(np.arange(8, 10), AttentionOptions(causal=True))
            out, lse = await Orchestrator(pool, fanin=2, remote_merge_bytes=2**30).run(
                q, query, resolved.jobs(pool, 2), Timings(), state_nbytes=q.shape[0] * q.shape[1] * 10 * 4)
            assert_close_to_reference(out, lse, q, k, k, causal=True)
        finally:
            pool.shutdown()

    asyncio.run(run())
