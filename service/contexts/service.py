"""Resident KV contexts: create, append, describe, list, delete, and resolve for queries.

The records live in the directory actor (``service.contexts.directory``); the keys
live on the workers in the kernel's streaming layout (``workers.store``). Writes
are all-or-nothing: a create or append that fails anywhere (no room: 507; a
worker gone: 503; a worker that hangs: 503, once it is killed, ``service.contexts.fencing``)
undoes what it wrote before the error is returned, and only then is the new record
committed, so a query sees a context before or after an append, never half of it
(docs/CONTEXTS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.cluster.surface import WorkerSurface, last_line
from service.contexts.cache import RecordCache
from service.contexts.directory import LEASE_MAX_S, LEASE_RENEW_S, LEASE_TTL_S, DirectorySurface
from service.contexts.fencing import Fence
from service.contexts.placement import WorkerLoad, place
from service.contexts.records import (
    LOST,
    ContextRecord,
    ShardEntry,
    continues_upload,
    describe,
    health,
    key_bytes,
    length,
    new_context_id,
    note_upload,
    upload_entry,
)
from service.contexts.resolved import Resolved
from service.contexts.sharding import AppendPlan, plan_append, plan_shards, reach_of, reserve_of
from service.core.errors import (
    ContextLost,
    ContextNotFound,
    InsufficientCapacity,
    InvalidOption,
    InvalidTensor,
    LengthMismatch,
    ShuttingDown,
    WorkersUnavailable,
    client_input,
)
from service.core.metrics import Timings
from service.core.settings import ServiceSettings
from service.wire.request import ContextWrite, InlineKV
from workers.dtypes import dtype_name, dtype_of
from workers.problem import Arange, KVDims, check_positions
from workers.store import CapacityError, ShardMissing, TombstoneUnwritten
from workers.tasks import ShardWrite

log = logging.getLogger(__name__)

LEASE_POLL_S = 0.01


def worker_message(exc: BaseException) -> str:
    """The message a worker raised: Ray hands its exception over as the ``cause`` of an error that
    is also an instance of its class, whose own text is the worker's traceback."""
    return str(getattr(exc, "cause", exc))


@dataclass(frozen=True)
class Refs:
    """A write's k and v as the workers get them (object refs, or the arrays when small: ``pool.put``)."""

    k: Any
    v: Any


@dataclass(frozen=True)
class Undo:
    """What to do to one replica if a write fails elsewhere: cut the shard back, or drop it."""

    worker: int
    context_id: str
    shard: int
    truncate_to: int | None  # None: drop the shard


@dataclass
class Lease:
    """One write's hold on a context (:meth:`ContextService._lease`): the owner token it commits with, and
    the directory's incarnation at its commit and at the release. Different incarnations mean the
    directory restarted in between (leases and records in memory lost, records rebuilt from the workers)."""

    owner: str
    record: ContextRecord | None = None  #: the committed record when the lease was taken (None: no such context)
    committed: str | None = None  #: the incarnation the commit went to (None: nothing committed)
    released: str | None = None  #: the incarnation the release went to


class ContextService:
    def __init__(self, settings: ServiceSettings, pool: WorkerSurface, directory: DirectorySurface) -> None:
        self.settings = settings
        self.pool = pool
        self.directory = directory
        self.owner = "frontend-" + secrets.token_hex(8)
        self._turns: dict[str, asyncio.Lock] = {}  # context id -> this front end's writes take turns (_lease)
        self.cache = RecordCache(settings.record_cache)
        #: Every worker call of a write goes through it: a worker that hangs is fenced (service.contexts.fencing).
        self.fence = Fence(pool, settings.write_timeout_s)

    # -- queries --------------------------------------------------------------
    async def resolve(self, ids: Sequence[str], *, fresh: bool = False) -> Resolved:
        """The named contexts as committed (from the cache unless ``fresh``); 404 for an unknown id."""
        cached = None if fresh else self.cache.servable(ids)
        found: list[ContextRecord] = list(cached) if cached is not None else []
        if cached is None:
            records = await self.directory.get_many(list(ids))
            for ctx_id, rec in zip(ids, records):
                if rec is None:
                    raise ContextNotFound(f"contexts must name existing contexts, got unknown id {ctx_id!r}")
                found.append(rec)
                self.cache.put(rec)
        return self.resolved(found, cached=cached is not None)

    async def resolve_many(self, ids: Sequence[str]) -> tuple[dict[str, ContextRecord], set[str]]:
        """The records of those of ``ids`` that exist, and which of them came from the cache: one
        directory call for all the cache cannot serve (a batch's contexts, ``service.batch``)."""
        found: dict[str, ContextRecord] = {}
        from_cache: set[str] = set()
        missing = []
        for ctx_id in dict.fromkeys(ids):
            rec = self.cache.servable([ctx_id])
            if rec is None:
                missing.append(ctx_id)
            else:
                found[ctx_id] = rec[0]
                from_cache.add(ctx_id)
        if missing:
            for ctx_id, got in zip(missing, await self.directory.get_many(missing)):
                if got is not None:
                    found[ctx_id] = got
                    self.cache.put(got)
        return found, from_cache

    def forget(self, ids: Sequence[str]) -> None:
        """Drop cached records a query found stale (the next resolution asks the directory)."""
        self.cache.drop_stale(ids)

    @staticmethod
    def resolved(found: Sequence[ContextRecord], *, cached: bool) -> Resolved:
        """The :class:`Resolved` of records found for a query's ids (in its order); 422 if their shapes differ."""
        dims = [[r["h_kv"], r["d"], r["d_v"]] for r in found]
        for other, other_dims in zip(found[1:], dims[1:]):
            if other_dims != dims[0]:  # named in the query's order: the first, the first that differs
                raise InvalidOption(f"contexts must share [h_kv, d, d_v], got {dims[0]} for {found[0]['id']} and "
                                    f"{other_dims} for {other['id']}")
        h_kv, d, d_v = dims[0]
        return Resolved(records=tuple(found),
                        dims=KVDims(n_k=sum(s["length"] for r in found for s in r["shards"]), h_kv=h_kv, d=d, d_v=d_v),
                        next_pos=max(r["next_pos"] for r in found), dtypes=tuple(dtype_of(r["dtype"]) for r in found),
                        cached=cached)

    # -- reads ----------------------------------------------------------------
    async def get(self, ctx_id: str, upload: str | None = None) -> dict:
        """The context's description; with ``upload``, also where that upload's keys are
        (``"upload": {"id", "start", "end"}``, or None if it is not among the recent ones)."""
        record = await self._record(ctx_id)
        if upload is None:
            return self.describe(record)
        return {**self.describe(record), "upload": upload_entry(record, upload)}

    async def describe_all(self) -> list[dict]:
        return [self.describe(r) for r in await self.directory.all()]

    def describe(self, record: ContextRecord) -> dict:
        """The public description with the context's health as this front end's pool sees it."""
        return {**describe(record), **self.health(record)}

    def health(self, record: ContextRecord) -> dict:
        return health(record, {s.name for s in self.pool.alive})

    async def count(self) -> int:
        return int((await self.directory.ping())["contexts"])

    # -- writes ---------------------------------------------------------------
    async def create(self, write: ContextWrite, timings: Timings) -> dict:
        """A new context holding the write's keys; ``timings`` gets its place, put, store, commit and note stages."""
        kv = write.kv
        n, dims = kv.dims.n_k, kv.dims
        k_pos = self._positions(kv, start=0)
        live = len(self.pool.alive)
        replicas = 1 if write.replicas is None else write.replicas
        most = min(self.pool.size, self.settings.max_replicas)
        if not 1 <= replicas <= most:  # never possible here: the client's to change
            raise InvalidOption(f"replicas must be in [1, {most}] (workers), got {replicas}")
        if replicas > live:  # possible once the dead workers are replaced: a retry may succeed
            raise WorkersUnavailable(f"replicas={replicas} needs {replicas} live workers, {live} of "
                                     f"{self.pool.size} are live now; send it again shortly")
        plan = plan_shards(write, live, self.settings.context_shard_keys)
        record: ContextRecord = {
            "id": new_context_id(), "h_kv": dims.h_kv, "d": dims.d, "d_v": dims.d_v, "dtype": dtype_name(kv.k.dtype),
            "replicas": replicas, "shard_capacity": plan.capacity, "expected_length": write.expected_length,
            "next_pos": int(np.max(k_pos)) + 1 if n else 0, "version": 1, "shards": []}
        bounds = plan.bounds
        with timings.measure("place"):
            placement = await self._place(plan.sizes, record)
        with timings.measure("put"):
            refs = Refs(*await self.pool.put(kv.k, kv.v))
        # The whole record first: each holder keeps the record it is sent (a call's arguments are
        # taken when it is submitted), and a directory rebuild trusts it to list every shard.
        record["shards"] = [{"index": i, "length": hi - lo, "workers": self.pool.names(placement[i]),
                             "body": plan.reserve or hi - lo} for i, (lo, hi) in enumerate(bounds)]
        per_worker: dict[int, list[ShardWrite]] = {}  # one call per worker, whatever the shard count
        for i, (lo, hi) in enumerate(bounds):
            shard = ShardWrite(record["id"], i, record["dtype"], reach_of(record), k_pos[lo:hi], reserve=plan.reserve,
                               span=(lo, hi))
            for w in placement[i]:
                per_worker.setdefault(w, []).append(shard)
        writes: list[Awaitable[Any]] = [
            self.fence.call(w, self.pool.create_shards(w, shards, refs.k, refs.v, record))
            for w, shards in per_worker.items()]
        try:
            with timings.measure("store"):
                await self._write_all(writes, creating=True)
        except Exception:
            await self._drop_everywhere(record["id"])
            raise
        with timings.measure("commit"):
            await self.directory.commit(record, None)
        with timings.measure("note"):
            # Before the answer, as an append's: a holder serves cached reads only of a version it was told is
            # committed (workers.store.ShardStore.check_read), and this front end's cache has it from now on.
            await self._note(record)
        self.cache.put(record)
        return self.describe(record)

    async def append(self, ctx_id: str, write: ContextWrite, timings: Timings) -> dict:
        """The write's keys after the context's; ``timings`` gets its put, lease (take the turn and the lease,
        read the record, give the lease back), place (new shards), store, commit and note stages."""
        with timings.measure("put"):  # before the lease: the next write's keys travel while this one is stored
            refs = Refs(*await self.pool.put(write.kv.k, write.kv.v))
        async with self._lease(ctx_id, timings) as lease:
            if lease.record is None:
                raise ContextNotFound(f"id must name an existing context, got {ctx_id!r}")
            old = lease.record
            state = self.health(old)
            if state["state"] == LOST:  # keys after a hole would answer wrongly: refuse, as queries do
                again = ("a replacement worker reloads a dead holder's copy from --persist-dir within seconds: "
                         "send it again; if the context stays lost, its copies could not be read or did not fit "
                         "(see the workers' logs): delete it and create it again, or restart with them readable"
                         if self.settings.persist_dir is not None else
                         "without --persist-dir no copy comes back: delete the context and create it again")
                raise ContextLost(f"context {ctx_id} has lost shards {state['lost_shards']}: no live worker holds a "
                                  f"copy now; {again}")
            if write.after is not None and write.after != length(old):
                raise LengthMismatch(f"after must be the context's length {length(old)}, got {write.after}")
            if write.continues and write.upload is not None and not continues_upload(old, write.upload):
                # Another writer's keys came after this upload's last chunk: this chunk would
                # leave them between its own (its after can match when their chunks are as long).
                why = ("another writer appended since" if upload_entry(old, write.upload) is not None else
                       "the context holds no chunk of it (continues is for an upload's later chunks)")
                raise LengthMismatch(f"continues needs the context's last append to be upload {write.upload}'s; "
                                     f"{why} (the context holds {length(old)} keys)")
            kv = write.kv
            if dtype_name(kv.k.dtype) != old["dtype"]:
                raise InvalidTensor(f"k must have the context's dtype {old['dtype']}, got {kv.k.dtype}")
            if (kv.dims.h_kv, kv.dims.d, kv.dims.d_v) != (old["h_kv"], old["d"], old["d_v"]):
                raise InvalidTensor(f"k, v must have [h_kv, d, d_v] = {[old['h_kv'], old['d'], old['d_v']]} "
                                    f"as the context, got {[kv.dims.h_kv, kv.dims.d, kv.dims.d_v]}")
            n = kv.dims.n_k
            k_pos = self._positions(kv, start=old["next_pos"])
            new: ContextRecord = copy.deepcopy(old)
            new["version"] += 1
            new["writer"] = lease.owner
            if n:
                # One past the largest position stored; an empty context's 0 is no position of a key.
                past = int(np.max(k_pos)) + 1
                new["next_pos"] = max(old["next_pos"], past) if length(old) else past
            if write.upload is not None:
                note_upload(new, write.upload, length(old), length(old) + n, write.continues)
            plan = plan_append(new, n, len(self.pool.alive), self.settings.context_shard_keys)
            writes, undo = self._fill_shards(new, refs, plan, k_pos)
            more_writes, more_undo = await self._open_shards(new, refs, plan, k_pos, timings, committed=old)
            try:
                with timings.measure("store"):
                    await self._write_all(writes + more_writes, creating=False)
            except Exception:
                await asyncio.gather(*(self._undo(u) for u in undo + more_undo))
                raise
            with timings.measure("commit"):
                lease.committed = await self.directory.commit(new, lease.owner)
            with timings.measure("note"):
                # Under the lease, and before the answer: every holder keeps the record for a directory
                # rebuild, and refuses reads of older cached records from now on. A directory that restarts
                # before some holder has it rebuilds without this append; the release sees the restart.
                await self._note(new)
        if lease.released != lease.committed:
            await self._settle(new)
        self.cache.put(new)
        return self.describe(new)

    async def delete(self, ctx_id: str) -> dict:
        async with self._lease(ctx_id, Timings()):
            rec = await self.directory.remove(ctx_id)  # the lease goes with the record
        self._turns.pop(ctx_id, None)
        self.cache.drop([ctx_id])
        if rec is None:
            raise ContextNotFound(f"id must name an existing context, got {ctx_id!r}")
        # Tombstoned on every live worker before the answer: a holder down now removes it when it comes back
        # (service.contexts.tombstones).
        await asyncio.gather(*(self._tombstone(s.index, ctx_id) for s in self.pool.alive))
        return describe(rec)

    async def _tombstone(self, index: int, ctx_id: str) -> None:
        """Delete the context on worker ``index``. A full ``--persist-dir`` there is logged, not answered: the
        delete is done (gone from the directory, its shards and files dropped); the tombstones the other
        workers wrote still keep it from coming back at a directory rebuild."""
        try:
            await self._quietly(self.fence.call(index, self.pool.delete(index, ctx_id)))
        except TombstoneUnwritten as exc:
            log.warning("context %s deleted, but %s", ctx_id, worker_message(exc))

    # -- the parts of an append ---------------------------------------------------
    def _fill_shards(self, new: ContextRecord, refs: Refs, plan: AppendPlan,
                     k_pos: np.ndarray) -> tuple[list[Awaitable[Any]], list[Undo]]:
        """Append the plan's spans of the write to the shards it fills (:func:`plan_append`); updates ``new``;
        returns their writes and their undos."""
        writes: list[Awaitable[Any]] = []
        undo: list[Undo] = []
        for index, lo, take in plan.fills:
            more_writes, more_undo = self._fill(new, new["shards"][index], refs, k_pos, lo, take)
            writes, undo = writes + more_writes, undo + more_undo
        return writes, undo

    def _fill(self, new: ContextRecord, entry: ShardEntry, refs: Refs, k_pos: np.ndarray, lo: int,
              take: int) -> tuple[list[Awaitable[Any]], list[Undo]]:
        """Append keys ``[lo, lo + take)`` of the write to shard ``entry`` of ``new`` (updated)."""
        holders = self.pool.indexes(entry["workers"], alive=True)
        if not holders:
            raise ContextLost(f"shard {entry['index']} of context {new['id']} has no live replica left")
        entry["workers"] = self.pool.names(holders)
        shard = ShardWrite(new["id"], entry["index"], new["dtype"], reach_of(new), k_pos[lo:lo + take],
                           span=(lo, lo + take))
        writes: list[Awaitable[Any]] = [
            self.fence.call(w, self.pool.append_shard(w, shard, refs.k, refs.v, entry["length"])) for w in holders]
        undo = [Undo(w, new["id"], entry["index"], entry["length"]) for w in holders]
        entry["length"] += take
        return writes, undo

    async def _open_shards(self, new: ContextRecord, refs: Refs, plan: AppendPlan, k_pos: np.ndarray,
                           timings: Timings, *, committed: ContextRecord) -> tuple[list[Awaitable[Any]], list[Undo]]:
        """The new shards of the plan, each with its span of the append; updates ``new`` and returns their writes.

        Their workers keep the ``committed`` record, not ``new``: a directory rebuilt from the workers
        (after a restart) must never take an append that was not committed, which its front end may
        have answered 503 (``workers.store`` replaces such a shard, which no record names, when a
        later append opens the same one)."""
        cap = new["shard_capacity"]
        if not plan.new:
            return [], []
        starts, sizes = [lo for lo, _ in plan.new], [size for _, size in plan.new]
        reserve = reserve_of(new)
        with timings.measure("place"):
            placement = await self._place([reserve or size for size in sizes], new)
        per_worker: dict[int, list[ShardWrite]] = {}  # one call per worker, as a create's
        undo: list[Undo] = []
        for lo, size, workers in zip(starts, sizes, placement):
            idx = len(new["shards"])
            entry: ShardEntry = {"index": idx, "length": size, "workers": self.pool.names(workers),
                                 "body": reserve or size}
            new["shards"].append(entry)
            shard = ShardWrite(new["id"], idx, new["dtype"], reach_of(new), k_pos[lo:lo + size], reserve=reserve,
                               span=(lo, lo + size))
            for w in workers:
                per_worker.setdefault(w, []).append(shard)
            undo += [Undo(w, new["id"], idx, None) for w in workers]
        writes: list[Awaitable[Any]] = [
            self.fence.call(w, self.pool.create_shards(w, shards, refs.k, refs.v, committed))
            for w, shards in per_worker.items()]
        return writes, undo

    # -- helpers --------------------------------------------------------------
    async def _record(self, ctx_id: str) -> ContextRecord:
        rec = await self.directory.get(ctx_id)
        if rec is None:
            raise ContextNotFound(f"id must name an existing context, got {ctx_id!r}")
        return rec

    @staticmethod
    def _positions(kv: InlineKV, start: int) -> np.ndarray:
        """The keys' positions: as given (checked at the edge), or continuing from ``start``."""
        if kv.k_pos is not None:
            return kv.k_pos
        with client_input():
            default = check_positions("k_pos", Arange(start, kv.dims.n_k), kv.dims.n_k)
        return default.materialize()

    async def _place(self, sizes: list[int], record: ContextRecord) -> list[list[int]]:
        # Within the write deadline too: a hung worker's ping holds the write this long, then its write is fenced.
        await self.pool.refresh(timeout_s=self.settings.write_timeout_s)
        live = [WorkerLoad(s.index, s.node_id, int(s.info.get("bytes_held", 0))) for s in self.pool.alive]
        try:
            return place([n * key_bytes(record) for n in sizes], record["replicas"], live)
        except ValueError as exc:
            raise WorkersUnavailable(f"replicas could not be placed: {exc}") from exc

    async def _write_all(self, writes: list[Awaitable[Any]], *, creating: bool) -> None:
        """Run every write; if any fails, raise the first failure (after all finished). ``creating``: the
        writes of a create, whose context id the client never gets when they fail."""
        results = await asyncio.gather(*writes, return_exceptions=True)
        for res in results:
            if isinstance(res, CapacityError):
                what = "the new context does not fit (it was not created)" if creating else "the append does not fit"
                raise InsufficientCapacity(f"{what}: {worker_message(res)}")
            if isinstance(res, ShardMissing):
                raise ContextLost(f"a replica was lost during the write: {worker_message(res)}")
            if isinstance(res, BaseException):
                raise res

    async def _note(self, record: ContextRecord) -> None:
        """Every holder keeps the newest committed record (for a directory rebuild)."""
        names = sorted({w for s in record["shards"] for w in s["workers"]})
        await asyncio.gather(*(self._note_one(i, record) for i in self.pool.indexes(names)))

    async def _note_one(self, index: int, record: ContextRecord) -> None:
        """Best effort, and never the write's answer: the record is committed when this runs, so a
        holder that fails to keep it (its disk refused the record's file) is logged, and the
        client is still told what was stored. The holder takes the version before it writes the
        file (``ShardStore.note_context``), so older reads are refused there all the same."""
        try:
            await self._quietly(self.fence.call(index, self.pool.note_context(index, record["id"], record)))
        except Exception as exc:  # noqa: BLE001 - anything a worker raised; the commit stands
            log.warning("worker %s did not keep the record of context %s version %s: %s",
                        self.pool.slots[index].name, record["id"], record.get("version"), last_line(str(exc)))

    async def _settle(self, new: ContextRecord) -> None:
        """An append's commit and its lease's release met different directories: it restarted in between and
        was rebuilt from what the workers keep. The append stands if that took it (a holder had been told
        of it: the record's ``writer`` is this append's). Otherwise the holders told of it keep a record the
        directory does not have, which a later rebuild could take, and which names any shard the append
        opened (so the next append could not open it again): the directory's record is committed again
        above the append's version and noted, and the append is refused as not stored. If even that is
        not confirmed, the client is told the outcome is not known here."""
        ctx_id = new["id"]
        now = await self.directory.get(ctx_id)
        if now is not None and now.get("writer") == new["writer"]:
            return
        self.cache.drop([ctx_id])
        unknown = WorkersUnavailable(
            f"the append to context {ctx_id} may not be stored: the contexts directory restarted between its "
            f"commit and the workers' note of it; read the context's length (GET /v1/contexts/{ctx_id}) and "
            f"send the keys again (after = that length) if they are not in it")
        try:
            async with self._lease(ctx_id, Timings()) as lease:
                now = await self._record(ctx_id)
                if now.get("writer") == new["writer"]:
                    return
                fixed: ContextRecord = copy.deepcopy(now)
                fixed["version"] = max(now["version"], new["version"]) + 1
                fixed["writer"] = lease.owner
                lease.committed = await self.directory.commit(fixed, lease.owner)
                await self._note(fixed)
        except WorkersUnavailable:
            raise unknown from None
        if lease.released != lease.committed:
            raise unknown
        self.cache.put(fixed)
        raise WorkersUnavailable(
            f"the append to context {ctx_id} was not stored: the contexts directory restarted between its commit "
            f"and the workers' note of it, and came back without it; send it again")

    async def _undo(self, u: Undo) -> None:
        if not self.pool.slots[u.worker].alive:
            # Nothing to wait for there (a fenced worker, or its replacement starting): an undo only frees
            # memory, since keys past a shard's committed length are never read and the next append cuts
            # them, and a shard no record names is replaced when an append opens it again (workers.store).
            return
        if u.truncate_to is None:
            await self.drop_quietly(u.worker, u.context_id, u.shard)
        else:
            await self._quietly(self.fence.call(u.worker, self.pool.truncate_shard(u.worker, u.context_id, u.shard,
                                                                                    u.truncate_to)))

    async def _drop_everywhere(self, ctx_id: str) -> None:
        await asyncio.gather(*(self.drop_quietly(s.index, ctx_id) for s in self.pool.alive))

    @staticmethod
    async def _quietly(call: Awaitable[Any]) -> None:
        """Best effort: a worker gone or a shard already gone is what an undo expects."""
        try:
            await call
        except (WorkersUnavailable, ShardMissing, ValueError):
            pass

    # -- for the repair loop (service.contexts.repair) ---------------------------------
    def lease(self, ctx_id: str) -> contextlib.AbstractAsyncContextManager[Lease]:
        """The context's write lease, as appends take it (see :meth:`_lease`)."""
        return self._lease(ctx_id, Timings())

    async def record(self, ctx_id: str) -> ContextRecord:
        """The committed record; ContextNotFound if there is none."""
        return await self._record(ctx_id)

    async def note(self, record: ContextRecord) -> None:
        await self._note(record)

    async def commit(self, record: ContextRecord, lease: Lease) -> None:
        lease.committed = await self.directory.commit(record, lease.owner)
        self.cache.put(record)

    async def drop_quietly(self, worker: int, ctx_id: str, shard: int | None = None) -> None:
        """Drop a shard (every shard of the context: None) from a worker if it holds one."""
        await self._quietly(self.fence.call(worker, self.pool.drop(worker, ctx_id, shard)))

    @contextlib.asynccontextmanager
    async def _lease(self, ctx_id: str, timings: Timings) -> AsyncIterator[Lease]:
        """The context's lease for one operation; yields the :class:`Lease` to commit with.

        Writes that reach this front end take turns on a lock of its own first, in
        the order they arrived (an upload's chunks in flight together wait there
        without asking the directory); then the directory's lease keeps out other
        front ends. The call that takes the lease also reads the record (``Lease.record``).
        The time to take and give back both is ``timings``' lease.

        The lease lasts ``LEASE_TTL_S`` and is renewed every ``LEASE_RENEW_S`` while the operation runs, up
        to ``LEASE_MAX_S`` in all: a front end that dies holding one keeps the context's other writers out
        for ``LEASE_TTL_S`` at most.
        """
        turn = self._turns.setdefault(ctx_id, asyncio.Lock())
        with timings.measure("lease"):
            await turn.acquire()
        try:
            with timings.measure("lease"):
                lease = await self._acquire(ctx_id)
            renewing = asyncio.ensure_future(self._renew(ctx_id, lease.owner))
            failed = True
            try:
                yield lease
                failed = False
            finally:
                renewing.cancel()
                with timings.measure("lease"):
                    try:
                        lease.released = await self.directory.release(ctx_id, lease.owner)
                    except ShuttingDown:
                        if not failed:
                            raise
                        # The operation's own exception (a cancel: the server stops now) is its
                        # answer; the lease expires by itself after LEASE_TTL_S.
        finally:
            turn.release()

    async def _renew(self, ctx_id: str, owner: str) -> None:
        """Renew ``owner``'s lease on the context every ``LEASE_RENEW_S`` until cancelled, ``LEASE_MAX_S``
        after it was taken, or the directory says it is not held (a restart lost it; the commit will say so)."""
        for _ in range(int(LEASE_MAX_S / LEASE_RENEW_S) - int(LEASE_TTL_S / LEASE_RENEW_S)):
            await asyncio.sleep(LEASE_RENEW_S)
            try:
                if not await self.directory.renew(ctx_id, owner, LEASE_TTL_S):
                    return
            except Exception as exc:  # noqa: BLE001 - best effort: the commit finds out what became of the lease
                log.warning("the lease on context %s could not be renewed: %s", ctx_id, type(exc).__name__)
                return

    async def _acquire(self, ctx_id: str) -> Lease:
        """Take the directory's lease on the context, reading its record in the same call; the :class:`Lease`
        names the owner token to commit and release with."""
        owner = f"{self.owner}-{secrets.token_hex(6)}"
        while True:
            taken, record = await self.directory.begin(ctx_id, owner, LEASE_TTL_S)
            if taken:
                return Lease(owner, record)
            await asyncio.sleep(LEASE_POLL_S)
