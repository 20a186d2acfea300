"""Contexts whose shards came back from ``--persist-dir`` without a record any holder could read.

Each holder of a shard keeps the context's record beside it (``workers.persist``); the
directory is rebuilt from those records (``service.contexts.directory``). A context whose
record is missing or damaged on every holder is not rebuilt: it is not listed, cannot be
queried or deleted, and its shards, loaded all the same (another holder's record may name
them), would hold their memory for nothing.

Its record cannot be rebuilt from the shards: what a shard's files hold is every key
written, which may run past what was committed (an append stored on its holders whose
commit never came: the record is what cuts it at a restart), and neither the shards
the context has (one lost with its record would go unnoticed) nor its replicas,
positions or uploads are in them. Serving such a guess could answer from keys that were
never acknowledged. So :meth:`Orphans.sweep` releases those shards from the workers'
memory, their files left on disk as they are (a record put back brings the context back
at the next start), with one warning per context naming its folders and why.

A worker is swept once per incarnation: at start, before the service is ready, and then
by the repair loop for a worker that replaced a dead one (it loads the same folder).
Only shards of contexts the directory does not list, and that their worker holds no
record of, are released: a create always gives its holders the record, so nothing in
flight is ever one of them. Nothing is released while the directory lacks the reports of
some worker (its rebuild did not hear from all of them): the record may be there.
Before that, each worker swept deletes the contexts some worker has a tombstone of
(``service.contexts.tombstones``): a record of a deleted context is no reason to keep it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from service.cluster.surface import WorkerSlot, WorkerSurface
from service.contexts.directory import DirectorySurface
from service.contexts.tombstones import bury

log = logging.getLogger(__name__)


class Orphans:
    def __init__(self, pool: WorkerSurface, directory: DirectorySurface) -> None:
        self.pool, self.directory = pool, directory
        self.swept: set[str] = set()  #: worker incarnations swept

    async def sweep(self) -> int:
        """Release, on every live worker not swept yet, the shards of contexts no holder has a record of;
        returns the number of contexts released."""
        slots = [s for s in self.pool.alive if s.incarnation and s.incarnation not in self.swept]
        if not slots:
            return 0
        await bury(self.pool, slots)  # deleted while they were down (service.contexts.tombstones)
        rebuilt_from = int((await self.directory.ping()).get("rebuilt_from", 0))
        if rebuilt_from < self.pool.size:
            log.info("contexts without a record are not looked for: the directory was rebuilt from %d of the %d "
                     "workers (a record may be on the others)", rebuilt_from, self.pool.size)
            self.swept.update(s.incarnation for s in slots)
            return 0
        held = await asyncio.gather(*(self._held(s) for s in slots))
        unrecorded = {s.index: sorted({h["context_id"] for h in got if not h["context"]})
                      for s, got in zip(slots, held) if got is not None}
        candidates = sorted({c for ids in unrecorded.values() for c in ids})
        records = await self.directory.get_many(candidates) if candidates else []
        listed = {c for c, rec in zip(candidates, records) if rec is not None}
        released: dict[str, list[tuple[WorkerSlot, dict[str, Any]]]] = {}
        for s in slots:
            if s.index not in unrecorded:  # it did not answer: asked again at the next sweep
                continue
            ids = [c for c in unrecorded[s.index] if c not in listed]
            try:
                for r in await self.pool.release_unrecorded(s.index, ids) if ids else []:
                    released.setdefault(r["context_id"], []).append((s, r))
            except self.pool.call_errors as exc:
                log.warning("worker %s: contexts without a record not released: %s", s.name, exc)
                continue
            self.swept.add(s.incarnation)
        for ctx_id, parts in sorted(released.items()):
            _warn(ctx_id, parts)
        return len(released)

    async def _held(self, slot: WorkerSlot) -> list[dict] | None:
        try:
            held: list[dict] = await self.pool.held(slot.index)
            return held
        except self.pool.call_errors as exc:  # tried again at the next sweep
            log.warning("worker %s did not say what it holds: %s", slot.name, exc)
            return None


def _warn(ctx_id: str, parts: list[tuple[WorkerSlot, dict[str, Any]]]) -> None:
    """One warning for a released context: its workers, folders, and why each has no record."""
    shards = sorted({i for _, r in parts for i in r["shards"]})
    log.warning("context %s is not served: no holder has a readable record of it (%s). Its %s %s (%d keys, "
                "%d bytes in all) are released from memory; their files are left on disk as they are in %s: put "
                "its record.json back to have it at the next start, or remove those folders to free the disk",
                ctx_id, "; ".join(f"{s.name}: {r['why']}" for s, r in parts), "shard" if len(shards) == 1 else "shards",
                ", ".join(map(str, shards)),
                sum(r["keys"] for _, r in parts), sum(r["nbytes"] for _, r in parts),
                ", ".join(f"{r['path']} ({s.name})" for s, r in parts))
