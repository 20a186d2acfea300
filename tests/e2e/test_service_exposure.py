"""What an embedded `splitkey serve` exposes: every listening socket, of the service and of
the Ray it starts, is on loopback (docs/SECURITY.md)."""

from __future__ import annotations

import numpy as np
import psutil
from server import Server, is_loopback

from service.client import Client


def listening(root_pid: int) -> list[tuple[int, str, str, int]]:
    """``(pid, process name, ip, port)`` of every listening TCP/UDP socket of ``root_pid`` and its descendants."""
    root = psutil.Process(root_pid)
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr):  # TCP listen, or an unconnected UDP socket
                out.append((proc.pid, name, c.laddr.ip, c.laddr.port))
    return out


def test_embedded_ray_and_the_service_listen_only_on_loopback(tmp_path, rng):
    # The tests' conftest turns Ray's cluster mode off for the clusters tests build
    # themselves; this server gets Linux's default back, as a user's `splitkey serve` has.
    srv = Server(tmp_path, args=("--workers", "2"), env={"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}).start()
    try:
        assert srv.proc is not None
        k = rng.standard_normal((512, 2, 16), dtype=np.float32)
        with Client(srv.url) as c:
            ctx = c.create_context(k, k)  # the workers and the directory actor are up and have served
            c.attention(rng.standard_normal((1, 4, 16), dtype=np.float32), contexts=[ctx["id"]])
        sockets = listening(srv.proc.pid)
        names = {name for _, name, _, _ in sockets}
        # what was listed: the front end (uvicorn), GCS, raylet and at least one Ray worker
        assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), sockets
        assert any(port == srv.port for _, _, _, port in sockets)
        exposed = [s for s in sockets if not is_loopback(s[2])]
        assert exposed == [], f"listening beyond loopback: {exposed}"
    finally:
        srv.stop()
