"""Deleted contexts stay deleted: a holder that was dead at the delete must not bring one back.

A delete tombstones the context on every live worker before it answers (``workers.persist``:
``DIR/<worker>/.deleted/<id>``). A holder dead at that moment missed it: its replacement, or
the same worker after a restart, loads the context's files from its folder, record and all.
:func:`bury` runs in the orphan sweep (``service.contexts.orphans``), once per worker
incarnation: each worker it sweeps deletes (tombstones, then drops from memory and disk)
every context it holds that any live worker has a tombstone of. The directory's rebuild
skips those contexts too (``service.contexts.directory``), so a restart never lists one.

A tombstone is needed while some folder may still hold files of its context. :func:`forget`
runs in every repair round and removes the tombstones of a context once (1) every worker of the
pool is alive and says its folder holds no files of it (the folders of the pool's names are all
the store has: a start with fewer workers than non-empty folders is refused,
``service.cluster.pool.check_stores``), and (2) the tombstone is older than
``--tombstone-horizon`` (7 days by default). (1) covers a holder that was dead at the delete:
its replacement loaded its folder, and the context is buried there (with a tombstone of its
own) before the folder counts as clean. (2) covers what the workers cannot see: a folder on a
node's own disk, away while its worker runs elsewhere, that could come back with the node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from service.cluster.surface import WorkerSlot, WorkerSurface

log = logging.getLogger(__name__)


async def known(pool: WorkerSurface) -> set[str]:
    """The ids every live worker that answers has a tombstone of."""
    answers = await asyncio.gather(*(pool.tombstones(s.index) for s in pool.alive), return_exceptions=True)
    ids: set[str] = set()
    for slot, got in zip(pool.alive, answers):
        if isinstance(got, BaseException):
            if not isinstance(got, pool.call_errors):
                raise got
            log.warning("worker %s did not say which contexts were deleted: %s", slot.name, got)
            continue
        ids.update(got)
    return ids


async def forget(pool: WorkerSurface, horizon_s: float) -> int:
    """Remove the tombstones no folder needs any more (module docstring) from every worker; returns
    how many (tombstone, worker) pairs were removed. Nothing while a worker is dead or does not answer."""
    if not pool.slots or not all(s.alive for s in pool.slots):
        return 0
    ids = sorted(await known(pool))
    if not ids:
        return 0
    try:
        stored = await asyncio.gather(*(pool.stored(s.index, ids) for s in pool.slots))
    except pool.call_errors as exc:
        log.info("tombstones kept: a worker did not say which deleted contexts its folder holds: %s", exc)
        return 0
    settled = sorted(set(ids).difference(*stored))
    if not settled:
        return 0
    removed = await asyncio.gather(*(pool.forget_tombstones(s.index, settled, horizon_s) for s in pool.slots),
                                   return_exceptions=True)
    forgotten = 0
    for slot, got in zip(pool.slots, removed):
        if isinstance(got, BaseException):
            if not isinstance(got, pool.call_errors):
                raise got
            log.warning("worker %s: tombstones not removed (the next round tries again): %s", slot.name, got)
            continue
        forgotten += len(got)
    return forgotten


async def bury(pool: WorkerSurface, slots: Sequence[WorkerSlot]) -> int:
    """Delete on each of ``slots`` the contexts it holds that some worker has a tombstone of; returns how
    many (context, worker) pairs were deleted. A worker that does not answer is named in a warning."""
    dead = await known(pool)
    if not dead:
        return 0
    buried = 0
    for slot in slots:
        try:
            held = {h["context_id"] for h in await pool.held(slot.index)}
            for ctx_id in sorted(held & dead):
                await pool.delete(slot.index, ctx_id)
                log.warning("context %s was deleted while worker %s was down: its shards there are removed "
                            "(memory and disk)", ctx_id, slot.name)
                buried += 1
        except pool.call_errors as exc:
            log.warning("worker %s: deleted contexts not removed: %s", slot.name, exc)
    return buried
