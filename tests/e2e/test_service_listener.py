"""Closing without resets (service.core.listener, service.http_protocol.LingeringTransport), on real
loopback sockets."""

import asyncio
import socket
import sys

import pytest

from service.core import listener
from service.http_protocol import LingeringTransport

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="socket filters are Linux's")


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


@linux
def test_a_quieted_listener_completes_no_new_handshake_but_keeps_the_connections_it_had():
    with _listening() as lsock:
        port = lsock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as before:
            assert listener.refuse_new_connections(lsock)
            before.sendall(b"sent before")
            with pytest.raises(TimeoutError):
                socket.create_connection(("127.0.0.1", port), timeout=0.3)
            accepted, _ = lsock.accept()
            with accepted:
                assert accepted.recv(64) == b"sent before"


@linux
def test_quiet_returns_once_the_backlog_is_accepted_and_settled():
    async def main() -> float:
        lsock = _listening()
        lsock.setblocking(False)
        accepted: list[socket.socket] = []
        loop = asyncio.get_running_loop()
        loop.add_reader(lsock.fileno(), lambda: accepted.append(lsock.accept()[0]))
        waiting = [socket.create_connection(lsock.getsockname()) for _ in range(5)]
        start = loop.time()
        await listener.quiet(lsock, settle_s=0.1, limit_s=2.0)
        took = loop.time() - start
        loop.remove_reader(lsock.fileno())
        assert len(accepted) == 5
        for s in (*waiting, *accepted, lsock):
            s.close()
        return took

    assert 0.1 <= asyncio.run(main()) < 1.0


class _Answers(asyncio.Protocol):
    """Answers the first bytes it reads, then closes, with more of the request unread."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = LingeringTransport(transport, asyncio.get_running_loop())

    def data_received(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(b"the answer")
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport.closed()


def test_a_lingering_close_delivers_the_answer_and_a_clean_end_to_a_client_still_sending():
    async def main() -> bytes:
        server = await asyncio.get_running_loop().create_server(_Answers, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        def client() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"head")
                sock.recv(1)  # the server answered and closed
                sock.sendall(b"x" * 200_000)  # more of the body: a plain close resets the connection now
                received = b"t"
                while chunk := sock.recv(65536):
                    received += chunk
                return received

        try:
            return await asyncio.to_thread(client)
        finally:
            server.close()

    assert asyncio.run(main()) == b"the answer"
