"""benchmarks/locustfile.py under a real Locust against the real service: it loads, checks and cleans up."""

import csv
import importlib.util
import shutil
import subprocess
import sys

import numpy as np
import pytest
from faults import WrongAnswers
from server import ROOT

from service.client import Client

# Locust is looked for, never imported here: importing it monkey-patches the whole process
# with gevent (threads become greenlets), and the other tests' threads would deadlock.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust is not installed")


def run_locust(host: str, tmp_path, seconds: int = 4, *, from_root: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    """Locust on the locustfile; ``from_root``: as docs/LOADTEST.md runs it, from the repository's
    root with the file's relative path (Locust then puts benchmarks/ first on sys.path, where
    benchmarks/service.py could shadow the ``service`` package)."""
    locust = shutil.which("locust", path=str(ROOT / ".venv" / "bin")) or shutil.which("locust")
    locustfile = "benchmarks/locustfile.py" if from_root else str(ROOT / "benchmarks" / "locustfile.py")
    cmd = [locust or sys.executable, *([] if locust else ["-m", "locust"]), "-f", locustfile,
           "--host", host, "--headless", "-u", "2", "-r", "2", "-t", f"{seconds}s", "--only-summary",
           "--csv", str(tmp_path / "loc"), "--splitkey-n-k", "2K", "--splitkey-heads", "4,2,16",
           "--splitkey-verify-every", "3"]
    done = subprocess.run(cmd, cwd=ROOT if from_root else tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    with (tmp_path / "loc_stats.csv").open() as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    return done, rows


@pytest.mark.ray
def test_locust_decodes_over_a_stored_context_with_checked_answers_and_deletes_it(server, tmp_path):
    with Client(server.url) as c:
        before = {ctx["id"] for ctx in c.list_contexts()}
    # Eight seconds, and a few decodes asked for, not a rate: on a 2-core CI machine beside two other
    # test processes, 4 s once gave two users two decodes in all (every user's first answer is checked).
    done, rows = run_locust(server.url, tmp_path, seconds=8, from_root=True)
    assert done.returncode == 0, done.stdout + done.stderr
    row = rows["/v1/attention (decode)"]
    assert int(row["Request Count"]) >= 4 and int(row["Failure Count"]) == 0
    with Client(server.url) as c:
        assert {ctx["id"] for ctx in c.list_contexts()} == before


@pytest.mark.ray
def test_locust_counts_wrong_answers_as_failures(server, tmp_path):
    with WrongAnswers(server.port, lambda out, lse: (out, lse + np.float32(0.5))) as proxy:
        done, rows = run_locust(proxy.url, tmp_path, seconds=6)  # a user's second answer goes unchecked
    assert done.returncode == 1
    row = rows["/v1/attention (decode)"]
    assert int(row["Failure Count"]) > 0 and int(row["Failure Count"]) < int(row["Request Count"])  # the checked ones
    assert "wrong answer: relative error" in (tmp_path / "loc_failures.csv").read_text()
