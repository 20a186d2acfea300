"""The examples in README.md and docs/ run, and print what the docs say they print."""

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC_URL = "http://127.0.0.1:8000"


def blocks(path: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / path).read_text(), flags=re.DOTALL)


def curl_examples(path: str) -> list[tuple[str, str]]:
    """``(command, expected JSON)`` for each curl command followed by a ``# {...}`` answer line."""
    found = []
    for block in blocks(path, "bash"):
        m = re.search(r"^(curl .*?)\n# (\{.*\})$", block, flags=re.DOTALL | re.MULTILINE)
        if m:
            found.append((m.group(1), m.group(2)))
    return found


@pytest.mark.ray
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("path", ["README.md", "docs/SERVICE.md"])
def test_doc_curl_example_answers_what_it_says(server, path):
    [(command, expected)] = curl_examples(path)
    out = subprocess.run(["bash", "-c", command.replace(DOC_URL, server.url)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    got, want = json.loads(out), json.loads(expected)
    assert got["out"][0][0][0] == pytest.approx(want["out"][0][0][0], rel=1e-6)
    assert got["lse"][0][0] == pytest.approx(want["lse"][0][0], rel=1e-6)


@pytest.mark.ray
def test_service_doc_python_client_example_runs(server):
    [code] = [b for b in blocks("docs/SERVICE.md", "python") if "Client(" in b]
    run = subprocess.run([sys.executable, "-c", code.replace(DOC_URL, server.url)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    expected = re.search(r"# (\(.*\))\s*$", code.strip().splitlines()[-1]).group(1)
    assert out.strip() == expected


@pytest.mark.ray
def test_loadtest_doc_library_example_runs(server):
    [code] = [b for b in blocks("docs/LOADTEST.md", "python") if "run_sweep" in b]
    run = subprocess.run([sys.executable, "-c", code.replace(DOC_URL, server.url)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2 * 2 * 2 and all(line.endswith(" 0") for line in lines)  # 8 points, none wrong


@pytest.mark.ray
def test_engine_doc_decode_loop_runs_and_prints_what_it_says(server):
    [code] = [b for b in blocks("docs/ENGINE.md", "python") if "AsyncClient(" in b]
    said = re.search(r"^# (decoded .*)$", code, flags=re.MULTILINE).group(1)
    run = subprocess.run([sys.executable, "-c", code.replace(DOC_URL, server.url)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == said


@pytest.mark.ray
def test_engine_doc_transformers_example_runs_and_prints_what_it_says(server):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    [code] = [b for b in blocks("docs/ENGINE.md", "python") if "SplitkeyCache(" in b]
    said = re.search(r"^# (\d+ layers .*)$", code, flags=re.MULTILINE).group(1)
    run = subprocess.run([sys.executable, "-c", code.replace(DOC_URL, server.url)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == said
