"""The contexts directory: a named Ray actor holding every context's committed record.

Front ends are stateless: they read and commit records (``service.contexts.records``)
here, so a restarted front end, or a second one on the same cluster, sees the same
contexts. If the directory itself restarts, its constructor rebuilds the records
from what the workers report holding (each worker keeps the newest committed
record of every context it holds a shard of). Writes to one context are
serialised by a lease (:meth:`DirectoryActor.acquire`).

:class:`Directory` is the front end's handle: typed calls that wait out a
directory restart. :class:`DirectorySurface` is what the contexts service and the
repair loop use of it; :class:`LocalDirectory` is the other implementation, a
:class:`DirectoryActor` in this process (beside ``service.cluster.local.LocalPool``: no Ray).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar, cast

import ray

from service.cluster.channel import ChannelClosed, WorkerChannel
from service.contexts.records import ContextRecord
from service.core.errors import ShuttingDown, WorkersUnavailable
from service.core.settings import ServiceSettings
from workers import frames
from workers.channel import Listener

log = logging.getLogger(__name__)

DIRECTORY_NAME = "splitkey-directory"
#: Seconds a write's lease on a context lasts unless renewed (an append holds it from reading the record to
#: the commit): what a front end that dies holding one keeps the context's other writers waiting at most.
LEASE_TTL_S = 15.0
#: A live holder renews its lease every this many seconds (``ContextService._lease``) ...
LEASE_RENEW_S = LEASE_TTL_S / 3
#: ... up to this long in all: a write still running then (a worker that answers its pings but never the
#: write) lets the others in, and its commit is refused as lapsed.
LEASE_MAX_S = 60.0
#: How long a directory call waits for a restarting directory, and how often it retries.
DIRECTORY_WAIT_S = 30.0
DIRECTORY_RETRY_S = 0.1
#: The calls of a write (:meth:`ContextService.append`) that go over the directory's direct channel.
CHANNEL_OPS = frozenset({"begin", "commit", "release"})
#: Seconds before a directory channel that could not be opened is tried again (Ray meanwhile).
CHANNEL_RETRY_S = 30.0

_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """One call at a time: Ray's (the actor's thread) and the direct channel's (its connections' threads)."""
    @functools.wraps(method)
    def run(self: DirectoryActor, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return cast(_F, run)


def _node_address() -> str:
    """The address Ray uses for this node (as ``workers.actor``'s: front ends on other nodes connect there)."""
    return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"


class LeaseLost(ValueError):
    """A commit under a lease the caller no longer holds: it ran past the lease's time, or the directory
    restarted (leases live in its memory) and another write may have taken the context since."""


#: What one worker reports to a rebuilding directory: the shards it holds (``ShardWorker.held``), those
#: its start left on disk (``ShardWorker.unloaded``), the contexts it has a tombstone of, and which
#: worker it is (its incarnation, as its ping says).
WorkerReport = tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], str]
#: How a rebuilding directory asks a worker, by name, for its report: None when it does not answer.
Reporter = Callable[[str], WorkerReport | None]


def ray_reporter(namespace: str) -> Reporter:
    """Ask the named Ray actors of ``namespace`` (the directory actor's own way)."""
    def report(name: str) -> WorkerReport | None:
        try:
            handle = ray.get_actor(name, namespace=namespace)
            held: list[dict[str, Any]] = ray.get(handle.held.remote(), timeout=30)
            # Shards left on disk at its start (no room): their records count, the worker holds no replica.
            unloaded: list[dict[str, Any]] = ray.get(handle.unloaded.remote(), timeout=30)
            deleted: list[str] = ray.get(handle.tombstones.remote(), timeout=30)
            incarnation = str(ray.get(handle.ping.remote(), timeout=30)["incarnation"])
        except (ValueError, ray.exceptions.RayError) as exc:
            log.warning("directory rebuild: %s did not answer: %s", name, exc)
            return None
        return held, unloaded, deleted, incarnation
    return report


class DirectoryActor:
    def __init__(self, worker_names: list[str], namespace: str, reporter: Reporter | None = None, *,
                 listen: bool = False) -> None:
        """``reporter``: how the rebuild asks each worker (default: the Ray actors of ``namespace``);
        ``listen``: open a direct channel for the calls of a write (:meth:`channel`)."""
        self.records: dict[str, ContextRecord] = {}
        self.leases: dict[str, tuple[str, float]] = {}
        #: worker name -> the incarnations of it whose replicas were forgotten (:meth:`forget_worker`: once each)
        self.forgotten: dict[str, set[str]] = {}
        #: worker name -> the incarnation that reported to this directory's rebuild, while no death of it is known
        self.reported: dict[str, str] = {}
        self._lock = threading.RLock()
        #: Which life of the actor this is: new at every (re)start, so a writer that sees the same one
        #: at its commit and at its lease's release knows no restart came between (ContextService.append).
        self.incarnation = secrets.token_hex(8)
        self.rebuilt_from = self._rebuild(worker_names, reporter or ray_reporter(namespace))
        self.listener: Listener | None = None
        if listen:  # after the rebuild: no call is served before the records are back
            try:
                self.listener = Listener(self._channel_submit, host=_node_address(), name=DIRECTORY_NAME)
            except OSError as exc:
                log.warning("directory: direct channel not opened (%s); writes call it through Ray", exc)

    # -- the direct channel ---------------------------------------------------------
    def channel(self) -> dict | None:
        """Where and how to reach this directory's direct channel (host, port, token); None without one.

        A Ray actor call costs a millisecond or more on a small machine, and an append makes three
        (docs/CONTEXTS.md, "Append latency"): over the channel (``workers.channel``: JSON frames, a
        token only Ray's callers learn) :data:`CHANNEL_OPS` cost a fraction of that. Same methods,
        same answers; a restart closes the channel with the process."""
        return None if self.listener is None else self.listener.address()

    def _channel_submit(self, header: dict[str, Any], arrays: list[Any], alone: bool = False) -> Future:
        """One call from the channel, run at once (``_locked``, as every call): its reply, or its error."""
        op, args = header.get("op"), header.get("args")
        if op not in CHANNEL_OPS or not isinstance(args, list) or arrays:
            raise frames.FrameError(f"op must be one of {', '.join(sorted(CHANNEL_OPS))} with a list of args, "
                                    f"got {str(op)[:40]!r}")
        done: Future = Future()
        try:
            done.set_result(frames.done_frame(int(header["id"]), getattr(self, op)(*args)))
        except Exception as exc:  # noqa: BLE001 - the call's own answer (LeaseLost, a bad argument)
            done.set_exception(exc)
        return done

    def _rebuild(self, worker_names: list[str], reporter: Reporter) -> int:
        """Rebuild records from the workers' reports; returns how many workers answered."""
        reports: dict[str, list[dict[str, Any]]] = {}
        deleted: set[str] = set()  # tombstoned by some worker (service.contexts.tombstones): not rebuilt
        answered = 0
        for name in worker_names:
            got = reporter(name)
            if got is None:
                continue
            held, unloaded, tombstoned, incarnation = got
            self.reported[name] = incarnation
            deleted.update(tombstoned)
            answered += 1
            for info in held:
                reports.setdefault(info["context_id"], []).append({**info, "worker": name, "loaded": True})
            for info in unloaded:
                reports.setdefault(info["context_id"], []).append({**info, "worker": name, "loaded": False})
        for ctx_id, infos in reports.items():
            if ctx_id in deleted:
                continue
            # The newest version; at equal versions the fullest (an older front end sent partial
            # records with a create's first shards).
            newest = max((i["context"] for i in infos if i["context"]), default=None,
                         key=lambda r: (r.get("version", 0), len(r.get("shards", ())),
                                        sum(s["length"] for s in r.get("shards", ()))))
            if newest is None:
                continue
            shards = [{**shard, "workers": [i["worker"] for i in infos if i["loaded"] and i["index"] == shard["index"]
                                            and i["length"] >= shard["length"]]}
                      for shard in newest["shards"]]
            self.records[ctx_id] = cast(ContextRecord, {**newest, "shards": shards})
        return answered

    # -- records ------------------------------------------------------------------
    @_locked
    def get(self, ctx_id: str) -> ContextRecord | None:
        return self.records.get(ctx_id)

    @_locked
    def get_many(self, ids: list[str]) -> list[ContextRecord | None]:
        return [self.records.get(i) for i in ids]

    @_locked
    def all(self) -> list[ContextRecord]:
        return [self.records[k] for k in sorted(self.records)]

    @_locked
    def commit(self, record: ContextRecord, owner: str | None = None) -> str:
        """Store a record; for an existing context only under the caller's lease, and only newer than the one
        stored. Returns the incarnation.

        The version check catches the one change made without the lease: a dead worker's replicas forgotten
        (:meth:`forget_worker`) while a write was under way from the record before. Its commit would put the
        dead name back, and reuse the version the forget gave a different record, which a front end may have
        cached: a worker noted that version would then serve that record's shorter prefix. Refused, the write
        is sent again by its client (its keys past the committed length are never read)."""
        ctx_id = record["id"]
        current = self.records.get(ctx_id)
        if current is not None and owner is not None:
            if not self._holds(ctx_id, owner):
                raise LeaseLost(f"lease on {ctx_id} must be held by {owner}, got another holder")
            if record == current:  # the same commit sent again (its first answer was lost with the channel)
                return self.incarnation
            if int(record["version"]) <= int(current["version"]):
                raise LeaseLost(f"record of {ctx_id} must be newer than the directory's version {current['version']}, "
                                f"got version {record['version']}: it changed under the lease (a dead worker's "
                                "replicas were forgotten)")
        self.records[ctx_id] = record
        return self.incarnation

    @_locked
    def remove(self, ctx_id: str) -> ContextRecord | None:
        self.leases.pop(ctx_id, None)
        return self.records.pop(ctx_id, None)

    @_locked
    def forget_worker(self, name: str, incarnation: str) -> int:
        """Worker ``incarnation`` of ``name`` died: it holds none of its replicas any more. Returns the number
        of replicas forgotten.

        Removes the name from every shard (each record's version is bumped), so that no read or write goes
        to its replacement before that holds a copy. Once per incarnation, and not once another incarnation
        of the name reported to this directory: every front end that sees the death asks, and the one that
        replaces the worker asks first; a later ask would remove replicas made on the replacement since,
        which is alive, holds them, and would never be told of the appends after (it would answer a
        record cached before them: docs/RELIABILITY.md, "Found by the soak").
        """
        if incarnation in self.forgotten.get(name, ()) or self.reported.get(name, incarnation) != incarnation:
            return 0
        self.forgotten.setdefault(name, set()).add(incarnation)
        self.reported.pop(name, None)
        forgotten = 0
        for ctx_id, record in self.records.items():
            hit = [s for s in record["shards"] if name in s["workers"]]
            if not hit:
                continue
            shards = [{**s, "workers": [w for w in s["workers"] if w != name]} if s in hit else s
                      for s in record["shards"]]
            self.records[ctx_id] = cast(ContextRecord, {**record, "shards": shards, "version": record["version"] + 1})
            forgotten += len(hit)
        return forgotten

    # -- leases -------------------------------------------------------------------
    @_locked
    def acquire(self, ctx_id: str, owner: str, ttl_s: float) -> bool:
        now = time.monotonic()
        held = self.leases.get(ctx_id)
        if held is not None and held[0] != owner and held[1] > now:
            return False
        self.leases[ctx_id] = (owner, now + ttl_s)
        return True

    @_locked
    def renew(self, ctx_id: str, owner: str, ttl_s: float) -> bool:
        """Extend ``owner``'s lease to ``ttl_s`` from now if it still holds it; never takes one (a renewal that
        arrives after the release or the expiry must not lock the context again)."""
        if not self._holds(ctx_id, owner):
            return False
        self.leases[ctx_id] = (owner, time.monotonic() + ttl_s)
        return True

    @_locked
    def begin(self, ctx_id: str, owner: str, ttl_s: float) -> tuple[bool, ContextRecord | None]:
        """:meth:`acquire` and, when it is taken, :meth:`get` in one call: a write's first round trip."""
        taken = self.acquire(ctx_id, owner, ttl_s)
        return taken, self.records.get(ctx_id) if taken else None

    @_locked
    def release(self, ctx_id: str, owner: str) -> str:
        """Give the lease back if the caller holds it; returns the incarnation."""
        if self._holds(ctx_id, owner):
            del self.leases[ctx_id]
        return self.incarnation

    def _holds(self, ctx_id: str, owner: str) -> bool:
        held = self.leases.get(ctx_id)
        return held is not None and held[0] == owner and held[1] > time.monotonic()

    @_locked
    def ping(self) -> dict:
        return {"contexts": len(self.records), "rebuilt_from": self.rebuilt_from}


def lapsed(ctx_id: str) -> WorkersUnavailable:
    """The 503 for a commit refused with ``LeaseLost``: the write was not stored (nothing a directory rebuilt
    from the workers could take names it: the workers keep only committed records, ``ContextService``)."""
    return WorkersUnavailable(
        f"the write to context {ctx_id} was not stored: its lease lapsed before the commit (the write "
        f"ran past {LEASE_MAX_S:g} s, or the contexts directory restarted), or a dead worker's replicas were "
        f"forgotten meanwhile, and another write may have taken the context since; send it again")


class DirectorySurface(Protocol):
    """What the contexts service, the repair loop and the orphan sweep use of the directory (each call
    as :class:`Directory`'s; :meth:`commit` raises :func:`lapsed` for a lease lost)."""

    async def ping(self) -> dict: ...
    async def get(self, ctx_id: str) -> ContextRecord | None: ...
    async def get_many(self, ids: list[str]) -> list[ContextRecord | None]: ...
    async def all(self) -> list[ContextRecord]: ...
    async def commit(self, record: ContextRecord, owner: str | None) -> str: ...
    async def remove(self, ctx_id: str) -> ContextRecord | None: ...
    async def forget_worker(self, name: str, incarnation: str) -> int: ...
    async def acquire(self, ctx_id: str, owner: str, ttl_s: float) -> bool: ...
    async def renew(self, ctx_id: str, owner: str, ttl_s: float) -> bool: ...
    async def begin(self, ctx_id: str, owner: str, ttl_s: float) -> tuple[bool, ContextRecord | None]: ...
    async def release(self, ctx_id: str, owner: str) -> str: ...


class Directory:
    """Front-end handle of the directory actor: typed calls that wait out a restart.

    The calls of a write (:data:`CHANNEL_OPS`) go over the directory's direct channel when it has
    one (:meth:`DirectoryActor.channel`), through Ray otherwise, and through Ray again when the
    channel breaks before the answer (the directory died, or the socket did): :meth:`_call` then
    waits out a restart as for any call. Sending one again is what a Ray call retried after a
    restart already does: ``begin`` and ``release`` by the same owner repeat harmlessly, and a
    ``commit`` a restarted directory did not keep is refused (its lease went with the restart)."""

    def __init__(self, handle: Any, channel: bool = False) -> None:
        self.handle = handle
        self._channel: WorkerChannel | None = None
        self._channel_lock = asyncio.Lock()
        #: monotonic time before which no channel is opened (inf: never; none asked for, or none there)
        self._channel_retry_at = 0.0 if channel else math.inf
        #: True once the lifespan is about to leave Ray (:meth:`close`): every call is ShuttingDown
        self.closed = False

    def close(self) -> None:
        """Take no more calls: the lifespan leaves Ray next. A write still running (a second signal
        stopped the server without waiting for it) gets :class:`ShuttingDown` from its next call."""
        self.closed = True
        self._channel_retry_at = math.inf
        if self._channel is not None:
            self._channel.close()

    @classmethod
    async def connect(cls, settings: ServiceSettings, worker_names: list[str], detached: bool) -> Directory:
        opts: dict[str, Any] = {"name": DIRECTORY_NAME, "namespace": settings.ray_namespace, "get_if_exists": True,
                                "max_restarts": -1, "num_cpus": 0}
        if detached:
            opts["lifetime"] = "detached"
        handle = ray.remote(DirectoryActor).options(**opts).remote(worker_names, settings.ray_namespace,
                                                                   listen=settings.worker_channel)
        directory = cls(handle, channel=settings.worker_channel)
        await directory.ping()
        return directory

    async def _open_channel(self) -> WorkerChannel | None:
        """The directory's open channel, opened now if need be; None when there is none to use now."""
        if self._channel is not None and not self._channel.closed:
            return self._channel
        async with self._channel_lock:
            if self._channel is not None and not self._channel.closed:
                return self._channel
            if time.monotonic() < self._channel_retry_at:
                return None
            try:
                address = await self._call(lambda h: h.channel.remote())
            except (AttributeError, ray.exceptions.RayTaskError):  # a directory of a release without one
                address = None
            if address is None:  # a directory started without one (or one that could not bind): ask again later
                self._channel_retry_at = time.monotonic() + CHANNEL_RETRY_S
                return None
            try:
                self._channel = await WorkerChannel.open(DIRECTORY_NAME, address)
            except ChannelClosed as exc:
                log.warning("directory: %s; writes call it through Ray for %.0f s", exc, CHANNEL_RETRY_S)
                self._channel_retry_at = time.monotonic() + CHANNEL_RETRY_S
                return None
            return self._channel

    async def _fast(self, op: str, *args: Any) -> Any:
        """``op(*args)`` over the direct channel, through Ray (:meth:`_call`) when it has none or it broke."""
        channel = await self._open_channel()
        if channel is not None:
            try:
                return await channel.write(lambda i: frames.encode({"id": i, "op": op, "args": list(args)}))
            except frames.RemoteError as exc:
                if exc.kind == "LeaseLost":
                    raise LeaseLost(exc.message) from None
                raise
            except ChannelClosed as exc:  # no answer: through Ray, which waits out a restart
                log.info("directory: %s; the %s goes through Ray", exc, op)
                channel.close()
            except (frames.FrameError, TypeError) as exc:  # arguments that are not JSON, or a bad reply
                log.info("directory: the channel could not carry a %s (%s); it goes through Ray", op, exc)
        return await self._call(lambda h: getattr(h, op).remote(*args))

    async def _call(self, call: Callable[[Any], Any]) -> Any:
        """Call the directory; while Ray restarts it (it rebuilds from the workers), retry.

        A directory that stays away past ``DIRECTORY_WAIT_S`` is a 503, never a 500; so is a call
        made after :meth:`close` (a write the second signal left behind, ``service.core.drain``):
        :class:`ShuttingDown`.
        """
        deadline = time.monotonic() + DIRECTORY_WAIT_S
        while True:
            if self.closed:
                raise ShuttingDown("the server is stopping: its contexts directory is no longer reachable")
            try:
                return await call(self.handle)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError) as exc:
                if time.monotonic() > deadline:
                    log.warning("the contexts directory did not answer for %g s: %s", DIRECTORY_WAIT_S,
                                type(exc).__name__)
                    raise WorkersUnavailable(f"the contexts directory must be reachable, got no answer for "
                                             f"{DIRECTORY_WAIT_S:g} s (it is restarting or gone)") from None
                await asyncio.sleep(DIRECTORY_RETRY_S)

    async def ping(self) -> dict:
        result: dict = await self._call(lambda h: h.ping.remote())
        return result

    async def get(self, ctx_id: str) -> ContextRecord | None:
        result: ContextRecord | None = await self._call(lambda h: h.get.remote(ctx_id))
        return result

    async def get_many(self, ids: list[str]) -> list[ContextRecord | None]:
        result: list[ContextRecord | None] = await self._call(lambda h: h.get_many.remote(ids))
        return result

    async def all(self) -> list[ContextRecord]:
        result: list[ContextRecord] = await self._call(lambda h: h.all.remote())
        return result

    async def commit(self, record: ContextRecord, owner: str | None) -> str:
        """Commit ``record``; returns the directory's incarnation (:attr:`DirectoryActor.incarnation`). A lease
        lost before it (``LeaseLost``) is a 503 saying the write was not stored: nothing a directory rebuilt
        from the workers could take names it (the workers keep only committed records: ``ContextService``)."""
        try:
            result: str = await (self._fast("commit", record, owner) if owner is not None
                                 else self._call(lambda h: h.commit.remote(record, owner)))
            return result
        except LeaseLost:
            raise lapsed(record["id"]) from None

    async def remove(self, ctx_id: str) -> ContextRecord | None:
        result: ContextRecord | None = await self._call(lambda h: h.remove.remote(ctx_id))
        return result

    async def forget_worker(self, name: str, incarnation: str) -> int:
        return int(await self._call(lambda h: h.forget_worker.remote(name, incarnation)))

    async def acquire(self, ctx_id: str, owner: str, ttl_s: float) -> bool:
        result: bool = await self._call(lambda h: h.acquire.remote(ctx_id, owner, ttl_s))
        return result

    async def renew(self, ctx_id: str, owner: str, ttl_s: float) -> bool:
        result: bool = await self._call(lambda h: h.renew.remote(ctx_id, owner, ttl_s))
        return result

    async def begin(self, ctx_id: str, owner: str, ttl_s: float) -> tuple[bool, ContextRecord | None]:
        """Take the lease and read the record in one round trip (:meth:`DirectoryActor.begin`); a directory of a
        release without ``begin`` (joined detached) is asked in two."""
        try:
            taken, record = await self._fast("begin", ctx_id, owner, ttl_s)
        except AttributeError:
            taken = await self.acquire(ctx_id, owner, ttl_s)
            record = await self.get(ctx_id) if taken else None
        return bool(taken), record

    async def release(self, ctx_id: str, owner: str) -> str:
        """Give the lease back; returns the directory's incarnation."""
        result: str = await self._fast("release", ctx_id, owner)
        return result


class LocalDirectory:
    """The directory in this process: a :class:`DirectoryActor` called directly, with :class:`Directory`'s
    typed calls. Arguments and answers are copied, as Ray's calls pass them by value. A directory restart
    is a new :class:`DirectoryActor` over the same workers (its reporter: ``LocalPool.report``) put in
    :attr:`actor`."""

    def __init__(self, actor: DirectoryActor) -> None:
        self.actor = actor

    async def _call(self, method: str, *args: Any) -> Any:
        await asyncio.sleep(0)  # a call lets the event loop run others, as an actor call does
        return copy.deepcopy(getattr(self.actor, method)(*copy.deepcopy(args)))

    async def ping(self) -> dict:
        result: dict = await self._call("ping")
        return result

    async def get(self, ctx_id: str) -> ContextRecord | None:
        result: ContextRecord | None = await self._call("get", ctx_id)
        return result

    async def get_many(self, ids: list[str]) -> list[ContextRecord | None]:
        result: list[ContextRecord | None] = await self._call("get_many", ids)
        return result

    async def all(self) -> list[ContextRecord]:
        result: list[ContextRecord] = await self._call("all")
        return result

    async def commit(self, record: ContextRecord, owner: str | None) -> str:
        try:
            result: str = await self._call("commit", record, owner)
            return result
        except LeaseLost:
            raise lapsed(record["id"]) from None

    async def remove(self, ctx_id: str) -> ContextRecord | None:
        result: ContextRecord | None = await self._call("remove", ctx_id)
        return result

    async def forget_worker(self, name: str, incarnation: str) -> int:
        return int(await self._call("forget_worker", name, incarnation))

    async def acquire(self, ctx_id: str, owner: str, ttl_s: float) -> bool:
        result: bool = await self._call("acquire", ctx_id, owner, ttl_s)
        return result

    async def renew(self, ctx_id: str, owner: str, ttl_s: float) -> bool:
        result: bool = await self._call("renew", ctx_id, owner, ttl_s)
        return result

    async def begin(self, ctx_id: str, owner: str, ttl_s: float) -> tuple[bool, ContextRecord | None]:
        taken, record = await self._call("begin", ctx_id, owner, ttl_s)
        return bool(taken), record

    async def release(self, ctx_id: str, owner: str) -> str:
        result: str = await self._call("release", ctx_id, owner)
        return result


#: Both directories are implementations of the surface (mypy checks these assignments).
_SURFACES: tuple[type[DirectorySurface], ...] = (Directory, LocalDirectory)
