"""benchmarks/scaling.py --quick on a real two-worker Ray cluster, then benchmarks/model.py on its JSON.

The run starts its own cluster and front ends; nothing is timed against a target. What must
hold: every cell answered (checked against the in-process answer by the script itself), the
probes split the stages, the report has its tables, and the model fits the cells, writes its
check table into a copy of docs/SCALING.md and draws the plot.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scaling")
    run = subprocess.run([sys.executable, "benchmarks/scaling.py", "--quick", "--json", str(tmp / "scaling.json"),
                          "--out", str(tmp / "scaling.md")], cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "HOME": str(tmp)}, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return tmp


def test_every_cell_has_requests_stages_and_probes(quick_run):
    raw = json.loads((quick_run / "scaling.json").read_text())
    cells = raw["cells"]
    assert {(c["shards"], c["fanin"], c["shape"]) for c in cells} == {
        (s, f, shape) for s, f in ((1, 2), (2, 2), (2, 4)) for shape in ("decode", "prefill")}
    for c in cells:
        assert c["requests"] and all(r["stages"]["total"] > 0 for r in c["requests"])
        assert c["max_abs_diff"] <= 1e-3
        assert len(c["probe"]["shard_s"][0]) == c["shards"] and c["probe"]["directory_s"]
        # derived compute is Server-Timing compute minus the probes' state return, two separate
        # measurements: on a tiny quick-run cell it can come out below zero. Their sum is measured.
        assert c["derived"]["compute"] + c["derived"]["state_return"] > 0 and c["derived"]["directory"] > 0
        assert c["depth"] == (1 if c["shards"] > 1 else 0)
    loops = [c for c in cells if c["loop"]]
    assert loops and all(c["loop"]["per_second"] > 0 and c["loop"]["errors"] == 0 for c in loops)
    assert raw["kernel"]["decode"]["gb_per_s"] > 0 and raw["kernel"]["prefill"]["gflop_per_s"] > 0


def test_the_report_has_its_tables(quick_run):
    text = (quick_run / "scaling.md").read_text()
    for head in ("| shape | n_q | keys |", "| setup | nodes | workers |", "| cell | front end | directory |",
                 "| cell | parse | lookup | scatter | compute | merge | encode | total |"):
        assert head in text, head
    assert "1 node, 2 workers, 2 shards, fan-in 4, prefill" in text


def test_the_model_fits_the_run_and_rewrites_its_blocks(quick_run):
    doc = quick_run / "SCALING.md"
    shutil.copy(ROOT / "docs" / "SCALING.md", doc)
    before = doc.read_text()
    plot = quick_run / "plot.png"
    run = subprocess.run([sys.executable, "benchmarks/model.py", "--scaling", str(quick_run / "scaling.json"),
                          "--doc", str(doc), "--plot", str(plot), "--json", str(quick_run / "model.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    text = doc.read_text()
    check = text.split("<!-- model:check:begin -->")[1].split("<!-- model:check:end -->")[0]
    cells, loops = check.split("Closed loops:")
    assert "| cell | measured ms | model ms | error |" in cells
    assert cells.count("\n| 1 node, 2 workers") == 6  # one row per cell
    assert loops.count("\n| 1 node, 2 workers") == 2  # decode and prefill at shards = workers
    for name in ("fit", "inputs", "predictions", "crossovers", "replicas", "comparison"):
        inside = text.split(f"<!-- model:{name}:begin -->")[1].split(f"<!-- model:{name}:end -->")[0]
        assert "| --- |" in inside, name
    # Everything outside the markers is as it was.
    outside = before.split("<!-- model:fit:begin -->")[0]
    assert text.startswith(outside)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fitted = json.loads((quick_run / "model.json").read_text())
    assert len(fitted["check"]) == 6 and fitted["predictions"]
