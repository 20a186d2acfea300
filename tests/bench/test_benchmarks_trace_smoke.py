"""benchmarks/trace_path.py traces a real request through the front end and the workers."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def test_the_traced_request_crosses_every_layer_in_every_process(tmp_path):
    out = tmp_path / "trace.json"
    run = subprocess.run([sys.executable, "benchmarks/trace_path.py", "--json", str(out),
                          "--cpu-kernels", "numpy"], cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=280, env={**os.environ, "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    names = report["function_names"]
    front, *workers = report["processes"].values()
    # The front end ran the route, the request rules, the orchestrator and the merge ...
    for fn in ("service/routes/attention.py:attention", "service/wire/request.py:attention_request",
               "service/cluster/orchestrator.py:Orchestrator.run", "merge/combine.py:merge_all"):
        assert fn in names, fn
    # ... and two worker processes each ran the (NumPy) kernel over their shard.
    # The query came over each worker's direct channel (the default), not a Ray method call.
    assert "workers/actor.py:ShardWorker._channel_submit" in names and "workers/blockwise.py:stream" in names
    # (frames.parse_query runs inside _channel_submit, in the traced window; the connection thread's _read
    # is entered before a frame arrives, so its call may fall before the window: not a sign of the path)
    assert "workers/frames.py:parse_query" in names and "service/cluster/channel.py:WorkerChannel.resident" in names
    assert sum(1 for w in workers if w["functions"] > 10) == 2
    assert front["files"] > 10 and report["files"] >= front["files"]
