"""What an operator reads and scrapes from a real ``splitkey serve`` (issue 51): the log as JSON lines
with no line of Ray's or uvicorn's own format, "ready" only once it answers, an access line per request,
"stopped" at exit, /metrics without the key on --metrics-port, and no Ray session folder left after it."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import tempfile

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server import Server

KEY = "ops-key"


@pytest.mark.ray
def test_a_json_log_names_each_request_ready_and_stopped_metrics_need_no_key_and_no_ray_session_is_left(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    ray_tmp = pathlib.Path(tempfile.mkdtemp(prefix="skr-", dir="/tmp"))  # short: Ray's socket paths live here
    srv = Server(tmp_path, args=("--workers", "1", "--api-key-file", str(key_file), "--log-format", "json",
                                 "--metrics-port", "0"), env={"RAY_TMPDIR": str(ray_tmp)}).start(api_key=KEY)
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        one = {"q": [[[1.0, 2.0]]], "k": [[[1.0, 0.0]], [[0.0, 1.0]]], "v": [[[1.0]], [[2.0]]]}
        r = httpx.post(srv.url + "/v1/attention", json=one, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        [port] = re.findall(r"splitkey metrics on http://127\.0\.0\.1:(\d+)/metrics", srv.log())
        assert httpx.get(srv.url + "/metrics").status_code == 401  # the API port keeps its key
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert scraped.status_code == 200
        families = {f.name: f for f in text_string_to_metric_families(scraped.text)}
        assert families["splitkey_workers"].samples[0].value == 1.0 and "splitkey_build_info" in families
        assert [p.name for p in (ray_tmp / "ray").glob("session_2*")], "Ray must keep its session under RAY_TMPDIR"
    finally:
        srv.stop()
    try:
        assert [p.name for p in (ray_tmp / "ray").glob("session_*")] == []  # nor session_latest
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [json.loads(line) for line in srv.log().splitlines() if line.strip()]  # every line is one object
    messages = [line["message"] for line in lines]
    starting = next(i for i, m in enumerate(messages) if m.startswith("splitkey starting on http://127.0.0.1:"))
    up = next(i for i, m in enumerate(messages) if m.startswith("splitkey workers up: 1 cpu workers"))
    ready = next(i for i, m in enumerate(messages) if m == f"splitkey ready on {srv.url}: 1 cpu workers")
    assert starting < up < ready and messages[-1] == "splitkey stopped"
    assert not any("Ray" in m and "instance" in m for m in messages)  # Ray's start-up lines are not asked for
    [access] = [line for line in lines if line["logger"] == "splitkey.access" and line["route"] == "/v1/attention"]
    assert access["method"] == "POST" and access["status"] == 200 and access["request_id"] == r.headers["x-request-id"]
    assert access["bytes_in"] == int(r.request.headers["content-length"]) and access["bytes_out"] == len(r.content)
    assert access["duration_ms"] >= access["stages_ms"]["total"] > 0 and "compute" in access["stages_ms"]
    ready_probes = [line for line in lines if line.get("route") == "/readyz"]
    assert ready_probes and all(line["status"] in (200, 503) for line in ready_probes)
