"""The service as a Ray Serve application: the same FastAPI app, in several replicas behind
Serve's HTTP proxy (docs/DEPLOY.md "Ray Serve").

Each replica is one front end: its app's lifespan joins the cluster it runs in and the
shared, named shard workers and contexts directory (detached actors, so they outlive any
replica). A context created through one replica is visible through every other: the
directory holds the records, and no replica keeps state of its own.

Settings come from ``SPLITKEY_*`` variables (a RayService's ``runtime_env.env_vars``);
``ray_address`` defaults to ``auto`` here, the cluster the replica runs in.

* In a cluster: ``serve run service.serve:app`` or the RayService of deploy/k8s.
* On one machine: ``python -m service.serve --port 8000 --replicas 2`` starts an embedded
  Ray on loopback, Serve's proxy on 127.0.0.1 and the replicas, and stops them on SIGTERM.
  Each replica also opens Ray Serve's inter-deployment gRPC server, on every interface
  (Ray 2.60 binds it to ``[::]:0``, with no setting to change it): on a machine others can
  reach, firewall those ports or run ``splitkey serve``, which listens on loopback only.
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence

from ray import serve
from ray.serve import Deployment

from service.app import create_app
from service.core.settings import ServiceSettings

#: The Serve deployment's name (deploy/k8s/rayservice.yaml configures it under this name).
DEPLOYMENT = "SplitkeyIngress"
#: Requests a replica takes at once: the app's own admission control answers 429 past
#: ``max_inflight``; Serve's default (5) would queue requests in front of it instead.
MAX_ONGOING_REQUESTS = 64


def replica_settings() -> ServiceSettings:
    """The settings from the environment, joined to the replica's own cluster unless told otherwise."""
    settings = ServiceSettings()
    if settings.ray_address is None:
        settings = settings.model_copy(update={"ray_address": "auto"})
    return settings


fastapi_app = create_app(replica_settings(), request_id_header=False)  # Serve's proxy writes X-Request-Id


@serve.ingress(fastapi_app)
class Replica:
    """One replica: the FastAPI app of service.app does all the work."""


SplitkeyIngress: Deployment = serve.deployment(name=DEPLOYMENT, num_replicas=2,
                                               max_ongoing_requests=MAX_ONGOING_REQUESTS)(Replica)


app = SplitkeyIngress.bind()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the application on this machine until SIGTERM or SIGINT (see the module docstring)."""
    import ray

    from service.cluster.connect import connect, disconnect

    p = argparse.ArgumentParser(prog="python -m service.serve", description="splitkey on Ray Serve, on this machine")
    p.add_argument("--port", type=int, default=8000, help="port of Serve's HTTP proxy on 127.0.0.1 (default 8000)")
    p.add_argument("--replicas", type=int, default=2, help="front-end replicas (default 2)")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error(f"--replicas must be >= 1, got {args.replicas}")
    started = connect(ServiceSettings())  # embedded Ray on loopback (service.cluster.connect)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        # The replicas reserve no CPU here: on one machine the shard workers get them all
        # (a cluster's RayService gives each replica its own, deploy/k8s/rayservice.yaml).
        deployment = SplitkeyIngress.options(num_replicas=args.replicas, ray_actor_options={"num_cpus": 0})
        serve.run(deployment.bind(), name="splitkey", route_prefix="/")
        print(f"splitkey on Ray Serve: http://127.0.0.1:{args.port} ({args.replicas} replicas)", flush=True)
        stop.wait()
    finally:
        if ray.is_initialized():
            serve.shutdown()
        disconnect(started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
