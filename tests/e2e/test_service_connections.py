"""Connection limits (service.core.connections): idle connections make room for new ones, a new one
that finds none idle gets 503 too_many_connections, and the server answers real requests after."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from server import Server, read_response

pytestmark = pytest.mark.ray

TOTAL, PER_CLIENT = 60, 40
#: A request line and one header, never ended: the connection is in a request, not idle.
HEAD_BEGUN = b"POST /v1/attention HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("connections"),
                 args=("--workers", "1", "--max-connections", str(TOTAL),
                       "--max-client-connections", str(PER_CLIENT))).start()
    yield srv
    srv.stop()


def connect(srv: Server, source: str = "127.0.0.1") -> socket.socket:
    """A connection from ``source`` (another loopback address is another client to the server)."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5, source_address=(source, 0))
    return sock


def closed_by_server(sock: socket.socket, within_s: float = 0.5) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def refused(sock: socket.socket) -> dict:
    """The answer of a connection refused for want of room (read, then the end)."""
    answer = read_response(sock)
    head, _, body = answer.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 503 "), answer
    assert "retry-after: 1" in head.lower() and "connection: close" in head.lower(), head
    return json.loads(body)


@contextlib.contextmanager
def busy(srv: Server, n: int, source: str) -> Iterator[list[socket.socket]]:
    """``n`` connections from ``source``, each in a request (its head begun)."""
    socks = [connect(srv, source) for _ in range(n)]
    try:
        for s in socks:
            s.sendall(HEAD_BEGUN)
        yield socks
    finally:
        for s in socks:
            s.close()


def answers_a_real_request(srv: Server) -> bool:
    body = {"q": [[[1.0, 0.0]]], "k": [[[1.0, 0.0]]], "v": [[[1.0, 0.0]]]}
    return httpx.post(srv.url + "/v1/attention", json=body, timeout=30).status_code == 200


def test_hundreds_of_idle_connections_make_room_for_new_ones_oldest_first(server):
    socks = [connect(server) for _ in range(300)]
    try:
        assert answers_a_real_request(server)  # its connection took the place of an idle one
        still_open = [s for s in socks if not closed_by_server(s, within_s=0.05)]
        assert len(still_open) < PER_CLIENT  # the oldest were closed (cleanly), the newest kept
        assert all(s in socks[-PER_CLIENT:] for s in still_open)
    finally:
        for s in socks:
            s.close()


def test_a_client_past_its_own_limit_with_none_idle_gets_503_too_many_connections(server):
    with busy(server, PER_CLIENT, "127.0.0.1"):
        with connect(server) as one_more:
            doc = refused(one_more)
        assert doc["code"] == "too_many_connections" and "per client address" in doc["detail"], doc
        with busy(server, 5, "127.0.0.2") as other_client:  # another address still has room
            assert not any(closed_by_server(s, within_s=0.05) for s in other_client)
    assert answers_a_real_request(server)


def test_past_the_total_with_none_idle_every_client_gets_503_and_the_server_answers_once_they_close(server):
    with busy(server, PER_CLIENT, "127.0.0.1"), busy(server, TOTAL - PER_CLIENT, "127.0.0.2"):
        for _ in range(20):  # a few refusals in a row: each answered, none reset
            with connect(server, "127.0.0.3") as one_more:
                assert refused(one_more)["code"] == "too_many_connections"
    assert answers_a_real_request(server)
