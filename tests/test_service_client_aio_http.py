"""service.client.aio_http: the asyncio HTTP/1.1 transport, against a real http.server on loopback."""

import asyncio
import http.server
import json
import threading

import pytest

from service.client.aio_http import HttpPool, TransportError


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    connections = 0  #: handlers made: one per connection

    def setup(self):
        super().setup()
        type(self).connections += 1

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
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
