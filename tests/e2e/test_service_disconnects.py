"""A client that goes away mid-request is counted apart (499) and logged at INFO, never as a 500."""

import re
import socket
import time

import httpx
import pytest

pytestmark = pytest.mark.ray


def requests_counted(url: str, route: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {code: float(n) for code, n in re.findall(
        rf'splitkey_requests_total{{code="(\d+)",route="{re.escape(route)}"}} ([0-9.e+]+)', text)}


def test_a_client_that_closes_mid_upload_is_a_499_at_info_and_the_service_carries_on(server):
    before = requests_counted(server.url, "/v1/attention")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                      b"Content-Length: 1000000\r\n\r\n" + b"\0" * 1000)
            time.sleep(0.2)
    deadline = time.monotonic() + 10
    while requests_counted(server.url, "/v1/attention").get("499", 0) - before.get("499", 0) < 3:
        assert time.monotonic() < deadline, requests_counted(server.url, "/v1/attention")
        time.sleep(0.2)
    after = requests_counted(server.url, "/v1/attention")
    assert after.get("500", 0) == before.get("500", 0)
    log = server.log()
    assert "client closed the connection during POST /v1/attention" in log
    assert "Traceback" not in log.split("client closed the connection")[-1]
    assert httpx.get(server.url + "/healthz").status_code == 200


def test_a_client_that_closes_after_its_whole_body_is_a_499_not_a_200(server):
    """Issue 50, finding 4: a client gone after sending its whole body was counted 200 and its answer encoded
    for nobody; the route now looks at the connection before the compute and before the encode."""
    import numpy as np

    from service.wire.safetensors import encode_safetensors, to_bytes

    rng = np.random.default_rng(4)
    body = to_bytes(encode_safetensors({"q": rng.standard_normal((4, 8, 64), dtype=np.float32),
                                        "k": rng.standard_normal((60_000, 2, 64), dtype=np.float32),
                                        "v": rng.standard_normal((60_000, 2, 64), dtype=np.float32)}))
    before = requests_counted(server.url, "/v1/attention")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            s.sendall(body)
    deadline = time.monotonic() + 30
    while requests_counted(server.url, "/v1/attention").get("499", 0) - before.get("499", 0) < 3:
        assert time.monotonic() < deadline, (before, requests_counted(server.url, "/v1/attention"))
        time.sleep(0.2)
    after = requests_counted(server.url, "/v1/attention")
    assert after.get("200", 0) == before.get("200", 0) and after.get("500", 0) == before.get("500", 0)
    assert httpx.get(server.url + "/healthz").status_code == 200
