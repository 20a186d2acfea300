"""Errors say what the client needs and nothing else (docs/SECURITY.md): every error path of a
live server answers JSON ``{detail, code, request_id}`` with the id also in ``X-Request-Id``,
and no detail carries a traceback, a path, an address, a PID, a Ray id or an escape code.
The machine details of a worker's death stay in the server log, under the request id."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import numpy as np
import psutil
import pytest
from server import Server, read_response

from service.client import Client, SplitkeyError
from service.core.errors import internals
from service.wire.safetensors import encode_safetensors, to_bytes

pytestmark = pytest.mark.ray

KEY = "leak-test-key"
MIB = 2**20


def checked(r: httpx.Response, status: int, code: str) -> dict:
    """The error body of ``r``, after checking its status, code, request id and that nothing leaks."""
    assert r.status_code == status and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    doc = r.json()
    assert doc["code"] == code and isinstance(doc["detail"], str) and doc["detail"], doc
    assert doc["request_id"] == r.headers["x-request-id"], (doc, r.headers)
    assert internals(r.text) is None, f"{internals(r.text)} in {r.text}"
    return doc


def shard_workers(srv: Server) -> list[psutil.Process]:
    assert srv.proc is not None
    return [p for p in psutil.Process(srv.proc.pid).children(recursive=True) if p.name() == "ray::ShardWorker"]


def test_every_error_path_answers_in_the_services_words_with_a_request_id(tmp_path, rng):
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    srv = Server(tmp_path, args=("--workers", "2", "--api-key-file", str(key_file), "--max-body-bytes", str(4 * MIB),
                                 "--worker-memory-bytes", str(MIB), "--body-grace", "0.5", "--min-body-rate", "1000"),
                 env={"SPLITKEY_HEAL_INTERVAL_S": "600"}).start(api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    url = srv.url
    try:
        k = rng.standard_normal((256, 2, 16), dtype=np.float32)
        q = rng.standard_normal((1, 4, 16), dtype=np.float32)
        with Client(url, api_key=KEY) as c:
            ctx = c.create_context(k, k, replicas=1)
            with pytest.raises(SplitkeyError) as err:  # the client hands the id on
                c.get_context("ctx_nope")
            assert err.value.request_id and f"(request id {err.value.request_id})" in str(err.value)

        checked(httpx.get(url + "/v1/cluster"), 401, "unauthorized")
        checked(httpx.post(url + "/v1/attention", headers={**auth, "Content-Type": "application/json"},
                           content=b"{not json"), 400, "invalid_body")
        checked(httpx.get(url + "/v1/contexts/ctx_nope", headers=auth), 404, "context_not_found")
        doc = checked(httpx.get(url + "/v1/attentio", headers=auth), 404, "route_not_found")
        assert doc["detail"] == "path must be one of the service's routes (docs/API.md section 6.1), got \"/v1/attentio\""
        wrong = httpx.put(url + "/v1/attention", headers=auth)
        doc = checked(wrong, 405, "method_not_allowed")
        assert wrong.headers["allow"] == "POST" and doc["detail"] == (
            'method must be one of POST for "/v1/attention", got "PUT"')
        checked(httpx.get(url + "/v2/nope"), 401, "unauthorized")  # an unknown path still asks for the key first
        checked(httpx.post(url + f"/v1/contexts/{ctx['id']}/append", params={"after": 7},
                           headers={**auth, "Content-Type": "application/octet-stream"},
                           content=to_bytes(encode_safetensors({"k": k[:4], "v": k[:4]}))), 409, "length_mismatch")
        checked(httpx.post(url + "/v1/attention", headers={**auth, "Content-Type": "application/octet-stream"},
                           content=b"\0" * (5 * MIB)), 413, "body_too_large")
        checked(httpx.post(url + "/v1/attention", headers={**auth, "Content-Type": "text/plain"}, content=b"hi"),
                415, "unsupported_media_type")
        checked(httpx.post(url + "/v1/attention", headers=auth, json={"q": [[[1.0]]], "k": [[1.0]], "v": [[1.0]]}),
                422, "invalid_tensor")
        checked(httpx.post(url + "/v1/attention", headers=auth,
                           json={"q": [[[1.0]]], "k": [[[1.0]]], "v": [[[1.0]]], "scale": "big"}),
                422, "invalid_option")
        big = rng.standard_normal((4096, 2, 64), dtype=np.float32)  # 4 MiB over two workers of 1 MiB
        checked(httpx.post(url + "/v1/contexts", headers={**auth, "Content-Type": "application/octet-stream"},
                           content=to_bytes(encode_safetensors({"k": big[:2048], "v": big[:2048]})), timeout=60),
                507, "insufficient_capacity")

        with socket.create_connection(("127.0.0.1", srv.port)) as s:  # a stalled body: 408
            s.settimeout(30)
            s.sendall(b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n")
            head, _, body = read_response(s).partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 408") and internals(head + body) is None, head + body
        rid = next(line.split(":", 1)[1].strip() for line in head.split("\r\n") if line.lower().startswith("x-request-id"))
        assert json.loads(body)["request_id"] == rid and json.loads(body)["code"] == "request_timeout"

        for proc in shard_workers(srv):  # the context's only replica dies with its worker: 503
            os.kill(proc.pid, signal.SIGKILL)
        time.sleep(1.0)
        r = httpx.post(url + "/v1/attention", headers=auth, timeout=60, json={"q": q.tolist(), "contexts": [ctx["id"]]})
        assert r.status_code == 503, r.text
        assert checked(r, 503, r.json()["code"])["code"] in ("context_lost", "workers_unavailable")
        assert httpx.get(url + "/healthz").status_code == 200
    finally:
        srv.stop()
