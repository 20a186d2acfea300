"""benchmarks/ray_calls.py: what a Ray actor call costs beside what it runs (a few calls, its own process)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_ray_calls_benchmark_reports_every_call(tmp_path):
    out = tmp_path / "ray_calls.md"
    subprocess.run([sys.executable, "benchmarks/ray_calls.py", "--calls", "3", "--out", str(out)], cwd=ROOT,
                   check=True, timeout=240, capture_output=True)
    text = out.read_text()
    assert "| ping |" in text and "beyond the sleep" in text
    assert len([line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]) == 2
