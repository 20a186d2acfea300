"""The worker's end of the direct channel (workers.channel): who it serves, what it refuses, that it goes on."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from workers import channel, frames
from workers.actor import ShardWorker, _share_a_shard
from workers.batch import Batcher
from workers.config import WorkerConfig
from workers.options import AttentionOptions
from workers.store import Expired
from workers.tasks import ResidentQuery, ShardQuery, ShardRead, ShardWrite

N_K, H_KV, H_Q, D = 300, 2, 4, 16


@pytest.fixture
def worker(rng):
    w = ShardWorker(WorkerConfig(memory_budget_bytes=2**24), "w-test")
    k = rng.standard_normal((N_K, H_KV, D)).astype(np.float32)
    v = rng.standard_normal((N_K, H_KV, D)).astype(np.float32)
    w.create_shard(ShardWrite("ctx", 0, "float32", N_K, np.arange(N_K)), k, v, {"version": 1})
    yield w
    w.listener.close()


def connect(w: ShardWorker, token: str | None = None) -> socket.socket:
    addr = w.channel()
    s = socket.create_connection((addr["host"], addr["port"]), timeout=10)
    send(s, frames.encode({"op": "hello", "token": addr["token"] if token is None else token}))
    return s


def send(s: socket.socket, buffers) -> None:
    s.sendall(b"".join(bytes(b) for b in buffers))


def receive(s: socket.socket) -> tuple[dict, list[np.ndarray]]:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = s.recv(n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
        return out
    header_len, body_len = frames.sizes(exactly(frames.PREFIX.size))
    head = exactly(header_len)
    return frames.decode(head, bytearray(exactly(body_len)))


def closed_without_answer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def query(rng, n_q: int = 1) -> tuple[np.ndarray, ShardQuery, tuple[ShardRead, ...]]:
    q = rng.standard_normal((n_q, H_Q, D)).astype(np.float32)
    return q, ShardQuery(np.full(n_q, N_K), AttentionOptions(causal=True)), (ShardRead("ctx", 0, N_K, 1, fresh=True),)  # as read from the directory


def assert_serves(worker: ShardWorker, rng) -> None:
    """A new connection is served: the worker went on after whatever the test did."""
    q, sq, reads = query(rng)
    with connect(worker) as s:
        receive(s)
        send(s, frames.query_frame(1, q, sq, reads, 2))
        assert receive(s)[0]["op"] == "state"


def test_a_query_over_the_channel_is_bitwise_the_ray_methods_answer(worker, rng):
    q, sq, reads = query(rng, n_q=3)
    want_status, want = worker.partial_resident(q, sq, reads, 2)
    with connect(worker) as s:
        assert receive(s)[0] == {"op": "hello", "worker": "w-test", "arrays": []}
        send(s, frames.query_frame(5, q, sq, reads, 2))
        header, arrays = receive(s)
    status, got = frames.parse_state(header, arrays)
    assert header["id"] == 5 and status.worker == "w-test"
    for a, b in ((got.m, want.m), (got.l, want.l), (got.acc, want.acc)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert worker.ping()["channel_calls"] == 1


def test_replies_name_their_requests_and_a_bad_one_fails_alone(worker, rng):
    qs = [query(rng) for _ in range(6)]
    with connect(worker) as s:
        receive(s)
        for i, (q, sq, reads) in enumerate(qs):
            send(s, frames.query_frame(i, q, sq, reads if i != 3 else (ShardRead("gone", 0, 5, 0),), 2))
        replies = dict((h["id"], (h, a)) for h, a in (receive(s) for _ in qs))
    assert sorted(replies) == list(range(6))
    for i, (q, sq, reads) in enumerate(qs):
        header, arrays = replies[i]
        if i == 3:
            assert header["op"] == "error" and header["kind"] == "ShardMissing"
            continue
        want = worker.partial_resident(q, sq, reads, 2)[1]
        assert frames.parse_state(header, arrays)[1].acc.tobytes() == want.acc.tobytes()


def test_queries_and_batch_items_whose_budget_ran_out_while_the_worker_was_busy_answer_expired(worker, rng):
    """Over the channel, behind a query that holds the compute thread: a resident query and a batch
    item sent with 0.2 s left are answered Expired, not computed; the item with time left is exact."""
    (q0, sq, reads), (q1, _, _), (q2, _, _) = query(rng), query(rng), query(rng)
    want = worker.partial_resident_many([ResidentQuery(q2, sq, reads)])[0][1][0]
    held, release = threading.Event(), threading.Event()
    computed = []

    def held_run(jobs):
        computed.append(len(jobs))
        if not held.is_set():
            held.set()
            assert release.wait(30)
        return worker._run(jobs)

    worker.compute = Batcher(held_run, joins=_share_a_shard, expired=Expired)
    late, left = sq.with_budget(0.2), sq.with_budget(3600.0)
    first = threading.Thread(target=worker.partial_resident, args=(q0, sq, reads, 2))  # holds the compute thread
    first.start()
    assert held.wait(10)
    with connect(worker) as s:
        receive(s)
        send(s, frames.query_frame(1, q1, late, reads, 2))
        send(s, frames.many_frame(2, [ResidentQuery(q1, late, reads), ResidentQuery(q2, left, reads)]))
        deadline = time.monotonic() + 10
        while len(worker.compute._queue) < 3:  # the late query and the batch's two items
            assert time.monotonic() < deadline
            time.sleep(0.001)
        time.sleep(0.3)  # 0.2 s run out while the first query holds the thread
        release.set()
        replies = dict((h["id"], (h, a)) for h, a in (receive(s) for _ in range(2)))
    first.join(30)
    assert replies[1][0]["op"] == "error" and replies[1][0]["kind"] == "Expired"
    expired, (status, states) = frames.parse_many_reply(*replies[2])
    assert isinstance(expired, frames.RemoteError) and expired.kind == "Expired"
    assert status.batch == 1 and states[0].acc.tobytes() == want.acc.tobytes()
    assert computed == [1, 1] and worker.ping()["expired"] == 2


def test_a_wrong_token_is_closed_without_an_answer_and_the_worker_goes_on(worker, rng):
    with connect(worker, token="not-the-token") as s:
        assert closed_without_answer(s)
    assert_serves(worker, rng)


@pytest.mark.parametrize("garbage", [
    struct.pack("<IQ", frames.MAX_HEADER_BYTES + 1, 0),  # a header over the bound: nothing allocated
    struct.pack("<IQ", 4, frames.MAX_BODY_BYTES + 1) + b"{}{}",
    struct.pack("<IQ", 5, 0) + b"[1,2]",
    struct.pack("<IQ", 2, 0) + b"{}",  # no id
])
def test_a_malformed_frame_closes_its_connection_only(worker, rng, garbage):
    with connect(worker) as s:
        receive(s)
        s.sendall(garbage)
        assert closed_without_answer(s)
    assert_serves(worker, rng)


def test_an_unknown_op_is_that_request_s_error(worker):
    with connect(worker) as s:
        receive(s)
        send(s, frames.encode({"id": 3, "op": "drop_everything"}))
        header, _ = receive(s)
    assert header["op"] == "error" and header["id"] == 3 and "op must be resident, many, write or note" in header["message"]


def test_a_connection_that_does_not_say_hello_in_time_is_closed(worker, monkeypatch):
    monkeypatch.setattr(channel, "HELLO_TIMEOUT_S", 0.3)
    addr = worker.channel()
    t0 = time.monotonic()
    with socket.create_connection((addr["host"], addr["port"]), timeout=10) as s:
        assert closed_without_answer(s)
    assert time.monotonic() - t0 < 5


def test_connections_past_the_bound_are_closed_at_once(worker):
    addr = worker.channel()
    held = []
    try:
        for _ in range(channel.MAX_CONNECTIONS):
            held.append(connect(worker))
            receive(held[-1])
        with socket.create_connection((addr["host"], addr["port"]), timeout=10) as extra:
            assert closed_without_answer(extra)
    finally:
        for s in held:
            s.close()


def test_a_worker_configured_without_a_channel_has_none():
    w = ShardWorker(WorkerConfig(channel=False), "w-none")
    assert w.channel() is None and w.listener is None


def test_an_append_streamed_in_parts_stores_what_append_shard_stores(worker, rng):
    """Issue 47: an append over the channel, its parts stored as they arrive, holds the same bits as one through
    the Ray method; a create over the channel as well."""
    n = 70
    k = rng.standard_normal((n, H_KV, D)).astype(np.float32)
    v = rng.standard_normal((n, H_KV, D)).astype(np.float32)
    twin = ShardWorker(WorkerConfig(memory_budget_bytes=2**24, channel=False), "w-twin")
    base = worker.store.export("ctx", 0, N_K)
    twin.create_shard(ShardWrite("ctx", 0, "float32", 1024, np.arange(N_K)), base[0], base[1], {"version": 1})
    twin.append_shard(ShardWrite("ctx", 0, "float32", 1024, np.arange(N_K, N_K + n)), k, v, N_K)
    write = ShardWrite("ctx", 0, "float32", 1024, np.arange(N_K, N_K + n))
    with connect(worker) as s:
        receive(s)
        send(s, channel.append_frame(4, write, k, v, N_K, 16))  # parts of 16, 16, 16, 16, 6 keys
        header, _ = receive(s)
        assert header["op"] == "written" and header["id"] == 4 and header["infos"][0]["length"] == N_K + n
        create = [ShardWrite("ctx2", 0, "float32", 64, np.arange(n), reserve=64)]
        send(s, channel.write_frame(5, create, k, v, record={"version": 1}))
        header, _ = receive(s)
        assert header["op"] == "written" and header["infos"][0]["length"] == n
    for a, b in zip(worker.store.export("ctx", 0, N_K + n), twin.store.export("ctx", 0, N_K + n)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert np.asarray(worker.store.export("ctx2", 0, n)[0]).tobytes() == k.tobytes()
    assert_serves(worker, rng)


def test_a_streamed_append_that_fails_answers_its_error_and_stores_no_later_part(worker, rng):
    """An append after more keys than the shard holds (ShardMissing) is that request's error: its body is read
    to the end, the connection goes on, and the shard keeps what it held."""
    k = rng.standard_normal((40, H_KV, D)).astype(np.float32)
    bad = ShardWrite("ctx", 0, "float32", 1024, np.arange(N_K + 5, N_K + 45))
    with connect(worker) as s:
        receive(s)
        send(s, channel.append_frame(1, bad, k, k, N_K + 5, 8))
        header, _ = receive(s)
        assert header["op"] == "error" and header["kind"] == "ShardMissing"
        assert worker.store.info("ctx", 0).length == N_K
        send(s, channel.append_frame(2, ShardWrite("ctx", 0, "float32", 1024, np.arange(N_K, N_K + 40)), k, k,
                                     N_K, 8))
        assert receive(s)[0]["infos"][0]["length"] == N_K + 40
    assert_serves(worker, rng)
