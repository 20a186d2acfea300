"""benchmarks/idle.py --quick: every work after every pause, with its ratio to back to back."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_idle_benchmark_reports_every_work_after_every_pause(tmp_path):
    out = tmp_path / "idle.md"
    subprocess.run([sys.executable, "benchmarks/idle.py", "--quick", "--n-k", "512", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=120, capture_output=True)
    text = out.read_text()
    assert "| work | back to back | sleep 1 ms | sleep 3 ms | sleep 20 ms | spin 3 ms |" in text
    rows = [line for line in text.splitlines() if line.startswith(("| sgemm piece", "| decode, 512 keys"))]
    assert len(rows) == 5 and all("(1.00x)" in row.split(" | ")[1] for row in rows), rows
