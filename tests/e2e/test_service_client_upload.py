"""Uploads of any size: chunk sizing and retry decisions (pure), then chunked creates and appends
against real servers: exactness, planned shards, limits, a chunk that fails midway, retries."""

import asyncio
import json
import re
import threading
import time

import httpx
import numpy as np
import pytest
from faults import LoseAppendAfter, LostAnswers, RefuseFirst
from reference import assert_close_to_reference
from server import Server

from service.cli import build_parser
from service.client import AsyncClient, Client, UploadError
from service.client.retry import BACKOFF_S
from service.client.upload import (
    HEADER_ROOM,
)
from service.wire.rules import Limits
from service.wire.safetensors import encode_safetensors, to_bytes
from workers import BFLOAT16


def kv(rng, n, h_kv=2, d=16, d_v=8, dtype=np.float32):
    return rng.standard_normal((n, h_kv, d)).astype(dtype), rng.standard_normal((n, h_kv, d_v)).astype(dtype)


# -- chunk sizing and retry decisions (pure) ---------------------------------------------------


# -- against the shared server (64 MiB bodies, context_shard_keys 256, two workers) -------------

@pytest.mark.ray
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=lambda t: np.dtype(t).name)
def test_a_chunked_create_and_append_are_exact_and_fill_the_planned_shards_in_order(client, rng, dtype):
    k, v = kv(rng, 1700, dtype=dtype)
    k_pos = 3 * np.arange(1700) + 7  # not the defaults: each chunk must carry its own slice
    before = {c["id"] for c in client.list_contexts()}
    seen, shards = [], []

    def progress(done, total):
        seen.append((done, total))
        [ctx] = [c for c in client.list_contexts() if c["id"] not in before]
        shards.append(ctx["shard_lengths"])

    # One chunk in flight: the server's state at each progress call is exactly that chunk's.
    desc = client.create_context(k[:1000], v[:1000], k_pos[:1000], replicas=2, chunk_keys=128, progress=progress,
                                 pipeline=1)
    assert desc["length"] == 1000 and desc["expected_length"] == 1000 and desc["replicas"] == 2
    assert seen == [(n, 1000) for n in (128, 256, 384, 512, 640, 768, 896, 1000)]
    # Two workers, 1000 keys planned: two shards of 500, filled in order.
    assert shards == [[128, 0], [256, 0], [384, 0], [500, 12], [500, 140], [500, 268], [500, 396], [500, 500]]
    seen.clear()
    desc = client.append(desc["id"], k[1000:], v[1000:], k_pos[1000:], chunk_keys=300, progress=progress, pipeline=1)
    assert seen == [(300, 700), (600, 700), (700, 700)]
    assert desc["length"] == 1700 and desc["shard_lengths"] == [850, 850]  # past the plan: levelled
    q = rng.standard_normal((4, 4, 16)).astype(dtype)
    q_pos = np.array([0, 2000, 4000, 6000])
    out, lse = client.attention(q, contexts=[desc["id"]], causal=True, q_pos=q_pos)
    assert_close_to_reference(out, lse, q, k, v, causal=True, q_pos=q_pos, k_pos=k_pos)
    client.delete_context(desc["id"])


@pytest.mark.ray
@pytest.mark.parametrize("pipeline", [2, 4])
def test_chunks_in_flight_together_store_every_key_once_in_order(client, rng, pipeline):
    k, v = kv(rng, 2000, dtype=BFLOAT16)
    seen = []
    desc = client.create_context(k[:1200], v[:1200], chunk_keys=100, pipeline=pipeline,
                                 progress=lambda done, total: seen.append(done))
    assert seen == list(range(100, 1300, 100)) and desc["length"] == 1200
    desc = client.append(desc["id"], k[1200:], v[1200:], chunk_keys=64, pipeline=pipeline)
    assert desc["length"] == 2000 and sum(desc["shard_lengths"]) == 2000
    q = rng.standard_normal((3, 4, 16)).astype(BFLOAT16)
    q_pos = np.array([50, 1500, 1999])
    out, lse = client.attention(q, contexts=[desc["id"]], causal=True, q_pos=q_pos)
    assert_close_to_reference(out, lse, q, k, v, causal=True, q_pos=q_pos, k_pos=np.arange(2000))
    client.delete_context(desc["id"])


@pytest.mark.ray
def test_a_context_sent_piece_by_piece_with_expected_length_fills_its_planned_shards(client, rng):
    k, v = kv(rng, 1200)
    desc = client.create_context(k[:100], v[:100], expected_length=1200)
    assert desc["expected_length"] == 1200 and desc["length"] == 100
    for lo in range(100, 1200, 220):  # the rest later, in pieces the client never holds together
        desc = client.append(desc["id"], k[lo:lo + 220], v[lo:lo + 220])
    assert desc["length"] == 1200 and desc["shard_lengths"] == [600, 600]  # no shard beyond the plan
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[desc["id"]], q_pos=np.array([1199, 1199]))
    assert_close_to_reference(out, lse, q, k, v, q_pos=np.array([1199, 1199]))
    with pytest.raises(ValueError, match="expected_length must be an int >= the 100 keys given, got 99"):
        client.create_context(k[:100], v[:100], expected_length=99)
    client.delete_context(desc["id"])


@pytest.mark.ray
def test_one_chunk_is_the_single_request_of_old(client, rng):
    k, v = kv(rng, 300)
    seen = []
    desc = client.create_context(k, v, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(300, 300)] and desc["expected_length"] is None  # no plan: sized for its body, as ever
    assert desc["shard_lengths"] == [150, 150]
    client.delete_context(desc["id"])


@pytest.mark.ray
def test_arrays_that_disagree_on_n_k_are_refused_before_anything_is_sent(client, rng):
    k, v = kv(rng, 300)
    before = client.list_contexts()
    with pytest.raises(ValueError, match="v must have the n_k = 300 keys of k, got 299"):
        client.create_context(k, v[:299], chunk_keys=100)
    with pytest.raises(ValueError, match="k_pos must have the n_k = 300 keys of k, got 3"):
        client.create_context(k, v, np.arange(3), chunk_keys=100)
    assert client.list_contexts() == before


# -- against a small server: 256 KiB bodies, 1 MiB per worker, one request in flight -------------

BODY = 256 * 2**10


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("small-home"),
                 args=("--workers", "2", "--max-inflight", "1", "--worker-memory-bytes", str(2**20)),
                 env={"SPLITKEY_MAX_BODY_BYTES": str(BODY), "SPLITKEY_MAX_INFLIGHT_BYTES": str(BODY),
                      "SPLITKEY_CONTEXT_SHARD_KEYS": "64",
                      "SPLITKEY_MAX_REPLICAS": "3", "SPLITKEY_MIN_SHARD_KEYS": "64"})
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def small_client(small):
    with Client(small.url) as c:
        yield c
        for ctx in c.list_contexts():  # each test leaves the budget as it found it
            c.delete_context(ctx["id"])


@pytest.mark.ray
def test_limits_reports_the_settings_values(small, small_client):
    doc = httpx.get(small.url + "/v1/limits").json()
    assert doc == {"max_body_bytes": BODY, "max_json_body_bytes": BODY, "max_header_bytes": 2**20,
                   "max_elements": 2**28, "max_dims": 3, "max_contexts": 64, "max_context_id_chars": 128,
                   "max_shards": 1024, "max_replicas": 3, "max_batch_items": 256, "max_json_answer_elements": 2**21}
    assert small_client.limits() == Limits(max_body_bytes=BODY, max_json_body_bytes=BODY, max_replicas=3)


@pytest.mark.ray
def test_the_automatic_chunk_size_follows_the_servers_limits(small_client, rng):
    k, v = kv(rng, 5000)  # 960 KB of k and v: four bodies of at most 256 KiB
    size = (BODY - HEADER_ROOM) // 192
    seen = []
    desc = small_client.create_context(k, v, progress=lambda done, total: seen.append(done))
    assert seen == [size, 2 * size, 3 * size, 5000]
    assert desc["length"] == 5000 and desc["expected_length"] == 5000
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = small_client.attention(q, contexts=[desc["id"]])
    assert_close_to_reference(out, lse, q, k, v)


@pytest.mark.ray
def test_a_chunk_that_fails_midway_raises_upload_error_and_the_prefix_stays_exact(small_client, rng):
    k, v = kv(rng, 512 + 16384)
    ctx = small_client.create_context(k[:512], v[:512], chunk_keys=256)  # planned: 2 shards of 256
    seen = []
    with pytest.raises(UploadError) as err:  # 3.3 MB more: past the two workers' 2 MiB
        small_client.append(ctx["id"], k[512:], v[512:], chunk_keys=1024, progress=lambda d, t: seen.append(d))
    e = err.value
    assert (e.status, e.code) == (507, "insufficient_capacity") and "budget" in e.detail
    assert e.context_id == ctx["id"] and e.total == 16384
    assert 0 < e.committed < 16384 and e.committed % 1024 == 0 and seen[-1] == e.committed
    assert f"{e.committed} of 16384 keys committed" in str(e)
    n = 512 + e.committed
    assert small_client.get_context(ctx["id"])["length"] == n  # exactly the prefix: the failed chunk left nothing
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = small_client.attention(q, contexts=[ctx["id"]], causal=True)
    assert_close_to_reference(out, lse, q, k[:n], v[:n], causal=True)


def hold_the_body_budget(url: str, seconds: float) -> threading.Thread:
    """A request whose body, nearly the whole in-flight body budget, stops 10 bytes short of its end
    for ``seconds``: until then any other body gets 429. Returns once the server holds those bytes."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 2, 8)).astype(np.float32), rng.standard_normal((2000, 2, 8)).astype(np.float32)
    body = to_bytes(encode_safetensors({"q": q, "k": k, "v": k}))  # 256 KB of the 256 KiB budget
    result = {}

    def trickle():
        yield body[:-10]
        time.sleep(seconds)
        yield body[-10:]

    def send():
        result["status"] = httpx.post(url + "/v1/attention", content=trickle(), timeout=30,
                                      headers={"Content-Type": "application/octet-stream"}).status_code

    thread = threading.Thread(target=send)
    thread.result = result
    thread.start()
    deadline = time.monotonic() + 10
    held = rf"^splitkey_inflight_body_bytes {len(body) - 10}\.0$"
    while not re.search(held, httpx.get(url + "/metrics").text, re.MULTILINE):
        assert time.monotonic() < deadline, "the slow body was never held"
        time.sleep(0.02)
    return thread


@pytest.mark.ray
def test_a_chunk_refused_with_429_is_sent_again_after_retry_after(small, small_client, rng):
    k, v = kv(rng, 300)
    slow = []

    def progress(done, total):
        if done == 100:  # the next chunk's first attempt is refused (429: the body budget is held)
            slow.append(hold_the_body_budget(small.url, 0.5))
            assert httpx.get(small.url + "/v1/limits").status_code == 200  # not admission-controlled

    t0 = time.monotonic()
    desc = small_client.create_context(k, v, chunk_keys=100, progress=progress)
    assert time.monotonic() - t0 >= 1.0, "the retry must wait for Retry-After (1 s)"
    slow[0].join()
    assert slow[0].result["status"] == 200
    assert desc["length"] == 300
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = small_client.attention(q, contexts=[desc["id"]])
    assert_close_to_reference(out, lse, q, k, v)


@pytest.mark.ray
@pytest.mark.parametrize("pipeline", [1, 2])
def test_a_chunk_whose_answer_was_lost_is_found_stored_and_counts_once(client, server, rng, pipeline):
    k, v = kv(rng, 400)
    lose = LoseAppendAfter(100)  # the answer to the append of keys 100..200 never comes back

    seen = []
    with LostAnswers(server.port, lose) as proxy, Client(proxy.url) as c:
        desc = c.create_context(k, v, chunk_keys=100, pipeline=pipeline, progress=lambda d, t: seen.append(d))
    assert desc["length"] == 400 and seen == [100, 200, 300, 400]
    if pipeline == 1:
        # One at a time, the lost chunk is sent again, refused (409: its keys are there) and found stored.
        assert lose.appends == [(100, 200), (100, 409), (200, 200), (300, 200)], lose.appends
    else:
        # Two at a time, the lost chunk is never sent again: the upload's end on the server says it
        # is stored. A chunk is sent again only if the server refused it: the chunk after the lost
        # one, when it reached the server first (409, its predecessor not yet stored; the next test).
        afters = [after for after, _ in lose.appends]
        refused = [after for after, status in lose.appends if status == 409]
        assert afters.count(100) == 1 and refused in ([], [200]), lose.appends
        assert sorted(afters) == sorted([100, 200, 300] + refused), lose.appends
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[desc["id"]])
    assert_close_to_reference(out, lse, q, k, v)  # every key once: the chunk stored twice would show
    client.delete_context(desc["id"])


@pytest.mark.ray
@pytest.mark.parametrize("which", ["sync", "async"])
def test_a_plain_append_whose_answer_was_lost_is_not_sent_again_and_says_its_keys_may_be_stored(
        client, server, rng, which):
    """One chunk without ``after``: sending it again could store it twice, so it is not; the error
    must not say that none was appended (it was), or the documented resume stores it twice."""
    k, v = kv(rng, 5)
    ctx = client.create_context(k, v)["id"]
    appends = []

    def lose(method, path, status):  # every answer to an append of ctx is lost
        if method == "POST" and path.startswith(f"/v1/contexts/{ctx}/append"):
            appends.append(status)
            return True
        return False

    k1, v1 = kv(rng, 1)
    with LostAnswers(server.port, lose) as proxy, pytest.raises(UploadError) as raised:
        if which == "sync":
            with Client(proxy.url) as c:
                c.append(ctx, k1, v1)
        else:
            async def main():
                async with AsyncClient(proxy.url) as c:
                    await c.append(ctx, k1, v1)
            asyncio.run(main())
    err = raised.value
    assert appends == [200]  # stored once, its answer lost, never sent again
    assert (err.committed, err.unknown, err.context_id) == (0, 1, ctx), str(err)
    assert "may have been too" in str(err) and "none was appended" not in str(err)
    assert client.get_context(ctx)["length"] == 6  # what the error says to read before resuming
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[ctx])
    assert_close_to_reference(out, lse, q, np.concatenate([k, k1]), np.concatenate([v, v1]))
    client.delete_context(ctx)


@pytest.mark.ray
@pytest.mark.parametrize("which", ["sync", "async"])
def test_an_append_with_after_is_sent_again_after_a_lost_answer_and_stored_once_and_refused_elsewhere(
        client, server, rng, which):
    """An engine's step: one token's keys with ``after`` = the keys it has appended so far. Its answer
    lost, it is sent again, refused (409: its keys are there) and found stored; an ``after`` that is
    not the context's length is refused and stores nothing."""
    k, v = kv(rng, 5)
    ctx = client.create_context(k, v)["id"]
    k1, v1 = kv(rng, 1)
    lose = LoseAppendAfter(5)

    def append(url, *args, **kw):
        if which == "sync":
            with Client(url) as c:
                return c.append(ctx, *args, **kw)

        async def main():
            async with AsyncClient(url) as c:
                return await c.append(ctx, *args, **kw)
        return asyncio.run(main())

    with LostAnswers(server.port, lose) as proxy:
        desc = append(proxy.url, k1, v1, after=5)
    assert desc["length"] == 6 and lose.appends == [(5, 200), (5, 409)], lose.appends
    with pytest.raises(UploadError) as raised:
        append(server.url, k1, v1, after=5)  # the context holds 6 keys now
    assert raised.value.status == 409 and raised.value.code == "length_mismatch" and raised.value.committed == 0
    with pytest.raises(ValueError, match="after must be an int >= 0"):
        append(server.url, k1, v1, after=-1)
    assert client.get_context(ctx)["length"] == 6
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[ctx])
    assert_close_to_reference(out, lse, q, np.concatenate([k, k1]), np.concatenate([v, v1]))  # stored once
    client.delete_context(ctx)

@pytest.mark.ray
@pytest.mark.parametrize("which", ["sync", "async"])
def test_a_chunked_appends_first_read_of_the_length_whose_answer_was_lost_is_read_again(client, server, rng, which):
    k, v = kv(rng, 5)
    ctx = client.create_context(k, v)["id"]
    reads = []

    def lose(method, path, status):  # the first two answers to GET /v1/contexts/{ctx} never come back
        if method == "GET" and path == f"/v1/contexts/{ctx}":  # (the transport itself sends once more)
            reads.append(status)
            return len(reads) <= 2
        return False

    k1, v1 = kv(rng, 30)
    with LostAnswers(server.port, lose) as proxy:
        if which == "sync":
            with Client(proxy.url) as c:
                desc = c.append(ctx, k1, v1, chunk_keys=10)
        else:
            async def main():
                async with AsyncClient(proxy.url) as c:
                    return await c.append(ctx, k1, v1, chunk_keys=10)
            desc = asyncio.run(main())
    assert reads[:3] == [200, 200, 200] and desc["length"] == 35
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[ctx])
    assert_close_to_reference(out, lse, q, np.concatenate([k, k1]), np.concatenate([v, v1]))
    client.delete_context(ctx)


@pytest.mark.ray
def test_a_lost_chunk_overtaken_by_the_next_one_is_found_stored_and_only_the_refused_one_is_sent_again(
        client, server, rng):
    k, v = kv(rng, 400)
    # Keys 200..300 reach the server before keys 100..200, whose answer is then lost.
    lose = LoseAppendAfter(100, first=200)
    with LostAnswers(server.port, lose) as proxy, Client(proxy.url) as c:
        desc = c.create_context(k, v, chunk_keys=100, pipeline=2)
    assert desc["length"] == 400
    # 200..300 is refused (its predecessor is not there yet), 100..200 stored with its answer lost:
    # the upload's end on the server says 100..200 is stored, and it goes on one at a time from 200.
    assert lose.appends == [(200, 409), (100, 200), (200, 200), (300, 200)], lose.appends
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[desc["id"]])
    assert_close_to_reference(out, lse, q, k, v)
    client.delete_context(desc["id"])


@pytest.mark.ray
@pytest.mark.parametrize("pipeline", [1, 2])
def test_two_chunked_uploads_to_one_context_at_once_store_what_each_reports_and_nothing_else(client, rng, pipeline):
    """Each writer's keys stay contiguous, and what each says it stored is what is there: another
    writer's chunk of the same size must not pass for a writer's own (docs/CONTEXTS.md)."""
    base_k, base_v = kv(rng, 50)
    for trial in range(4):
        ctx = client.create_context(base_k, base_v)
        writers = [kv(rng, 600), kv(rng, 600)]
        ends: list = [None, None]

        def upload(i):
            with Client(client.url) as c:
                try:
                    c.append(ctx["id"], *writers[i], chunk_keys=100, pipeline=pipeline)
                    ends[i] = 600
                except UploadError as e:
                    ends[i] = e

        threads = [threading.Thread(target=upload, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for end in ends:  # a writer stops only because the other one's keys came between its chunks
            assert end == 600 or (end.context_id == ctx["id"] and end.code == "length_mismatch"), end
        results = [end if end == 600 else end.committed for end in ends]
        length = client.get_context(ctx["id"])["length"]
        assert length == 50 + sum(results), (trial, results, length)
        # Non-causal attention without positions' terms does not depend on the keys' order: the
        # context must hold the base, then exactly each writer's reported prefix (in either order).
        k = np.concatenate([base_k] + [w[0][:n] for w, n in zip(writers, results)])
        v = np.concatenate([base_v] + [w[1][:n] for w, n in zip(writers, results)])
        q = rng.standard_normal((2, 4, 16)).astype(np.float32)
        out, lse = client.attention(q, contexts=[ctx["id"]])
        assert_close_to_reference(out, lse, q, k, v)
        client.delete_context(ctx["id"])


@pytest.mark.ray
def test_a_first_attempt_refused_for_length_stops_the_upload_at_what_it_committed(small, small_client, rng):
    k, v = kv(rng, 300)

    def progress(done, total):
        if done == 100:  # someone else appends in between: the context is no longer ours to extend
            [ctx] = small_client.list_contexts()
            r = httpx.post(small.url + f"/v1/contexts/{ctx['id']}/append", json={"k": k[:5].tolist(),
                                                                                  "v": v[:5].tolist()})
            assert r.status_code == 200, r.text

    with pytest.raises(UploadError) as err:
        small_client.create_context(k, v, chunk_keys=100, progress=progress)
    e = err.value
    assert (e.status, e.code, e.committed, e.total) == (409, "length_mismatch", 100, 300)
    assert e.detail == "after must be the context's length 105, got 100"
    assert small_client.get_context(e.context_id)["length"] == 105


@pytest.mark.ray
def test_loadtest_uploads_a_context_larger_than_one_body_with_progress_lines(small, tmp_path, capsys):
    args = build_parser().parse_args([
        "loadtest", "--url", small.url, "--n-k", "4096", "--h-q", "4", "--h-kv", "2", "--d", "16",
        "--concurrency", "1", "--requests", "4", "--verify-every", "1", "--out", str(tmp_path), "--no-plots"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("upload")]
    # not a terminal: a line per tenth done, the last at 100%
    assert len(lines) >= 4 and lines[-1].startswith("upload context of 4096 keys 100.0%  4096/4096 keys")
    assert all(re.fullmatch(r"upload context of 4096 keys +[0-9.]+%  \d+/4096 keys  [0-9.]+ GB/s", line)
               for line in lines)
    [point] = json.loads((tmp_path / "results.json").read_text())["points"]
    assert point["failed"] == 0 and point["verified"] == 4 and point["wrong"] == 0 and point["max_error"] < 1e-5


@pytest.mark.ray
def test_loadtest_says_what_to_try_when_the_context_does_not_fit(small, capsys):
    args = build_parser().parse_args([
        "loadtest", "--url", small.url, "--n-k", "16384", "--h-q", "4", "--h-kv", "2", "--d", "16",
        "--concurrency", "1", "--requests", "1"])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "insufficient_capacity" in err and "--dtype bfloat16" in err
    with Client(small.url) as c:
        assert c.list_contexts() == []


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.ray
@pytest.mark.parametrize("status", [429, 503])
def test_an_uploads_first_read_of_the_limits_is_sent_again_after_429_and_503(small, rng, status):
    k, v = kv(rng, 200)
    with RefuseFirst(_port(small.url), "GET", "/v1/limits", status, times=2) as proxy, Client(proxy.url) as c:
        t0 = time.monotonic()
        desc = c.create_context(k, v, chunk_keys=100)
        waited = time.monotonic() - t0
        assert proxy.refused == 2 and desc["length"] == 200
        # 429: Retry-After (1 s) each time; 503: the backoff, 0.25 then 0.5 s
        assert waited >= (2.0 if status == 429 else BACKOFF_S * 3), waited
        q = rng.standard_normal((2, 4, 16)).astype(np.float32)
        out, lse = c.attention(q, contexts=[desc["id"]])
        assert_close_to_reference(out, lse, q, k, v)
        c.delete_context(desc["id"])


@pytest.mark.ray
def test_the_async_clients_first_read_of_the_limits_is_sent_again_and_gives_up_after_its_retries(small, rng):
    k, v = kv(rng, 200)

    async def upload(url: str, retries: int) -> dict:
        async with AsyncClient(url) as c:
            desc = await c.create_context(k, v, chunk_keys=100, retries=retries)
            await c.delete_context(desc["id"])
            return desc

    with RefuseFirst(_port(small.url), "GET", "/v1/limits", 503, times=2) as proxy:
        assert asyncio.run(upload(proxy.url, retries=3))["length"] == 200 and proxy.refused == 2
    with RefuseFirst(_port(small.url), "GET", "/v1/limits", 503, times=5) as proxy:
        with pytest.raises(UploadError) as caught:
            asyncio.run(upload(proxy.url, retries=1))
        assert caught.value.status == 503 and caught.value.committed == 0 and proxy.refused == 2


@pytest.mark.ray
def test_an_uploads_read_of_the_limits_whose_answer_was_lost_is_sent_again(small, rng):
    k, v = kv(rng, 200)
    lost = []

    def lose(method, path, status):
        if (method, path) == ("GET", "/v1/limits") and not lost:
            lost.append(status)
            return True
        return False

    with LostAnswers(_port(small.url), lose) as proxy, Client(proxy.url) as c:
        desc = c.create_context(k, v, chunk_keys=100)
        assert lost == [200] and desc["length"] == 200
        c.delete_context(desc["id"])
