"""The in-process pool with faults injected, and the few helpers the unit tests of the seam share.

``FaultyPool`` is ``service.cluster.local.LocalPool`` (real ``ShardWorker`` objects, no Ray) that can
be told, per worker, to die, to hang, to lose a shard or to raise on its next call. The faults
live here, not in the package: nothing in production would ever ask a pool for them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from service.cluster.local import LocalPool
from service.cluster.orchestrator import Orchestrator
from service.contexts.directory import DirectoryActor, LocalDirectory
from service.contexts.service import ContextService
from service.core.metrics import Timings
from service.core.settings import ServiceSettings
from service.wire.request import ContextWrite, InlineKV
from workers.options import AttentionOptions
from workers.problem import KVDims
from workers.tasks import ShardQuery

NAMESPACE = "unit"


class FaultyPool(LocalPool):
    """A LocalPool whose workers can be told to fail (module docstring); ``sent`` lists every call made,
    ``(worker index, method)``, in the order the calls reached their worker (or its fault)."""

    def __init__(self, settings: ServiceSettings, workers: int, tracer: Any = None) -> None:
        super().__init__(settings, workers, tracer)
        self.sent: list[tuple[int, str]] = []
        self._gates: dict[int, tuple[asyncio.Event, frozenset[str]]] = {}
        self._fail: dict[int, list[tuple[str | None, Exception]]] = {}

    def kill(self, index: int) -> None:
        """The worker dies: its calls, in flight and later, raise WorkersUnavailable (as Ray's pool turns a
        RayActorError into), and its next call or ping counts it dead."""
        self.stop(index)

    def hang(self, index: int, *methods: str) -> None:
        """The worker's calls (of ``methods``; all, pings too, when none is named) wait until :meth:`release`,
        until the worker is stopped (fenced or killed) or until their caller gives up on them."""
        self._gates[index] = (asyncio.Event(), frozenset(methods))

    def release(self, index: int) -> None:
        """The hung worker goes on (SIGCONT); nothing if it was stopped meanwhile."""
        gated = self._gates.pop(index, None)
        if gated is not None:
            gated[0].set()

    def stop(self, index: int) -> None:
        """A stopped worker's hung calls end too, raising WorkersUnavailable (Ray's raylet kills a paused
        process): they never reach the worker."""
        super().stop(index)
        self.release(index)

    def lose_shard(self, index: int, context_id: str, shard: int) -> None:
        """The worker drops the shard from its store: reads of it raise ``workers.store.ShardMissing``."""
        worker = self.slots[index].worker
        assert worker is not None, "a dead worker holds nothing to lose"
        worker.store.drop(context_id, shard)

    def fail_next(self, index: int, exc: Exception, method: str | None = None) -> None:
        """The worker's next call (of ``method``, or any) raises ``exc`` in place of its method's answer (a
        batch of queries, ``partial_resident_many``: each item's answer is ``exc``, as when its kernel raises)."""
        self._fail.setdefault(index, []).append((method, exc))

    async def _invoke(self, index: int, worker: Any, method: str, args: tuple[Any, ...], *,
                      health: bool = False) -> Any:
        self.sent.append((index, method))
        gated = self._gates.get(index)
        if gated is not None and (not gated[1] or method in gated[1]):
            await gated[0].wait()
        pending = self._fail.get(index, [])
        for i, (wanted, exc) in enumerate(pending):
            if worker is not None and worker is self.slots[index].worker and wanted in (None, method):
                del pending[i]
                if method == "partial_resident_many":  # its kernel raised: each item's answer (the worker's way)
                    return [exc for _ in args[0]]
                raise exc
        return await super()._invoke(index, worker, method, args, health=health)

    def report(self, name: str) -> Any:
        """A hung worker does not answer a rebuilding directory (Ray's ``ray.get`` times out on it)."""
        index = next(s.index for s in self.slots if s.name == name)
        if index in self._gates and not self._gates[index][1]:
            return None
        return super().report(name)

    def calls_of(self, method: str) -> list[int]:
        """The workers a method was sent to, in order."""
        return [i for i, m in self.sent if m == method]


def settings(**overrides: Any) -> ServiceSettings:
    """Small shards and no cache unless asked: test-sized contexts still spread over the workers."""
    values: dict[str, Any] = {"context_shard_keys": 64, "min_shard_keys": 16, "worker_memory_bytes": 64 * 2**20,
                              "record_cache": 0}
    values.update(overrides)
    return ServiceSettings(**values)


async def started(workers: int = 3, tracer: Any = None,
                  **overrides: Any) -> tuple[FaultyPool, LocalDirectory, ContextService]:
    """A pool of ``workers`` (their pass spans to ``tracer``), a directory over them, and the contexts
    service on both (one front end)."""
    s = settings(**overrides)
    pool = FaultyPool(s, workers, tracer)
    await pool.refresh()
    directory = LocalDirectory(DirectoryActor([sl.name for sl in pool.slots], NAMESPACE, reporter=pool.report))
    return pool, directory, ContextService(s, pool, directory)


def restart_directory(directory: LocalDirectory, pool: LocalPool) -> None:
    """What Ray does when the directory actor dies: a new one, rebuilt from what the workers report."""
    directory.actor = DirectoryActor([s.name for s in pool.slots], NAMESPACE, reporter=pool.report)


def write(k: np.ndarray, v: np.ndarray, *, replicas: int | None = None, shards: int | None = None,
          after: int | None = None) -> ContextWrite:
    return ContextWrite(InlineKV(k, v, None, KVDims(k.shape[0], k.shape[1], k.shape[2], v.shape[2])),
                        replicas=replicas, shards=shards, after=after)


def kv(rng: np.random.Generator, n: int, h_kv: int = 2, d: int = 8, d_v: int = 4) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((n, h_kv, d)).astype(np.float32),
            rng.standard_normal((n, h_kv, d_v)).astype(np.float32))


async def read(pool: LocalPool, contexts: ContextService, ids: list[str], q: np.ndarray, *, fanin: int = 2,
               remote_merge_bytes: int = 2**30, causal: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` of ``q`` (decode: its rows at the contexts' last positions) over the contexts, through
    the orchestrator, from the records in the directory."""
    resolved = await contexts.resolve(ids, fresh=True)
    n_q = q.shape[0]
    q_pos = np.arange(resolved.next_pos - n_q, resolved.next_pos, dtype=np.int64)
    query = ShardQuery(q_pos, AttentionOptions(causal=causal))
    orch = Orchestrator(pool, fanin=fanin, remote_merge_bytes=remote_merge_bytes)
    d_v = resolved.dims.d_v
    out, lse = await orch.run(q, query, resolved.jobs(pool, fanin), Timings(),
                              state_nbytes=n_q * q.shape[1] * (d_v + 2) * 4)
    return out, lse


def bitwise(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))
