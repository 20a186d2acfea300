"""`splitkey loadtest` against a real server: bounded, exact, and reporting what it measured."""

import json

import pytest

from service.cli import build_parser

pytestmark = pytest.mark.ray


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


def test_loadtest_check_fails_the_run_past_its_tolerance(server, capsys):
    # float32 answers differ from the float64 reference by rounding (~1e-7): far above 1e-12.
    args = build_parser().parse_args([
        "loadtest", "--url", server.url, "--mode", "inline", "--n-k", "512", "--h-q", "2", "--h-kv", "1", "--d", "8",
        "--concurrency", "1", "--requests", "2", "--check", "--tolerance", "1e-12"])
    assert args.func(args) == 1
    assert "must be within 1e-12 of the float64 reference" in capsys.readouterr().err
