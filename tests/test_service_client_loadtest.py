"""`splitkey loadtest` against a real server: bounded, exact, and reporting what it measured."""

import io
import json
import re

import numpy as np
import pytest

from service.cli import build_parser
from service.client import SplitkeyError
from service.client.loadtest import UploadProgress, random_kv, upload_failed
from workers import BFLOAT16


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["context", "inline"])
def test_loadtest_runs_bounded_levels_and_checks_exactness(server, tmp_path, capsys, mode):
    out = tmp_path / "lt.json"
    args = build_parser().parse_args([
        "loadtest", "--url", server.url, "--mode", mode, "--n-k", "2048", "--h-q", "4", "--h-kv", "2", "--d", "16",
        "--concurrency", "1,3", "--requests", "12", "--duration", "20", "--check", "--json", str(out)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    err = float(text.split("max |out - float64 reference| = ")[1].split()[0])
    assert err < 1e-5
    doc = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in doc["levels"]] == [1, 3]
    assert all(lv["requests"] == 12 and lv["errors"] == 0 and lv["p50_ms"] > 0 for lv in doc["levels"])
    if mode == "context":
        from service.client import Client

        with Client(server.url) as c:
            assert all(ctx["length"] != 2048 for ctx in c.list_contexts()), "the loadtest must delete its context"


def test_loadtest_refuses_bad_concurrency(capsys):
    args = build_parser().parse_args(["loadtest", "--url", "http://127.0.0.1:1", "--concurrency", "0"])
    assert args.func(args) == 2
    assert "--concurrency must list ints >= 1" in capsys.readouterr().err


@pytest.mark.ray
def test_loadtest_check_fails_the_run_past_its_tolerance(server, capsys):
    # float32 answers differ from the float64 reference by rounding (~1e-7): far above 1e-12.
    args = build_parser().parse_args([
        "loadtest", "--url", server.url, "--mode", "inline", "--n-k", "512", "--h-q", "2", "--h-kv", "1", "--d", "8",
        "--concurrency", "1", "--requests", "2", "--check", "--tolerance", "1e-12"])
    assert args.func(args) == 1
    assert "must be within 1e-12 of the float64 reference" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_upload_progress_rewrites_one_line_on_a_terminal():
    out = Terminal()
    bar = UploadProgress(key_bytes=1000, stream=out)
    for done in (250, 500, 750, 1000):
        bar(done, 1000)
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    assert re.fullmatch(r"(\rupload +[0-9.]+%  \d+/1000 keys  [0-9.]+ GB/s)+\n", text)
    assert "\rupload 100.0%  1000/1000 keys" in text


def test_upload_progress_writes_a_line_per_tenth_elsewhere_and_nothing_for_one_chunk():
    out = io.StringIO()
    bar = UploadProgress(key_bytes=1000, stream=out)
    for done in range(7, 101, 7):
        bar(min(done, 100), 100)
    bar(100, 100)
    lines = out.getvalue().splitlines()
    assert [line.split("%")[0] for line in lines] == [f"upload {p:5.1f}" for p in (14, 21, 35, 42, 56, 63, 70, 84, 91,
                                                                                   100)]
    quiet = io.StringIO()
    UploadProgress(key_bytes=1000, stream=quiet)(100, 100)
    assert quiet.getvalue() == ""


def test_random_kv_draws_the_values_of_one_float32_draw_chunk_by_chunk(monkeypatch):
    from service.client import loadtest

    monkeypatch.setattr(loadtest, "GENERATE_KEYS", 7)
    got = random_kv(np.random.default_rng(5), 30, 2, 4, BFLOAT16)
    want = np.random.default_rng(5).standard_normal((30, 2, 4), dtype=np.float32).astype(BFLOAT16)
    assert got.dtype == BFLOAT16 and got.tobytes() == want.tobytes()


def test_a_context_that_does_not_fit_suggests_what_to_try():
    full = SplitkeyError(507, "insufficient_capacity", "the context does not fit")
    assert "try --dtype bfloat16 (half the bytes of float32), fewer keys" in upload_failed(full, "float32")
    assert "try fewer keys (--n-k)" in upload_failed(full, "bfloat16")
    assert "try" not in upload_failed(SplitkeyError(503, "workers_unavailable", "gone"), "float32")
