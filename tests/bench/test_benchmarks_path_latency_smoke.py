"""benchmarks/path_latency.py times the traced request in two checkouts side by side (here: this one twice)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def test_two_checkouts_are_timed_in_turn_and_their_answers_compared(tmp_path):
    out = tmp_path / "latency.md"
    run = subprocess.run([sys.executable, "benchmarks/path_latency.py", ".", ".", "--quick", "--out", str(out)],
                         cwd=ROOT, check=False, capture_output=True, text=True, timeout=280,
                         env={**os.environ, "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    report = out.read_text()
    rows = [line for line in report.splitlines() if line.startswith(f"| {ROOT}")]
    assert len(rows) == 2, report  # one row per checkout, each with its medians and answer digest
    assert "2 rounds of 10 requests" in report and "Bitwise the same answers in every checkout: yes." in report
