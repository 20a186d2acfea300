"""benchmarks/engine.py --quick: single calls (HTTP, AsyncClient, gRPC, raw socket) and batches, answers checked."""

import json
import math

import pytest
from benchloader import benchmark_module


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_engine_benchmark_reports_single_calls_and_batches(tmp_path):
    with benchmark_module("engine.py") as bench:
        assert bench.main(["--quick", "--out", str(tmp_path / "engine.md"), "--json", str(tmp_path / "e.json")]) == 0
    text = (tmp_path / "engine.md").read_text()
    for row in ("| this tree, Client |", "| this tree, AsyncClient |", "| this tree, gRPC (tritonclient.grpc) |",
                "| this tree, raw HTTP/1.1 (no client library) |", "`GET /healthz` the same way", "| 1 |", "| 8 |",
                "| this tree, raw HTTP/1.1, over a ", "| this tree, Client, 2 contexts of 4096 keys in turn |",
                "| this tree, raw HTTP/1.1, 2 contexts in turn |"):
        assert row in text, row
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["single"]["this tree, Client"][0]["single"]["n"] == 20 and max(result["max_diff"]) < 1e-5
    own = result["this_tree_rounds"][0]
    assert own["raw"]["n"] == own["healthz"]["n"] == 20 and "compute" in own["raw"]["stages"]
    # each client's calls against the kernel measured just before their block (--quick: 2 blocks of 10)
    assert "beyond the kernel beside it" in text
    assert all(own[c]["n"] == 20 and math.isfinite(own[c]["beyond"])
               for c in ("single", "raw", "raw_small", "async", "grpc", "client_layers", "raw_layers"))
    # the layers' calls are compared with the kernel over the same contexts in turn, measured before and after
    assert all(k["layers"] > 0 for k in own["kernel"])
    # the small context's calls are compared with its own kernel: a call takes longer than the kernel alone
    # (against the 4096-key kernel, ten times the 256-key one's, they would come out about 3 ms below it)
    assert own["raw_small"]["p50"] < own["raw"]["p50"] and own["raw_small"]["beyond"] > 0
