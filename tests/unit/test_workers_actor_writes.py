"""A shard worker's notes of committed records over its direct channel (``note`` frames), without a socket:
the frames go to ``ShardWorker._channel_submit`` as the channel's reader hands them over. (Appends come
as streamed ``write`` frames: tests/unit/test_workers_write_frames.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from workers import frames
from workers.actor import ShardWorker
from workers.config import WorkerConfig
from workers.store import RecordStale
from workers.tasks import ShardRead, ShardWrite

H_KV, D = 2, 8


def decoded(buffers) -> tuple[dict, list[np.ndarray]]:
    data = b"".join(bytes(b) for b in buffers)
    header_len, _ = frames.sizes(data[:frames.PREFIX.size])
    return frames.decode(data[frames.PREFIX.size:frames.PREFIX.size + header_len],
                         bytearray(data[frames.PREFIX.size + header_len:]))


def over_channel(worker: ShardWorker, buffers) -> dict:
    """The reply the channel sends (``Listener._done``: an exception is the request's ``error`` frame)."""
    header, arrays = decoded(buffers)
    try:
        reply_buffers = worker._channel_submit(header, arrays).result(timeout=30)
    except Exception as exc:  # noqa: BLE001 - what the listener answers
        reply_buffers = frames.error_frame(header["id"], exc)
    reply, _ = decoded(reply_buffers)
    return reply


@pytest.fixture
def worker(rng):
    w = ShardWorker(WorkerConfig(memory_budget_bytes=2**24, channel=False), "w-test")
    k = rng.standard_normal((4, H_KV, D)).astype(np.float32)
    w.create_shard(ShardWrite("ctx", 0, "float32", 16, np.arange(4)), k, k, {"id": "ctx", "version": 1})
    return w


def test_a_note_over_the_channel_keeps_the_record_and_refuses_older_reads(worker):
    record = {"id": "ctx", "version": 3, "shards": [{"index": 0, "length": 4, "workers": ["w-test"]}]}
    reply = over_channel(worker, frames.note_frame(8, "ctx", record))
    assert reply["op"] == "done" and reply["result"] is None
    assert worker.held()[0]["context"] == record
    with pytest.raises(RecordStale):
        worker.store.check_read(ShardRead("ctx", 0, 4, 2))
