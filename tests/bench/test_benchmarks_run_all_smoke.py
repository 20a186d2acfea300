"""benchmarks/run_all: the generated blocks of docs/BENCHMARKS-run_all.md, and one --quick run through it.

The rendering is tested on a fixture (a manifest and reports written here). Every benchmark's
--quick runs whole in its own smoke test (tests/bench/test_benchmarks_*_smoke.py), except the contexts
benchmark's: that one runs here, through run_all, with the model fitted on a stored scaling run,
against copies of the documents in a temporary folder. What run_all passes to the others is
checked against their argument parsers.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from benchloader import benchmark_module

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_all():
    with benchmark_module("run_all.py") as module:
        yield module


def fixture_run(tmp_path, names=("kernel", "scaling"), rc=0):
    out = tmp_path / "results"
    out.mkdir()
    runs = []
    for name in names:
        (out / f"{name}.md").write_text(f"### {name} benchmark\n\nCommand: `x`\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n")
        runs.append({"name": name, "command": f"benchmarks/{name}.py", "rc": rc, "seconds": 3.0,
                     "load_before": "0.50, 0.40, 0.30", "load_after": "0.90, 0.50, 0.30", "date": "2026-12-01T08:00"})
    return out, {"quick": False, "machine": ["- CPU: test, 2 cores"], "runs": runs}


def test_blocks_are_rewritten_and_everything_else_is_kept(run_all, tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## Kernel (issue 2)\n\nhand-written analysis\n")
    out, manifest = fixture_run(tmp_path)
    assert run_all.render(doc, out, manifest) == ["kernel", "scaling"]
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Kernel (issue 2)\n\nhand-written analysis\n")
    kernel = text.split("<!-- run_all:kernel:begin -->")[1].split("<!-- run_all:kernel:end -->")[0]
    assert "Run 2026-12-01T08:00 (3 s, exit 0)" in kernel and "CPU: test, 2 cores" in kernel
    assert "load average before 0.50, 0.40, 0.30" in kernel
    assert "#### kernel benchmark" in kernel  # the report's headings sit one level below the block's
    assert "| 1 | 2 |" in kernel
    service = text.split("<!-- run_all:service:begin -->")[1].split("<!-- run_all:service:end -->")[0]
    assert "Not generated yet" in service
    # A second rendering replaces the blocks, it does not add to them.
    run_all.render(doc, out, manifest)
    assert doc.read_text() == text


def test_a_failed_run_leaves_its_block_as_it_was(run_all, tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n")
    out, manifest = fixture_run(tmp_path, names=("kernel",), rc=1)
    assert run_all.render(doc, out, manifest) == []
    assert "Not generated yet: `benchmarks/run_all --only kernel`" in doc.read_text()


def test_the_repository_document_keeps_its_hand_written_header(run_all, tmp_path):
    doc = tmp_path / "BENCHMARKS-run_all.md"
    shutil.copy(ROOT / run_all.DOC, doc)
    original = doc.read_text()
    out, manifest = fixture_run(tmp_path)
    run_all.render(doc, out, manifest)
    head = original.split(run_all.SECTION)[0]
    assert doc.read_text().startswith(head)
    assert "# Benchmarks: the last full `benchmarks/run_all` run" in head and "(BENCHMARKS.md)" in head
    # Every block is there to be replaced (none appended); the hand-written document has none of them.
    assert all(f"<!-- run_all:{name}:begin -->" in original for name in run_all.NAMES)
    hand = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert run_all.SECTION not in hand and "<!-- run_all:" not in hand
    assert "## CPU kernels (issues 2, 16 and 48)" in hand and "## Inline requests (issue 3)" in hand


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_every_benchmarks_arguments_are_accepted_by_its_script(run_all, quick):
    # The smoke run below runs one benchmark; the others run --quick in their own smoke tests, so what
    # is left to check here is that the arguments run_all gives each script are ones it accepts.
    for bench in run_all.BENCHES:
        with benchmark_module(pathlib.Path(bench.script).name) as script:
            args = script.parse_args([*(bench.quick if quick else bench.full), "--json", "x.json", "--out", "x.md"])
        assert args.out == "x.md" and args.json == "x.json", bench.name
        assert getattr(args, "quick", False) == quick, bench.name


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_regenerates_its_block_and_the_model_from_the_results_folder(tmp_path):
    # One benchmark end to end through run_all: the contexts benchmark, the one no other smoke test
    # runs whole. The results folder already holds a scaling.json (a real full run, committed), so
    # run_all also fits the model on it and rewrites SCALING.md and its plot, as after a full run.
    docs = tmp_path / "root" / "docs"
    docs.mkdir(parents=True)
    for name in ("BENCHMARKS.md", "BENCHMARKS-run_all.md", "SCALING.md"):
        shutil.copy(ROOT / "docs" / name, docs / name)
    out = tmp_path / "results"
    out.mkdir()
    shutil.copy(ROOT / "benchmarks" / "results" / "2026-12-01" / "scaling.json", out / "scaling.json")
    run = subprocess.run([sys.executable, "benchmarks/run_all.py", "--quick", "--only", "contexts", "--out", str(out),
                          "--doc-root", str(tmp_path / "root")], cwd=ROOT, capture_output=True, text=True,
                         timeout=280, env={**os.environ, "HOME": str(tmp_path)}, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((out / "run.json").read_text())
    assert [(r["name"], r["rc"]) for r in manifest["runs"]] == [("contexts", 0), ("model", 0)]
    results = json.loads((out / "contexts.json").read_text())["results"]
    assert [r["n_k"] for r in results] == [8 * 1024, 32 * 1024]
    assert all(r["diff"] <= 1e-4 and all(level["errors"] == 0 for level in r["levels"]) for r in results)
    text = (docs / "BENCHMARKS-run_all.md").read_text()
    block = text.split("<!-- run_all:contexts:begin -->")[1].split("<!-- run_all:contexts:end -->")[0]
    assert "exit 0" in block and "#### Resident-context benchmark" in block
    kernel = text.split("<!-- run_all:kernel:begin -->")[1].split("<!-- run_all:kernel:end -->")[0]
    original = (ROOT / "docs" / "BENCHMARKS-run_all.md").read_text()
    assert kernel in original  # a benchmark that did not run keeps its block as it was
    assert (docs / "BENCHMARKS.md").read_text() == (ROOT / "docs" / "BENCHMARKS.md").read_text()  # hand-written
    assert "| cell | measured ms | model ms |" in (docs / "SCALING.md").read_text()
    assert (docs / "images" / "scaling-decode-latency.png").exists()
