"""benchmarks/persist.py --quick: a real server with and without --persist-dir, and a restart, end to end."""

import pytest
from benchloader import benchmark_module


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_persist_benchmark_runs_and_reports_both_rates_and_the_restart(tmp_path, capsys):
    with benchmark_module("persist.py") as persist:
        assert persist.main(["--quick", "--out", str(tmp_path / "persist.md")]) == 0
    text = (tmp_path / "persist.md").read_text()
    assert "| median |" in text and "load s per GiB" in text and "GiB on disk" in text
