"""`splitkey loadtest` against a real server: every mode and arrival process, checked answers, outputs,
a server that answers wrongly, thresholds, and contexts deleted also when interrupted."""

import io
import re

import pytest

from service.client import SplitkeyError, UploadError
from service.client.loadtest.cli import setup_failed
from service.client.loadtest.progress import LiveLine, UploadProgress

SMALL = ["--h-q", "4", "--h-kv", "2", "--d", "16"]


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
    bar = UploadProgress(key_bytes=1000, stream=out, label="upload context of 100 keys")
    for done in range(7, 101, 7):
        bar(min(done, 100), 100)
    bar(100, 100)
    lines = out.getvalue().splitlines()
    assert [line.split("%")[0] for line in lines] == [f"upload context of 100 keys {p:5.1f}"
                                                      for p in (14, 21, 35, 42, 56, 63, 70, 84, 91, 100)]
    quiet = io.StringIO()
    UploadProgress(key_bytes=1000, stream=quiet)(100, 100)
    assert quiet.getvalue() == ""


def test_the_live_line_counts_requests_and_ends_with_a_newline():
    out = Terminal()
    line = LiveLine("decode n_k=4096 c=2", out)
    line.every = 0.0
    line.add(True, 0.010)
    line.add(False, 1.0)
    line.add(True, 0.030)
    line.close()
    text = out.getvalue()
    assert text.endswith("\n") and "\rdecode n_k=4096 c=2: 2 done, 1 failed" in text and "p50 30.0 ms" in text


def test_a_context_that_does_not_fit_suggests_what_to_try():
    full = UploadError("abc", 0, 10, 507, "insufficient_capacity", "the context does not fit")
    assert "try --dtype bfloat16 (half the bytes of float32), fewer keys" in setup_failed(full, "float32")
    assert "context upload failed" in setup_failed(full, "float32")
    assert "try fewer keys (--n-k)" in setup_failed(full, "bfloat16")
    assert "try" not in setup_failed(SplitkeyError(503, "workers_unavailable", "gone"), "float32")


def test_a_finished_upload_records_its_rate_once_also_when_done_in_one_chunk():
    records: list[dict] = []
    bar = UploadProgress(key_bytes=1000, stream=io.StringIO(), label="upload context of 100 keys", done=records.append)
    bar(50, 100)
    bar(100, 100)
    bar(100, 100)
    one = UploadProgress(key_bytes=10, stream=io.StringIO(), done=records.append)
    one(100, 100)
    assert [(r["label"], r["keys"], r["gb"]) for r in records] == [("context of 100 keys", 100, 1e-4), ("upload", 100, 1e-6)]
    assert all(r["seconds"] > 0 and r["gb_per_s"] == r["gb"] / r["seconds"] for r in records)


def test_every_loadtest_flag_has_help_naming_its_default():
    import argparse

    from service.client.loadtest.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 25
    for action in options:
        assert action.help and ("default" in action.help or action.required), action.option_strings


def sweep_result(completed: int, slo_ms: float | None = 50.0):
    from service.client.loadtest import SweepConfig
    from service.client.loadtest.metrics import Sample, summarize
    from service.client.loadtest.runner import SweepResult

    result = SweepResult(SweepConfig(url="http://127.0.0.1:9", n_k=(1024, 4096), concurrency=(1, 4), slo_ms=slo_ms),
                         environment={"date": "2026-12-06T23:00:00+00:00", "host": "box", "shape": "h_q=4 h_kv=2 d=16 "
                                      "d_v=16", "dtype": "bfloat16", "server_version": "0.1.0", "service_workers": 2})
    for n_k in (1024, 4096):
        for c in (1, 4):
            samples = [Sample(i, 0.0, 0.001 * (i + 1) * c, 200, keys=n_k, n_q=1) for i in range(completed)]
            result.points.append(summarize(samples, 1.0, mode="decode", n_k=n_k, arrival="concurrency", load=c,
                                           key_bytes=64, slo_ms=slo_ms))
    result.uploads.append({"label": "context of 4096 keys", "keys": 4096, "gb": 0.25, "seconds": 2.0, "gb_per_s": 0.125})
    return result


def test_the_summary_marks_rough_percentiles_and_says_the_upload_rate():
    from service.client.loadtest.report import summary

    text = summary(sweep_result(completed=5))
    assert re.search(r"^decode +1024 +c=1 +5 +0 .* [0-9.]+\* +[0-9.]+\* +[0-9.]+\* ", text, re.MULTILINE), text
    assert "* rests on fewer than 20 completed requests" in text
    assert "decode n_k=4096 c=4: p50, p90 and p99 rest on 5 completed requests, fewer than 20" in text
    assert "context of 4096 keys: 4096 keys, 0.250 GB in 2.0 s, 0.125 GB/s" in text
    assert "*" not in summary(sweep_result(completed=20)) and "warnings" not in summary(sweep_result(completed=20))


def test_a_gate_on_a_metric_a_point_has_no_value_for_fails_the_run():
    import dataclasses

    from service.client.loadtest.config import FailOn

    result = sweep_result(completed=5)
    result.config = dataclasses.replace(result.config, fail_on=(FailOn.parse("max_error>1e-4"),
                                                                FailOn.parse("latency_p99_ms>1e6")))
    assert result.points[0].max_error is None  # nothing verified
    assert result.violations()[0] == "decode n_k=1024 c=1: max_error>0.0001 (got no value)"
    result.points = [dataclasses.replace(p, max_error=0.0) for p in result.points]
    assert result.violations() == [] and result.passed()
    result.points[1] = dataclasses.replace(result.points[1], latency_p99_ms=float("nan"))  # nothing completed
    assert result.violations() == ["decode n_k=1024 c=4: latency_p99_ms>1e+06 (got no value)"]

def test_plots_carry_the_runs_metadata_and_are_written_with_an_slo_and_rough_points(tmp_path):
    pytest.importorskip("matplotlib")
    from service.client.loadtest import plots

    result = sweep_result(completed=5)
    assert plots.footer(result.environment) == ("2026-12-06T23:00:00+00:00 | host box | h_q=4 h_kv=2 d=16 d_v=16 | "
                                                "bfloat16 | splitkey 0.1.0 | 2 workers")
    paths = plots.write_plots(result, tmp_path)
    assert [p.name for p in paths] == ["latency_vs_context.png", "latency_vs_load.png", "throughput.png"]
    import matplotlib.image

    assert all(matplotlib.image.imread(p).shape[0] > 300 for p in paths)
    assert plots.write_plots(sweep_result(completed=30, slo_ms=None), tmp_path / "plain")
