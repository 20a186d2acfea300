"""service.client.Client's queries: sent again after 429 (after its Retry-After), 503 (backing off) or a
lost connection, ``retries`` times, within a per-call ``deadline``, as AsyncClient sends them.

Against a scripted server on loopback (a real ``http.server``: how the client's attempts are seen
from the wire), and once against the live test server. The client's other calls are tested with the
service (test_service_attention, test_service_client_upload and the rest).
"""

import asyncio
import http.server
import json
import math
import re
import threading
import time

import numpy as np
import pytest

from service.client import AsyncClient, Client, SplitkeyError
from service.client.retry import BACKOFF_S
from service.wire.safetensors import encode_safetensors

OUT = np.full((1, 1, 2), 7.0, np.float32)
LSE = np.full((1, 1), 3.0, np.float32)
Q = np.ones((1, 1, 2), np.float32)
#: A script step: the request is read and its connection closed without an answer.
DROP = "drop"


def busy(retry_after: str) -> tuple[int, dict[str, str]]:
    return 429, {"Retry-After": retry_after}


UNAVAILABLE = (503, {})


def hold(seconds: float) -> tuple[str, float]:
    """A script step: the answer comes after ``seconds`` (or never, if the test ends first)."""
    return "hold", seconds


def trickle(gap_s: float) -> tuple[str, float]:
    """A script step: the answer's head at once, then its body one byte every ``gap_s`` seconds."""
    return "trickle", gap_s


class Stub(http.server.ThreadingHTTPServer):
    """Answers each POST with the next step of ``script``, then as a query is answered (``OUT``,
    ``LSE`` per item); ``posts`` has each POST's arrival (``time.monotonic()``) and path, ``timeouts``
    its ``X-Request-Timeout`` header (None without one). Test-only."""

    def __init__(self, script) -> None:
        self.script, self.posts, self.timeouts = list(script), [], []
        self.ending = threading.Event()
        super().__init__(("127.0.0.1", 0), _Handler)
        self.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def gaps(self) -> list[float]:
        """Seconds between one POST's arrival and the next's."""
        return [b - a for (a, _), (b, _) in zip(self.posts, self.posts[1:])]

    def handle_error(self, request, client_address) -> None:
        pass  # a held answer written to a client that gave up

    def __enter__(self):
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.ending.set()
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        self.server.posts.append((time.monotonic(), path))
        self.server.timeouts.append(self.headers.get("X-Request-Timeout"))
        step = self.server.script.pop(0) if self.server.script else None
        if step == DROP:
            self.close_connection = True
            return
        status, headers, data = 200, {}, b""
        if isinstance(step, tuple) and step[0] == "hold":
            if self.server.ending.wait(step[1]):
                return
        elif isinstance(step, tuple) and step[0] == "trickle":
            pass
        elif step is not None:
            status, headers = step
            data = json.dumps({"detail": "scripted", "code": "x"}).encode()
        if status == 200:
            data = _answer(path, body)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if isinstance(step, tuple) and step[0] == "trickle":
            self.wfile.flush()
            for i in range(len(data)):
                if self.server.ending.wait(step[1]):
                    return
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
            return
        self.wfile.write(data)


def _answer(path: str, body: bytes) -> bytes:
    if path == "/v1/attention/batch":  # one answer per item the request's metadata lists
        size = int.from_bytes(body[:8], "little")
        count = len(json.loads(json.loads(body[8:8 + size])["__metadata__"]["items"]))
        tensors = {f"{i}.{name}": a for i in range(count) for name, a in (("out", OUT), ("lse", LSE))}
        buffers = encode_safetensors(tensors, {"items": json.dumps([{"status": 200}] * count)})
    else:
        buffers = encode_safetensors({"out": OUT, "lse": LSE})
    return b"".join(bytes(b) for b in buffers)


def query(c: Client, call: str, **kw) -> np.ndarray:
    """``call``'s ``out`` for one query ``Q``."""
    if call == "attention":
        return c.attention(Q, Q, Q, **kw)[0]
    [(out, _)] = c.attention_batch([{"q": Q, "k": Q, "v": Q}], **kw)
    return out


def test_sync_client_retries_a_429_after_its_retry_after():
    with Stub([busy("0.6")]) as stub, Client(stub.url) as c:
        out, lse = c.attention(Q, Q, Q)
    assert np.array_equal(out, OUT) and np.array_equal(lse, LSE)
    [gap] = stub.gaps()
    assert gap >= 0.6  # Retry-After, longer than the first backoff (0.25 s)


@pytest.mark.parametrize("call", ["attention", "attention_batch"])
def test_sync_client_backs_off_after_each_503_doubling_the_wait(call):
    with Stub([UNAVAILABLE, UNAVAILABLE]) as stub, Client(stub.url) as c:  # the default: retries=2
        assert np.array_equal(query(c, call), OUT)
    first, second = stub.gaps()
    assert first >= BACKOFF_S and second >= 2 * BACKOFF_S
    assert {path for _, path in stub.posts} == {"/v1/" + call.replace("_", "/")}


def test_sync_client_resends_a_query_whose_connection_was_lost_before_its_answer():
    with Stub([DROP]) as stub, Client(stub.url) as c:  # a fresh connection: not a kept one gone stale
        assert np.array_equal(query(c, "attention"), OUT)
    [gap] = stub.gaps()
    assert len(stub.posts) == 2 and gap < 0.2  # at once the first time


def test_sync_client_with_retries_0_sends_a_query_once_even_when_its_kept_connection_is_lost():
    with Stub([None, DROP]) as stub, Client(stub.url, retries=0) as c:
        assert np.array_equal(query(c, "attention"), OUT)  # the connection is kept
        with pytest.raises(ConnectionError):  # RemoteDisconnected: lost after the query went out
            query(c, "attention")
    assert len(stub.posts) == 2  # not sent a third time

def test_sync_client_with_retries_0_raises_the_first_429_at_once():
    with Stub([busy("0.6")]) as stub, Client(stub.url, retries=0) as c:
        t0 = time.monotonic()
        with pytest.raises(SplitkeyError) as info:
            c.attention(Q, Q, Q)
        elapsed = time.monotonic() - t0
    assert elapsed < 0.5 and len(stub.posts) == 1
    assert info.value.status == 429 and info.value.retry_after == 0.6


def test_sync_client_raises_the_last_error_once_its_retries_are_spent_and_resends_no_other_error():
    with Stub([UNAVAILABLE] * 3) as stub, Client(stub.url, retries=1) as c:
        with pytest.raises(SplitkeyError) as info:
            c.attention(Q, Q, Q)
    assert info.value.status == 503 and len(stub.posts) == 2
    with Stub([(422, {}), (504, {})]) as stub, Client(stub.url, retries=3) as c:
        for status in (422, 504):  # a refusal, a deadline the server spent: a resend changes neither
            with pytest.raises(SplitkeyError) as info:
                c.attention(Q, Q, Q)
            assert info.value.status == status
    assert len(stub.posts) == 2


def test_sync_client_deadline_ending_during_a_retry_after_wait_raises_at_once_without_sleeping():
    with Stub([busy("5")]) as stub, Client(stub.url) as c:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=re.escape("deadline of 1 s")) as info:
            c.attention(Q, Q, Q, deadline=1.0)
        elapsed = time.monotonic() - t0
    assert elapsed < 0.5 and len(stub.posts) == 1
    assert isinstance(info.value.__cause__, SplitkeyError) and info.value.__cause__.status == 429


def test_sync_client_deadline_stops_a_backoff_that_would_end_past_it():
    with Stub([UNAVAILABLE] * 5) as stub, Client(stub.url, retries=5) as c:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline"):
            query(c, "attention_batch", deadline=0.6)  # waits 0.25 s, then 0.5 s would end at 0.75 s
        elapsed = time.monotonic() - t0
    assert len(stub.posts) == 2 and BACKOFF_S <= elapsed < 0.6


def test_sync_client_deadline_cuts_an_attempt_the_server_is_slow_to_answer():
    with Stub([hold(5.0)]) as stub, Client(stub.url) as c:  # timeout 600 s: the deadline bounds the socket
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline of 0.5 s") as info:
            c.attention(Q, Q, Q, deadline=0.5)
        elapsed = time.monotonic() - t0
        assert np.array_equal(query(c, "attention"), OUT)  # the cut connection is replaced
    assert 0.5 <= elapsed < 1.5
    assert isinstance(info.value.__cause__, TimeoutError) and len(stub.posts) == 2


def test_sync_client_deadline_bounds_an_answer_that_trickles_in_not_each_read_of_it():
    # Each byte comes well within any one read's wait; the whole body would take about 20 s.
    with Stub([trickle(0.05)]) as stub, Client(stub.url, retries=0) as c:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline of 0.8 s"):
            c.attention(Q, Q, Q, deadline=0.8)
        elapsed = time.monotonic() - t0
        assert np.array_equal(query(c, "attention"), OUT)  # the cut connection is replaced
    assert 0.8 <= elapsed < 1.6


def test_sync_client_tells_the_server_the_time_left_of_its_deadline_and_nothing_without_one():
    with Stub([UNAVAILABLE]) as stub, Client(stub.url) as c:
        assert np.array_equal(query(c, "attention", deadline=5.0), OUT)  # a 503, then the answer
        assert np.array_equal(query(c, "batch"), OUT)
    first, second, none = stub.timeouts
    assert 4.5 < float(first) <= 5.0 and float(second) < float(first) - 0.2  # the backoff's 0.25 s spent
    assert none is None


def test_sync_client_keeps_its_positional_parameters_and_refuses_bad_retries_and_deadlines_naming_them():
    c = Client("http://127.0.0.1:9/base", "key", 5.0)  # nothing below is sent
    assert (c.api_key, c.timeout, c.retries) == ("key", 5.0, 2)
    assert Client("http://127.0.0.1:9", retries=0).retries == 0
    for retries in (-1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match=re.escape(f"retries must be an int >= 0, got {retries!r}")):
            Client("http://127.0.0.1:9", retries=retries)
    for timeout in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match=re.escape(f"timeout must be > 0 seconds, got {timeout!r}")):
            Client("http://127.0.0.1:9", timeout=timeout)
    for deadline in (0, -1.0, math.nan, "1", True):
        for call in ("attention", "attention_batch"):
            with pytest.raises(ValueError, match=re.escape(f"deadline must be > 0 seconds, got {deadline!r}")):
                query(c, call, deadline=deadline)


def test_sync_and_async_clients_send_a_query_again_alike():
    script = [busy("0.6"), UNAVAILABLE, DROP]  # Retry-After, a backoff (the second attempt's: 0.5 s), at once

    async def aio(url: str) -> np.ndarray:
        async with AsyncClient(url, retries=3) as c:
            return (await c.attention(Q, Q, Q))[0]

    with Stub(script) as sync_stub, Client(sync_stub.url, retries=3) as c:
        assert np.array_equal(query(c, "attention"), OUT)
    with Stub(script) as aio_stub:
        assert np.array_equal(asyncio.run(aio(aio_stub.url)), OUT)
    for stub in (sync_stub, aio_stub):
        retry_after, backoff, lost = stub.gaps()
        assert retry_after >= 0.6 and backoff >= 2 * BACKOFF_S and lost < 0.2, stub.gaps()

    async def aio_deadline(url: str) -> None:
        async with AsyncClient(url) as c:
            await c.attention(Q, Q, Q, deadline=1.0)

    def sync_deadline(url: str) -> None:
        with Client(url) as c:
            c.attention(Q, Q, Q, deadline=1.0)

    errors = []
    for send in (sync_deadline, lambda url: asyncio.run(aio_deadline(url))):
        with Stub([busy("5")]) as stub, pytest.raises(TimeoutError) as info:
            t0 = time.monotonic()
            send(stub.url)
        assert stub.posts[0][0] - t0 < 0.5 and time.monotonic() - stub.posts[0][0] < 0.5  # no wait begun
        errors.append((str(info.value), type(info.value.__cause__), len(stub.posts)))
    assert errors[0] == errors[1] == ("the call did not finish within its deadline of 1 s", SplitkeyError, 1)


@pytest.mark.ray
def test_sync_client_resends_a_query_whose_answer_the_live_server_sent_but_was_lost(server, rng):
    from faults import LostAnswers
    from reference import assert_close_to_reference

    lost: list[str] = []

    def lose_first_query(method: str, path: str, status: int) -> bool:
        if method == "POST" and path.startswith("/v1/attention"):
            lost.append(path)
            return len(lost) == 1
        return False

    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((300, 2, 16)).astype(np.float32) for _ in range(2))
    with LostAnswers(server.port, lose_first_query) as proxy, Client(proxy.url) as c:
        out, lse = c.attention(q, k, v, causal=True, deadline=60.0)
    assert len(lost) == 2  # the server answered twice; the client saw the second answer
    assert_close_to_reference(out, lse, q, k, v, causal=True)
