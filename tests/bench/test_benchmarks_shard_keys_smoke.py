"""benchmarks/shard_keys.py --quick: closed loops over many contexts for each shard size, and single calls over
one context cut in several shards, answers checked."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_shard_keys_benchmark_compares_split_and_whole_contexts_and_times_fragments(tmp_path):
    out, raw = tmp_path / "shard_keys.md", tmp_path / "shard_keys.json"
    subprocess.run([sys.executable, "benchmarks/shard_keys.py", "--quick", "--out", str(out), "--json", str(raw)],
                   cwd=ROOT, check=True, timeout=300, capture_output=True)
    text = out.read_text()
    assert "| concurrency | --context-shard-keys |" in text
    result = json.loads(raw.read_text())
    # --quick: 512-key contexts; 256-key shards cut each in two, 512-key shards keep each whole
    assert {sk: rounds[0]["shards_per_context"] for sk, rounds in result["rounds"].items()} == {
        "256": [2, 2], "512": [1, 1]}
    for rounds in result["rounds"].values():
        assert rounds[0]["max_diff"] < 1e-5  # float32 over 512 keys against the float64 reference
        assert [x["level"] for x in rounds[0]["levels"]] == [1, 2]
        assert all(x["calls"] > 0 and x["rps"] > 0 for x in rounds[0]["levels"])
    # fragments: one 1024-key context as 1 and as 4 shards, this tree's server only
    (fragments,) = result["fragments"]["this tree"]
    assert fragments["max_diff"] < 1e-5 and set(fragments["p50"]) == {"1", "4"}
    assert all(x > 0 for x in fragments["p50"].values())
    assert "| server | shards | p50 per round | p50 | against 1 shards, per round |" in text
