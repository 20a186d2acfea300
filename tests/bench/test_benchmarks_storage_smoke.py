"""benchmarks/storage.py --quick: memory held against data, appended against created contexts, appends beside
queries, through a real server, end to end."""

import pytest
from benchloader import benchmark_module


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_storage_benchmark_runs_and_reports_every_part(tmp_path):
    with benchmark_module("storage.py") as storage:
        assert storage.main(["--quick", "--out", str(tmp_path / "storage.md"), "--json", str(tmp_path / "storage.json")]) == 0
    text = (tmp_path / "storage.md").read_text()
    assert "(a) Memory held against data" in text and "held / data" in text and "held - data" in text
    assert "Appended / created decode p50" in text and "max abs error vs float64" in text
    assert "one-key append, replicas 1" in text and "one-key append, replicas 2" in text
    assert "lscpu" in text and (tmp_path / "storage.json").is_file()
