"""A real ``splitkey serve`` in a subprocess on a free loopback port, for end-to-end tests.

Each server gets its own HOME (Ray writes its auth token there), its settings
through ``SPLITKEY_*`` environment variables and CLI flags, and is waited for on
``/readyz``. ``stop()`` terminates it and its embedded Ray.

The server picks its ports itself (``--port 0``, and ``--grpc-port 0`` with ``grpc=True``)
and the harness reads them from its log: a port chosen here and passed in could be taken by
another process (Ray's, a worker's channel) before the server binds it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import psutil

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The lines `splitkey serve` logs with the ports it bound (service.cli, service.grpc_server).
HTTP_PORT_LINE = re.compile(r"splitkey starting on http://\S+:(\d+)")
GRPC_PORT_LINE = re.compile(r"KServe v2 gRPC on \S+:(\d+)")
_serial = itertools.count()


@contextlib.contextmanager
def three_nodes(namespace: str = "splitkey") -> Iterator:
    """Three one-CPU Ray nodes on loopback (``ray.cluster_utils.Cluster``; conftest turns Ray's
    token auth on), this process connected to them in ``namespace``; yields the Cluster."""
    import ray
    from ray.cluster_utils import Cluster

    assert os.environ["RAY_AUTH_MODE"] == "token"
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=namespace, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, home: pathlib.Path, *, args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 startup_s: float = 120.0, grpc: bool = False) -> None:
        self.home = home
        self.port: int | None = None  #: the HTTP port, once started
        self.grpc_port: int | None = None  #: the gRPC port, once started with grpc=True
        self.args = (*args, "--grpc-port", "0") if grpc else args
        self.env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.startup_s = startup_s
        self.log_path = home / f"server-{os.getpid()}-{next(_serial)}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server must be started before its url is known")
        return f"http://127.0.0.1:{self.port}"

    def start(self, api_key: str | None = None) -> Server:
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = self.grpc_port = None  # a restart binds new ones
        cmd = [sys.executable, "-m", "service.cli", "serve", "--port", "0", *self.args]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if self.port is None or (self.grpc_port is None and "--grpc-port" in self.args):
                self._read_ports()
            elif self._ready(headers):
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not become ready in {self.startup_s} s:\n{self.log()}")

    def _read_ports(self) -> None:
        text = self.log()
        if (m := HTTP_PORT_LINE.search(text)) is not None:
            self.port = int(m.group(1))
        if (m := GRPC_PORT_LINE.search(text)) is not None:
            self.grpc_port = int(m.group(1))

    def _ready(self, headers: dict[str, str]) -> bool:
        try:
            return httpx.get(self.url + "/readyz", headers=headers, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the front end alone, as Kubernetes and systemd's ``KillMode=mixed`` send it
        (docs/SERVICE.md, "Stopping it"); SIGKILL to its process group if it is not gone in 30 s,
        and to what is left of the group once it is (nothing leaks into the next test).

        Not SIGTERM to the whole group: that reaches the embedded Ray's processes too, and
        ``ray.shutdown`` then waits on the dead raylet, so the server took 8.6 s to exit
        instead of 2.0 s (measured 2026-12-05), in every test that starts one.
        """
        if self.proc is None:
            return
        stop_front_end(self.proc)
        self._log.close()
        self.proc = None


def stop_front_end(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM to ``proc`` (a ``start_new_session`` process group's leader), SIGKILL to its group after
    ``timeout_s``; then SIGKILL to whatever of the group is still there."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def read_response(sock: socket.socket) -> str:
    """Status line, headers and body of one HTTP/1.1 response read off a raw socket.

    The head and the body may arrive in separate segments: read until the
    Content-Length is satisfied (or the server closes the connection).
    """
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data.decode()
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def shard_worker_pids(root: int) -> list[int]:
    """The ShardWorker processes among ``root``'s descendants (the embedded Ray's workers)."""
    found = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if "ShardWorker" in " ".join(p.cmdline()) or "ShardWorker" in p.name():
                found.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def is_loopback(ip: str) -> bool:
    """Whether a listening address is loopback (IPv4, IPv6, or IPv4 loopback mapped into IPv6)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # ::ffff:127.0.0.1, a dual-stack socket bound to IPv4 loopback
    return addr.is_loopback
