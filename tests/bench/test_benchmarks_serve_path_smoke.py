"""benchmarks/serve_path.py --quick: uvicorn direct and Ray Serve's proxy side by side, end to end."""

import importlib.util

import pytest
from benchloader import benchmark_module


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("grpc") is None, reason="Ray Serve (ray[serve]) not installed")
def test_the_serve_path_benchmark_reports_both_paths_with_equal_answers(tmp_path):
    with benchmark_module("serve_path.py") as bench:
        assert bench.main(["--quick", "--out", str(tmp_path / "serve.md")]) == 0
    text = (tmp_path / "serve.md").read_text()
    assert "| uvicorn |" in text and "| serve |" in text and "answers bitwise equal in 1 of 1 rounds" in text
