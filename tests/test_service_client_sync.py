"""The synchronous client's transport (service.client.sync): how a request leaves the socket.

Its calls against a live server are tested with the service (test_service_attention and the rest).
"""

import socket

import numpy as np
import pytest

from service.client.sync import ONE_WRITE_BYTES, _Connection
from service.wire.safetensors import encode_safetensors


class Recording:
    """A connected socket that notes the size of every write."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.writes: list[int] = []

    def sendall(self, data) -> None:
        self.writes.append(memoryview(data).nbytes)
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()


def received(server: socket.socket, n: int) -> bytes:
    conn, _ = server.accept()
    with conn:
        got = b""
        while len(got) < n:
            got += conn.recv(n - len(got))
        return got


@pytest.mark.parametrize("n_k, joined", [(8, True), (ONE_WRITE_BYTES // 64, False)])
def test_a_small_request_leaves_in_one_write_and_a_large_one_as_its_buffers(n_k, joined):
    body = encode_safetensors({"q": np.arange(n_k * 16, dtype=np.float32).reshape(n_k, 1, 16)})
    size = sum(memoryview(b).nbytes for b in body)
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
    with socket.create_server(("127.0.0.1", 0)) as server:
        conn = _Connection("127.0.0.1", server.getsockname()[1], timeout=10)
        conn.connect()
        conn.sock = recording = Recording(conn.sock)
        try:
            conn.request_at_once("POST", "/v1/attention?contexts=a", body, headers, size)
            total = sum(recording.writes)
            data = received(server, total)
        finally:
            conn.close()
    # Large: the headers, then each buffer of the body (safetensors: its length, its header, the tensor).
    assert len(recording.writes) == (1 if joined else 1 + len(body))
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/attention?contexts=a HTTP/1.1\r\n")
    assert b"Content-Length: %d" % size in head
    assert rest == b"".join(bytes(b) for b in body)
