"""The CPU side of benchmarks/gpu.py: arguments, derived numbers, report; and its answer without a GPU."""

import json

import pytest
from benchloader import benchmark_module

from workers.gpu import backend as gpu


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("gpu.py") as module:
        yield module


def test_benchmark_arguments_default_to_the_issue_cases_and_out_from_the_environment(bench, monkeypatch):
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    args = bench.parse_args([])
    assert args.out == "/tmp/somewhere"
    assert args.decode_keys == [128 * 1024, 1024 * 1024, 4 * 1024 * 1024]
    assert (args.prefill_queries, args.dtypes) == (2048, ["bfloat16", "float16"])
    assert set(args.paths) == {"generic", "fused", "sdpa"}
    assert bench.parse_args(["--out", "x", "--paths", "fused"]).paths == ["fused"]


def test_benchmark_rejects_zero_repeats(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])


def test_summary_derives_bandwidth_throughput_and_ratios_from_the_median(bench):
    r = bench.Result(case="decode", dtype="bfloat16", path="fused", n_q=1, n_k=1 << 20, ms_runs=[2.0, 1.0, 9.0])
    bench.summarize(r, copy_gb_per_s=4000.0, sdpa_ms=3.0)
    assert r.ms_median == 2.0
    assert r.gb_per_s == pytest.approx(2 * (1 << 20) * 8 * 128 * 2 / 2e-3 / 1e9)
    assert r.of_copy == pytest.approx(r.gb_per_s / 4000.0)
    assert r.of_sdpa == pytest.approx(1.5)
    assert r.tflop_per_s == pytest.approx(4 * 32 * (1 << 20) * 128 / 2e-3 / 1e12)


def test_report_is_written_as_json_and_markdown(bench, tmp_path):
    results = [bench.summarize(bench.Result("decode", "float16", "sdpa", 1, 4096, ms_runs=[0.5]), 1000.0, None),
               bench.Result("prefill", "float16", "fused", 2048, 32768, error="RuntimeError: boom")]
    bench.write_report(tmp_path, {"device": "test"}, 1000.0, results)
    doc = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert doc["copy_gb_per_s"] == 1000.0 and [r["path"] for r in doc["results"]] == ["sdpa", "fused"]
    md = (tmp_path / "gpu_bench.md").read_text()
    assert "| decode | float16 | 1 | 4096 | sdpa | 0.500 |" in md
    assert "RuntimeError: boom" in md and "- device: test" in md


@pytest.mark.skipif(gpu.unavailable_reason() is None, reason="a GPU is present: the benchmark would run for minutes")
def test_benchmark_without_a_gpu_says_why_and_exits_2(bench, tmp_path):
    assert bench.main(["--out", str(tmp_path)]) == 2
    doc = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert doc["env"]["error"] == gpu.unavailable_reason() and doc["results"] == []
