"""The pool of Ray shard workers: start or find them, pick one, call it, heal it.

Workers are named actors (``splitkey-worker-<i>`` in the settings' namespace), so
a restarted front end, or a second one on the same cluster, finds the same
workers and the contexts they hold. When the front end joined an existing
cluster the workers are detached (they outlive it); with an embedded Ray they
end with the process. A worker that dies is replaced under the same name by
:meth:`WorkerPool.replace` (``service.contexts.repair`` decides when, after the
directory has forgotten what the dead one held, and rebuilds its replicas elsewhere).

This is the only module that calls ``workers.actor.ShardWorker``'s methods over Ray: the
typed methods below are its remote API (``service.cluster.surface.WorkerSurface``; ``service.cluster.local``
calls the same methods in this process). A worker that dies mid-call is marked
dead and the call raises :class:`service.core.errors.WorkersUnavailable`. A worker that *answers* a
query with an exception other than a domain one (:data:`DOMAIN_ERRORS`) is alive and holds its
shards: that is a fault of the service, :class:`service.core.errors.Internal` (500) with the worker and
the exception's kind, the same over the direct channel and over Ray, and not retried elsewhere.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from merge import State
from service.cluster.channel import (
    MAX_CALL_BYTES,
    MAX_WRITE_BYTES,
    STAGED_WRITES,
    ChannelClosed,
    WorkerChannel,
    WriteChannel,
)
from service.cluster.startup import (
    WORKER_PREFIX,
    check_fits,
    check_stores,
    default_worker_count,
    resolve_device,
    worker_config,
)
from service.cluster.surface import (
    DOMAIN_CLASSES,
    DOMAIN_ERRORS,  # noqa: F401 - re-exported: service.cluster.pool.DOMAIN_ERRORS as before
    InlineWork,
    ResidentWork,
    Roster,
    WorkerSlot,
    WorkerSurface,
    answered,
    failed,
    last_line,
    missed_ping,
)
from service.cluster.surface import domain as _domain
from service.core import deadline
from service.core.errors import WorkersUnavailable
from service.core.settings import ServiceSettings
from workers import frames
from workers.actor import ShardWorker
from workers.channel import append_frame, write_frame
from workers.config import settings_of
from workers.frames import FrameError, RemoteError
from workers.options import CpuKernels
from workers.store import CapacityError, ShardMissing, StorageFull
from workers.tasks import Carried, ComputeStatus, ResidentQuery, ShardQuery, ShardRead, ShardWrite, carry

#: Bytes of k and v per part of an append sent over a write channel: the worker stores a part while the
#: next one arrives (``workers.channel.append_frame``), so a smaller part overlaps more; each costs a hand-off.
APPEND_PART_BYTES = 2 * 2**20


def _span(carried: Any, write: ShardWrite) -> Any:
    """The write's keys of a (carried) array, carried as it was."""
    return Carried(write.keys_of(carried.bits)) if isinstance(carried, Carried) else write.keys_of(carried)


def _part_keys(k: Any, v: Any) -> int:
    """Keys per part of an append of ``k``, ``v`` over a write channel (:data:`APPEND_PART_BYTES`)."""
    n = int((k.bits if isinstance(k, Carried) else k).shape[0])
    per_key = max((_nbytes(k) + _nbytes(v)) // max(n, 1), 1)
    return max(1, APPEND_PART_BYTES // per_key)

_T = TypeVar("_T")

log = logging.getLogger(__name__)

#: What a call made through :meth:`WorkerPool._call` raises when the worker is gone (WorkersUnavailable)
#: or its method failed (Ray's error around the worker's exception): for callers outside this
#: package, which do not import Ray (tests/unit/test_dependencies.py).
CALL_ERRORS: tuple[type[Exception], ...] = (WorkersUnavailable, ray.exceptions.RayError)
#: Seconds a new worker has to answer its first ping (its constructor runs first: imports, and
#: loading its --persist-dir store).
START_PING_S = 60.0
#: Seconds more when it compiles the fused CPU kernel first (``workers.fused.warm``): a cold
#: compile of three dtypes took 55-71 s on this project's quiet 2-core machines, and a first
#: start 70-135 s under load; of the four it compiles since 2026-12-06, 143 s under load
#: (docs/BENCHMARKS.md "Start-up").
COMPILE_S = 360.0
#: The workers' concurrency group of their health calls (pings): one thread of its own, so that
#: a ping is answered while the worker's other calls (as many as ``worker_concurrency``) wait.
HEALTH_GROUP = "health"
#: Arrays up to this size travel inside the task call instead of through ray.put.
INLINE_ARG_BYTES = 256 * 2**10
#: Seconds before a worker whose direct channel could not be opened is tried again (Ray meanwhile).
CHANNEL_RETRY_S = 30.0
#: A worker's exceptions a write over the channel may answer that the contexts service handles by class
#: (a StorageFull is a CapacityError: its --persist-dir was full, and the write was undone).
WRITE_ERRORS: dict[str, type[Exception]] = {"CapacityError": CapacityError, "StorageFull": StorageFull,
                                            "ShardMissing": ShardMissing}


@dataclass
class Slot:
    index: int
    name: str
    handle: Any
    node_id: str = ""
    outstanding: int = 0
    alive: bool = True
    info: dict = field(default_factory=dict)
    incarnation: str = ""  #: the ShardWorker instance behind the name, from its last ping
    missed: int = 0  #: pings in a row that timed out (MISSED_PINGS of them and it counts as dead)
    error: str = ""  #: why its last ping failed, in one line (a worker that did not start: its constructor's error)
    channel: WorkerChannel | None = None  #: the direct channel, once opened (``service.cluster.channel``)
    channel_retry_at: float = 0.0  #: monotonic time before which no channel is opened (one just failed)
    channel_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    write_channel: WriteChannel | None = None  #: the connection for context writes, once opened

    @property
    def held(self) -> dict:
        """What the last ping reported held (bytes, shards, calls); nothing once counted dead: the
        service has forgotten that worker's replicas, and a replacement starts empty."""
        return self.info if self.alive else {}

    def drop_channel(self) -> None:
        """Close the channel (a new or dead worker, a broken socket); the next query may open one again."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.write_channel is not None:
            self.write_channel.close()
            self.write_channel = None


def _kill(slot: Slot) -> None:
    """Ask Ray to kill the slot's worker for good (no restart), whatever state its process is in; best
    effort: a worker already gone, or a handle Ray no longer knows, is what a dead one leaves."""
    if slot.handle is None:
        return
    try:
        ray.kill(slot.handle, no_restart=True)
    except Exception as exc:  # noqa: BLE001 - Ray's errors for an actor it has already forgotten
        log.info("worker %s could not be killed (%s): it is gone already", slot.name, type(exc).__name__)


async def _await(ref: Any) -> Any:
    """An ObjectRef as a coroutine (for ``asyncio.wait_for``)."""
    return await ref


def _nbytes(a: Any) -> int:
    return int((a.bits if isinstance(a, Carried) else a).nbytes)


class Staged:
    """A context write's array (carried: ``workers.tasks.carry``) kept here until a worker's call takes it.

    Over a worker's write channel it is sent from this memory as it is; a call that goes through
    Ray instead (no channel, or more than a frame holds) puts it into the object store once, on
    the first such call, and every other replica's call reads that object (:meth:`for_ray`).
    """

    def __init__(self, carried: Any) -> None:
        self.carried = carried
        self.nbytes = _nbytes(carried)
        self._ref: asyncio.Future | None = None

    async def for_ray(self) -> Any:
        """What a Ray call takes: the array itself when small (inlined in the call), else its ObjectRef."""
        if self.nbytes <= INLINE_ARG_BYTES:
            return self.carried
        if self._ref is None:
            self._ref = asyncio.ensure_future(asyncio.to_thread(ray.put, self.carried))
        try:
            return await asyncio.shield(self._ref)
        except ray.exceptions.RayError as exc:
            log.warning("the object store refused a request's arrays: %s", type(exc).__name__)
            raise WorkersUnavailable("the object store could not take the request's arrays (see the server's "
                                     "log); send it again") from None


def _written(name: str, header: dict, arrays: list[Any]) -> list[dict]:
    """The shards' summaries a ``written`` reply carries; a worker's error raised as a Ray call raises it."""
    if header.get("op") == "error":
        err = RemoteError(str(header.get("kind", "Exception")), str(header.get("message", "")))
        known = WRITE_ERRORS.get(err.kind)
        if known is not None:
            raise known(err.message)
        raise failed(name, err.kind, err.message)
    infos = header.get("infos")
    if header.get("op") != "written" or not isinstance(infos, list):
        raise failed(name, "FrameError", f"a write must be answered written, got {header.get('op')!r:.40}")
    return infos


class WorkerPool(Roster[Slot]):
    #: What a call other than a query raises when the worker is gone or its method failed (:data:`CALL_ERRORS`).
    call_errors = CALL_ERRORS
    #: Ray's own errors (``WorkerSurface.cluster_errors``).
    cluster_errors: tuple[type[Exception], ...] = (ray.exceptions.RayError,)

    def __init__(self, settings: ServiceSettings, slots: list[Slot], device: str, detached: bool) -> None:
        self.settings = settings
        self.slots = slots
        self.device = device
        self.detached = detached
        self._config = worker_config(settings, device)

    # -- lifecycle --------------------------------------------------------------
    @classmethod
    async def start(cls, settings: ServiceSettings, detached: bool) -> WorkerPool:
        device = resolve_device(settings)
        n = settings.workers or default_worker_count(settings, device)
        check_fits(settings, device, [f"{WORKER_PREFIX}{i}" for i in range(n)])
        if settings.persist_dir is not None:
            check_stores(settings.persist_dir, n)
        pool = cls(settings, [], device, detached)
        pool.slots = [Slot(i, f"{WORKER_PREFIX}{i}", pool._spawn(f"{WORKER_PREFIX}{i}")) for i in range(n)]
        fused = settings.cpu_kernels is CpuKernels.FUSED and device == "cpu"
        if fused:
            log.info("workers compile the fused CPU kernel as they start: about a minute the first time on a "
                     "2-core machine, under two seconds once numba's disk cache holds it (docs/BENCHMARKS.md)")
        await pool.refresh(timeout_s=START_PING_S + (COMPILE_S if fused else 0.0))
        dead = [f"{s.name} ({s.error})" if s.error else s.name for s in pool.slots if not s.alive]
        if dead:
            raise WorkersUnavailable(f"workers did not start: {', '.join(dead)}")
        pool.warn_other_settings()
        return pool

    def warn_other_settings(self) -> None:
        """One log line per running worker this front end joined whose settings are not its own: a
        worker keeps what it was started with (its constructor's config) until it is replaced."""
        wanted = settings_of(self._config)
        for slot in self.slots:
            theirs = slot.info.get("config")
            if not isinstance(theirs, dict):
                continue
            differ = [f"{name} {theirs.get(name)!r} (this front end: {value!r})" for name, value in wanted.items()
                      if theirs.get(name) != value]
            if differ:
                log.warning("worker %s was running already and keeps the settings it was started with: %s; a "
                            "worker takes new ones only when started anew (docs/DEPLOY.md)", slot.name,
                            ", ".join(differ))

    def _spawn(self, name: str, reuse: bool = True) -> Any:
        """A worker under ``name``: the one already there when ``reuse`` (a front end joining detached
        workers), else a new one (ValueError while the name is held)."""
        opts: dict[str, Any] = {
            "name": name,
            "namespace": self.settings.ray_namespace,
            "get_if_exists": reuse,
            "max_restarts": 0,
            # Threaded: a call waits in its own thread for the worker's one compute
            # thread (workers.batch), so queries that arrive together share a pass
            # and a context write does not wait behind them.
            "max_concurrency": self.settings.worker_concurrency,
            "num_cpus": self.settings.worker_cpus if self.device == "cpu" else 0,
            "num_gpus": 1 if self.device == "gpu" else 0,
            "scheduling_strategy": "SPREAD",
        }
        if self.detached:
            opts["lifetime"] = "detached"
        # Concurrency groups are the class's (Ray takes them in ray.remote, not in .options).
        worker_class = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(ShardWorker)  # type: ignore[call-overload]
        return worker_class.options(**opts).remote(self._config, name)

    async def refresh(self, timeout_s: float = 60.0) -> None:
        """Ping every worker; record node, bytes held and whether it answered.

        A name whose worker is not the one seen before (another front end replaced
        it) is taken as it is: that front end forgot the old worker's replicas first
        (``service.contexts.repair``); only its direct channel is opened again.
        """
        async def one(slot: Slot) -> None:
            if slot.handle is None:  # a replacement Ray refused (WorkerPool.replace): dead, tried again next round
                slot.alive = False
                return
            try:
                info = await asyncio.wait_for(
                    _await(slot.handle.ping.options(concurrency_group=HEALTH_GROUP).remote()), timeout_s)
                if answered(slot, info):
                    slot.drop_channel()
                    slot.channel_retry_at = 0.0  # the new worker may have a channel the old one had not
            except TimeoutError:
                if missed_ping(slot, timeout_s):
                    slot.drop_channel()
            except ray.exceptions.RayError as exc:
                slot.error = last_line(str(exc))
                if slot.alive or slot.incarnation:
                    log.warning("worker %s did not answer: %s", slot.name, slot.error)
                    log.debug("worker %s did not answer: %s", slot.name, exc)  # Ray's traceback
                slot.alive = False
                slot.drop_channel()

        await asyncio.gather(*(one(s) for s in self.slots))

    async def answers(self, index: int, timeout_s: float) -> bool:
        slot = self.slots[index]
        if slot.handle is None:
            return False
        try:
            await asyncio.wait_for(_await(slot.handle.ping.options(concurrency_group=HEALTH_GROUP).remote()), timeout_s)
        except (TimeoutError, ray.exceptions.RayError):
            return False
        return True

    async def fence(self, index: int) -> None:
        slot = self.slots[index]
        slot.alive = False  # its incarnation stays: the repair loop forgets its replicas and replaces it
        slot.drop_channel()
        _kill(slot)

    def replace(self, slot: WorkerSlot) -> bool:
        """Start a new, empty worker under a dead one's name (the caller first forgets what it held);
        False when the name is still held, to try again next round.

        The dead worker's handle is dropped first: Ray keeps a dead actor's name while a handle to it
        lives, and asking for the name with ``get_if_exists`` then gives back the dead worker (a
        worker whose process was killed stayed dead for good that way). A name still held after
        that is a replacement another front end started (detached workers), or a death Ray has not
        processed yet: the slot takes whatever holds it, and keeps its incarnation, so that the next
        refresh either adopts a live worker (a new incarnation) or finds it dead and replaces again.
        The old worker is killed first: one counted dead for its missed pings may be paused (SIGSTOP)
        and hold the name for as long as it is; until 2026-12-06 it was never replaced.
        """
        return self._replace(self.slots[slot.index])  # this pool's own slot (the surface hands them out read-only)

    def _replace(self, slot: Slot) -> bool:
        slot.drop_channel()
        slot.channel_retry_at = 0.0
        _kill(slot)
        dead, slot.handle = slot.handle, None  # the slot holds the only handle the front end keeps
        del dead
        try:
            slot.handle = self._spawn(slot.name, reuse=False)
        except ValueError:  # the name is held: take its holder (or a new worker, were it freed meanwhile)
            slot.handle = self._spawn(slot.name, reuse=True)
            return False
        slot.incarnation = ""  # the next refresh learns the new one
        return True

    def shutdown(self) -> None:
        """Close the channels; kill the workers unless they are detached (they belong to the cluster)."""
        for slot in self.slots:
            slot.drop_channel()
        if self.detached:
            return
        for slot in self.slots:
            try:
                ray.kill(slot.handle)
            except Exception:  # best effort at exit
                log.debug("could not kill %s", slot.name)


    # -- the object store -----------------------------------------------------------
    async def put(self, *arrays: Any) -> list[Any]:
        """Arrays as task arguments: large ones copied into the object store once (off the
        event loop, so every replica's call reads the same object), small ones passed by
        value (Ray inlines them in the call, which saves a round trip to the store).

        Within a context write (``service.cluster.channel.staged_writes``) with the direct
        channel on, each array stays here, :class:`Staged`, and goes to the workers over their
        write channels (:meth:`create_shards`, :meth:`append_shard`): no copy into the store."""
        out = [carry(a) for a in arrays]  # bfloat16 as its bits (workers.tasks.Carried)
        if STAGED_WRITES.get() and self.settings.worker_channel:
            return [Staged(a) for a in out]
        big = [i for i, a in enumerate(arrays) if a.nbytes > INLINE_ARG_BYTES]
        if big:
            try:
                refs = await asyncio.to_thread(lambda: [ray.put(out[i]) for i in big])
            except ray.exceptions.RayError as exc:
                log.warning("the object store refused a request's arrays: %s", type(exc).__name__)
                raise WorkersUnavailable("the object store could not take the request's arrays (see the server's "
                                         "log); send it again") from None
            for i, ref in zip(big, refs):
                out[i] = ref
        return out

    # -- calls ----------------------------------------------------------------------
    def _submit(self, index: int, call: Callable[[Any], Any]) -> Any:
        """Submit ``call(handle)``; the ObjectRef(s) are returned at once (await with :meth:`_result`)."""
        slot = self.slots[index]
        slot.outstanding += 1
        return call(slot.handle)

    async def _result(self, index: int, ref: Any) -> Any:
        """Await a submitted call; a dead worker is marked and raises WorkersUnavailable."""
        slot = self.slots[index]
        try:
            return await ref
        except RayActorError as exc:
            slot.alive = False
            slot.drop_channel()
            log.warning("worker %s died during a call: %s", slot.name, type(exc).__name__)
            raise WorkersUnavailable(f"worker {slot.name} died during the call") from exc
        finally:
            slot.outstanding -= 1

    def _call(self, index: int, call: Callable[[Any], Any]) -> Awaitable[Any]:
        return self._result(index, self._submit(index, call))

    async def compute(self, index: int, q: Any, query: ShardQuery, work: InlineWork | ResidentWork,
                      *, keep_state: bool, state_nbytes: int = 0) -> tuple[ComputeStatus, Any]:
        """One state of ``q`` over ``work``: ``(status, State)``; with ``keep_state`` the state stays
        in the object store and its ObjectRef is returned (for a merge on the workers).

        A resident query whose state comes back here (``state_nbytes`` bytes) goes over the
        worker's direct channel when it has one and the query fits it; through Ray otherwise,
        and whenever the channel breaks before the answer (the query is read-only: running it
        again is safe). Within a request the query carries the seconds left of its deadline
        (``service.core.deadline``); work the worker could not start in time raises ``Expired``.
        """
        if isinstance(work, ResidentWork) and len(work.reads) > 1:
            if keep_state:
                raise ValueError(f"keep_state must be False for several reads, got {len(work.reads)} reads")
            return await self._compute_reads(index, q, query, work.reads)
        left = deadline.budget()
        if left is not None:
            query = query.with_budget(left)
        # Over the channel when its frames hold what goes (q, its positions, the ALiBi slopes) and what
        # comes back (the state); not for a q large enough to have gone into the object store.
        if isinstance(work, ResidentWork) and not keep_state and self.settings.worker_channel \
                and isinstance(q, (np.ndarray, Carried)):
            alibi = query.options.alibi_slopes
            sent = _nbytes(q) + 8 * len(query.q_pos) + (np.asarray(alibi).nbytes if alibi is not None else 0)
            if max(sent, state_nbytes) <= MAX_CALL_BYTES:
                reads, fanin = work.reads, work.fanin
                answer = await self._via_channel(index, "query", lambda ch: ch.resident(q, query, reads, fanin))
                if answer is not None:
                    return answer

        def method(h: Any) -> Any:  # two return refs only when the state stays on the worker
            m = h.partial if isinstance(work, InlineWork) else h.partial_resident
            return m.options(num_returns=2) if keep_state else m

        if isinstance(work, InlineWork):
            refs = self._submit(index, lambda h: method(h).remote(q, work.k, work.v, query, work.k_pos))
        else:
            refs = self._submit(index, lambda h: method(h).remote(q, query, work.reads, work.fanin))
        if keep_state:
            status_ref, state_ref = refs
            return await self._answer(index, status_ref), state_ref
        result: tuple[ComputeStatus, State] = await self._answer(index, refs)
        return result

    async def _answer(self, index: int, ref: Any) -> Any:
        """A query's reply through Ray, its worker's exception raised as over the channel: a domain error
        by its own class (Ray's error is an instance of it), any other of the worker's own as :func:`failed`.
        Ray's errors stay Ray's (the cluster's fault, 503 at the route: ``service.app``), also where the
        worker's method raised one (an object it needed was lost)."""
        try:
            return await self._result(index, ref)
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(exc, DOMAIN_CLASSES) or cause is None or isinstance(cause, RayError):
                raise
            raise failed(self.slots[index].name, type(cause).__name__, str(cause)) from exc

    async def _compute_reads(self, index: int, q: Any, query: ShardQuery,
                             reads: tuple[ShardRead, ...]) -> tuple[ComputeStatus, list[State]]:
        """``(status, [State per read])`` of ``q`` over several shards this worker holds, in one call (the
        batch route's call with one item). Raises what the item raised, as :meth:`compute` does."""
        (answer,) = await self.compute_many(index, [ResidentQuery(q, query, reads)])
        if isinstance(answer, RemoteError):  # not a domain error: the worker failed the query
            raise failed(self.slots[index].name, answer.kind, answer.message)
        if isinstance(answer, BaseException):
            if not isinstance(answer, DOMAIN_CLASSES):  # through Ray: the worker's own exception
                raise failed(self.slots[index].name, type(answer).__name__, str(answer))
            raise answer
        status, states = answer
        return status, list(states)

    async def _channel(self, index: int) -> WorkerChannel | None:
        """The worker's open channel, opened now if need be; None when it has none or it just failed to open."""
        slot = self.slots[index]
        if slot.channel is not None and not slot.channel.closed:
            return slot.channel
        async with slot.channel_lock:
            if slot.channel is not None and not slot.channel.closed:
                return slot.channel
            if time.monotonic() < slot.channel_retry_at:
                return None
            try:
                address = await self._call(index, lambda h: h.channel.remote())  # a dead worker raises here
            except (AttributeError, ray.exceptions.RayTaskError) as exc:  # a worker of a release without one
                log.warning("worker %s has no direct channel (%s); its queries go through Ray", slot.name,
                            type(exc).__name__)
                address = None
            if address is None:  # none opened (--worker-channel false where it started, or none could bind)
                slot.channel_retry_at = math.inf
                return None
            try:
                slot.channel = await WorkerChannel.open(slot.name, address)
            except ChannelClosed as exc:
                log.warning("worker %s: %s; its queries go through Ray for %.0f s", slot.name, exc, CHANNEL_RETRY_S)
                slot.channel_retry_at = time.monotonic() + CHANNEL_RETRY_S
                return None
            return slot.channel

    async def _via_channel(self, index: int, what: str,
                           send: Callable[[WorkerChannel], Awaitable[_T | None]]) -> _T | None:
        """``send`` over worker ``index``'s direct channel: its answer, or None where the work must go
        through Ray instead (no channel; the channel broke before the answer: the work is read-only,
        so running it again is safe; or ``send`` itself gave None)."""
        channel = await self._channel(index)
        if channel is None:
            return None
        slot = self.slots[index]
        slot.outstanding += 1
        try:
            return await send(channel)
        except ChannelClosed as exc:
            log.info("worker %s: %s; the %s goes through Ray", slot.name, exc, what)
            slot.drop_channel()
            return None
        finally:
            slot.outstanding -= 1

    def merge_states(self, index: int, *states: Any) -> tuple[Any, Callable[[], None]]:
        """Submit one node of the merge tree on a worker: ``(ref, done)``; call ``done`` once it is awaited."""
        ref = self._submit(index, lambda h: h.merge_states.remote(*states))

        def done() -> None:
            self.slots[index].outstanding -= 1

        return ref, done

    async def root_state(self, state: Any) -> State:
        """The merge tree's root (an ObjectRef :meth:`merge_states` gave), here; a node lost on the way (its
        worker died, Ray lost the object) is ``WorkersUnavailable``."""
        try:
            root: State = await state
            return root
        except ray.exceptions.RayError as exc:
            log.warning("the merge tree lost a node: %s", type(exc).__name__)
            raise WorkersUnavailable("the merge tree lost a node (a worker died or Ray lost a state)") from exc

    def create_shard(self, index: int, write: ShardWrite, k: Any, v: Any,
                     record: Mapping[str, object]) -> Awaitable[Any]:
        return self._call(index, lambda h: h.create_shard.remote(write, k, v, record))

    def create_shards(self, index: int, writes: Sequence[ShardWrite], k: Any, v: Any,
                      record: Mapping[str, object]) -> Awaitable[Any]:
        """Several new shards of one context on one worker, in one call (``ShardWorker.create_shards``).
        Staged arrays (:meth:`put`) go over the worker's write channel when it has one."""
        if not isinstance(k, Staged) or not isinstance(v, Staged):
            return self._call(index, lambda h: h.create_shards.remote(list(writes), k, v, record))
        shards, kept = list(writes), copy.deepcopy(dict(record))  # as a Ray call takes them: now

        async def run() -> Any:
            sent = await self._write_over(index, k.nbytes + v.nbytes, lambda i: write_frame(
                i, shards, k.carried, v.carried, record=kept))
            if sent is not None:
                return sent
            rk, rv = await k.for_ray(), await v.for_ray()
            return await self._call(index, lambda h: h.create_shards.remote(shards, rk, rv, kept))
        return run()

    def append_shard(self, index: int, write: ShardWrite, k: Any, v: Any, committed: int) -> Awaitable[Any]:
        """Keys appended to one shard (``ShardWorker.append_shard``); staged arrays (:meth:`put`) go over
        the worker's write channel when it has one, only the write's span of them, in parts that the
        worker stores as they arrive."""
        if not isinstance(k, Staged) or not isinstance(v, Staged):
            return self._call(index, lambda h: h.append_shard.remote(write, k, v, committed))

        async def run() -> Any:
            ks, vs = _span(k.carried, write), _span(v.carried, write)
            sent = await self._write_over(index, _nbytes(ks) + _nbytes(vs), lambda i: append_frame(
                i, write, ks, vs, committed, _part_keys(ks, vs)))
            if sent is not None:
                [info] = sent
                return info
            rk, rv = await k.for_ray(), await v.for_ray()
            return await self._call(index, lambda h: h.append_shard.remote(write, rk, rv, committed))
        return run()

    async def _write_channel(self, index: int) -> WriteChannel | None:
        """The worker's write channel, opened now if need be; None when it has no direct channel (or one
        just failed to open: its writes go through Ray meanwhile)."""
        slot = self.slots[index]
        if slot.write_channel is not None and not slot.write_channel.closed:
            return slot.write_channel
        if await self._channel(index) is None:  # none, or none for now (its retry time is the query channel's)
            return None
        async with slot.channel_lock:
            if slot.write_channel is not None and not slot.write_channel.closed:
                return slot.write_channel
            try:
                address = await self._call(index, lambda h: h.channel.remote())
                if address is None:
                    return None
                slot.write_channel = await asyncio.to_thread(WriteChannel.open, slot.name, address)
            except ChannelClosed as exc:
                log.warning("worker %s: %s; its context writes go through Ray for %.0f s", slot.name, exc,
                            CHANNEL_RETRY_S)
                slot.drop_channel()
                slot.channel_retry_at = time.monotonic() + CHANNEL_RETRY_S
                return None
            return slot.write_channel

    async def _write_over(self, index: int, nbytes: int, frame: Callable[[int], Any]) -> Any:
        """A context write over worker ``index``'s write channel: the shards' summaries, or None when it
        must go through Ray (no channel, more than a frame holds, a frame that cannot be built: nothing was
        sent then). A connection that breaks on the way is 503: the write may be half stored, and the
        caller undoes it (docs/CONTEXTS.md, "Consistency")."""
        if not self.settings.worker_channel or nbytes > MAX_WRITE_BYTES:
            return None
        channel = await self._write_channel(index)
        if channel is None:
            return None
        slot = self.slots[index]
        slot.outstanding += 1
        try:
            header, arrays = await asyncio.to_thread(channel.call, frame)
        except (FrameError, TypeError, ValueError) as exc:  # raised building the frame, before any byte went
            log.info("worker %s: a context write could not be framed (%s); it goes through Ray", slot.name, exc)
            return None
        except ChannelClosed as exc:
            slot.drop_channel()
            log.info("worker %s: %s during a context write", slot.name, exc)  # the cause's class: for the log only
            raise WorkersUnavailable(f"worker {slot.name}'s channel closed during a context write (the connection "
                                     f"was lost); the write was undone: send it again") from None
        finally:
            slot.outstanding -= 1
        if header.get("op") == "error" and header.get("kind") == "FrameError":
            # Refused before anything was stored: a worker of a release without context writes on its
            # channel ("op must be resident or many"), or a frame it could not read. Ray carries it.
            log.info("worker %s refused a context write over its channel (%s); it goes through Ray", slot.name,
                     str(header.get("message", ""))[:200])
            return None
        return _written(slot.name, header, arrays)

    def export_shard(self, index: int, context_id: str, shard: int, length: int) -> Awaitable[Any]:
        """The first ``length`` keys of a shard, ``(k, v, k_pos)``: k and v stay in the object store
        (their ObjectRefs go on to the worker that rebuilds the replica), k_pos comes back."""
        async def run() -> tuple[Any, Any, Any]:
            k, v, k_pos = self._submit(index, lambda h: h.export_shard.options(num_returns=3).remote(
                context_id, shard, length))
            return k, v, await self._result(index, k_pos)
        return run()

    def truncate_shard(self, index: int, context_id: str, shard: int, length: int) -> Awaitable[Any]:
        return self._call(index, lambda h: h.truncate_shard.remote(context_id, shard, length))

    def note_context(self, index: int, context_id: str, record: Mapping[str, object]) -> Awaitable[Any]:
        """Tell a holder of a committed record (``ShardWorker.note_context``): over its direct channel when
        it has one, through Ray otherwise."""
        if self.settings.worker_channel:
            return self._note_over(index, lambda i: frames.note_frame(i, context_id, record),
                                    lambda h: h.note_context.remote(context_id, record))
        return self._call(index, lambda h: h.note_context.remote(context_id, record))

    async def _note_over(self, index: int, frame: Callable[[int], Any], call: Callable[[Any], Any]) -> Any:
        """A note of a committed record over the worker's direct channel (a Ray call costs a millisecond or
        more here, docs/CONTEXTS.md "Append latency"), through Ray (``call``) when it has none or the channel
        broke first: safe to run twice, a note keeps the newest version it was told. What the worker raised
        comes back as its own class for the errors a write expects (:data:`WRITE_ERRORS`)."""
        async def send(channel: WorkerChannel) -> tuple[Any] | None:
            try:
                return (await channel.write(frame),)
            except RemoteError as exc:
                known = WRITE_ERRORS.get(exc.kind)
                raise (known(exc.message) if known is not None else exc) from None
            except (frames.FrameError, TypeError) as exc:  # not JSON (a frame it cannot carry), or a bad reply
                log.info("worker %s: a write the channel could not carry (%s) goes through Ray",
                         self.slots[index].name, exc)
                return None

        answer = await self._via_channel(index, "write", send)
        if answer is not None:
            return answer[0]
        return await self._call(index, call)

    def drop(self, index: int, context_id: str, shard: int | None = None) -> Awaitable[Any]:
        return self._call(index, lambda h: h.drop.remote(context_id, shard))

    def delete(self, index: int, context_id: str) -> Awaitable[Any]:
        """Tombstone the deleted context on the worker, then drop its shards (``ShardWorker.delete``)."""
        return self._call(index, lambda h: h.delete.remote(context_id))

    def tombstones(self, index: int) -> Awaitable[Any]:
        """The ids of the contexts the worker has a tombstone of (``ShardWorker.tombstones``)."""
        return self._call(index, lambda h: h.tombstones.remote())

    def stored(self, index: int, context_ids: Sequence[str]) -> Awaitable[Any]:
        """Of ``context_ids``, those with files in the worker's folder (``ShardWorker.stored``)."""
        return self._call(index, lambda h: h.stored.remote(list(context_ids)))

    def forget_tombstones(self, index: int, context_ids: Sequence[str], older_than_s: float) -> Awaitable[Any]:
        """Remove the named tombstones the worker no longer needs (``ShardWorker.forget_tombstones``)."""
        return self._call(index, lambda h: h.forget_tombstones.remote(list(context_ids), older_than_s))

    def held(self, index: int) -> Awaitable[Any]:
        """What the worker holds: ``[{"context_id", "index", "length", ...}]`` (``ShardWorker.held``)."""
        return self._call(index, lambda h: h.held.remote())

    def release_unrecorded(self, index: int, context_ids: Sequence[str]) -> Awaitable[Any]:
        """Free the named contexts' shards the worker holds no record of, files left on disk: what it released,
        ``[{"context_id", "shards", "keys", "nbytes", "path", "why"}]`` (``ShardWorker.release_unrecorded``)."""
        return self._call(index, lambda h: h.release_unrecorded.remote(list(context_ids)))


    async def compute_many(self, index: int, items: Sequence[ResidentQuery]) -> list[Any]:
        """Every item's states over the resident shards it names on this worker, in one call: per item,
        ``(status, [State per read])`` or the exception it raised (``ShardWorker.partial_resident_many``).

        Over the worker's direct channel when it has one and the items fit it (their queries and,
        counted at the queries' size per read, their states), through Ray otherwise or when the
        channel breaks first. Within a request each item carries the seconds left of its deadline; an item
        the worker could not start in time is answered ``Expired``."""
        left = deadline.budget()
        if left is not None:
            items = [ResidentQuery(item.q, item.query.with_budget(left), item.reads) for item in items]
        sent = sum(_nbytes(item.q) * (1 + 2 * len(item.reads)) for item in items)

        async def send(channel: WorkerChannel) -> list[Any] | None:
            try:
                return [_domain(r) if isinstance(r, RemoteError) else r for r in await channel.many(items)]
            except RemoteError as exc:  # the worker refused the whole call (a frame it could not encode)
                log.info("worker %s refused a batch over the channel (%s); it goes through Ray",
                         self.slots[index].name, exc)
                return None

        if self.settings.worker_channel and sent <= MAX_CALL_BYTES:
            answers = await self._via_channel(index, "batch", send)
            if answers is not None:
                return answers
        return await self._call(index, lambda h: h.partial_resident_many.remote(list(items)))


#: The Ray pool is one implementation of the cluster's surface (mypy checks this assignment).
_RAY_SURFACE: type[WorkerSurface] = WorkerPool
