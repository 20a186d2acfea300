"""The repair loop and a directory restart on the in-process pool and directory (no Ray).

``Repairer.step`` runs one round over real ``ShardWorker`` objects (``service.cluster.local``) with a
worker told to die or to hang (``faulty_pool``); a directory restart is a new ``DirectoryActor``
over the same workers, rebuilt from what they report (``restart_directory``).
"""

import asyncio

import numpy as np
import pytest
from faulty_pool import bitwise, kv, read, restart_directory, started, write

from service.cluster.orchestrator import Orchestrator
from service.contexts import repair
from service.contexts.repair import Repairer
from service.contexts.service import ContextService
from service.contexts.tombstones import forget
from service.core.errors import ContextLost
from service.core.metrics import Timings
from workers.options import AttentionOptions
from workers.store import RecordStale
from workers.tasks import ShardQuery


def normal(records):
    return [{**r, "shards": [{**s, "workers": sorted(s["workers"])} for s in r["shards"]]} for r in records]


def q_of(rng):
    return rng.standard_normal((2, 4, 8)).astype(np.float32)


def test_a_dead_workers_replicas_are_forgotten_and_rebuilt_on_live_workers(rng):
    async def main():
        pool, directory, contexts = await started(3)
        healer = Repairer(pool, directory, contexts)
        try:
            k, v = kv(rng, 150)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            q = q_of(rng)
            before = await read(pool, contexts, [ctx], q)
            old = await contexts.record(ctx)
            dead = pool.slots[pool.indexes(old["shards"][0]["workers"])[0]]
            dead_incarnation = dead.incarnation
            pool.kill(dead.index)
            await healer.step()
            assert healer.stats.workers_replaced == 1
            assert healer.stats.replicas_forgotten == sum(dead.name in s["workers"] for s in old["shards"])
            assert healer.stats.replicas_rebuilt == healer.stats.replicas_forgotten
            assert dead.alive and dead.incarnation not in ("", dead_incarnation)  # replaced under its name
            desc = await contexts.get(ctx)
            assert desc["state"] == "ready" and desc["live_replicas"] == [2] * len(old["shards"])
            new = await contexts.record(ctx)
            assert new["version"] > old["version"]
            # Only the rebuilt copies left (one may be on the dead worker's replacement, under its name): the
            # answer is still bit for bit the one before.
            for entry, was in zip(new["shards"], old["shards"]):
                if dead.name in was["workers"]:
                    for name in set(was["workers"]) - {dead.name}:
                        pool.lose_shard(pool.indexes([name])[0], ctx, entry["index"])
            assert bitwise(await read(pool, contexts, [ctx], q), before)
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_worker_that_misses_fewer_than_three_pings_keeps_its_replicas(rng, monkeypatch):
    monkeypatch.setattr(repair, "PING_TIMEOUT_S", 0.05)

    async def main():
        pool, directory, contexts = await started(3)
        healer = Repairer(pool, directory, contexts)
        try:
            k, v = kv(rng, 150)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            await healer.orphans.sweep()  # as the app's start does: later rounds sweep only new workers
            held = pool.indexes((await contexts.record(ctx))["shards"][0]["workers"])[0]
            pool.hang(held)  # pings too
            for _ in range(2):
                await healer.step()
                assert pool.slots[held].alive and healer.stats.replicas_forgotten == 0
            assert (await contexts.get(ctx))["state"] == "ready"
            await healer.step()  # the third ping in a row: counted dead, forgotten, replaced, rebuilt elsewhere
            assert healer.stats.replicas_forgotten > 0 and healer.stats.workers_replaced == 1
            assert healer.stats.replicas_rebuilt == healer.stats.replicas_forgotten
            pool.release(held)
            await healer.step()
            assert pool.slots[held].alive
            assert (await contexts.get(ctx))["state"] == "ready"
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_restarted_directory_rebuilds_every_record_from_the_workers(rng):
    async def main():
        pool, directory, contexts = await started(3)
        try:
            (k1, v1), (k2, v2), (k3, v3) = kv(rng, 150), kv(rng, 70), kv(rng, 40)
            one = (await contexts.create(write(k1, v1, replicas=2), Timings()))["id"]
            two = (await contexts.create(write(k2, v2, replicas=1), Timings()))["id"]
            await contexts.append(two, write(k3, v3), Timings())
            gone = (await contexts.create(write(k3, v3), Timings()))["id"]
            await contexts.delete(gone)
            records = await directory.all()
            q = q_of(rng)
            answers = [await read(pool, contexts, [c], q) for c in (one, two)]
            old = directory.actor
            restart_directory(directory, pool)
            assert directory.actor is not old and directory.actor.incarnation != old.incarnation
            assert (await directory.ping())["rebuilt_from"] == 3
            # Every record as committed (each shard's replicas listed in the workers' order now), and the
            # deleted context is not back.
            assert normal(await directory.all()) == normal(records)
            for c, answer in zip((one, two), answers):
                assert bitwise(await read(pool, contexts, [c], q), answer)
            assert (await contexts.append(one, write(k3, v3), Timings()))["length"] == 190  # leases work again
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_directory_restarted_while_a_worker_is_dead_lists_its_shards_without_it(rng):
    async def main():
        pool, directory, contexts = await started(3)
        healer = Repairer(pool, directory, contexts)
        try:
            k, v = kv(rng, 150)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            q = q_of(rng)
            before = await read(pool, contexts, [ctx], q)
            dead = pool.slots[pool.indexes((await contexts.record(ctx))["shards"][0]["workers"])[0]]
            pool.kill(dead.index)
            restart_directory(directory, pool)
            assert (await directory.ping())["rebuilt_from"] == 2
            record = await contexts.record(ctx)
            assert all(dead.name not in s["workers"] and s["workers"] for s in record["shards"])
            await pool.refresh()
            assert (await contexts.get(ctx))["state"] == "degraded"
            assert bitwise(await read(pool, contexts, [ctx], q), before)
            await healer.step()
            assert (await contexts.get(ctx))["state"] == "ready"
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_restarted_directory_takes_the_newest_record_any_holder_keeps(rng):
    async def main():
        pool, directory, contexts = await started(2)
        try:
            k, v = kv(rng, 100)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            pool.fail_next(1, OSError("the disk is full"), "note_context")  # worker 1 keeps the create's record
            k2, v2 = kv(rng, 20)
            assert (await contexts.append(ctx, write(k2, v2), Timings()))["length"] == 120
            restart_directory(directory, pool)
            assert (await contexts.get(ctx))["length"] == 120
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_context_deleted_while_a_holder_was_unreachable_is_not_rebuilt(rng, tmp_path):
    async def main():
        pool, directory, contexts = await started(2, persist_dir=tmp_path)  # tombstones are files
        try:
            k, v = kv(rng, 100)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            pool.hang(1)
            for _ in range(3):  # three pings missed in a row: counted dead, its shards still in its memory
                await pool.refresh(timeout_s=0.05)
            assert not pool.slots[1].alive
            await contexts.delete(ctx)  # tombstoned on worker 0 alone
            pool.release(1)
            assert {h["context_id"] for h in await pool.held(1)} == {ctx}
            restart_directory(directory, pool)
            assert (await directory.ping())["rebuilt_from"] == 2 and await directory.all() == []
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_rebuilt_copy_of_a_shard_with_a_tail_answers_the_same_bits(rng):
    async def main():
        pool, directory, contexts = await started(3)
        healer = Repairer(pool, directory, contexts)
        try:
            k, v = kv(rng, 3000)
            ctx = (await contexts.create(write(k[:100], v[:100], replicas=2, shards=1), Timings()))["id"]
            for lo in range(100, 3000, 700):  # past the body of 100 keys: into the shard's tail
                await contexts.append(ctx, write(k[lo:lo + 700], v[lo:lo + 700]), Timings())
            q = q_of(rng)
            before = await read(pool, contexts, [ctx], q)
            old = await contexts.record(ctx)
            assert old["shards"][0]["body"] == 100 and old["shards"][0]["length"] > 100  # a body and a tail
            dead = pool.slots[pool.indexes(old["shards"][0]["workers"])[0]]
            pool.kill(dead.index)
            await healer.step()
            assert healer.stats.replicas_rebuilt >= 1
            for entry in old["shards"]:  # only the rebuilt copies answer now
                if dead.name in entry["workers"]:
                    for name in set(entry["workers"]) - {dead.name}:
                        pool.lose_shard(pool.indexes([name])[0], ctx, entry["index"])
            assert bitwise(await read(pool, contexts, [ctx], q), before)
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_lost_shard_its_restarted_holder_reloaded_from_disk_is_listed_again_and_answers_as_before(rng, tmp_path):
    async def main():
        pool, directory, contexts = await started(2, persist_dir=tmp_path)
        healer = Repairer(pool, directory, contexts)
        try:
            k, v = kv(rng, 300)
            ctx = (await contexts.create(write(k[:200], v[:200], shards=1), Timings()))["id"]
            await contexts.append(ctx, write(k[200:], v[200:]), Timings())
            q = q_of(rng)
            before = await read(pool, contexts, [ctx], q)
            [holder] = pool.indexes((await contexts.record(ctx))["shards"][0]["workers"])
            pool.kill(holder)
            await pool.refresh()  # its death seen: the shard has no live replica until the repair round
            with pytest.raises(ContextLost) as lost:  # lost for now, and the client told it may come back
                await contexts.append(ctx, write(k[:5], v[:5], after=300), Timings())
            assert "reloads a dead holder's copy from --persist-dir within seconds: send it again" in lost.value.detail
            await healer.step()  # forgotten, replaced: the replacement loads the shard from its folder
            assert healer.stats.replicas_forgotten == 1 and healer.stats.replicas_readopted == 1
            desc = await contexts.get(ctx)
            assert desc["state"] == "ready" and desc["length"] == 300, desc
            assert bitwise(await read(pool, contexts, [ctx], q), before)
            await contexts.append(ctx, write(k[:5], v[:5]), Timings())  # writable again, not "delete it"
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_tombstone_is_removed_once_no_folder_holds_its_context_and_the_context_stays_deleted(rng, tmp_path):
    async def main():
        pool, directory, contexts = await started(2, persist_dir=tmp_path, tombstone_horizon_s=0)
        healer = Repairer(pool, directory, contexts)
        try:
            k, v = kv(rng, 100)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            pool.kill(1)  # its folder keeps the context's files
            await contexts.delete(ctx)  # tombstoned on worker 0 alone
            assert await forget(pool, 0) == 0  # a dead worker's folder may bring it back: kept
            assert await pool.tombstones(0) == [ctx]
            await healer.step()  # replaced: the replacement loads the folder, the sweep buries the context there
            assert healer.stats.workers_replaced == 1 and healer.stats.tombstones_forgotten == 2
            assert await pool.tombstones(0) == await pool.tombstones(1) == []
            assert not any((tmp_path / s.name / ctx).exists() for s in pool.slots)
        finally:
            pool.shutdown()
        pool, directory, contexts = await started(2, persist_dir=tmp_path)  # a full restart: still deleted
        try:
            assert await directory.all() == [] and await pool.held(0) == await pool.held(1) == []
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_tombstone_younger_than_the_horizon_is_kept(rng, tmp_path):
    async def main():
        pool, directory, contexts = await started(2, persist_dir=tmp_path, tombstone_horizon_s=3600)
        healer = Repairer(pool, directory, contexts)
        try:
            k, v = kv(rng, 100)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            await contexts.delete(ctx)
            await healer.step()
            assert healer.stats.tombstones_forgotten == 0
            assert await pool.tombstones(0) == await pool.tombstones(1) == [ctx]
        finally:
            pool.shutdown()

    asyncio.run(main())


def reference(k, v, q):
    """float64 attention of ``q`` [n_q, h_q, d] over every key of ``k``, ``v`` (GQA: h_q a multiple of h_kv)."""
    group = q.shape[1] // k.shape[1]
    kk = np.repeat(k.astype(np.float64), group, axis=1)  # [n_k, h_q, d]
    vv = np.repeat(v.astype(np.float64), group, axis=1)  # [n_k, h_q, d_v]
    s = np.einsum("qhd,khd->qhk", q.astype(np.float64), kk) / np.sqrt(q.shape[2])  # [n_q, h_q, n_k]
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("qhk,khd->qhd", p / p.sum(-1, keepdims=True), vv)


async def cached_read(pool, contexts, ids, q):
    """``out`` of ``q`` over the contexts as a front end's query path reads them: from its record cache when it
    can, once more from the directory when a worker refuses the cached record (``AttentionService.attention``)."""
    for fresh in (False, True):
        resolved = await contexts.resolve(ids, fresh=fresh)
        n_q = q.shape[0]
        q_pos = np.arange(resolved.next_pos - n_q, resolved.next_pos, dtype=np.int64)
        orch = Orchestrator(pool, fanin=2, remote_merge_bytes=2**30)
        try:
            out, _ = await orch.run(q, ShardQuery(q_pos, AttentionOptions()), resolved.jobs(pool, 2),
                                    Timings(), state_nbytes=n_q * q.shape[1] * (resolved.dims.d_v + 2) * 4)
            return out
        except (RecordStale, ContextLost):
            if fresh or not resolved.cached:
                raise
            contexts.forget(ids)
    raise AssertionError("unreachable")


def test_a_cached_record_never_reads_a_replica_reloaded_from_disk_after_newer_appends(rng, tmp_path):
    """The soak's stale read (docs/RELIABILITY.md): a front end caches a record, a holder dies and its
    replacement reloads the shard from its folder while the repair copies it elsewhere, another front end
    appends; a query through the old record must not be answered from the reloaded copy's prefix."""
    async def main():
        pool, directory, reader = await started(3, persist_dir=tmp_path, record_cache=64, context_shard_keys=1024)
        writer = ContextService(reader.settings, pool, directory)  # a second front end: its own cache
        healer = Repairer(pool, directory, writer)
        try:
            k, v = kv(rng, 100)
            ctx = (await writer.create(write(k[:64], v[:64], replicas=2, shards=1), Timings()))["id"]
            await writer.append(ctx, write(k[64:72], v[64:72]), Timings())
            q = q_of(rng)
            out = await cached_read(pool, reader, [ctx], q)  # the reader now caches the record of 72 keys
            np.testing.assert_allclose(out, reference(k[:72], v[:72], q), atol=1e-5)
            holders = sorted(pool.indexes((await writer.record(ctx))["shards"][0]["workers"]))
            pool.kill(holders[0])  # the replica a query picks first (ties go to the lowest index)
            await healer.step()  # forgotten, replaced (its replacement reloads the shard), copied elsewhere
            assert healer.stats.workers_replaced == 1
            await writer.append(ctx, write(k[72:88], v[72:88]), Timings())  # acknowledged: 88 keys
            out = await cached_read(pool, reader, [ctx], q)
            np.testing.assert_allclose(out, reference(k[:88], v[:88], q), atol=1e-5)
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_worker_that_hangs_when_swept_does_not_hold_up_the_repairs(rng, tmp_path, monkeypatch):
    """The orphan sweep asks each worker not swept yet what it holds; one that does not answer is asked again
    at a later round, while this round still replaces a dead worker and rebuilds what it held."""
    monkeypatch.setattr(repair, "PING_TIMEOUT_S", 0.2)

    async def main():
        pool, directory, contexts = await started(3, persist_dir=tmp_path)
        healer = Repairer(pool, directory, contexts)  # nothing swept yet (the app's start would have)
        try:
            k, v = kv(rng, 150)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            dead = pool.indexes((await contexts.record(ctx))["shards"][0]["workers"])[0]
            hung = next(i for i in range(pool.size) if i != dead)
            pool.kill(dead)
            pool.hang(hung, "held")  # answers pings, never says what it holds
            await asyncio.wait_for(healer.step(), 10)
            assert healer.stats.workers_replaced == 1 and healer.stats.replicas_rebuilt >= 1
            assert (await contexts.get(ctx))["state"] == "ready"
            assert pool.slots[hung].incarnation not in healer.orphans.swept
            pool.release(hung)
            await asyncio.wait_for(healer.step(), 10)
            assert pool.slots[hung].incarnation in healer.orphans.swept
        finally:
            pool.shutdown()

    asyncio.run(main())
