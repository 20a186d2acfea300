import os
import socket
import subprocess
import sys

import pytest

from service.cli import listen
from service.client import Client


@pytest.mark.ray
def test_serve_with_device_gpu_on_a_cluster_without_gpus_fails_fast(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--port", "0", "--device", "gpu", "--workers", "1"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 1
    assert "the Ray cluster has no GPU" in run.stderr and "Traceback" not in run.stdout + run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("splitkey serve: the start failed: ")


@pytest.mark.ray
def test_more_workers_than_the_cpus_hold_fail_at_once_naming_what_is_missing(tmp_path):
    cpus = os.cpu_count() or 1
    env = {**os.environ, "HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", "0", "--workers", str(cpus + 1)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)  # not Ray's minute-long wait
    assert run.returncode == 1 and "Traceback" not in run.stdout + run.stderr
    assert (f"workers must fit the cluster: {cpus + 1} new worker(s) x 1 CPU each need {cpus + 1} CPU, the cluster "
            f"has {cpus} free of {cpus}") in run.stdout + run.stderr
    assert "--worker-cpus" in run.stdout + run.stderr


@pytest.mark.ray
def test_a_smaller_cpu_share_fits_more_workers(tmp_path):
    from server import Server

    cpus = os.cpu_count() or 1
    srv = Server(tmp_path, args=("--workers", str(2 * cpus), "--worker-cpus", "0.5")).start()
    try:
        with Client(srv.url) as c:
            assert len([w for w in c.cluster()["workers"] if w["alive"]]) == 2 * cpus
    finally:
        srv.stop()


def test_serve_on_a_port_in_use_exits_1_naming_it_before_starting_ray(tmp_path):
    """The HTTP socket is bound first (service.cli.listen): a taken port fails in about a second, with
    no Ray started (no session directory under HOME/TMP), instead of after the whole cluster start."""
    env = {**os.environ, "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "RAY_TMPDIR": str(tmp_path)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
                             capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1
    assert f"splitkey serve: cannot listen on 127.0.0.1:{port}: Address already in use" in run.stderr
    assert not list(tmp_path.rglob("session_*")), "Ray must not start when the port is taken"


@pytest.mark.ray
def test_a_port_another_process_listens_on_while_the_server_starts_fails_it_instead_of_a_silent_ready(tmp_path):
    """Two servers started on one port a second apart both bound it (SO_REUSEADDR, neither listening
    yet); the one whose listen came second said it was ready and served nothing. It now exits 1."""
    env = {**os.environ, "HOME": str(tmp_path), "SPLITKEY_CPU_KERNELS": "numpy"}
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))  # as another `splitkey serve` binds its port before its cluster starts
        port = other.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--workers", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            lines = []
            while not any("splitkey starting on" in line for line in lines):  # it has bound the port too
                lines.append(proc.stdout.readline())
                assert lines[-1], "".join(lines)
            other.listen()  # ... and the other listens first, while this server's Ray starts
            out = "".join(lines) + proc.communicate(timeout=120)[0]
        finally:
            proc.kill()
    assert proc.returncode == 1, out
    assert (f"splitkey serve: cannot listen on 127.0.0.1:{port}: Address already in use (another process listened "
            "on it while this one started)") in out
    assert "splitkey ready" not in out and "Traceback" not in out

def test_joining_a_ray_address_where_nothing_answers_fails_at_once_naming_it(tmp_path):
    """Ray retries an unreachable GCS for minutes (still at 205 s), the port bound and connections
    refused meanwhile; the start now fails in one line (exit 1)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed below: nothing listens there
    env = {**os.environ, "HOME": str(tmp_path), "RAY_TMPDIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--port", "0", "--ray-address",
                          f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (f"splitkey serve: the start failed: --ray-address 127.0.0.1:{port} "
                                                   "must reach a Ray cluster's GCS, got Connection refused")
    assert "Traceback" not in run.stderr

def test_serve_with_its_grpc_port_in_use_exits_1_naming_it_before_starting_ray(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "RAY_TMPDIR": str(tmp_path)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--port", "0", "--grpc-port", str(port)],
                             capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1
    assert f"splitkey serve: cannot listen on 127.0.0.1:{port} (--grpc-port): Address already in use" in run.stderr
    assert not list(tmp_path.rglob("session_*")), "Ray must not start when the port is taken"


def test_listen_binds_any_free_port_for_port_0_and_takes_bracketed_ipv6():
    with listen("127.0.0.1", 0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1" and sock.getsockname()[1] > 0
    if socket.has_ipv6:
        try:
            six = listen("[::1]", 0)
        except OSError:  # no IPv6 loopback on this machine
            pytest.skip("no ::1 here")
        with six:
            assert six.family == socket.AF_INET6 and six.getsockname()[0] == "::1"


@pytest.mark.ray
def test_workers_that_fail_in_their_constructor_end_the_start_with_their_error_in_one_line(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", "0", "--workers", "1",
           "--persist-dir", "/proc/splitkey-nonexistent"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        "splitkey serve: the start failed: workers did not start: splitkey-worker-0 (FileNotFoundError: [Errno 2] "
        "No such file or directory: '/proc/splitkey-nonexistent')")
    assert "Traceback" not in run.stdout + run.stderr
