"""Fixtures and settings every tier shares; helpers live beside this file (``reference``, ``server``,
``expect``, ``faults``; on the path through ``pythonpath`` in pyproject.toml).

The tiers (README, "Tests"):

* ``tests/unit/``: no Ray, no server, no INET socket (its conftest fails a test that tries); the inner
  loop, under a minute.
* ``tests/e2e/``: a real ``splitkey serve`` on loopback, a real Ray (``ray.cluster_utils.Cluster`` for
  several nodes), real clients. Marked ``e2e`` by their folder.
* ``tests/bench/``: the benchmark scripts' smoke runs. Marked ``slow`` by their folder.
"""

from __future__ import annotations

import os
import secrets
import zlib

import numpy as np
import pytest

# Every Ray cluster of the test session (embedded ones in server subprocesses, the
# multi-node Cluster of test_service_cluster) runs with Ray's token auth, one token
# for the session, set before Ray is imported anywhere (Ray caches the mode).
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
# Ray rewrites "127.0.0.1" in a cluster address to the machine's own IP unless this
# is off; with it off every test cluster stays on loopback, as tests must.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# One CPU kernel for a server's whole life: under the default ``auto`` a worker switches from NumPy to
# the fused kernel a few seconds after it starts, and the two round differently, so a test comparing
# answers bit for bit (batch against single, before and after a restart) would depend on when it ran.
# Tests of the switch ask for ``auto`` themselves (tests/e2e/test_service_fused.py, the kernels' units).
os.environ.setdefault("SPLITKEY_CPU_KERNELS", "numpy")

#: The tier folders (this file's docstring).
TIERS = ("unit", "e2e", "bench")

@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's name: reproducible, different per test, the same in whichever
    tier folder the test lives (``tests/unit/test_x.py::t`` draws as ``tests/test_x.py::t`` did)."""
    nodeid = request.node.nodeid
    for tier in TIERS:
        nodeid = nodeid.replace(f"tests/{tier}/", "tests/", 1)
    seed = zlib.crc32(nodeid.encode())  # not hash(): str hashes change per process
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A real `splitkey serve` (embedded Ray, two workers) shared by the end-to-end tests.

    Small ``min_shard_keys`` so that test-sized requests really fan out over the
    workers; a moderate body limit so 413 can be tested without sending gigabytes.
    """
    from server import Server

    srv = Server(tmp_path_factory.mktemp("server-home"), args=("--workers", "2"),
                 env={"SPLITKEY_MIN_SHARD_KEYS": "64", "SPLITKEY_MAX_BODY_BYTES": str(64 * 2**20),
                      "SPLITKEY_CONTEXT_SHARD_KEYS": "256"})
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    from service.client import Client

    with Client(server.url) as c:
        yield c


def _module_weight(items: list[pytest.Item]) -> tuple[int, float, int, int]:
    """How early a module should start (smaller first): end-to-end and bench tiers before the unit tier,
    then by the longest timeout its tests declare, the tests marked slow, and the number of tests."""
    tier = items[0].path.parent.name
    timeout = max((float(m.args[0]) for item in items for m in item.iter_markers("timeout") if m.args), default=0.0)
    slow = sum(1 for item in items if item.get_closest_marker("slow") is not None)
    return (0 if tier in ("e2e", "bench") else 1, -timeout, -slow, -len(items))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules in the order they should start: longest expected first.

    ``--dist loadfile`` hands whole modules to the processes in collection order (pyproject.toml turns
    off xdist's own reorder, which puts the modules with the most tests first and so the one-test
    soaks and benchmark smokes of one or two minutes last, where each ran alone at the end of a CI
    run). Within a module the order is kept."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(str(item.path), []).append(item)
    items[:] = [item for group in sorted(modules.values(), key=_module_weight) for item in group]
