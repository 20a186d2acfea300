"""Resident context shards held by one worker, within a memory budget.

A shard is identified by ``(context_id, index)``. The store holds it in the
kernel's streaming layout (``ShardKV``, in the stored dtype) and remembers
enough about its context to let the directory rebuild itself from what the
workers report (``held``).

Appends only ever add keys at the end, so a reader that asks for the first
``length`` keys (the directory's committed length) sees a consistent prefix even
while an append to this shard is under way.

The worker calls the store from several threads (``workers.actor``). Writes
(create, append, truncate, drop) run one at a time under ``_writing``: the budget
is checked and charged by one writer at a time. ``_index`` guards the maps and is
held only to look up, insert or remove, never while keys are copied, so a query
reads its view while a long write copies.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from workers.batch import lower_priority
from workers.copies import prefault
from workers.dtypes import dtype_name, dtype_of
from workers.layout import ShardKV, ShardView, StreamingKV, bytes_per_key, padded_capacity
from workers.persist import NoSpace, ShardFiles
from workers.tasks import ShardRead, ShardWrite

log = logging.getLogger(__name__)

#: Keys a shard's prefault thread faults in per step, ahead of the appends.
PREFAULT_KEYS = 8192
#: Its scheduling priority: below queries and writes (workers.batch.lower_priority).
PREFAULT_NICE = 15


def _prefault_ahead(kv: StreamingKV) -> None:
    """Fault in a reserved shard's capacity in key order, from where the appends are (workers.copies.prefault).

    Runs in a thread of its own; the appends write the same memory meanwhile, which
    prefault leaves as it is. A step the appends already passed is skipped.
    """
    lower_priority(PREFAULT_NICE)
    start, end = kv.n_k, kv.capacity
    while start < end:
        start = max(start, kv.n_k)
        stop = min(start + PREFAULT_KEYS, end)
        if not all(prefault(region) for region in kv.regions(start, stop)):
            return  # the platform cannot: appends fault their pages in themselves
        start = stop


class CapacityError(Exception):
    """The worker's memory budget cannot hold what was asked; nothing was written."""


class StorageFull(CapacityError):
    """The worker's ``--persist-dir`` refused a write for lack of room (``workers.persist.NoSpace``): the
    write was undone, in memory and on disk, as a refused capacity is; nothing of it was stored."""


class TombstoneUnwritten(Exception):
    """A delete whose tombstone the worker's ``--persist-dir`` had no room for: the context's shards and
    files there are gone all the same (``ShardStore.delete``); only the guard against another worker's
    copy coming back at a restart is missing on this worker."""


class ShardMissing(Exception):
    """The worker does not hold the shard (never stored, dropped, or lost in a restart)."""


class RecordStale(Exception):
    """A query read a context record older than one this worker was told is committed.

    The front end caches records (``service.contexts.cache``) and names the version it
    read in each :class:`workers.tasks.ShardRead`; a worker that was noted a newer
    committed version (``note_context``, sent after every commit and before a write is
    acknowledged), or none since it loaded the context, refuses (:meth:`ShardStore.check_read`),
    and the front end reads the directory again.
    """


class Expired(Exception):
    """A job whose request's deadline passed before the worker's compute thread could start it: not
    computed (its budget, ``workers.tasks.ShardQuery.budget_s``, was spent waiting; docs/SERVICE.md,
    "Deadlines"). The front end answers it 504 ``deadline_exceeded``."""


@dataclass(frozen=True)
class ShardInfo:
    """What a worker reports about one shard it holds."""

    context_id: str
    index: int
    length: int
    h_kv: int
    d: int
    d_v: int
    dtype: str
    nbytes: int
    context: dict  # the context's newest committed record seen here, for a directory rebuild

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> dict:
        """:meth:`to_dict` without the record (what a write answers: the record is the caller's own)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "context"}


@dataclass(frozen=True)
class Released:
    """The shards of one context :meth:`ShardStore.release_unrecorded` freed from memory."""

    context_id: str
    shards: list[int]  #: their indexes
    keys: int
    nbytes: int
    path: str | None  #: the context's folder on disk, left as it is (None: a store without one)
    why: str  #: why this store has no record of the context

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> dict:
        """:meth:`to_dict` without the record (what a write answers: the record is the caller's own)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "context"}


class ShardStore:
    def __init__(self, budget_bytes: int, xp: Any = np, files: ShardFiles | None = None) -> None:
        self.budget = budget_bytes
        self.xp = xp
        self.files = files  # every write also on disk, durable before it returns (workers.persist)
        self._shards: dict[tuple[str, int], ShardKV] = {}
        self._info: dict[str, dict] = {}  # context_id -> the newest committed context record seen
        #: context_id -> the newest version known committed here: noted (note_context; a create's record may
        #: not be committed yet, so it does not count) or read fresh (check_read); what check_read compares with.
        self._committed: dict[str, int] = {}
        #: (context_id, index) -> a shard a restart found on disk and left there (its budget: :meth:`restore`),
        #: with the record found beside it: reported to a directory rebuild (:meth:`unloaded`).
        self._unloaded: dict[tuple[str, int], dict] = {}
        self._writing = threading.Lock()  # one write at a time (module doc)
        self._index = threading.Lock()  # the two maps, held briefly

    @property
    def used(self) -> int:
        with self._index:
            shards = list(self._shards.values())
        return sum(kv.nbytes for kv in shards)

    def _reserve(self, extra: int, what: str) -> None:
        used = self.used
        if used + extra > self.budget:
            raise CapacityError(f"{what} needs {extra} bytes, but this worker holds {used} of its {self.budget}-byte "
                                f"budget ({max(self.budget - used, 0)} free)")

    def _full(self, what: str, exc: NoSpace) -> StorageFull:
        """The refusal of a write undone because the disk refused it for lack of room; names the worker
        (its folder under ``--persist-dir`` is named for it: ``workers.actor``), never the path."""
        name = self.files.root.name if self.files is not None else "?"
        return StorageFull(f"worker {name}'s --persist-dir is full ({exc.strerror}): {what} was refused, and "
                           f"nothing of it was stored")

    def create(self, write: ShardWrite, k: Any, v: Any, *, context: dict) -> ShardInfo:
        """A new shard holding ``k``, ``v`` at ``write.k_pos``; ``context`` is the record to remember.

        It is allocated for ``write.reserve`` keys when that is more than ``k`` holds,
        so appends up to it neither grow nor copy the shard, and the budget is
        charged for all of it now.
        """
        with self._writing:
            return self._create(write, k, v, context)

    def _create(self, write: ShardWrite, k: Any, v: Any, context: dict, persist: bool = True) -> ShardInfo:
        context_id, index = write.context_id, write.index
        key = (context_id, index)
        if key in self._shards:
            if not self._uncommitted(context_id, index):
                raise ValueError(f"shard must not exist yet, got an existing shard {index} of {context_id}")
            # An append that opened it never committed (its front end failed, or lost its lease): no record
            # this worker holds names it, so nothing reads it; the new shard takes its place.
            with self._index:
                del self._shards[key]
            if self.files is not None:
                self.files.drop(context_id, index)
        dt = dtype_of(write.dtype)
        n, h_kv, d = (int(s) for s in k.shape)
        d_v = int(v.shape[2])
        # The body: the reservation (a planned capacity, or a copy's own body: fewer keys than it is given, the
        # rest then goes to its tail), else the keys written.
        capacity = write.reserve or n
        # The body is allocated for the keys and the reservation, charged now; the keys appended past it are
        # held page by page (workers.layout.ShardKV), in no more address space than the budget could fill.
        reach = max(capacity, min(write.max_capacity, self.budget // bytes_per_key(h_kv, d, d_v, dt)))
        self._reserve(padded_capacity(capacity, dt.itemsize) * bytes_per_key(h_kv, d, d_v, dt),
                      f"shard {index} of context {context_id}")
        kv = ShardKV(h_kv, d, d_v, dt, xp=self.xp, capacity=capacity, reach=reach)
        kv.append(self._to(k, dt), self._to(v, dt), self._to_pos(write.k_pos))
        what = f"shard {index} of context {context_id}"
        if self.files is not None and persist:
            try:
                self.files.create(context_id, index, write.dtype, capacity, write.max_capacity, (h_kv, d, d_v))
                self.files.write(context_id, index, 0, self._host(k, dt), self._host(v, dt), np.asarray(write.k_pos))
            except NoSpace as exc:
                self.files.drop(context_id, index)  # shard.json, or a folder made before the disk was full
                raise self._full(what, exc) from exc
        with self._index:
            old = self._info.get(context_id)
            self._shards[key] = kv
        # Not a commit: the write may still be undone. A restore writes nothing: the record it read is on disk
        # already, and one it could not read (damaged, or none) must stay as it is, not become ``{}``.
        try:
            self._remember(context_id, context, persist=persist)
        except NoSpace as exc:  # its record.json: the shard goes as it came (the old record.json is intact)
            with self._index:
                del self._shards[key]
                if old is None:
                    self._info.pop(context_id, None)
                else:
                    self._info[context_id] = old
            if self.files is not None:
                self.files.drop(context_id, index)
            raise self._full(what, exc) from exc
        if capacity > n and self.xp is np:
            # Reserved for the appends to come: fault its memory in now, beside the
            # upload's next chunks, instead of in each append (workers.copies.prefault).
            threading.Thread(target=_prefault_ahead, args=(kv.body,), name="splitkey-prefault", daemon=True).start()
        return self.info(context_id, index)

    def append(self, write: ShardWrite, k: Any, v: Any, *, committed: int) -> ShardInfo:
        """Append after the first ``committed`` keys (the directory's length).

        Keys past ``committed`` are an earlier append that never committed (its
        front end failed or gave up); they are dropped first, so the new keys
        always follow the committed prefix.
        """
        with self._writing:
            return self._append(write, k, v, committed)

    def _append(self, write: ShardWrite, k: Any, v: Any, committed: int) -> ShardInfo:
        context_id, index = write.context_id, write.index
        kv = self._get(context_id, index)
        if committed > kv.n_k:
            raise ShardMissing(f"shard {index} of context {context_id} holds {kv.n_k} keys, fewer than the {committed} committed")
        kv.truncate(committed)
        if self.files is not None:
            self.files.truncate(context_id, index, committed)
        n = int(k.shape[0])
        # What the keys add: the tail's new pages (a GPU body that grows: its new arrays, in full, while the old
        # ones still exist).
        extra = kv.held_after(n) - kv.nbytes
        if kv.body.xp is not np and extra:
            extra = kv.held_after(n)
        self._reserve(extra, f"append to shard {index} of context {context_id}")
        kv.append(self._to(k, kv.dtype), self._to(v, kv.dtype), self._to_pos(write.k_pos))
        if self.files is not None:
            try:
                self.files.write(context_id, index, committed, self._host(k, kv.dtype), self._host(v, kv.dtype),
                                 np.asarray(write.k_pos))
            except NoSpace as exc:  # undone as a refused capacity leaves it: the first ``committed`` keys
                kv.truncate(committed)
                self.files.truncate(context_id, index, committed)
                raise self._full(f"the append to shard {index} of context {context_id}", exc) from exc
        return self.info(context_id, index)

    def truncate(self, context_id: str, index: int, length: int) -> None:
        with self._writing:
            self._get(context_id, index).truncate(length)
            if self.files is not None:
                self.files.truncate(context_id, index, length)

    def drop(self, context_id: str, index: int | None = None) -> int:
        """Free one shard or every shard of a context; returns the number freed."""
        with self._writing, self._index:
            keys = [key for key in self._shards if key[0] == context_id and (index is None or key[1] == index)]
            for key in keys:
                del self._shards[key]
            for key in [key for key in self._unloaded if key[0] == context_id and index in (None, key[1])]:
                del self._unloaded[key]  # its files go below
            if not any(key[0] == context_id for key in self._shards):
                self._info.pop(context_id, None)
                self._committed.pop(context_id, None)
            if self.files is not None:  # what is on disk goes too, held or not (a shard the budget left there)
                self.files.drop(context_id, index)
            return len(keys)

    def delete(self, context_id: str) -> int:
        """The context was deleted: its tombstone on disk (``workers.persist``), then every shard dropped from
        memory and disk; returns the shards dropped.

        A tombstone that cannot be written (a full disk: :class:`TombstoneUnwritten`; a bad id) is
        raised, but only after the shards are dropped all the same: the user deleted the context,
        and its memory must not stay held until the next start. Without the tombstone this worker's
        files still go; what a tombstone guards against is another worker's copy coming back
        (docs/CONTEXTS.md).
        """
        try:
            if self.files is not None:
                self.files.tombstone(context_id)
        except NoSpace as exc:
            name = self.files.root.name if self.files is not None else "?"
            raise TombstoneUnwritten(f"worker {name}'s --persist-dir is full ({exc.strerror}): the tombstone of "
                                     f"context {context_id} was not written; its shards and files here are "
                                     "removed") from exc
        finally:
            dropped = self.drop(context_id)
        return dropped

    def tombstones(self) -> list[str]:
        """The ids of the contexts deleted here (tombstones on disk; none without ``files``)."""
        return sorted(self.files.tombstones()) if self.files is not None else []

    def stored(self, context_ids: Sequence[str]) -> list[str]:
        """Of ``context_ids``, those with files here (none without ``files``: nothing is tombstoned then)."""
        return sorted(self.files.stored(context_ids)) if self.files is not None else []

    def forget_tombstones(self, context_ids: Sequence[str], older_than_s: float) -> list[str]:
        """Remove the named tombstones older than ``older_than_s`` whose context has no files here
        (``ShardFiles.forget_tombstones``); returns the ids removed."""
        return self.files.forget_tombstones(context_ids, older_than_s) if self.files is not None else []

    def release_unrecorded(self, context_ids: Sequence[str]) -> list[Released]:
        """Free from memory the shards of each named context this store holds no record of; their files stay
        on disk as they are. Returns what was released, one per context.

        For a context whose record no holder could read at a restart (``service.contexts.orphans``): it
        cannot be served (the committed length of each shard, and which shards it has, are the record's to
        say), listed or deleted, so its memory would be held for nothing. A context this store has been
        told a record of since (a create, a note) is kept.
        """
        released = []
        with self._writing, self._index:
            for context_id in dict.fromkeys(context_ids):
                keys = sorted(key for key in self._shards if key[0] == context_id)
                if not keys or self._info.get(context_id):
                    continue
                kvs = [self._shards.pop(key) for key in keys]
                self._info.pop(context_id, None)
                self._committed.pop(context_id, None)
                files = self.files
                why = "no record was given" if files is None else files.unrecorded.get(context_id, "none is here")
                released.append(Released(context_id, [i for _, i in keys], sum(kv.n_k for kv in kvs),
                                         sum(kv.nbytes for kv in kvs),
                                         None if files is None else str(files.root / context_id), why))
        for r in released:
            log.warning("context %s: no holder has a readable record of it, so it cannot be served: its shards %s "
                        "(%d keys, %d bytes) are released from memory, their files left on disk as they are in "
                        "%s; its record here: %s", r.context_id, ", ".join(map(str, r.shards)), r.keys, r.nbytes,
                        r.path, r.why)
        return released

    def note_context(self, context_id: str, record: dict) -> None:
        """Remember the context's committed record (kept if its version is the newest seen); from now on
        reads of older versions are refused (:meth:`check_read`).

        Only for a context this store holds a shard of, checked under the write lock that
        :meth:`drop` holds: a note of an earlier commit that arrives after a delete dropped the
        context here would otherwise bring its record back (in memory, and on disk for the
        next restart), or write it into a folder being removed.
        """
        with self._writing:
            with self._index:
                if not any(key[0] == context_id for key in self._shards):
                    return
                version = int(record.get("version", 0))
                if version > self._committed.get(context_id, 0):
                    self._committed[context_id] = version
            self._remember(context_id, record)

    def _remember(self, context_id: str, record: dict, persist: bool = True) -> None:
        """Keep ``record`` for a directory rebuild (``held``) if its version is the newest seen (and, with
        ``persist``, on disk)."""
        with self._index:
            old = self._info.get(context_id)
            newest = old is None or record.get("version", 0) >= old.get("version", 0)
            changed = newest and old != record  # a create's record noted once committed: on disk already
            if newest:
                self._info[context_id] = dict(record)
        if changed and persist and self.files is not None:
            self.files.save_record(context_id, dict(record))

    def _uncommitted(self, context_id: str, index: int) -> bool:
        """Whether shard ``index`` of the context is a leftover of a write that never committed: the
        record this worker keeps of the context (the committed one it was noted, or the one a create
        or an append's new shard came with: ``ContextService`` sends the committed record there too)
        does not name it."""
        with self._index:
            record = self._info.get(context_id)
        return record is not None and all(s.get("index") != index for s in record.get("shards", ()))

    def check_read(self, read: ShardRead) -> None:
        """Raise :class:`RecordStale` when ``read`` names a record this worker cannot vouch for.

        A read of a record the front end took from the directory for this query (``read.fresh``) is
        never refused: this worker is listed in it, so its copy holds that version's keys, and it
        takes the version as noted (a replacement that reloaded its copy from disk, or missed a note,
        learns it so). A read of a cached record is refused when a newer version was noted here, and
        also when none was: this worker (re)loaded the context or was listed again since it was last
        told, so appends acknowledged meanwhile may be missing from its copy (docs/RELIABILITY.md,
        the soak's stale reads). Version 0 is not checked (a front end of a release before 2026-12-07).
        """
        context_id, version = read.context_id, read.version
        if not version:
            return
        with self._index:
            noted = self._committed.get(context_id)
            if read.fresh:
                # Only over a shard held here: a read racing a delete must not bring a note back.
                if (noted is None or noted < version) and (context_id, read.index) in self._shards:
                    self._committed[context_id] = version
                return
        if noted is None:
            raise RecordStale(f"context {context_id}: no committed version of it was noted on this worker since it "
                              f"loaded it; the query read version {version}")
        if noted > version:
            raise RecordStale(f"context {context_id} is at version {noted} or later, the query read {version}")

    def view(self, context_id: str, index: int, length: int) -> ShardView:
        """The first ``length`` keys of a shard (the committed prefix)."""
        kv = self._get(context_id, index)
        if length > kv.n_k:
            raise ShardMissing(f"shard {index} of context {context_id} holds {kv.n_k} keys, fewer than the {length} committed")
        return kv.snapshot(length)

    def export(self, context_id: str, index: int, length: int) -> tuple[Any, Any, Any]:
        """``(k [n, h_kv, d], v [n, h_kv, d_v], k_pos [n])``: copies of the first ``length`` keys in the
        contract layout, as host arrays (to rebuild a replica elsewhere)."""
        parts = self.view(context_id, index, length).parts
        to_host = getattr(self.xp, "asnumpy", np.asarray)
        k = np.concatenate([to_host(p.kt).transpose(2, 0, 1) for p in parts])  # [n, h_kv, d]
        v = np.concatenate([to_host(p.v).transpose(1, 0, 2) for p in parts])  # [n, h_kv, d_v]
        return k, v, np.concatenate([to_host(p.k_pos) for p in parts])

    def info(self, context_id: str, index: int) -> ShardInfo:
        kv = self._get(context_id, index)
        with self._index:
            context = dict(self._info.get(context_id, {}))
        return ShardInfo(context_id=context_id, index=index, length=kv.n_k, h_kv=kv.h_kv, d=kv.d, d_v=kv.d_v,
                         dtype=dtype_name(kv.dtype), nbytes=kv.nbytes, context=context)

    def held(self) -> list[ShardInfo]:
        with self._index:
            keys = sorted(self._shards)
        out = []
        for c, i in keys:
            try:
                out.append(self.info(c, i))
            except ShardMissing:  # dropped since the keys were listed
                pass
        return out

    def _get(self, context_id: str, index: int) -> ShardKV:
        with self._index:
            kv = self._shards.get((context_id, index))
        if kv is None:
            raise ShardMissing(f"this worker does not hold shard {index} of context {context_id}")
        return kv

    def restore(self) -> int:
        """Load what ``files`` holds (a restart): every shard and record found; the shards loaded.

        A shard that no longer fits the budget is left on disk and not loaded, named in a warning (as
        ``files.load`` names a damaged one).
        """
        if self.files is None:
            return 0
        shards, records = self.files.load()
        loaded = 0
        # Shards whose context has a record here first: one without may be of a context no holder has a record
        # of (released once the directory says so), and must not take the budget from the others.
        for s in sorted(shards, key=lambda s: s.context_id not in records):
            write = ShardWrite(s.context_id, s.index, s.dtype, s.max_capacity, s.k_pos, reserve=s.reserve)
            try:
                with self._writing:
                    self._create(write, s.k, s.v, records.get(s.context_id, {}), persist=False)
                loaded += 1
            except (CapacityError, ValueError) as exc:
                log.warning("persisted shard %d of context %s left on disk, not loaded: %s", s.index, s.context_id, exc)
                with self._index:
                    self._unloaded[(s.context_id, s.index)] = {
                        "context_id": s.context_id, "index": s.index, "keys": len(s.k_pos),
                        "context": records.get(s.context_id, {}), "why": str(exc)}
        return loaded

    def unloaded(self) -> list[dict]:
        """The shards the last restart left on disk, each with the record found beside it: a directory rebuild
        takes their contexts' records from them (without this replica), so that a context none of whose shards
        loaded is listed ``lost``, and can be deleted, rather than unknown (docs/RELIABILITY.md)."""
        with self._index:
            return [dict(u) for _, u in sorted(self._unloaded.items())]

    def _host(self, x: Any, dt: np.dtype) -> np.ndarray:
        """``x`` as a host array in ``dt`` (what goes to disk)."""
        to_host = getattr(self.xp, "asnumpy", np.asarray)
        arr = np.asarray(to_host(x))
        return arr if arr.dtype == dt else arr.astype(dt)

    def _to(self, x: Any, dt: np.dtype) -> Any:
        arr = self.xp.asarray(x)
        return arr if arr.dtype == dt else arr.astype(dt)

    def _to_pos(self, p: Any) -> Any:
        return self.xp.asarray(p, dtype=self.xp.int64)
