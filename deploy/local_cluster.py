"""The Python half of ``deploy/local-cluster.sh``: run it with the Python that has Ray.

``start RAY_START_ARGS...``
    Ray's own ``ray start`` for a node that stays on loopback, head or worker (below);
    ``--ray-client-server-port=P`` is dropped where Ray Client is not installed.
``ports K``
    K free TCP ports on 127.0.0.1, one a line.
``token``
    A new random token (64 hex digits).
``wait-nodes ADDRESS N TIMEOUT_S [PID...]``
    Until the cluster at ADDRESS has N live nodes; fails at once if a PID has exited.
``wait-ready URL TIMEOUT_S [PID...]``
    Until ``URL/readyz`` answers 200; fails at once if a PID has exited.

Why ``start`` is not plain ``ray start``: Ray rewrites ``127.0.0.1`` (in
``--node-ip-address`` and in ``--address``) to the machine's own IP, and its servers
then listen on that IP, unless cluster mode is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
read once at import). With cluster mode off, though, ``ray start --address`` refuses to
start a worker node ("Multi-node Ray clusters are not supported on Windows and OSX");
``ray.cluster_utils.Cluster`` gets round that by calling Ray's ``Node`` itself. This runs
Ray's ``ray start`` with two changes, in this process only: cluster mode on (so a worker
node may start) and this machine's IP taken to be 127.0.0.1 (so loopback stays
loopback). The environment keeps ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: the processes
the node starts (GCS, raylet, agents, workers) inherit it and see loopback as their IP.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

LOOPBACK = "127.0.0.1"


def ray_start(args: Sequence[str]) -> int:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants, services
    from ray._private.utils import get_ray_client_dependency_error
    from ray.scripts.scripts import cli

    if get_ray_client_dependency_error() is not None:
        args = without_client_port(args)

    def loopback_ip(address: str | None = None) -> str:
        return LOOPBACK

    ray_constants.ENABLE_RAY_CLUSTER = True
    # resolve_ip_for_localhost turns 127.0.0.1 into this; worker nodes take their IP from it.
    services.get_node_ip_address = loopback_ip
    return cli.main(args=["start", *args], prog_name="ray") or 0


def without_client_port(args: Sequence[str]) -> list[str]:
    """``args`` less ``--ray-client-server-port``: Ray refuses that flag without ``ray[client]`` (grpcio),
    which the README's plain install lacks, and without it starts no client server at all. With it
    installed, the head is given a free port, or Ray's client server would take its fixed 10001."""
    return [a for a in args if not a.startswith("--ray-client-server-port=")]


def free_ports(k: int) -> list[int]:
    """K distinct free ports (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(k):
            s = socket.socket()
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def exited(pids: Sequence[int]) -> list[int]:
    """The PIDs among ``pids`` that no longer run (gone, or a zombie)."""
    gone = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    gone.append(pid)
        except FileNotFoundError:
            gone.append(pid)
    return gone


def wait_nodes(address: str, n: int, timeout_s: float, pids: Sequence[int]) -> int:
    import ray._private.state
    from ray._raylet import GcsClientOptions

    deadline = time.monotonic() + timeout_s
    alive = 0
    state: ray._private.state.GlobalState | None = None
    while time.monotonic() < deadline:
        if gone := exited(pids):
            print(f"process {gone[0]} exited before the cluster had {n} nodes", file=sys.stderr)
            return 1
        try:
            if state is None:
                options = GcsClientOptions.create(address, None, allow_cluster_id_nil=True,
                                                  fetch_cluster_id_if_nil=False)
                state = ray._private.state.GlobalState()
                state._initialize_global_state(options)
            alive = sum(1 for node in state.node_table() if node["Alive"])
            if alive >= n:
                return 0
        except Exception:  # noqa: BLE001 - the GCS is still starting
            state = None
        time.sleep(0.5)
    print(f"the cluster at {address} had {alive} live node(s) of {n} after {timeout_s:g} s", file=sys.stderr)
    return 1


def wait_ready(url: str, timeout_s: float, pids: Sequence[int]) -> int:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if gone := exited(pids):
            print(f"process {gone[0]} exited before {url}/readyz answered 200 (last: {last})", file=sys.stderr)
            return 1
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return 0
                last = f"status {r.status}"
        except urllib.error.HTTPError as e:
            last = f"status {e.code}"
        except OSError as e:
            last = str(e)
        time.sleep(0.5)
    print(f"{url}/readyz did not answer 200 in {timeout_s:g} s (last: {last})", file=sys.stderr)
    return 1


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[0], list(argv[1:])
    if cmd == "start":
        return ray_start(args)
    if cmd == "ports" and len(args) == 1:
        print("\n".join(map(str, free_ports(int(args[0])))))
        return 0
    if cmd == "token" and not args:
        print(secrets.token_hex(32))
        return 0
    if cmd == "wait-nodes" and len(args) >= 3:
        return wait_nodes(args[0], int(args[1]), float(args[2]), [int(p) for p in args[3:]])
    if cmd == "wait-ready" and len(args) >= 2:
        return wait_ready(args[0], float(args[1]), [int(p) for p in args[2:]])
    print(f"unknown command or wrong arguments: {' '.join(argv)}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
