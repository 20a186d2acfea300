"""The Ray Serve deployment's autoscaling and health check (service.serve), without starting Serve."""

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve (ray[serve]) is not installed here", exc_type=ImportError)

from service.core.drain import Drain  # noqa: E402
from service.core.metrics import Metrics  # noqa: E402
from service.core.settings import ServiceSettings  # noqa: E402
from service.runtime import AppState  # noqa: E402
from service.serve import MAX_ONGOING_REQUESTS, Autoscaling, SplitkeyIngress, check_replica, main  # noqa: E402


def app_state() -> AppState:
    settings = ServiceSettings()
    return AppState(settings=settings, limits=settings.limits(), pace=settings.pace(), metrics=Metrics(),
                    drain=Drain(settings.shutdown_grace_s))


def test_the_deployment_is_autoscaled_by_the_documented_defaults_below_what_a_replica_admits():
    config = SplitkeyIngress._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == (2, 8, 32)
    assert (config.upscale_delay_s, config.downscale_delay_s) == (30.0, 600.0)
    assert config.target_ongoing_requests < MAX_ONGOING_REQUESTS == SplitkeyIngress.max_ongoing_requests
    assert SplitkeyIngress._deployment_config.health_check_period_s == 10.0


def test_autoscaling_bounds_out_of_order_are_refused_naming_them():
    with pytest.raises(ValueError, match="min_replicas <= max_replicas, got 3 and 2"):
        Autoscaling(min_replicas=3, max_replicas=2)
    with pytest.raises(SystemExit):
        main(["--min-replicas", "0"])


def test_a_replica_whose_app_has_not_started_or_failed_fails_its_health_check():
    state = app_state()
    with pytest.raises(RuntimeError, match="must be running to serve, got none running"):
        check_replica(state)
    state.startup_error = "the workers need 8 CPUs, the cluster has 2"
    with pytest.raises(RuntimeError, match="got a failed start: the workers need 8 CPUs"):
        check_replica(state)
