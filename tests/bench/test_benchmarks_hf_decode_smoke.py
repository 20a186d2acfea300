"""benchmarks/hf_decode.py --quick: a real model's decode loop on splitkey beside SDPA, same tokens, no KV held."""

import pytest
from benchloader import benchmark_module

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_hf_decode_benchmark_reports_each_token_split_and_the_kv_each_cache_holds(tmp_path):
    with benchmark_module("hf_decode.py") as bench:
        assert bench.main(["--quick", "--out", str(tmp_path / "hf.md")]) == 0  # 0: the same tokens as SDPA
    text = (tmp_path / "hf.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 256 |")]
    assert len(rows) == 2 and all("| yes |" in row and "| 0 B |" in row for row in rows)
    assert all(row.split(" | ")[5] == "2" for row in rows)  # requests per token: one per layer (2 layers)
    assert "- CPU: " in text
