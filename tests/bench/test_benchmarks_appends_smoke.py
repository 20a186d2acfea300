"""benchmarks/appends.py: its report built from made-up requests, without a server (no timing is asserted)."""

import pytest
from benchloader import benchmark_module


@pytest.fixture(scope="module")
def appends():
    with benchmark_module("appends.py") as module:
        yield module


def records(appends, seconds, stages):
    return [appends.common.Record(seconds, dict(stages)) for _ in range(10)]


def test_the_report_compares_each_append_with_the_decode_and_names_the_stages(appends):
    args = appends.parse_args(["--quick", "--baseline", "/tmp/elsewhere"])
    assert (args.rounds, args.warmup) == (40, 5)
    stages = {"parse": 0.0002, "lease": 0.0006, "store": 0.0007, "commit": 0.0003, "note": 0.0003, "total": 0.0025}
    before = {"append r1": records(appends, 0.0140, stages), "append r2": records(appends, 0.0160, stages),
              "decode": records(appends, 0.0070, {"total": 0.006})}
    after = {"append r1": records(appends, 0.0035, stages), "append r2": records(appends, 0.0040, stages),
             "decode": records(appends, 0.0070, {"total": 0.006})}
    text = appends.report(args, {"baseline": before, "this tree": after}, [])
    assert "#### baseline" in text and "#### this tree" in text
    assert "Target: append (replicas 1) p50 <= decode p50: 2.00x (missed)" in text
    assert "Target: append (replicas 1) p50 <= decode p50: 0.50x (met)" in text
    assert "parse 0.20 (8%), lease 0.60 (24%), store 0.70 (28%), commit 0.30 (12%), note 0.30 (12%)" in text
