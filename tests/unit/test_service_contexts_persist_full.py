"""A full ``--persist-dir`` under the contexts service: a create or append that one worker's disk refuses for
lack of room is 507 ``insufficient_capacity`` naming that worker and its full ``--persist-dir``, and is undone
on every worker, in memory and on disk, as a refused capacity is (never a 500 that leaves the client unsure).

Real ``ShardWorker`` objects behind the in-process pool (``faulty_pool``), their stores on ``tmp_path``;
the full disk is safetensors' writer failing as it does on one, for one worker's folder. No Ray, no server.
"""

import asyncio
import json

import numpy as np
import pytest
from faulty_pool import bitwise, kv, read, started, write
from safetensors import SafetensorError

from service.cluster.pool import _written
from service.core.errors import InsufficientCapacity, render
from service.core.metrics import Timings
from workers import channel, frames, persist
from workers.actor import ShardWorker
from workers.config import WorkerConfig
from workers.store import CapacityError, StorageFull
from workers.tasks import ShardWrite

FULL = "splitkey-worker-1"  # the worker whose --persist-dir is full


def q_of(rng, n_q=2, h_q=4, d=8):
    return rng.standard_normal((n_q, h_q, d)).astype(np.float32)


def fill(monkeypatch, root, worker=FULL):
    """From now on the disk under ``worker``'s folder refuses segments for lack of room (as safetensors says)."""
    real = persist.save_file

    def save_file(tensors, path, metadata=None):
        if (root / worker) in persist.Path(path).parents:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, metadata=metadata)
    monkeypatch.setattr(persist, "save_file", save_file)


def files_of(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def answered(err: InsufficientCapacity, path: str) -> tuple[int, dict]:
    """The status and body a client gets for ``err`` on ``path`` (the one place errors are written)."""
    status, body, _ = render(err, path)
    return status, json.loads(body)


def test_a_create_on_a_full_persist_dir_is_refused_507_and_leaves_nothing_on_any_worker(rng, tmp_path, monkeypatch):
    async def main():
        pool, directory, contexts = await started(2, persist_dir=tmp_path)
        try:
            fill(monkeypatch, tmp_path)
            k, v = kv(rng, 200)
            with pytest.raises(InsufficientCapacity) as err:
                await contexts.create(write(k, v, replicas=2), Timings())
            status, body = answered(err.value, "/v1/contexts")
            assert status == 507 and body["code"] == "insufficient_capacity"
            assert body["detail"].startswith("the new context does not fit (it was not created): worker "
                                             f"{FULL}'s --persist-dir is full (No space left on device): shard ")
            assert body["detail"].endswith("was refused, and nothing of it was stored")
            assert [h for i in range(pool.size) for h in await pool.held(i)] == []
            assert await directory.all() == []
            assert files_of(tmp_path) == {}  # on neither worker: the one whose write went through undid it too
        finally:
            pool.shutdown()

    asyncio.run(main())


#: Keys created, then the append's shard: one with room (64 keys a shard), or a new one (the first is full).
@pytest.mark.parametrize("m, into", [(40, "the append to shard 0"), (64, "shard 1")])
def test_append_to_full_persist_dir_is_refused_507_and_leaves_every_replica_unchanged(rng, tmp_path, monkeypatch,
                                                                                      m, into):
    async def main():
        pool, _, contexts = await started(2, persist_dir=tmp_path)
        try:
            k, v = kv(rng, m + 10)
            ctx = (await contexts.create(write(k[:m], v[:m], replicas=2, shards=1), Timings()))["id"]
            q = q_of(rng)
            before = await read(pool, contexts, [ctx], q)
            held = [await pool.held(i) for i in range(pool.size)]
            on_disk = files_of(tmp_path)
            fill(monkeypatch, tmp_path)
            with pytest.raises(InsufficientCapacity) as err:
                await contexts.append(ctx, write(k[m:], v[m:], after=m), Timings())
            status, body = answered(err.value, f"/v1/contexts/{ctx}/append")
            assert status == 507 and body["code"] == "insufficient_capacity"
            assert body["detail"] == (f"the append does not fit: worker {FULL}'s --persist-dir is full (No space "
                                      f"left on device): {into} of context {ctx} was refused, and nothing of it "
                                      f"was stored")
            assert (await contexts.get(ctx))["length"] == m
            assert [await pool.held(i) for i in range(pool.size)] == held
            assert files_of(tmp_path) == on_disk
            assert bitwise(await read(pool, contexts, [ctx], q), before)
            monkeypatch.undo()  # room again: the client sends the same append (after = the same length)
            assert (await contexts.append(ctx, write(k[m:], v[m:], after=m), Timings()))["length"] == m + 10
        finally:
            pool.shutdown()

    asyncio.run(main())


def decoded(buffers) -> tuple[dict, list[np.ndarray]]:
    data = b"".join(bytes(b) for b in buffers)
    header_len, _ = frames.sizes(data[:frames.PREFIX.size])
    return frames.decode(data[frames.PREFIX.size:frames.PREFIX.size + header_len],
                         bytearray(data[frames.PREFIX.size + header_len:]))


def test_a_streamed_append_a_full_persist_dir_refuses_comes_back_over_the_channel_as_storage_full(rng, tmp_path,
                                                                                                  monkeypatch):
    worker = ShardWorker(WorkerConfig(memory_budget_bytes=2**24, channel=False, persist_dir=str(tmp_path)), FULL)
    k, v = kv(rng, 30)
    worker.create_shard(ShardWrite("ctx", 0, "float32", 64, np.arange(10)), k[:10], v[:10], {"id": "ctx"})
    fill(monkeypatch, tmp_path)
    header, arrays = decoded(channel.append_frame(5, ShardWrite("ctx", 0, "float32", 64, np.arange(10, 30)),
                                                  k[10:], v[10:], 10, part_keys=8))  # three parts
    with pytest.raises(StorageFull) as err:
        worker._channel_append(header, iter(arrays)).result(timeout=30)
    assert worker.held()[0]["length"] == 10  # the first part failed: none after it was stored
    reply, _ = decoded(frames.error_frame(5, err.value))  # what the channel's listener answers
    with pytest.raises(StorageFull, match=f"^worker {FULL}'s --persist-dir is full") as got:
        _written(FULL, reply, [])  # the front end's side: the class kept, so the service answers 507
    assert isinstance(got.value, CapacityError)


def test_a_delete_whose_tombstone_a_full_persist_dir_refuses_is_still_done(rng, tmp_path, monkeypatch, caplog):
    """The delete took effect (gone from the directory, every shard and file dropped): it is answered as done,
    and the missing tombstone is logged, never a 500 that a retry would turn into a 404."""
    async def main():
        pool, directory, contexts = await started(2, persist_dir=tmp_path)
        try:
            k, v = kv(rng, 200)
            ctx = (await contexts.create(write(k, v, replicas=2), Timings()))["id"]
            real = persist.ShardFiles.tombstone

            def tombstone(files, context_id):
                if files.root.name == FULL:
                    raise persist.NoSpace(28, "No space left on device")
                return real(files, context_id)
            monkeypatch.setattr(persist.ShardFiles, "tombstone", tombstone)
            assert (await contexts.delete(ctx))["id"] == ctx
            assert await directory.get(ctx) is None
            assert [await pool.held(i) for i in range(pool.size)] == [[], []]
            assert not any((tmp_path / s.name / ctx).exists() for s in pool.slots)  # files gone on both
            assert any("tombstone of context" in r.getMessage() and FULL in r.getMessage() for r in caplog.records)
        finally:
            pool.shutdown()

    asyncio.run(main())
