"""The cluster's surface in this process: ``workers.actor.ShardWorker`` objects, called in threads, no Ray.

:class:`LocalPool` is the second implementation of ``service.cluster.surface.WorkerSurface`` (the
first is ``service.cluster.pool.WorkerPool``, over Ray actors). The code above the seam (the
orchestrator, the contexts service, the repair loop, the batch planner) runs on it unchanged;
``tests/unit`` tests it there, with faults injected (``tests/faulty_pool.py``).

It keeps what the Ray pool's callers rely on:

* each worker is the real :class:`ShardWorker`, built from the settings' ``WorkerConfig`` as the Ray
  pool builds it, without its direct channel (no socket is opened); its calls run in threads of its
  own (``worker_concurrency`` of them, pings on one more, as the actor's concurrency groups), so
  calls that arrive together really run together and batch in the worker;
* a call is submitted when it is made, and its arguments are taken then, by value (deep-copied, as
  Ray's are); so are the answers;
* a worker that is gone (:meth:`LocalPool.stop`, this process's ``ray.kill``) makes its calls, in
  flight or later, raise ``WorkersUnavailable`` and is marked dead; :meth:`LocalPool.replace` starts
  a new, empty one under its name;
* a query answered with a worker's own exception is ``failed`` (500), a domain error keeps its
  class; the other calls raise what the worker raised, as its class (Ray's error is an instance of it).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from merge import State
from service.cluster.startup import WORKER_PREFIX, worker_config
from service.cluster.surface import (
    DOMAIN_CLASSES,
    InlineWork,
    ResidentWork,
    Roster,
    answered,
    missed_ping,
    WorkerSlot,
    WorkerSurface,
    failed,
)
from service.core import deadline
from service.core.errors import WorkersUnavailable
from service.core.settings import ServiceSettings
from workers.actor import ShardWorker
from workers.config import WorkerConfig
from workers.tasks import ComputeStatus, ResidentQuery, ShardQuery, ShardRead, ShardWrite, carry

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

#: What a worker reports to a rebuilding directory (``service.contexts.directory.WorkerReport``).
WorkerReport = tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], str]


#: A query's exceptions that keep their class (the worker gone, the domain errors); any other is ``failed``.
_KEPT: tuple[type[Exception], ...] = (WorkersUnavailable, *DOMAIN_CLASSES)


def by_value(obj: Any) -> Any:
    """``obj`` as a call hands it over: a deep copy, as Ray copies arguments and answers (nothing here is
    ever unpickled)."""
    return copy.deepcopy(obj)


@dataclass
class LocalSlot:
    """One in-process worker as the pool sees it (``service.cluster.surface.WorkerSlot``)."""

    index: int
    name: str
    worker: ShardWorker | None  #: None once stopped
    calls: ThreadPoolExecutor  #: the worker's call threads (``worker_concurrency``)
    health: ThreadPoolExecutor  #: its ping thread
    node_id: str = ""
    outstanding: int = 0
    alive: bool = True
    info: dict = field(default_factory=dict)
    incarnation: str = ""
    missed: int = 0
    error: str = ""

    @property
    def held(self) -> dict:
        """What the last ping reported held; nothing once counted dead (as ``service.cluster.pool.Slot``)."""
        return self.info if self.alive else {}


class LocalPool(Roster[LocalSlot]):
    """Shard workers in this process (module docstring); ``await LocalPool.start(settings, workers=2)``."""

    #: A call other than a query raises the worker's own exception (any class), or WorkersUnavailable.
    call_errors: tuple[type[Exception], ...] = (WorkersUnavailable, Exception)
    #: No cluster beside the workers: every exception is a worker's (``WorkerSurface.cluster_errors``).
    cluster_errors: tuple[type[Exception], ...] = ()

    def __init__(self, settings: ServiceSettings, workers: int, tracer: Tracer | None = None) -> None:
        """``tracer``: where the workers' pass spans go (``workers.tracing``; None: as their config says)."""
        self.settings = settings
        self.tracer = tracer
        self.device = "cpu"
        #: The Ray pool's config for the same settings, without the direct channel (no socket here).
        self.config: WorkerConfig = dataclasses.replace(worker_config(settings, "cpu"), channel=False)
        self.slots: list[LocalSlot] = [self._slot(i, f"{WORKER_PREFIX}{i}") for i in range(workers)]

    @classmethod
    async def start(cls, settings: ServiceSettings, workers: int = 2) -> LocalPool:
        """``workers`` new workers, pinged once (as ``WorkerPool.start``: their incarnation and info known)."""
        pool = cls(settings, workers)
        await pool.refresh()
        return pool

    def _slot(self, index: int, name: str) -> LocalSlot:
        return LocalSlot(index, name, ShardWorker(self.config, name, self.tracer),
                         ThreadPoolExecutor(self.settings.worker_concurrency, thread_name_prefix=f"{name}-call"),
                         ThreadPoolExecutor(1, thread_name_prefix=f"{name}-health"))

    # -- lifecycle --------------------------------------------------------------
    def stop(self, index: int) -> None:
        """Let worker ``index`` go (this process's ``ray.kill``): its calls in flight and later raise
        WorkersUnavailable, and it is counted dead at its next call or ping."""
        self.slots[index].worker = None

    async def answers(self, index: int, timeout_s: float) -> bool:
        slot = self.slots[index]
        try:
            await asyncio.wait_for(self._invoke(index, slot.worker, "ping", (), health=True), timeout_s)
        except Exception:  # noqa: BLE001 - timed out, gone, or its ping raised: no answer
            return False
        return True

    async def fence(self, index: int) -> None:
        """``WorkerPool.fence``: the worker is stopped (:meth:`stop`) and counted dead now."""
        self.stop(index)
        self.slots[index].alive = False

    def replace(self, slot: WorkerSlot) -> bool:
        """A new, empty worker under a dead one's name (``WorkerPool.replace``); the old one is stopped first,
        as that kills it (one counted dead for its missed pings may only be hung)."""
        self.stop(slot.index)
        own = self.slots[slot.index]
        own.calls.shutdown(wait=False)
        own.health.shutdown(wait=False)
        fresh = self._slot(own.index, own.name)
        own.worker, own.calls, own.health = fresh.worker, fresh.calls, fresh.health
        own.incarnation = ""  # the next refresh learns the new one
        return True

    def shutdown(self) -> None:
        for slot in self.slots:
            slot.worker = None
            slot.calls.shutdown(wait=False)
            slot.health.shutdown(wait=False)

    async def refresh(self, timeout_s: float = 60.0) -> None:
        """Ping every worker, as ``WorkerPool.refresh`` does (the same rules for a ping that times out)."""
        async def one(slot: LocalSlot) -> None:
            try:
                info: dict = await asyncio.wait_for(self._invoke(slot.index, slot.worker, "ping", (), health=True),
                                                    timeout_s)
                answered(slot, info)
            except TimeoutError:
                missed_ping(slot, timeout_s)
            except Exception as exc:  # noqa: BLE001 - gone, or its ping raised: as a RayError there
                slot.error = str(exc)
                if slot.alive or slot.incarnation:
                    log.warning("worker %s did not answer: %s", slot.name, slot.error)
                slot.alive = False

        await asyncio.gather(*(one(s) for s in self.slots))

    def report(self, name: str) -> WorkerReport | None:
        """What the named worker reports to a rebuilding directory (``service.contexts.directory.Reporter``):
        ``DirectoryActor(names, namespace, reporter=pool.report)``. None when it is gone."""
        slot = next((s for s in self.slots if s.name == name), None)
        worker = slot.worker if slot is not None else None
        if worker is None:
            log.warning("directory rebuild: %s did not answer: it is gone", name)
            return None
        got: WorkerReport = by_value((worker.held(), worker.unloaded(), worker.tombstones(), worker.incarnation))
        return got


    # -- calls --------------------------------------------------------------------
    async def _invoke(self, index: int, worker: ShardWorker | None, method: str, args: tuple[Any, ...], *,
                      health: bool = False) -> Any:
        """Run ``method(*args)`` of ``worker``, the one at ``index`` when the call was made, in one of its
        threads; its answer, by value. A worker gone before or during the call (stopped, or replaced
        since: a call made to a dead worker never reaches its replacement) is marked dead and the call
        raises WorkersUnavailable."""
        slot = self.slots[index]
        if worker is None or slot.worker is not worker:
            raise self._died(slot)
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(slot.health if health else slot.calls,
                                            functools.partial(_run, worker, method, args))
        if slot.worker is not worker:  # stopped or replaced while it ran: its answer never came back
            raise self._died(slot)
        return answer

    @staticmethod
    def _died(slot: LocalSlot) -> WorkersUnavailable:
        slot.alive = False
        return WorkersUnavailable(f"worker {slot.name} died: it was stopped")

    def _submit(self, index: int, method: str, *args: Any) -> asyncio.Task[Any]:
        """Submit a call now (arguments taken now, by value); await the task for its answer."""
        sent = by_value(args)
        slot = self.slots[index]
        worker = slot.worker
        slot.outstanding += 1

        async def run() -> Any:
            try:
                return await self._invoke(index, worker, method, sent)
            finally:
                slot.outstanding -= 1

        return asyncio.ensure_future(run())

    async def put(self, *arrays: Any) -> list[Any]:
        """The arrays as the workers take them (bfloat16 as its bits); no object store here."""
        return [carry(a) for a in arrays]

    async def compute(self, index: int, q: Any, query: ShardQuery, work: InlineWork | ResidentWork,
                      *, keep_state: bool, state_nbytes: int = 0) -> tuple[ComputeStatus, Any]:
        """``WorkerPool.compute``: ``(status, State)``; with ``keep_state`` the state is the one to merge."""
        if isinstance(work, ResidentWork) and len(work.reads) > 1:
            if keep_state:
                raise ValueError(f"keep_state must be False for several reads, got {len(work.reads)} reads")
            return await self._compute_reads(index, q, query, work.reads)
        left = deadline.budget()
        if left is not None:
            query = query.with_budget(left)
        if isinstance(work, InlineWork):
            call = self._submit(index, "partial", q, work.k, work.v, query, work.k_pos)
        else:
            call = self._submit(index, "partial_resident", q, query, work.reads, work.fanin)
        try:
            result: tuple[ComputeStatus, State] = await call
            return result
        except _KEPT:
            raise
        except Exception as exc:  # the worker's own: a fault of the service
            raise failed(self.slots[index].name, type(exc).__name__, str(exc)) from exc

    async def _compute_reads(self, index: int, q: Any, query: ShardQuery,
                             reads: tuple[ShardRead, ...]) -> tuple[ComputeStatus, list[State]]:
        (answer,) = await self.compute_many(index, [ResidentQuery(q, query, reads)])
        if isinstance(answer, BaseException):
            if not isinstance(answer, DOMAIN_CLASSES):
                raise failed(self.slots[index].name, type(answer).__name__, str(answer))
            raise answer
        status, states = answer
        return status, list(states)

    async def compute_many(self, index: int, items: Sequence[ResidentQuery]) -> list[Any]:
        """``WorkerPool.compute_many``: per item ``(status, [State per read])`` or the exception it raised."""
        left = deadline.budget()
        if left is not None:
            items = [ResidentQuery(item.q, item.query.with_budget(left), item.reads) for item in items]
        answers: list[Any] = await self._submit(index, "partial_resident_many", list(items))
        return answers

    def merge_states(self, index: int, *states: Any) -> tuple[Any, Callable[[], None]]:
        """One node of the merge tree on worker ``index``: ``(task, done)``; its inputs are states or
        earlier nodes' tasks (awaited first, as Ray resolves the refs it is given)."""
        slot = self.slots[index]
        worker = slot.worker
        slot.outstanding += 1

        async def run() -> State:
            # Every input node awaited (a failed one's error retrieved), then the first failure raised.
            got = await asyncio.gather(*(_ready(s) for s in states), return_exceptions=True)
            for g in got:
                if isinstance(g, BaseException):
                    raise g
            inputs: list[State] = list(got)  # type: ignore[arg-type]
            merged: State = await self._invoke(index, worker, "merge_states", by_value(tuple(inputs)))
            return merged

        def done() -> None:
            slot.outstanding -= 1

        return asyncio.ensure_future(run()), done

    async def root_state(self, state: Any) -> State:
        try:
            root: State = await state if isinstance(state, asyncio.Future) else state
            return root
        except Exception as exc:  # a node's worker gone or failed: as a RayError there
            raise WorkersUnavailable(f"the merge tree lost a node: {type(exc).__name__}") from exc

    # -- resident shards (WorkerPool's, one call each) --------------------------------
    def create_shard(self, index: int, write: ShardWrite, k: Any, v: Any,
                     record: Mapping[str, object]) -> Awaitable[Any]:
        return self._submit(index, "create_shard", write, k, v, record)

    def create_shards(self, index: int, writes: Sequence[ShardWrite], k: Any, v: Any,
                      record: Mapping[str, object]) -> Awaitable[Any]:
        return self._submit(index, "create_shards", list(writes), k, v, record)

    def append_shard(self, index: int, write: ShardWrite, k: Any, v: Any, committed: int) -> Awaitable[Any]:
        return self._submit(index, "append_shard", write, k, v, committed)

    def export_shard(self, index: int, context_id: str, shard: int, length: int) -> Awaitable[Any]:
        return self._submit(index, "export_shard", context_id, shard, length)

    def truncate_shard(self, index: int, context_id: str, shard: int, length: int) -> Awaitable[Any]:
        return self._submit(index, "truncate_shard", context_id, shard, length)

    def note_context(self, index: int, context_id: str, record: Mapping[str, object]) -> Awaitable[Any]:
        return self._submit(index, "note_context", context_id, record)

    def drop(self, index: int, context_id: str, shard: int | None = None) -> Awaitable[Any]:
        return self._submit(index, "drop", context_id, shard)

    def delete(self, index: int, context_id: str) -> Awaitable[Any]:
        return self._submit(index, "delete", context_id)

    def tombstones(self, index: int) -> Awaitable[Any]:
        return self._submit(index, "tombstones")

    def stored(self, index: int, context_ids: Sequence[str]) -> Awaitable[Any]:
        return self._submit(index, "stored", list(context_ids))

    def forget_tombstones(self, index: int, context_ids: Sequence[str], older_than_s: float) -> Awaitable[Any]:
        return self._submit(index, "forget_tombstones", list(context_ids), older_than_s)

    def held(self, index: int) -> Awaitable[Any]:
        return self._submit(index, "held")

    def release_unrecorded(self, index: int, context_ids: Sequence[str]) -> Awaitable[Any]:
        return self._submit(index, "release_unrecorded", list(context_ids))


async def _ready(state: Any) -> Any:
    """A merge node's input: a state, or an earlier node's task awaited."""
    return await state if isinstance(state, asyncio.Future) else state


def _run(worker: ShardWorker, method: str, args: tuple[Any, ...]) -> Any:
    """In the worker's thread: the call, and its answer by value."""
    return by_value(getattr(worker, method)(*args))


#: The in-process pool is the other implementation of the cluster's surface (mypy checks this assignment).
_LOCAL_SURFACE: type[WorkerSurface] = LocalPool
