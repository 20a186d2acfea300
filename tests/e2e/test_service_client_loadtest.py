"""`splitkey loadtest` against a real server: every mode and arrival process, checked answers, outputs,
a server that answers wrongly, thresholds, and contexts deleted also when interrupted."""

import importlib.metadata
import io
import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from faults import WrongAnswers
from server import ROOT

from service.cli import build_parser
from service.client import Client
from service.client.loadtest import Shape, SweepConfig, run_sweep

SMALL = ["--h-q", "4", "--h-kv", "2", "--d", "16"]
PNG = b"\x89PNG\r\n\x1a\n"


def loadtest(url: str, *extra: str) -> int:
    args = build_parser().parse_args(["loadtest", "--url", url, *SMALL, *extra])
    return args.func(args)


def context_ids(url: str) -> set[str]:
    with Client(url) as c:
        return {ctx["id"] for ctx in c.list_contexts()}


@pytest.mark.ray
def test_every_mode_closed_and_open_loop_answers_exactly_and_writes_sane_outputs(server, tmp_path, capsys):
    before = context_ids(server.url)
    out = tmp_path / "lt"
    rc = loadtest(server.url, "--mode", "decode,inline,prefill,shared-prefix,multi-turn", "--n-k", "1K,2K",
                  "--concurrency", "1,3", "--rate", "25", "--requests", "12", "--duration", "20", "--verify-every", "3",
                  "--prefill-n-q", "16", "--suffix-keys", "300", "--groups", "2", "--conversations", "2",
                  "--slo-ms", "10000", "--out", str(out), "--per-request")
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    doc = json.loads((out / "results.json").read_text())
    points = doc["points"]
    assert len(points) == 5 * 2 * 3 and "api_key" not in doc["config"]
    env = doc["environment"]
    assert env["shape"] == "h_q=4 h_kv=2 d=16 d_v=16" and env["dtype"] == "float32" and env["host"]
    assert env["server_version"] == importlib.metadata.version("splitkey") and env["date"].startswith("20")
    assert {u["label"] for u in doc["uploads"]} >= {"context of 1024 keys", "context of 2048 keys"}
    assert all(u["gb_per_s"] > 0 for u in doc["uploads"])
    for p in points:
        assert p["completed"] == 12 and p["failed"] == 0 and p["wrong"] == 0, p
        assert p["verified"] == 4 and 0 < p["max_error"] < 1e-5  # requests 0, 3, 6, 9 of each point, and exact
        assert 0 < p["latency_p50_ms"] <= p["latency_p90_ms"] <= p["latency_p99_ms"] <= p["latency_max_ms"]
        assert p["requests_per_s"] > 0 and p["kv_gb_per_s"] > 0 and p["slo_attainment"] == 1.0
        assert p["keys_per_s"] > 0 and len(p["warnings"]) == 1  # 12 requests: rough percentiles, said so
        assert {"parse", "compute", "total"} <= set(p["stages_ms"]), p  # the attention's Server-Timing
        if p["arrival"] == "rate":
            assert p["load"] == 25.0
    keys = {(p["mode"], p["n_k"]): p["pairs_per_s"] / p["requests_per_s"] for p in points if p["load"] == 1}
    assert keys[("decode", 1024)] == pytest.approx(1024) and keys[("shared-prefix", 2048)] == pytest.approx(2348)
    assert keys[("prefill", 1024)] > 16 * 1024  # n_q = 16 over the context, its turns and the new keys
    assert len(doc["requests"]) == len(points) and len(doc["requests"]["decode n_k=1024 c=3"]) == 12
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) == 1 + len(points) and rows[0].startswith("mode,n_k,arrival,load,completed")
    assert (out / "requests.csv").read_text().count("\n") == 1 + 12 * len(points)
    for name in ("latency_vs_context.png", "latency_vs_load.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG)
        import matplotlib.image

        assert matplotlib.image.imread(out / name).shape[0] > 200  # a real image, not an empty file
    assert "decode n_k=1024 c=1" in printed.err  # the live progress line
    assert re.search(r"^ +decode +1024 +c=1 +12 +0 ", printed.out, re.MULTILINE)
    assert context_ids(server.url) == before, "the load test must delete every context it made"


@pytest.mark.ray
@pytest.mark.parametrize("change", [
    pytest.param(lambda out, lse: (out * np.float32(1.001), lse), id="outputs-off-by-a-tenth-of-a-percent"),
    pytest.param(lambda out, lse: (out, lse + np.float32(np.log(2))), id="a-merge-that-missed-half-the-keys"),
])
def test_a_server_that_answers_wrongly_fails_the_load_test(server, tmp_path, capsys, change):
    before = context_ids(server.url)
    with WrongAnswers(server.port, change) as proxy:
        rc = loadtest(proxy.url, "--n-k", "1K", "--concurrency", "2", "--requests", "10", "--verify-every", "5",
                      "--out", str(tmp_path / "o"), "--no-plots")
    text = capsys.readouterr().out
    assert rc == 1
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    assert doc["points"][0]["wrong"] == 2 and doc["points"][0]["completed"] == 10
    assert "2 of 2 checked answers differ from the float64 reference by more than 0.0001" in text
    assert not (tmp_path / "o" / "throughput.png").exists()
    assert context_ids(server.url) == before


@pytest.mark.ray
def test_a_crossed_fail_on_threshold_fails_the_run_and_names_it(server, capsys):
    rc = loadtest(server.url, "--n-k", "512", "--concurrency", "1", "--requests", "4", "--fail-on", "latency_p50_ms<1e9",
                  "--fail-on", "wrong>0")
    text = capsys.readouterr().out
    assert rc == 1
    assert "decode n_k=512 c=1: latency_p50_ms<1e+09 (got " in text and "wrong>0" not in text.split("crossed:")[1]


@pytest.mark.ray
def test_the_library_runs_a_sweep_and_returns_its_points(server):
    cfg = SweepConfig(url=server.url, modes=("decode",), n_k=(300,), concurrency=(2,), requests=6,
                      shape=Shape(h_q=2, h_kv=1, d=8, d_v=8, dtype="float16"), verify_every=2, warmup=0)
    res = run_sweep(cfg, stream=io.StringIO())
    assert res.passed() and [p.label for p in res.points] == ["decode n_k=300 c=2"]
    assert res.points[0].verified == 3 and res.points[0].max_error < 1e-3


@pytest.mark.ray
def test_an_inline_body_over_the_server_limit_is_refused_before_any_request(server, capsys):
    # The session server takes bodies up to 64 MiB; 1M keys of this shape is 128 MiB of K+V.
    assert loadtest(server.url, "--mode", "inline", "--n-k", "1M", "--requests", "1") == 1
    assert "over the server's 67108864-byte limit: use --mode decode" in capsys.readouterr().err
    # Also when another mode comes first: refused before its upload and points, not after them.
    before = context_ids(server.url)
    assert loadtest(server.url, *SMALL, "--mode", "decode,inline", "--n-k", "2K,1M", "--requests", "1") == 1
    err = capsys.readouterr().err
    assert "over the server's 67108864-byte limit" in err and "upload" not in err
    assert context_ids(server.url) == before


@pytest.mark.ray
def test_ctrl_c_deletes_the_contexts_and_exits_130(server):
    before = context_ids(server.url)
    cmd = [sys.executable, "-m", "service.cli", "loadtest", "--url", server.url, *SMALL, "--mode", "decode,multi-turn",
           "--n-k", "2K", "--concurrency", "2", "--requests", "100000", "--duration", "60"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(context_ids(server.url) - before) < 1:
        time.sleep(0.2)
    time.sleep(1.5)  # requests are running
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "interrupted" in out
    assert context_ids(server.url) == before


