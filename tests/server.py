"""A real ``splitkey serve`` in a subprocess on a free loopback port, for end-to-end tests.

Each server gets its own HOME (Ray writes its auth token there), its settings
through ``SPLITKEY_*`` environment variables and CLI flags, and is waited for on
``/readyz``. ``stop()`` terminates it and its embedded Ray.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
                 startup_s: float = 120.0) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.startup_s = startup_s
        self.log_path = home / f"server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, api_key: str | None = None) -> Server:
        self.home.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(self.port), *self.args]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/readyz", headers=headers, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not become ready in {self.startup_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()
        self.proc = None


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
