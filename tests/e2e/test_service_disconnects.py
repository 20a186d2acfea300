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
