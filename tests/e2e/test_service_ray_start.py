"""`splitkey serve --ray-address auto` joins a cluster started by `ray start --head`."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from reference import assert_close_to_reference
from server import Server, free_port, stop_front_end

from service.client import Client

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def head(tmp_path):
    """`ray start --head --block` on loopback, in its own process group (ended without `ray stop`,
    which would end every Ray on the machine).

    On SIGTERM Ray drains the node first, waiting up to RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
    (30 s) for leases to come back; the detached workers a joined front end leaves keep theirs,
    so the head took 31.5 s to end. The drain is not what these tests check: it is off here.
    """
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    port = free_port()
    proc = subprocess.Popen([ray_cli, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                             "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"],
                            stdout=(tmp_path / "ray.log").open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
    time.sleep(1)
    yield f"127.0.0.1:{port}"
    stop_front_end(proc, timeout_s=60)


def test_serve_joins_a_ray_start_head_cluster_with_auto(head, tmp_path):
    srv = Server(tmp_path / "fe", args=("--ray-address", "auto", "--workers", "2"), env={"RAY_ADDRESS": head})
    srv.start()
    try:
        rng = np.random.default_rng(0)
        q = rng.standard_normal((2, 4, 16)).astype(np.float32)
        k = rng.standard_normal((300, 2, 16)).astype(np.float32)
        with Client(srv.url) as c:
            out, lse = c.attention(q, k, k, causal=True)
            assert c.cluster()["workers"][0]["alive"]
        assert_close_to_reference(out, lse, q, k, k, causal=True)
    finally:
        srv.stop()


def test_embedded_serve_starts_its_own_ray_whatever_ray_address_names(tmp_path):
    # Without --ray-address the service must start its own Ray, never join (or hang on)
    # a cluster named by RAY_ADDRESS or by a stale /tmp/ray/ray_current_cluster.
    srv = Server(tmp_path / "fe", args=("--workers", "1"), env={"RAY_ADDRESS": "127.0.0.1:1"}, startup_s=90)
    srv.start()
    try:
        with Client(srv.url) as c:
            assert len(c.cluster()["workers"]) == 1
    finally:
        srv.stop()
