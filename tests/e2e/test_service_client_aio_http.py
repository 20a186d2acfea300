"""service.client.aio_http: the asyncio HTTP/1.1 transport, against a real http.server on loopback."""

import asyncio
import http.server
import json
import threading
import time

import pytest

from service.client.aio_http import HttpPool, TransportError


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    connections = 0  #: handlers made: one per connection
    seen: list = []  #: paths of the requests read, in order

    def setup(self):
        super().setup()
        type(self).connections += 1

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).seen.append(self.path)
        if self.path == "/swallow":  # read, then closed without an answer
            self.close_connection = True
            return
        if self.path == "/slow":
            time.sleep(0.3)
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"ab", b"cde"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        data = json.dumps({"len": len(body), "path": self.path, "x": self.headers.get("X-Test")}).encode()
        self.send_response(404 if self.path == "/missing" else 200)
        self.send_header("Content-Length", str(len(data)))
        if self.path == "/close":
            self.send_header("Connection", "close")
            self.close_connection = True
        if self.path == "/drop":  # kept alive as far as the client knows, then dropped (an idle timeout)
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST


def serve(port=0):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_requests_reuse_connections_and_read_every_kind_of_answer():
    srv = serve()
    port = srv.server_address[1]

    async def main():
        pool = HttpPool("127.0.0.1", port, max_connections=2)
        first = await pool.request("POST", "/a?b=1", {"X-Test": "yes"}, [b"hello", memoryview(b" world")])
        missing = await pool.request("GET", "/missing", {})
        chunked = await pool.request("POST", "/chunked", {}, [b"x"])
        idle_before_close = len(pool._idle)
        closed = await pool.request("POST", "/close", {})
        idle_after_close = len(pool._idle)
        many = await asyncio.gather(*(pool.request("POST", f"/{i}", {}, [b"z" * i]) for i in range(10)))
        await pool.aclose()
        return first, missing, chunked, idle_before_close, closed, idle_after_close, many, len(pool._idle)

    first, missing, chunked, before, closed, after, many, idle = asyncio.run(main())
    srv.shutdown()
    assert first.status == 200 and json.loads(first.body) == {"len": 11, "path": "/a?b=1", "x": "yes"}
    assert missing.status == 404 and json.loads(missing.body)["path"] == "/missing"
    assert chunked.body == b"abcde"
    assert before == 1 and closed.status == 200 and after == 0  # "Connection: close" is not kept
    assert [json.loads(r.body)["len"] for r in many] == list(range(10)) and idle == 0


def test_an_idle_connection_the_server_dropped_is_replaced_once_and_a_dead_server_is_a_transport_error():
    srv = serve()
    port = srv.server_address[1]

    async def main():
        pool = HttpPool("127.0.0.1", port)
        dropped = await pool.request("POST", "/drop", {})
        kept = len(pool._idle)  # the answer did not say "close": the pool kept the connection
        before = Handler.connections
        answer = await pool.request("POST", "/two", {}, [b"q"])  # finds it closed, sends on a new one
        made = Handler.connections - before
        await pool.aclose()
        srv.shutdown()
        srv.server_close()
        with pytest.raises(TransportError):
            await HttpPool("127.0.0.1", port).request("GET", "/", {})
        return dropped, kept, answer, made

    dropped, kept, answer, made = asyncio.run(main())
    assert dropped.status == 200 and kept == 1
    assert answer.status == 200 and json.loads(answer.body) == {"len": 1, "path": "/two", "x": None} and made == 1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_connections"):
        HttpPool("127.0.0.1", 1, max_connections=0)


def test_idle_connections_the_server_closed_are_dropped_before_reuse_and_nothing_is_resent():
    srv = serve()
    port = srv.server_address[1]

    async def main():
        pool = HttpPool("127.0.0.1", port)
        await asyncio.gather(*(pool.request("POST", "/drop", {}) for _ in range(3)))  # three kept, all closed by the server
        await asyncio.sleep(0.2)  # the server's FINs arrive while the pool is idle
        before, seen = Handler.connections, len(Handler.seen)
        answer = await pool.request("POST", "/two", {}, [b"q"], resend=False)
        made, sent = Handler.connections - before, Handler.seen[seen:]
        idle = len(pool._idle)
        await pool.aclose()
        return answer, made, sent, idle

    answer, made, sent, idle = asyncio.run(main())
    srv.shutdown()
    assert answer.status == 200 and made == 1 and sent == ["/two"] and idle == 1


@pytest.mark.parametrize("resend, sent", [(False, 1), (True, 2)])
def test_a_request_lost_after_it_went_out_is_sent_again_only_when_allowed(resend, sent):
    srv = serve()
    port = srv.server_address[1]

    async def main():
        pool = HttpPool("127.0.0.1", port)
        await pool.request("POST", "/a", {})  # a kept connection, still open
        seen = len(Handler.seen)
        with pytest.raises(TransportError):
            await pool.request("POST", "/swallow", {}, [b"append"], resend=resend)
        await pool.aclose()
        return Handler.seen[seen:]

    got = asyncio.run(main())
    srv.shutdown()
    assert got == ["/swallow"] * sent


def test_a_connection_that_comes_back_after_aclose_is_closed_not_kept():
    srv = serve()
    port = srv.server_address[1]

    async def main():
        pool = HttpPool("127.0.0.1", port)
        flight = asyncio.gather(*(pool.request("POST", "/slow", {}) for _ in range(3)))
        await asyncio.sleep(0.1)
        await pool.aclose()
        answers = await flight
        return answers, pool._idle

    answers, idle = asyncio.run(main())
    srv.shutdown()
    assert [a.status for a in answers] == [200] * 3 and idle == []
