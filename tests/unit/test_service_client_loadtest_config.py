"""The load test's configuration: sizes, thresholds and every bad value named by its field or flag."""

import argparse

import pytest

from service.cli import build_parser
from service.client.loadtest.cli import config_from_args
from service.client.loadtest.config import FailOn, Shape, SweepConfig, parse_size
from service.client.loadtest.metrics import METRICS


def args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["loadtest", "--url", "http://127.0.0.1:1", *extra])


@pytest.mark.parametrize("text, n", [("4096", 4096), ("4K", 4096), ("64k", 65536), ("1M", 2**20), (" 2G ", 2**31)])
def test_sizes_take_binary_suffixes(text, n):
    assert parse_size(text, "--n-k") == n


@pytest.mark.parametrize("text", ["", "1.5K", "-4", "4KB", "M"])
def test_a_bad_size_names_the_flag_and_the_value(text):
    with pytest.raises(ValueError, match=f"--n-k must be a count such as 4096, 64K or 1M, got {text!r}"):
        parse_size(text, "--n-k")


@pytest.mark.parametrize("text, metric, op, value", [
    ("latency_p99_ms>500", "latency_p99_ms", ">", 500.0),
    ("failed>=1", "failed", ">=", 1.0),
    ("slo_attainment<0.9", "slo_attainment", "<", 0.9),
    ("requests_per_s <= 2.5", "requests_per_s", "<=", 2.5),
])
def test_fail_on_reads_a_metric_a_comparison_and_a_number(text, metric, op, value):
    rule = FailOn.parse(text)
    assert (rule.metric, rule.op, rule.value) == (metric, op, value)
    assert rule.violated(value + 1) == (op in (">", ">=")) and rule.violated(value) == (op in (">=", "<="))


@pytest.mark.parametrize("text", ["p99", "latency_p99_ms=5", "latency_p99_ms>fast"])
def test_a_bad_fail_on_says_the_form(text):
    with pytest.raises(ValueError, match="--fail-on must be METRIC<op>NUMBER"):
        FailOn.parse(text)


def test_fail_on_names_only_numeric_metrics():
    assert {"latency_p99_ms", "requests_per_s", "failed", "wrong", "slo_attainment", "max_error"} <= set(METRICS)
    assert not {"mode", "failed_by", "stages_ms", "arrival"} & set(METRICS)
    with pytest.raises(ValueError, match="--fail-on must name one of .*, got 'p99'"):
        config_from_args(args("--fail-on", "p99>5"))


def test_arguments_become_one_config():
    cfg = config_from_args(args("--mode", "decode,context,multi-turn", "--n-k", "4K,1M", "--rate", "2,8.5",
                                "--dtype", "bfloat16", "--d-v", "64", "--fail-on", "latency_p99_ms>500"))
    assert cfg.modes == ("decode", "multi-turn")  # "context" is the old name of decode: one mode, once
    assert cfg.n_k == (4096, 2**20) and cfg.rates == (2.0, 8.5)
    assert cfg.concurrency == ()  # --rate alone: open loop only
    assert cfg.shape == Shape(32, 8, 128, 64, "bfloat16") and cfg.shape.key_bytes == (128 + 64) * 8 * 2
    assert cfg.points() == [("rate", 2.0), ("rate", 8.5)]
    assert config_from_args(args()).points() == [("concurrency", 1.0), ("concurrency", 4.0), ("concurrency", 16.0)]


@pytest.mark.parametrize("extra, message", [
    (["--mode", "decode,chat"], "--mode must list decode, inline, prefill, shared-prefix, multi-turn, got 'decode,chat'"),
    (["--seed", "-1"], "--seed must be an int in [0, 2**63), got -1"),
    (["--url", "notaurl"], "--url must be http(s)://HOST[:PORT], got 'notaurl'"),
    (["--url", "ftp://host"], "--url must be http(s)://HOST[:PORT], got 'ftp://host'"),
    (["--concurrency", "1,0"], "--concurrency must list ints >= 1, got '1,0'"),
    (["--concurrency", "two"], "--concurrency must list ints >= 1, got 'two'"),
    (["--n-k", "4K,0"], "--n-k must list key counts >= 1, got '0'"),
    (["--rate", "0"], "--rate must list request rates > 0 per second, got '0'"),
    (["--rate", "2,-1"], "--rate must list request rates > 0 per second, got '-1'"),
    (["--rate", "x"], "--rate must list request rates per second, got 'x'"),
    (["--concurrency", "", "--rate", ""], "concurrency or rates must name at least one point"),
    (["--duration", "0"], "--duration must be a number > 0, got 0.0"),
    (["--requests", "0"], "--requests must be an int >= 1, got 0"),
    (["--verify-every", "0"], "--verify-every must be an int >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be an int >= 0, got -1"),
    (["--h-q", "6", "--h-kv", "4"], "--h-q must be a multiple of h_kv, got h_q=6, h_kv=4"),
    (["--slo-ms", "-3"], "--slo-ms must be a number > 0, got -3.0"),
    (["--fail-on", "slo_attainment<0.99"], "--fail-on slo_attainment<0.99 must come with an SLO (--slo-ms), got none"),
    (["--fail-on", "goodput_per_s<5"], "--fail-on goodput_per_s<5 must come with an SLO (--slo-ms), got none"),
    (["--burstiness", "nan"], "--burstiness must be a number > 0, got nan"),
])
def test_bad_arguments_are_refused_naming_the_flag(extra, message):
    with pytest.raises(ValueError) as err:
        config_from_args(args(*extra))
    assert message in str(err.value)


def test_a_bad_argument_is_exit_status_2_and_no_request_is_sent(capsys):
    a = args("--n-k", "lots")
    assert a.func(a) == 2
    assert "--n-k must be a count such as 4096, 64K or 1M, got 'lots'" in capsys.readouterr().err


def test_an_unreadable_key_file_or_unwritable_out_is_exit_status_2_before_the_run(capsys, tmp_path):
    a = args("--api-key-file", str(tmp_path / "missing"))
    assert a.func(a) == 2
    assert f"--api-key-file must be a readable file, got '{tmp_path / 'missing'}': No such file or directory" in \
        capsys.readouterr().err
    # No server listens at the URL: the run would fail with status 1, so 2 says it never started.
    a = args("--url", "http://127.0.0.1:9", "--out", "/proc/splitkey-out")
    assert a.func(a) == 2
    assert "--out must be a directory this user can write, got '/proc/splitkey-out'" in capsys.readouterr().err


def test_the_config_checks_its_own_fields_for_library_callers():
    with pytest.raises(ValueError, match="n_k must list key counts >= 1"):
        SweepConfig(url="http://x", n_k=(0,))
    with pytest.raises(ValueError, match="modes must list"):
        SweepConfig(url="http://x", modes=("nope",))
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\), got -1"):
        SweepConfig(url="http://x", seed=-1)
    with pytest.raises(ValueError, match="dtype must be one of"):
        Shape(dtype="int8")
