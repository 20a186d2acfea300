"""What the app holds: built from the settings at once, and started by the lifespan.

Routes read :class:`AppState` from ``request.app.state.splitkey`` (and the
started :class:`Runtime` through :func:`service.routes.common.runtime`).
Nothing here is global: two apps with different settings can live in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.core.admission import Admission
from service.attention import AttentionService
from service.batch import BatchService
from service.cluster.pool import WorkerPool
from service.contexts.repair import Repairer
from service.contexts.service import ContextService
from service.core.drain import Drain
from service.core.metrics import Metrics
from service.core.settings import ServiceSettings
from service.wire.body import Pace
from service.wire.rules import Limits


@dataclass
class Runtime:
    """The parts the lifespan starts: Ray's workers and the services over them."""

    pool: WorkerPool
    attention: AttentionService
    contexts: ContextService
    repair: Repairer
    batch: BatchService


@dataclass
class AppState:
    """One app's settings, limits, body pace and metrics, and its runtime once the lifespan has started it."""

    settings: ServiceSettings
    limits: Limits
    pace: Pace
    metrics: Metrics
    drain: Drain
    runtime: Runtime | None = None
    admission: Admission | None = None  #: the HTTP routes' admission control, shared by the gRPC server
    grpc_port: int | None = None  #: where the KServe v2 gRPC server listens (service.grpc_server), if it runs
    startup_error: str | None = None  #: why the start-up failed, in one line (service.app.lifespan)
