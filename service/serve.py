"""The service as a Ray Serve application: the same FastAPI app, in several replicas behind
Serve's HTTP proxy (docs/DEPLOY.md "Ray Serve").

Each replica is one front end: its app's lifespan joins the cluster it runs in and the
shared, named shard workers and contexts directory (detached actors, so they outlive any
replica). A context created through one replica is visible through every other: the
directory holds the records, and no replica keeps state of its own.

Settings come from ``SPLITKEY_*`` variables (a RayService's ``runtime_env.env_vars``);
``ray_address`` defaults to ``auto`` here, the cluster the replica runs in.

* In a cluster: ``serve run service.serve:app`` or the RayService of deploy/k8s.
* On one machine: ``python -m service.serve --port 8000`` starts an embedded Ray on loopback,
  Serve's proxy on 127.0.0.1 and the replicas (autoscaled, or ``--replicas N``), and stops them
  on SIGTERM.

Replicas are autoscaled by Serve (``Autoscaling``: its defaults, overridden by the flags of
``python -m service.serve`` or a Serve config's ``autoscaling_config``), and Serve asks each
replica's ``check_health`` every ``HEALTH_CHECK_PERIOD_S``: a replica whose app is not running
(its start failed, or it stopped) is replaced. On an upgrade the workers stay: docs/DEPLOY.md
"Ray Serve".
  Each replica also opens Ray Serve's inter-deployment gRPC server, on every interface
  (Ray 2.60 binds it to ``[::]:0``, with no setting to change it): on a machine others can
  reach, firewall those ports or run ``splitkey serve``, which listens on loopback only.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import ray

from fastapi import FastAPI
from ray import serve
from ray.serve import Deployment

from service.app import create_app
from service.core.settings import ServiceSettings
from service.runtime import AppState

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


@dataclass(frozen=True)
class Autoscaling:
    """Serve's autoscaling of the ingress replicas (its ``autoscaling_config``), with this service's defaults.

    Serve adds replicas while the requests in flight per replica stay above ``target_ongoing_requests``
    for ``upscale_delay_s``, and removes them while below for ``downscale_delay_s``, between
    ``min_replicas`` and ``max_replicas``. The target is half of what a replica takes at once
    (``MAX_ONGOING_REQUESTS``), so replicas are added before the app's own admission control answers
    429; two replicas at least, so that one replaced (a failed health check, an upgrade) leaves one
    answering; the delays are Serve's own defaults.
    """

    min_replicas: int = 2
    max_replicas: int = 8
    target_ongoing_requests: float = MAX_ONGOING_REQUESTS / 2
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"replicas must be 1 <= min_replicas <= max_replicas, got {self.min_replicas} and "
                             f"{self.max_replicas}")
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")

    def config(self) -> dict[str, float]:
        """As Serve's ``autoscaling_config`` takes it."""
        return dataclasses.asdict(self)


#: How often Serve calls a replica's ``check_health``, and how long it waits for an answer (Serve's defaults).
HEALTH_CHECK_PERIOD_S = 10.0
HEALTH_CHECK_TIMEOUT_S = 30.0


def check_replica(state: AppState) -> None:
    """Raise unless the replica's app is running: its start-up done (the runtime set) and Ray connected.

    The workers are not asked: they are shared by every replica, and a lost one is the cluster's to
    replace (``/readyz`` and ``/metrics`` report it); a new replica would not bring it back.
    """
    if state.runtime is None:
        raise RuntimeError("the replica's app must be running to serve, got "
                           + (f"a failed start: {state.startup_error}" if state.startup_error else "none running"))
    if not ray.is_initialized():
        raise RuntimeError("the replica must be connected to Ray, got no connection")


fastapi_app = create_app(replica_settings(), request_id_header=False)  # Serve's proxy writes X-Request-Id


@serve.ingress(fastapi_app)
class Replica:
    """One replica: the FastAPI app of service.app does all the work."""

    def check_health(self) -> None:
        """Serve's health check of this replica (``check_replica``): a replica that fails it is replaced.
        Serve runs a copy of ``fastapi_app`` in the replica (unpickled there), whose lifespan it ran:
        that copy is the ``app`` of the ingress class ``serve.ingress`` made this one a subclass of."""
        app: FastAPI = getattr(self, "app")  # noqa: B009 (set by Serve's ingress wrapper, unknown to the type)
        check_replica(app.state.splitkey)


SplitkeyIngress: Deployment = serve.deployment(
    name=DEPLOYMENT, max_ongoing_requests=MAX_ONGOING_REQUESTS, autoscaling_config=Autoscaling().config(),
    health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S)(Replica)


app = SplitkeyIngress.bind()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the application on this machine until SIGTERM or SIGINT (see the module docstring)."""
    from service.cluster.connect import connect, disconnect

    p = argparse.ArgumentParser(prog="python -m service.serve", description="splitkey on Ray Serve, on this machine")
    p.add_argument("--port", type=int, default=8000, help="port of Serve's HTTP proxy on 127.0.0.1 (default 8000)")
    p.add_argument("--replicas", type=int, default=None,
                   help="a fixed number of front-end replicas (default: autoscaled, as the flags below say)")
    for f in dataclasses.fields(Autoscaling):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                       help=f"Serve's autoscaling_config {f.name} (default {f.default})")
    args = p.parse_args(argv)
    if args.replicas is not None and args.replicas < 1:
        p.error(f"--replicas must be >= 1, got {args.replicas}")
    try:
        scaling = Autoscaling(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Autoscaling)})
    except ValueError as exc:
        p.error(str(exc))
    replicas: dict = ({"num_replicas": args.replicas, "autoscaling_config": None} if args.replicas is not None
                      else {"autoscaling_config": scaling.config()})
    started = connect(ServiceSettings())  # embedded Ray on loopback (service.cluster.connect)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        # The replicas reserve no CPU here: on one machine the shard workers get them all
        # (a cluster's RayService gives each replica its own, deploy/k8s/rayservice.yaml).
        deployment = SplitkeyIngress.options(**replicas, ray_actor_options={"num_cpus": 0})
        serve.run(deployment.bind(), name="splitkey", route_prefix="/")
        shown = f"{args.replicas} replicas" if args.replicas is not None else \
            f"{scaling.min_replicas} to {scaling.max_replicas} replicas, autoscaled"
        print(f"splitkey on Ray Serve: http://127.0.0.1:{args.port} ({shown})", flush=True)
        stop.wait()
    finally:
        if ray.is_initialized():
            serve.shutdown()
        disconnect(started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
