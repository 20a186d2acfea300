"""benchmarks/dispatch.py: the app's dispatch in process (a few requests, its own process)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_dispatch_benchmark_reports_every_variant_and_the_saving(tmp_path):
    out = tmp_path / "dispatch.md"
    subprocess.run([sys.executable, "benchmarks/dispatch.py", "--calls", "20", "--repeats", "2", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=120, capture_output=True)
    text = out.read_text()
    assert "| repeat | POST /v1/attention, hot routes | POST /v1/attention, FastAPI's dispatch |" in text
    assert "| POST /v1/attention answered, compute stubbed |" in text  # the whole decode path but the workers
    rows = [line for line in text.splitlines() if line.startswith(("| 1 ", "| 2 ", "| median "))]
    assert len(rows) == 3 and all(float(cell) > 0 for row in rows for cell in row.strip("| ").split(" | ")[1:])
    assert "The direct dispatch saves" in text
