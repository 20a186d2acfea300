"""What one point of a sweep measured, under the names serving benchmarks use (docs/LOADTEST.md, "Metrics").

A :class:`Sample` is one request as the load generator saw it; :func:`summarize`
turns a point's samples into :class:`PointMetrics`. :func:`run_level` is the plain
closed loop the benchmark scripts share.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from service.client.errors import SplitkeyError
from service.client.loadtest.arrivals import closed_loop
from service.client.sync import Client
from service.client.upload import ATTEMPT_ERRORS

#: Server-Timing stages reported per point (docs/SERVICE.md), in request order.
STAGES = ("parse", "lookup", "scatter", "compute", "worker", "merge", "encode", "total")
#: A point's latency percentiles rest on its completed requests: below this many they are rough
#: (a p99 of 5 samples is their maximum), and the reports say so.
MIN_SAMPLES = 20


@dataclass
class Sample:
    """One request: when it was due (seconds after the point began), how long it took, how it ended."""

    index: int
    due_s: float
    latency_s: float
    status: int  # HTTP status of the answer; 0 when no answer came
    code: str = ""  # the error's contract code ("" for 200); the exception's name when no answer came
    stages: dict[str, float] = field(default_factory=dict)  # Server-Timing, seconds
    keys: int = 0
    n_q: int = 0
    verified: bool = False
    error: float | None = None  # |answer - float64 reference| (reference.error) when verified

    @property
    def ok(self) -> bool:
        return self.status == 200


def outcome(exc: BaseException) -> tuple[int, str]:
    """``(status, code)`` of a failed request."""
    if isinstance(exc, SplitkeyError):
        return exc.status, exc.code or "error"
    return 0, type(exc).__name__


@dataclass
class PointMetrics:
    """One point: a mode, a context length, and a concurrency or a rate."""

    mode: str
    n_k: int
    arrival: str  # "concurrency" or "rate"
    load: float  # the concurrency level, or the offered rate in requests/s
    completed: int
    failed: int
    failed_by: dict[str, int]  # "429 too_many_requests" -> count
    duration_s: float
    requests_per_s: float
    pairs_per_s: float  # query-key pairs attended per second (n_q * keys per request)
    kv_gb_per_s: float  # GB of K+V the requests' keys hold, per second
    latency_mean_ms: float
    latency_p50_ms: float
    latency_p90_ms: float
    latency_p99_ms: float
    latency_max_ms: float
    slo_ms: float | None
    goodput_per_s: float | None  # completed within the SLO, per second
    slo_attainment: float | None  # share of all requests (failed ones miss) completed within the SLO
    stages_ms: dict[str, float]  # median of each Server-Timing stage
    verified: int = 0
    wrong: int = 0
    max_error: float | None = None
    keys_per_s: float = 0.0  # keys the completed requests read, per second
    warnings: list[str] = field(default_factory=list)  # e.g. percentiles resting on too few samples

    @property
    def thin(self) -> bool:
        """Whether its percentiles rest on fewer than :data:`MIN_SAMPLES` completed requests (and at least one)."""
        return 0 < self.completed < MIN_SAMPLES

    @property
    def label(self) -> str:
        load = f"c={int(self.load)}" if self.arrival == "concurrency" else f"rate={self.load:g}/s"
        return f"{self.mode} n_k={self.n_k} {load}"


#: Names ``--fail-on`` may compare: the numeric fields of PointMetrics.
METRICS = tuple(f.name for f in fields(PointMetrics)
                if f.type in ("int", "float", "float | None") and f.name not in ("n_k", "load"))


def _percentile(ms: np.ndarray, q: float) -> float:
    return float(np.percentile(ms, q)) if ms.size else math.nan


def summarize(samples: Sequence[Sample], wall_s: float, *, mode: str, n_k: int, arrival: str, load: float,
              key_bytes: int, slo_ms: float | None) -> PointMetrics:
    """The metrics of one point from its samples (the requests that finished) and its wall time."""
    ok = [s for s in samples if s.ok]
    ms = np.array([s.latency_s * 1000 for s in ok])
    per_s = 1.0 / wall_s if wall_s > 0 else 0.0
    failed_by = Counter(f"{s.status} {s.code}" for s in samples if not s.ok)
    good = sum(1 for s in ok if slo_ms is not None and s.latency_s * 1000 <= slo_ms)
    stages = {name: float(np.median([s.stages[name] for s in ok if name in s.stages])) * 1000
              for name in STAGES if any(name in s.stages for s in ok)}
    errors = [s.error for s in samples if s.verified and s.error is not None]
    return PointMetrics(
        mode=mode, n_k=n_k, arrival=arrival, load=load, completed=len(ok), failed=len(samples) - len(ok),
        failed_by=dict(sorted(failed_by.items())), duration_s=wall_s, requests_per_s=len(ok) * per_s,
        pairs_per_s=sum(s.n_q * s.keys for s in ok) * per_s, kv_gb_per_s=sum(s.keys for s in ok) * key_bytes * per_s / 1e9,
        latency_mean_ms=float(ms.mean()) if ms.size else math.nan, latency_p50_ms=_percentile(ms, 50),
        latency_p90_ms=_percentile(ms, 90), latency_p99_ms=_percentile(ms, 99),
        latency_max_ms=float(ms.max()) if ms.size else math.nan, slo_ms=slo_ms,
        goodput_per_s=good * per_s if slo_ms is not None else None,
        slo_attainment=(good / len(samples) if samples else math.nan) if slo_ms is not None else None,
        stages_ms=stages, verified=len(errors), wrong=0, max_error=max(errors) if errors else None,
        keys_per_s=sum(s.keys for s in ok) * per_s,
        warnings=[f"p50, p90 and p99 rest on {len(ok)} completed requests, fewer than {MIN_SAMPLES}: rough (raise "
                  "--requests or --duration)"] if 0 < len(ok) < MIN_SAMPLES else [])


# ------------------------------------------------------------------ the benchmarks' closed loop


@dataclass
class Level:
    """A closed-loop level of :func:`run_level`: latency percentiles and throughput of the completed requests."""

    concurrency: int
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    per_second: float


def run_level(make_client: Callable[[], Client], request: Callable[[Client], object], concurrency: int,
              max_requests: int, max_seconds: float) -> Level:
    """``concurrency`` clients send ``request(client)`` until either bound; errors are counted, not raised."""

    def timed(client: Client, i: int, due: float) -> Sample:
        try:
            request(client)
        except ATTEMPT_ERRORS as exc:
            status, code = outcome(exc)
            return Sample(i, 0.0, time.perf_counter() - due, status, code)
        return Sample(i, 0.0, time.perf_counter() - due, 200)

    samples, wall = closed_loop(make_client, timed, concurrency, max_requests, max_seconds)
    m = summarize(samples, wall, mode="", n_k=0, arrival="concurrency", load=concurrency, key_bytes=0, slo_ms=None)
    return Level(concurrency, m.completed, m.failed, wall, m.latency_p50_ms, m.latency_p90_ms, m.latency_p99_ms,
                 m.requests_per_s)
