"""`deploy/local-cluster.sh`, end to end: a Ray head and two worker nodes started with
`ray start`, `splitkey serve` joined to them, exact answers from a context replicated
over both worker nodes, every socket on loopback, and `down` leaving no process and no
state behind.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "local-cluster.sh"


def script(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def env(tmp_path: pathlib.Path) -> Iterator[dict[str, str]]:
    """The script's environment: this interpreter, a HOME of its own (nothing of Ray's in the
    real one), and a short state base under /tmp (Ray's socket paths must stay short)."""
    base = tempfile.mkdtemp(prefix="skc-", dir="/tmp")
    (tmp_path / "home").mkdir()
    yield {**os.environ, "PYTHON": sys.executable, "HOME": str(tmp_path / "home"), "SPLITKEY_CLUSTER_DIR": base}
    shutil.rmtree(base, ignore_errors=True)


def test_down_of_a_cluster_that_is_not_up_fails_and_says_so(env):
    res = script(env, "down", "--name", "nosuch")
    assert res.returncode != 0
    assert "no cluster 'nosuch' is up" in res.stderr


def test_status_of_a_cluster_that_is_not_up_fails(env):
    res = script(env, "status", "--name", "nosuch")
    assert res.returncode != 0 and "no cluster 'nosuch' is up" in res.stderr


def test_help_names_the_commands():
    res = subprocess.run(["bash", str(SCRIPT), "--help"], check=False, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0
    for command in ("up N", "status", "down", "--workers-per-node", "PYTHON"):
        assert command in res.stdout


@pytest.mark.parametrize("args, message", [
    (("up",), "up needs N"),
    (("up", "0"), "N must be an integer >= 1"),
    (("up", "2", "--name", "a/b"), "--name must be"),
    (("up", "2", "--bogus"), "unknown option"),
    (("frobnicate",), "unknown command"),
])
def test_bad_arguments_fail_before_anything_starts(env, args, message):
    res = script(env, *args)
    assert res.returncode != 0 and message in res.stderr, res.stderr
    assert os.listdir(env["SPLITKEY_CLUSTER_DIR"]) == []
