"""service.client.AsyncClient against the live test server: queries, batches, chunked uploads,
retries that honour Retry-After and back off on 503, deadlines."""

import asyncio
import http.client
import http.server
import json
import threading
import time

import numpy as np
import pytest
from reference import assert_close_to_reference

from service.client import AsyncClient, Client, SplitkeyError, UploadError

pytestmark = pytest.mark.ray


def kv(rng, n, h_kv=2, d=16, d_v=8):
    return rng.standard_normal((n, h_kv, d)).astype(np.float32), rng.standard_normal((n, h_kv, d_v)).astype(np.float32)


def run(coro):
    return asyncio.run(coro)


def test_async_client_queries_uploads_and_batches_match_the_sync_client(server, client, rng):
    k, v = kv(rng, 700)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    seen = []

    async def main():
        async with AsyncClient(server.url) as c:
            ctx = await c.create_context(k[:500], v[:500], chunk_keys=128, progress=lambda d, t: seen.append((d, t)))
            desc = await c.append(ctx["id"], k[500:], v[500:], chunk_keys=64)
            assert desc["length"] == 700 and (await c.get_context(ctx["id"]))["length"] == 700
            assert ctx["id"] in [x["id"] for x in await c.list_contexts()]
            out, lse = await c.attention(q, contexts=[ctx["id"]], causal=True)
            inline = await c.attention(q, k[:90], v[:90], window=(10, None))
            batch = await c.attention_batch([{"q": q, "contexts": [ctx["id"]], "causal": True},
                                             {"q": q, "contexts": ["nope"]}])
            # Calls from one loop at once share the client's connections.
            many = await asyncio.gather(*(c.attention(q, contexts=[ctx["id"]], causal=True) for _ in range(8)))
            return ctx, out, lse, inline, batch, many

    ctx, out, lse, inline, batch, many = run(main())
    assert seen == [(128, 500), (256, 500), (384, 500), (500, 500)]
    assert_close_to_reference(out, lse, q, k, v, causal=True)
    assert_close_to_reference(*inline, q, k[:90], v[:90], window=(10, None))
    sync_out, sync_lse = client.attention(q, contexts=[ctx["id"]], causal=True)
    assert np.array_equal(out, sync_out) and np.array_equal(lse, sync_lse)
    assert np.array_equal(batch[0][0], out) and np.array_equal(batch[0][1], lse)
    assert isinstance(batch[1], SplitkeyError) and batch[1].code == "context_not_found"
    assert all(np.array_equal(o, out) and np.array_equal(ls, lse) for o, ls in many)
    assert run(_delete(server.url, ctx["id"]))["deleted"] is True


async def _delete(url, ctx_id):
    async with AsyncClient(url) as c:
        return await c.delete_context(ctx_id)


def test_async_client_raises_the_contract_error_without_retrying_a_client_mistake(server):
    async def main():
        async with AsyncClient(server.url, retries=3) as c:
            with pytest.raises(SplitkeyError) as info:
                await c.attention(np.ones((1, 4, 16), np.float32), contexts=["missing"])
            return info.value
    err = run(main())
    assert err.status == 404 and err.code == "context_not_found" and err.request_id


class Scripted(http.server.ThreadingHTTPServer):
    """A proxy before the live server that answers the first POSTs from a script (status, headers, delay;
    ``None`` forwards it, ``"drop"`` closes without an answer), then forwards: how a client's retries are
    seen from the wire. Test-only."""

    def __init__(self, target_port, script):
        self.target_port, self.script, self.posts = target_port, list(script), []
        super().__init__(("127.0.0.1", 0), _Handler)
        self.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.posts.append(time.monotonic())
        step = self.server.script.pop(0) if self.server.script else None
        if step == "drop":  # no answer: the connection closed after the request arrived
            self.close_connection = True
            return
        if step is not None:
            status, headers, delay = step
            time.sleep(delay)
            data = json.dumps({"detail": "scripted", "code": {429: "overloaded", 503: "workers_unavailable"}
                               .get(status, "x")}).encode()
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.server.target_port, timeout=60)
            conn.request("POST", self.path, body=body, headers={"Content-Type": self.headers["Content-Type"]})
            resp = conn.getresponse()
            status, data, headers = resp.status, resp.read(), {}
            conn.close()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_async_client_waits_out_retry_after_and_backs_off_on_503(server, rng):
    k, v = kv(rng, 50)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    with Scripted(server.port, [(429, {"Retry-After": "1"}, 0), (503, {}, 0)]) as proxy:
        async def main():
            async with AsyncClient(proxy.url, retries=2) as c:
                return await c.attention(q, k, v)
        out, lse = run(main())
    assert_close_to_reference(out, lse, q, k, v)
    first, second, third = proxy.posts
    assert second - first >= 1.0  # Retry-After: 1
    assert third - second >= 0.5  # the second attempt's backoff (0.25 s doubled)


def test_async_client_gives_up_after_its_retries_and_within_its_deadline(server, rng):
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    k, v = kv(rng, 20)
    with Scripted(server.port, [(503, {}, 0)] * 3) as proxy:
        async def main():
            async with AsyncClient(proxy.url, retries=1) as c:
                await c.attention(q, k, v)
        with pytest.raises(SplitkeyError) as info:
            run(main())
        assert info.value.status == 503 and len(proxy.posts) == 2
    with Scripted(server.port, [(200, {}, 3.0)]) as proxy:
        async def slow():
            async with AsyncClient(proxy.url) as c:
                await c.attention(q, k, v, deadline=0.5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            run(slow())
        assert time.monotonic() - t0 < 2.5


def test_async_client_with_retries_0_sends_a_query_once_even_when_its_kept_connection_is_lost(server, rng):
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    k, v = kv(rng, 20)
    with Scripted(server.port, [None, "drop"]) as proxy:
        async def main():
            async with AsyncClient(proxy.url, retries=0) as c:
                await c.attention(q, k, v)  # the connection is kept
                await c.attention(q, k, v)
        with pytest.raises(ConnectionError):  # the client's TransportError: lost after the query went out
            run(main())
        assert len(proxy.posts) == 2  # not sent a third time

def test_async_upload_that_stops_says_what_is_stored(server, rng):
    k, v = kv(rng, 300)

    async def main():
        async with AsyncClient(server.url) as c:
            bad_v = v.copy()
            bad_v[250, 0, 0] = np.nan  # the third chunk is refused (422): not retried
            with pytest.raises(UploadError) as info:
                await c.create_context(k, bad_v, chunk_keys=100)
            return info.value
    err = run(main())
    assert err.status == 422 and err.committed == 200 and err.total == 300 and err.context_id
    with Client(server.url) as c:
        assert c.get_context(err.context_id)["length"] == 200
        c.delete_context(err.context_id)


def test_an_async_chunk_whose_answer_was_lost_is_found_stored_and_counts_once(server, client, rng):
    from faults import LoseAppendAfter, LostAnswers

    k, v = kv(rng, 300)
    lose = LoseAppendAfter(100)  # the answer to the append of keys 100..200 never comes back

    async def main(url):
        async with AsyncClient(url) as c:
            return await c.create_context(k, v, chunk_keys=100)

    with LostAnswers(server.port, lose) as proxy:
        desc = run(main(proxy.url))
    # The lost chunk is sent again, refused (409: its keys are there) and found stored.
    assert desc["length"] == 300 and lose.appends == [(100, 200), (100, 409), (200, 200)], lose.appends
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[desc["id"]])
    assert_close_to_reference(out, lse, q, k, v)  # every key once
    client.delete_context(desc["id"])


def test_async_client_refuses_bad_arguments_at_once(server):
    with pytest.raises(ValueError, match="url"):
        AsyncClient("ftp://x")

    async def main():
        async with AsyncClient(server.url) as c:
            with pytest.raises(ValueError, match="deadline"):
                await c.attention(np.ones((1, 1, 1), np.float32), contexts=["a"], deadline=0)
            with pytest.raises(ValueError, match="items"):
                await c.attention_batch([])
    run(main())
