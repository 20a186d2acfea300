"""Joining Ray: an embedded local instance on loopback, or an existing cluster."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import pathlib
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator

import ray
from ray._private import auto_init_hook, ray_constants
from ray._private import utils as ray_utils

from service.core.settings import ServiceSettings


def connect(settings: ServiceSettings) -> bool:
    """Start an embedded Ray (loopback, no dashboard) or join a cluster; True if we started it."""
    if ray.is_initialized():
        return False
    _no_auto_init()
    verbose = settings.log_level == "debug"
    route_ray_logs(verbose)
    if settings.ray_address is None:
        # address="local" always starts a new instance: without it ray.init() connects to
        # whatever /tmp/ray/ray_current_cluster or RAY_ADDRESS names (a user's `ray start`
        # cluster, or a dead one a killed process left behind), and embedded would not be.
        with _loopback_node(), _signals_left_alone():
            ray.init(address="local", namespace=settings.ray_namespace, include_dashboard=False,
                     _node_ip_address="127.0.0.1",
                     log_to_driver=verbose, configure_logging=False)
        return True
    host_port = _host_port(settings.ray_address)
    if host_port is not None:
        _reachable(*host_port)
    # A cluster on loopback (deploy/local-cluster.sh) registered its nodes as 127.0.0.1: the driver's
    # node must keep that address too, or it never finds its node (the rewrite _loopback_node stops).
    loopback = host_port is not None and _is_loopback(host_port[0])
    with _loopback_node() if loopback else contextlib.nullcontext(), _signals_left_alone():
        ray.init(address=settings.ray_address, namespace=settings.ray_namespace, log_to_driver=verbose,
                 configure_logging=False)
    return False


#: Seconds to reach a joined cluster's GCS before the start fails (Ray itself retries for minutes).
REACH_TIMEOUT_S = 10.0


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``HOST:PORT`` Ray address; None for ``auto`` or another form Ray resolves."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return None
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _reachable(host: str, port: int) -> None:
    """Raise ConnectionError, in one line for ``splitkey serve``, when nothing answers at the cluster's
    address: Ray would retry for minutes, the port bound and every connection refused meanwhile."""
    try:
        socket.create_connection((host, port), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        got = (f"no answer within {REACH_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError)
               else exc.strerror or type(exc).__name__)
        raise ConnectionError(f"--ray-address {host}:{port} must reach a Ray cluster's GCS, got {got}") from None


def _no_auto_init() -> None:
    """Turn off Ray's auto-init in this process: a call through Ray after :func:`disconnect` raises.

    Ray wraps its API (``.remote()``, ``ray.get``) so that a call made while it is not
    connected starts a new local instance. A write that outlives the lifespan (a second
    signal stops the server without waiting for it, ``service.core.drain``) would then
    start a whole Ray on the way out, for seconds, and leave its session behind. Ray reads
    ``RAY_ENABLE_AUTO_CONNECT`` once, at import, into this flag; the service always calls
    ``ray.init`` itself.
    """
    auto_init_hook.enable_auto_connect = False


def route_ray_logs(verbose: bool) -> None:
    """Ray's own Python log lines (``Started a local Ray instance``, ``Connecting to existing Ray cluster``)
    go through the service's log handler, in its format (``--log-format``), instead of the stderr handler
    Ray installs at import: its warnings and errors always, its start-up lines only when ``verbose``
    (``--log-level debug``, which also forwards the workers' output: ``log_to_driver``)."""
    ray_log = logging.getLogger("ray")
    for handler in list(ray_log.handlers):
        ray_log.removeHandler(handler)
    ray_log.propagate = True
    ray_log.setLevel(logging.INFO if verbose else logging.WARNING)


@contextlib.contextmanager
def _signals_left_alone() -> Iterator[None]:
    """``ray.init`` without the SIGTERM handler it installs (``sys.exit`` in the middle of whatever runs):
    the service's drain owns SIGTERM (``service.core.drain``, which keeps one that comes meanwhile)."""
    before = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = before


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Keep an embedded Ray on loopback while it starts.

    ``ray.init`` rewrites a loopback ``_node_ip_address`` to the machine's own IP, and
    Ray's servers (GCS, raylet, workers, agents) then listen on every interface, unless
    cluster mode is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, what Ray does on macOS
    and Windows). Ray reads that variable once, at import, into this constant; it is
    consulted only to choose the node's IP. tests/e2e/test_service_exposure.py lists the
    listening sockets of an embedded instance, so a Ray that changes this shows up there.
    """
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def disconnect(started: bool) -> None:
    """Shut down the embedded Ray this process started (a joined cluster stays up), and remove its
    ``session_*`` folder (logs, sockets, spilled objects) from Ray's temporary directory, with the
    ``session_latest`` link to it: a server that stops leaves nothing of its Ray behind."""
    if not started:
        return
    node = ray._private.worker._global_node
    session = pathlib.Path(node.get_session_dir_path()) if node is not None else None
    ray.shutdown()
    if session is None or not session.name.startswith("session_"):
        return
    shutil.rmtree(session, ignore_errors=True)
    latest = session.parent / "session_latest"
    if latest.is_symlink() and latest.resolve(strict=False) == session.resolve(strict=False):
        latest.unlink(missing_ok=True)


class Reaper:
    """The watcher that ends the embedded Ray's leftovers once this process ends (``service.cluster.reaper``).

    This process holds the write end of a pipe whose read end is the watcher's stdin;
    the pipe closes when this process ends, however it ends.
    """

    def __init__(self) -> None:
        read, self._write = os.pipe()  # both non-inheritable: Ray's processes do not keep the pipe open
        self.proc = subprocess.Popen([sys.executable, "-m", "service.cluster.reaper", str(os.getpid())],
                                     stdin=read, close_fds=True)
        os.close(read)

    def close(self) -> None:
        """Let the watcher end what is left now (after ``ray.shutdown``)."""
        if self._write >= 0:
            os.close(self._write)
            self._write = -1


def start_reaper(started: bool) -> Reaper | None:
    """A :class:`Reaper` for an embedded Ray on Linux; None otherwise (a joined cluster is not ours to end)."""
    if not started or not sys.platform.startswith("linux"):
        return None
    return Reaper()
