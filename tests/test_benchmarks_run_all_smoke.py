"""benchmarks/run_all: the generated blocks of docs/BENCHMARKS.md, and one --quick run of everything.

The rendering is tested on a fixture (a manifest and reports written here); the smoke run runs
every benchmark's --quick and the model against copies of the documents in a temporary folder.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from benchloader import benchmark_module

ROOT = pathlib.Path(__file__).resolve().parents[1]


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


def test_the_repository_document_keeps_its_hand_written_sections(run_all, tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    shutil.copy(ROOT / "docs" / "BENCHMARKS.md", doc)
    original = doc.read_text()
    out, manifest = fixture_run(tmp_path)
    run_all.render(doc, out, manifest)
    head = original.split(run_all.SECTION)[0]
    assert doc.read_text().startswith(head)
    assert "## Kernel (issue 2)" in head and "## Service (issue 3)" in head


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(540)
def test_quick_runs_everything_and_regenerates_the_documents(tmp_path):
    docs = tmp_path / "root" / "docs"
    docs.mkdir(parents=True)
    for name in ("BENCHMARKS.md", "SCALING.md"):
        shutil.copy(ROOT / "docs" / name, docs / name)
    out = tmp_path / "results"
    run = subprocess.run([sys.executable, "benchmarks/run_all.py", "--quick", "--out", str(out), "--doc-root",
                          str(tmp_path / "root")], cwd=ROOT, capture_output=True, text=True, timeout=520,
                         env={**os.environ, "HOME": str(tmp_path)}, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((out / "run.json").read_text())
    assert [r["name"] for r in manifest["runs"]] == ["kernel", "service", "contexts", "scaling", "engine", "model"]
    assert all(r["rc"] == 0 for r in manifest["runs"])
    for name in ("kernel", "service", "contexts", "scaling", "engine"):
        assert json.loads((out / f"{name}.json").read_text())
        block = (docs / "BENCHMARKS.md").read_text().split(f"<!-- run_all:{name}:begin -->")[1]
        assert "exit 0" in block.split(f"<!-- run_all:{name}:end -->")[0]
    assert "| cell | measured ms | model ms |" in (docs / "SCALING.md").read_text()
    assert (docs / "images" / "scaling-decode-latency.png").exists()
