"""benchmarks/kernel_parts.py --quick: every part of a block for every dtype, and the block's sum.

No rate is asserted; this guards the report's rows and that the parts compile and run.
"""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_parts_benchmark_reports_each_part_and_the_block_per_dtype(tmp_path):
    out = tmp_path / "parts.md"
    subprocess.run([sys.executable, "benchmarks/kernel_parts.py", "--quick", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=300, capture_output=True)
    text = out.read_text()
    assert "| K and V | part | us per block | GFLOP/s | / sgemm | K+V GB/s in cache |" in text
    for dtype, scores, pv in (("float32", "scores micro", "p @ v micro"), ("bfloat16", "scores micro", "p @ v micro"),
                              ("float16", "scores micro", "p @ v micro")):
        rows = [line for line in text.splitlines() if line.startswith(f"| {dtype} |")]
        parts = [row.split(" | ")[1] for row in rows]
        assert parts[:5] == ["scores micro", "scores loop", "softmax", "p @ v micro", "p @ v loop"], rows
        assert parts[5] == f"block: {scores} + {pv} + softmax", rows
        assert all(float(row.split(" | ")[2]) > 0 for row in rows), rows


def test_the_parts_benchmark_refuses_an_unknown_dtype():
    run = subprocess.run([sys.executable, "benchmarks/kernel_parts.py", "--dtypes", "int8"],
                         cwd=ROOT, timeout=60, capture_output=True, text=True)
    assert run.returncode == 2 and "--dtypes must name some of float32, bfloat16, float16, got 'int8'" in run.stderr
