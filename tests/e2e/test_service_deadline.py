"""The request deadline reaches the workers: work whose request was answered 504 is not computed
afterwards, so an overloaded worker does not spend its time on answers nobody waits for
(docs/SERVICE.md, "Deadlines")."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

import numpy as np
import pytest
from reference import assert_close_to_reference
from server import Server

from service.client import AsyncClient, Client, SplitkeyError
from service.wire.safetensors import encode_safetensors, to_bytes

TIMEOUT_S = 0.5


def counts(c: Client) -> dict[str, int]:
    worker = c.cluster()["workers"][0]
    return {name: worker[name] for name in ("calls", "batches", "expired")}


def wait_for(c: Client, name: str, value: int, within_s: float = 60.0) -> dict[str, int]:
    deadline_at = time.monotonic() + within_s
    while (now := counts(c))[name] < value:
        assert time.monotonic() < deadline_at, f"{name} must reach {value} within {within_s} s, got {now}"
        time.sleep(0.05)
    return now


@pytest.mark.ray
def test_queries_answered_504_while_the_worker_was_busy_are_not_computed_afterwards(tmp_path):
    """One worker: a large inline query with the server's long deadline holds the worker's compute thread
    for several seconds; queries sent behind it with a 0.5 s deadline (X-Request-Timeout; resident ones
    over the channel, an inline one over Ray, a batch of two) get 504, and once the large one ends the
    worker skips them all instead of computing them. The server then answers exactly as before."""
    srv = Server(tmp_path, args=("--workers", "1")).start()
    try:
        rng = np.random.default_rng(11)
        k = rng.standard_normal((512, 2, 64)).astype(np.float32)
        v = rng.standard_normal((512, 2, 64)).astype(np.float32)
        qs = [rng.standard_normal((1, 8, 64)).astype(np.float32) for _ in range(2)]
        with Client(srv.url) as c:
            ctx = c.create_context(k, v)["id"]
            out, lse = c.attention(qs[0], contexts=[ctx])
            assert_close_to_reference(out, lse, qs[0], k, v)
            before = counts(c)
            # 1.3 to 7 s of work on a 2-core machine (idle to loaded): the queued queries' deadlines pass
            # well before it ends.
            big_q = rng.standard_normal((1024, 16, 64)).astype(np.float32)
            big_k = rng.standard_normal((30000, 2, 64)).astype(np.float32)
            answers: list[tuple] = []

            late = {"X-Request-Timeout": str(TIMEOUT_S)}
            bodies = {"resident": ("/v1/attention", {"q": qs[0].tolist(), "dtype": "float32", "contexts": [ctx]}),
                      "inline": ("/v1/attention", {"q": qs[0].tolist(), "k": k[:64].tolist(), "v": v[:64].tolist(),
                                                   "dtype": "float32"}),
                      "batch": ("/v1/attention/batch", {"items": [{"q": q.tolist(), "dtype": "float32",
                                                                   "contexts": [ctx]} for q in qs]})}

            def send(kind: str) -> None:
                if kind != "busy":
                    path, body = bodies[kind]
                    r = httpx.post(srv.url + path, json=body, headers=late, timeout=60)
                    answers.append((kind, 200) if r.status_code == 200 else (kind, r.status_code, r.json()["code"]))
                    return
                with Client(srv.url) as own:
                    try:
                        own.attention(big_q, big_k, big_k)
                        answers.append((kind, 200))
                    except SplitkeyError as err:
                        answers.append((kind, err.status, err.code))

            busy = threading.Thread(target=send, args=("busy",))
            busy.start()
            wait_for(c, "batches", before["batches"] + 1)  # the large query runs on the compute thread
            queued = [threading.Thread(target=send, args=(kind,)) for kind in ("resident",) * 3 + ("inline", "batch")]
            for t in queued:
                t.start()
            for t in (*queued, busy):
                t.join(60)
            assert sorted(answers) == sorted([("busy", 200)] + [(kind, 504, "deadline_exceeded") for kind in
                                                                ("resident", "resident", "resident", "inline",
                                                                 "batch")]), (
                "the large query must outlast the others' deadline", answers)
            # Six jobs (three resident queries, the inline shard, the batch's two items) in five calls:
            # when the large query ends the worker takes them, finds their time out, and skips them.
            after = wait_for(c, "expired", before["expired"] + 6)
            assert after == {"calls": before["calls"] + 6, "batches": before["batches"] + 1,
                             "expired": before["expired"] + 6}
            # The worker goes on serving exact answers.
            out, lse = c.attention(qs[1], contexts=[ctx])
            assert_close_to_reference(out, lse, qs[1], k, v)
            out, lse = c.attention(qs[0], k[:64], v[:64])
            assert_close_to_reference(out, lse, qs[0], k[:64], v[:64])
            for (out, lse), q in zip(c.attention_batch([{"q": q, "contexts": [ctx]} for q in qs]), qs):
                assert_close_to_reference(out, lse, q, k, v)
            assert counts(c)["batches"] > after["batches"] and counts(c)["expired"] == after["expired"]
    finally:
        srv.stop()


@pytest.mark.ray
def test_a_clients_deadline_reaches_the_workers_so_what_it_gave_up_on_is_not_computed(tmp_path):
    """The server's own deadline is long (the default); each client sends the time left of its call's
    deadline as X-Request-Timeout. Queries queued behind a large one end with the client's
    TimeoutError (or, sent raw, the server's 504 at the header's time), and the worker skips them."""
    srv = Server(tmp_path, args=("--workers", "1")).start()
    try:
        rng = np.random.default_rng(12)
        k = rng.standard_normal((512, 2, 64)).astype(np.float32)
        v = rng.standard_normal((512, 2, 64)).astype(np.float32)
        q = rng.standard_normal((1, 8, 64)).astype(np.float32)
        with Client(srv.url) as c:
            ctx = c.create_context(k, v)["id"]
            out, lse = c.attention(q, contexts=[ctx], deadline=30.0)  # the header sent, time to spare
            assert_close_to_reference(out, lse, q, k, v)
            raw = {"q": q.tolist(), "contexts": [ctx]}
            bad = httpx.post(srv.url + "/v1/attention", json=raw, headers={"X-Request-Timeout": "soon"}, timeout=30)
            assert bad.status_code == 422 and bad.json()["code"] == "invalid_option"
            assert "X-Request-Timeout" in bad.json()["detail"] and '"soon"' in bad.json()["detail"]
            before = counts(c)
            big_q = rng.standard_normal((1024, 16, 64)).astype(np.float32)
            big_k = rng.standard_normal((30000, 2, 64)).astype(np.float32)
            answers: list[tuple] = []

            def send(kind: str) -> None:
                try:
                    if kind == "busy":  # no deadline: answered whatever it takes
                        with Client(srv.url) as own:
                            own.attention(big_q, big_k, big_k)
                    elif kind == "sync":
                        with Client(srv.url) as own:
                            own.attention(q, contexts=[ctx], deadline=0.5)
                    elif kind == "batch":
                        with Client(srv.url) as own:
                            own.attention_batch([{"q": q, "contexts": [ctx]}] * 2, deadline=0.5)
                    elif kind == "async":
                        async def one() -> None:
                            async with AsyncClient(srv.url) as own:
                                await own.attention(q, contexts=[ctx], deadline=0.5)
                        asyncio.run(one())
                    else:
                        r = httpx.post(srv.url + "/v1/attention", json=raw, headers={"X-Request-Timeout": "0.5"},
                                       timeout=60)
                        answers.append((kind, r.status_code, r.json().get("code")))
                        return
                    answers.append((kind, 200))
                except TimeoutError:
                    answers.append((kind, "TimeoutError"))

            busy = threading.Thread(target=send, args=("busy",))
            busy.start()
            wait_for(c, "batches", before["batches"] + 1)  # the large query runs on the compute thread
            queued = [threading.Thread(target=send, args=(kind,)) for kind in ("sync", "batch", "async", "raw")]
            for t in queued:
                t.start()
            for t in (*queued, busy):
                t.join(60)
            assert sorted(answers, key=str) == sorted(
                [("busy", 200), ("sync", "TimeoutError"), ("batch", "TimeoutError"), ("async", "TimeoutError"),
                 ("raw", 504, "deadline_exceeded")], key=str), answers
            # Five jobs (the sync, async and raw queries, the batch's two items): skipped, not computed.
            after = wait_for(c, "expired", before["expired"] + 5)
            assert after["expired"] == before["expired"] + 5 and after["batches"] == before["batches"] + 1
            name = c.cluster()["workers"][0]["name"]  # /metrics shows what /v1/cluster's ping just read
            metrics = httpx.get(srv.url + "/metrics", timeout=30).text
            assert f'splitkey_worker_expired_jobs_total{{worker="{name}"}} {float(after["expired"])}' in metrics
            out, lse = c.attention(q, contexts=[ctx], deadline=30.0)
            assert_close_to_reference(out, lse, q, k, v)
    finally:
        srv.stop()


@pytest.mark.ray
def test_a_query_answered_504_stops_computing_at_its_deadline_and_frees_the_worker(tmp_path):
    """A resident query of several seconds with a 0.3 s deadline is answered 504 at 0.3 s, and the
    worker stops it at its next block of keys (workers.cutoff): a small query sent right after the 504 is
    answered at once. Before, the worker computed the whole answer nobody waited for (measured: the
    small query waited 1.9 to 2.5 s more)."""
    srv = Server(tmp_path, args=("--workers", "1")).start()
    try:
        rng = np.random.default_rng(13)
        k = rng.standard_normal((16384, 8, 64), dtype=np.float32)
        big_q = rng.standard_normal((4096, 8, 64), dtype=np.float32)  # 3 to 10 s alone here
        small = rng.standard_normal((1, 8, 64), dtype=np.float32)
        with Client(srv.url) as c:
            ctx = c.create_context(k, k)["id"]
            c.attention(small, contexts=[ctx])
            before = counts(c)
            r = httpx.post(srv.url + f"/v1/attention?contexts={ctx}", timeout=60,
                           content=to_bytes(encode_safetensors({"q": big_q})),
                           headers={"Content-Type": "application/octet-stream", "X-Request-Timeout": "0.3"})
            assert r.status_code == 504, r.text
            assert r.json()["detail"] == "the request must finish within its X-Request-Timeout of 0.3 s, got longer"
            t0 = time.monotonic()
            out, lse = c.attention(small, contexts=[ctx])
            freed_s = time.monotonic() - t0
            assert_close_to_reference(out, lse, small, k, k)
            assert freed_s < 1.0, f"the worker must stop the 504'd query within a block, took {freed_s:.2f} s"
            assert counts(c)["expired"] == before["expired"] + 1
    finally:
        srv.stop()
