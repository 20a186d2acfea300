"""Joining Ray: an embedded local instance on loopback, or an existing cluster."""

from __future__ import annotations

import logging

import ray

from service.settings import ServiceSettings


def connect(settings: ServiceSettings) -> bool:
    """Start an embedded Ray (loopback, no dashboard) or join a cluster; True if we started it."""
    if ray.is_initialized():
        return False
    if settings.ray_address is None:
        # address="local" always starts a new instance: without it ray.init() connects to
        # whatever /tmp/ray/ray_current_cluster or RAY_ADDRESS names (a user's `ray start`
        # cluster, or a dead one a killed process left behind), and embedded would not be.
        ray.init(address="local", namespace=settings.ray_namespace, include_dashboard=False,
                 _node_ip_address="127.0.0.1",
                 logging_level=logging.WARNING, log_to_driver=False, configure_logging=False)
        return True
    ray.init(address=settings.ray_address, namespace=settings.ray_namespace, logging_level=logging.WARNING,
             log_to_driver=False, configure_logging=False)
    return False


def disconnect(started: bool) -> None:
    """Shut down the embedded Ray this process started (a joined cluster stays up)."""
    if started:
        ray.shutdown()
