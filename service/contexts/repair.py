"""Self-healing replicas (docs/CONTEXTS.md, "Health and repair").

Every ``heal_interval_s`` the loop pings the workers. A worker that died first loses
its replicas in the directory (``forget_worker``: nothing is read from or written to an
empty replacement), then is replaced under its name; a name another front end replaced
is taken as it is. Then every shard below its
context's replica count that still has a live replica is copied from one to other
live workers (another node first, then the one holding the fewest bytes), under
the context's write lease: an append waits for the copy instead of racing it, and
queries go on reading the replicas that are left. A copy that does not fit a
worker's budget is tried on the next one, and again at the next round.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import dataclass, field

from service.cluster.surface import WorkerSurface
from service.contexts.directory import DirectorySurface
from service.contexts.orphans import Orphans
from service.contexts.records import ContextRecord, ShardEntry
from service.contexts.service import ContextService
from service.contexts.sharding import reach_of, reserve_of
from service.contexts.tombstones import forget
from service.core.errors import ContextNotFound, WorkersUnavailable, internals
from workers.store import CapacityError, ShardMissing
from workers.tasks import ShardWrite

log = logging.getLogger(__name__)

#: How long a round waits for a worker's ping. A replacement that cannot be placed (its node
#: is gone) stays pending: the round must not wait a minute for it before repairing the rest.
PING_TIMEOUT_S = 5.0


@dataclass
class RepairStats:
    """What the loop did and what it sees now: ``/v1/cluster`` ("repair") and ``/metrics``."""

    rounds: int = 0
    workers_replaced: int = 0
    replicas_forgotten: int = 0
    replicas_rebuilt: int = 0
    replicas_readopted: int = 0  # lost shards listed again on a worker that reloaded them from disk
    tombstones_forgotten: int = 0  # (tombstone, worker) pairs no folder needed any more (contexts.tombstones)
    failures: int = 0
    under_replicated_shards: int = 0  # below their replica count, at least one live replica
    lost_shards: int = 0  # no live replica
    last_error: str = ""
    recent: list[str] = field(default_factory=list)  # the last few repairs, newest last

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def shown(exc: BaseException) -> str:
    """``exc`` as ``/v1/cluster`` shows it: its class, and its message unless that holds machine
    internals (service.core.errors.internals), which stay in the log."""
    message = str(exc)
    return type(exc).__name__ if internals(message) else f"{type(exc).__name__}: {message}"


class Repairer:
    def __init__(self, pool: WorkerSurface, directory: DirectorySurface, contexts: ContextService,
                 orphans: Orphans | None = None) -> None:
        self.pool, self.directory, self.contexts = pool, directory, contexts
        self.orphans = orphans or Orphans(pool, directory)
        self.stats = RepairStats()

    async def run_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.step()
            except Exception as exc:  # the loop must outlive one failed round
                self.stats.failures += 1
                self.stats.last_error = shown(exc)
                log.exception("the repair round failed")

    async def step(self) -> None:
        """One round: forget and replace dead workers, then rebuild what is below its replica count."""
        self.stats.rounds += 1
        await self.pool.refresh(timeout_s=PING_TIMEOUT_S)
        # Dead workers that had answered (a replacement that never came up, its node gone, is
        # not replaced again each round), and names another front end replaced.
        # A name another front end replaced needs nothing here: that front end forgot the dead worker's
        # replicas before it started the new one (below), and every replica listed under the name since is
        # the new worker's own.
        gone = [s for s in self.pool.slots if not s.alive and s.incarnation]
        for slot in gone:
            # Before any replacement; once per dead worker, whichever front end asks first (the directory's
            # forget_worker: a late ask must not remove what the replacement holds now).
            self.stats.replicas_forgotten += await self.directory.forget_worker(slot.name, slot.incarnation)
            if self.pool.replace(slot):
                self.stats.workers_replaced += 1
                log.warning("worker %s died: its replicas are forgotten and it is replaced", slot.name)
            else:
                log.warning("worker %s died: its replicas are forgotten; its name is still held, "
                            "so it is replaced in a later round", slot.name)
        if gone:
            await self.pool.refresh(timeout_s=PING_TIMEOUT_S)
        # A replacement loads the dead worker's --persist-dir folder: a context there that no holder has a
        # record of leaves its memory again (service.contexts.orphans; workers seen before are not asked).
        # Within PING_TIMEOUT_S: a worker that hangs is swept at a later round, and the repairs go on.
        try:
            await asyncio.wait_for(self.orphans.sweep(), PING_TIMEOUT_S)
        except TimeoutError:
            log.info("contexts without a record looked for again next round: a worker did not answer within %g s",
                     PING_TIMEOUT_S)
        await self._forget_tombstones()
        records = await self.directory.all()
        if await self.readopt(records):
            records = await self.directory.all()
        await self._count(records)
        for record in records:
            if self.contexts.health(record)["degraded_shards"]:
                try:
                    await self.rebuild(record["id"])
                except WorkersUnavailable as exc:  # its lease taken or lapsed (a worker forgotten meanwhile): next round
                    self._failed(f"rebuilding {record['id']}", exc)
        if self.stats.replicas_rebuilt:
            await self._count(await self.directory.all())

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.failures += 1
        self.stats.last_error = f"{what}: {shown(exc)}"
        log.warning("%s failed, tried again next round: %s", what, exc)

    async def _forget_tombstones(self) -> None:
        """Remove the tombstones no folder needs any more (``service.contexts.tombstones.forget``), within
        :data:`PING_TIMEOUT_S`: a worker that hangs keeps them, not the round."""
        settings = self.contexts.settings
        if settings.persist_dir is None:  # tombstones are files: none without a store
            return
        try:
            self.stats.tombstones_forgotten += await asyncio.wait_for(
                forget(self.pool, settings.tombstone_horizon_s), PING_TIMEOUT_S)
        except TimeoutError:
            log.info("tombstones kept this round: a worker did not answer within %g s", PING_TIMEOUT_S)

    async def _count(self, records: list[ContextRecord]) -> None:
        states = [self.contexts.health(r) for r in records]
        self.stats.under_replicated_shards = sum(len(h["degraded_shards"]) for h in states)
        self.stats.lost_shards = sum(len(h["lost_shards"]) for h in states)

    async def readopt(self, records: list[ContextRecord]) -> int:
        """List again the replicas a live worker reloaded from its ``--persist-dir`` (a worker restarted in
        place of one that died) for shards that no live worker is listed for; returns the shards adopted.

        Safe because such a shard is lost: while a context has a lost shard no append to it is committed
        (``ContextService.append`` refuses it), so its committed length has not moved since its last holder
        died, and a copy holding at least that many keys holds the committed ones (a write is on disk before
        it is acknowledged). The keys past that length, an append that never committed, are never read. A
        shard with a live replica left is copied from it instead (:meth:`rebuild`): a copy reloaded then
        may lack keys committed since.
        """
        lost = {r["id"]: set(self.contexts.health(r)["lost_shards"]) for r in records}
        lost = {ctx: shards for ctx, shards in lost.items() if shards}
        if not lost:
            return 0
        found: dict[tuple[str, int], list[tuple[str, int]]] = {}  # (context, shard) -> [(worker, keys held)]
        gone: tuple[type[BaseException], ...] = (TimeoutError, *self.pool.call_errors)
        for slot in self.pool.alive:
            try:
                held = await asyncio.wait_for(self.pool.held(slot.index), PING_TIMEOUT_S)
            except gone:
                continue  # its shards are looked for again next round
            for h in held:
                if h["index"] in lost.get(h["context_id"], ()):
                    found.setdefault((h["context_id"], h["index"]), []).append((slot.name, int(h["length"])))
        adopted = 0
        for ctx_id in sorted({ctx for ctx, _ in found}):
            try:
                async with self.contexts.lease(ctx_id) as lease:
                    new: ContextRecord = copy.deepcopy(await self.contexts.record(ctx_id))
                    here = 0
                    for entry in new["shards"]:
                        if self.pool.indexes(entry["workers"], alive=True):
                            continue  # not lost (any more)
                        holders = [name for name, keys in found.get((ctx_id, entry["index"]), ())
                                   if keys >= entry["length"]]
                        if holders:
                            entry["workers"] = holders[:new["replicas"]]
                            here += 1
                    if here:
                        new["version"] += 1
                        await self.contexts.commit(new, lease)
            except ContextNotFound:
                continue  # deleted meanwhile
            except WorkersUnavailable as exc:  # its lease taken or lapsed: looked for again next round
                self._failed(f"listing {ctx_id} again", exc)
                continue
            if here:
                await self.contexts.note(new)
                adopted += here
                self.stats.replicas_readopted += here
                self.stats.recent = [*self.stats.recent[-9:], f"context {ctx_id}: {here} lost shard(s) listed "
                                     "again on the workers that reloaded them from disk"]
                log.warning("context %s: %d lost shard(s) listed again on the workers that reloaded them from disk",
                            ctx_id, here)
        return adopted

    async def rebuild(self, ctx_id: str) -> int:
        """Copy the context's under-replicated shards to other live workers; replicas made."""
        try:
            async with self.contexts.lease(ctx_id) as lease:
                old = await self.contexts.record(ctx_id)
                new: ContextRecord = copy.deepcopy(old)
                made = 0
                for entry in new["shards"]:
                    made += await self._copy(new, entry)
                if made:
                    new["version"] += 1
                    await self.contexts.commit(new, lease)
        except ContextNotFound:
            return 0  # deleted meanwhile
        if made:
            await self.contexts.note(new)
        return made

    async def _copy(self, record: ContextRecord, entry: ShardEntry) -> int:
        """Replicas of shard ``entry`` made on other workers (``entry["workers"]`` updated)."""
        holders = self.pool.indexes(entry["workers"], alive=True)
        need = record["replicas"] - len(holders)
        if need <= 0 or not holders:
            return 0
        entry["workers"] = self.pool.names(holders)  # dead names out
        ctx_id, index, n = record["id"], entry["index"], entry["length"]
        # Under the lease: a holder or a target that hangs is fenced rather than waited for (service.contexts.fencing).
        fence = self.contexts.fence
        k, v, k_pos = await fence.call(holders[0], self.pool.export_shard(holders[0], ctx_id, index, n))
        # Cut as the shard's other replicas are: a body of the keys it was created with (or a planned
        # context's whole capacity), the rest in its tail (workers.layout.ShardKV), so that every replica
        # answers the same bits. A record written before 2026-12-06 does not say: a body of every key.
        write = ShardWrite(ctx_id, index, record["dtype"], reach_of(record), k_pos,
                           reserve=entry.get("body") or max(n, reserve_of(record)))
        made = 0
        for target in self._targets(holders):
            if made == need:
                break
            name = self.pool.slots[target].name
            try:
                await self.contexts.drop_quietly(target, ctx_id, index)  # a stale copy of a worker thought dead
                await fence.call(target, self.pool.create_shard(target, write, k, v, record))
            except (CapacityError, WorkersUnavailable, ShardMissing, ValueError) as exc:  # the next target or round
                self.stats.failures += 1
                self.stats.last_error = f"shard {index} of {ctx_id} on {name}: {shown(exc)}"
                log.warning("rebuilding shard %d of %s on %s failed: %r", index, ctx_id, name, exc)
                continue
            entry["workers"].append(name)
            made += 1
            self.stats.replicas_rebuilt += 1
            self.stats.recent = [*self.stats.recent[-9:], f"shard {index} of {ctx_id} ({n} keys) -> {name}"]
        return made

    def _targets(self, holders: list[int]) -> list[int]:
        """Live workers holding no replica of the shard: other nodes than the holders' first, then fewest bytes."""
        nodes = {self.pool.slots[i].node_id for i in holders}
        free = [s for s in self.pool.alive if s.index not in holders]
        free.sort(key=lambda s: (s.node_id in nodes, int(s.info.get("bytes_held", 0)), s.index))
        return [s.index for s in free]
