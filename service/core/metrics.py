"""Prometheus metrics of one app instance (its own registry, so tests can run several),
and the per-request stage timings that feed them and the ``Server-Timing`` header."""

from __future__ import annotations

import bisect
import collections
import importlib.metadata
import platform
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from service.core import VERSION

#: Stages of a request: an attention request is parse, lookup (the named contexts' records, from
#: the front end's cache or the directory; absent without contexts), scatter, compute, merge, encode,
#: and within compute, worker (the longest pass a worker ran for it: its kernels and local merge);
#: a context write is parse, place (pick workers), put (into Ray's object store), store
#: (the workers copy the keys in), commit (the directory, and the record on each holder).
STAGES = ("parse", "lookup", "scatter", "compute", "worker", "merge", "encode", "place", "put", "lease", "store", "commit", "note", "total")
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


#: Where the stages of the request this task serves go as intervals: set per request by the tracing
#: middleware (``service.tracing``), only when tracing is on; None otherwise.
RECORDING: ContextVar[list[tuple[str, float, float]] | None] = ContextVar("splitkey_stage_spans", default=None)
#: The W3C ``traceparent`` of the request's server span while tracing (service.tracing), for the workers'
#: calls to carry (``workers.tasks.ShardQuery.trace``); None: not traced.
TRACEPARENT: ContextVar[str | None] = ContextVar("splitkey_traceparent", default=None)


@dataclass
class Timings:
    """Seconds spent per stage of one request (``STAGES``); while a trace records the request
    (``service.tracing``), also each stage's interval as ``(stage, start, end)`` in ``perf_counter``
    seconds (``spans``: the list the tracing middleware set in ``RECORDING``; None without tracing)."""

    stages: dict[str, float] = field(default_factory=dict)
    spans: list[tuple[str, float, float]] | None = field(default_factory=RECORDING.get)

    def add(self, stage: str, seconds: float) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds
        if self.spans is not None:  # a stage is added as it ends
            end = time.perf_counter()
            self.spans.append((stage, end - seconds, end))

    @contextmanager
    def measure(self, stage: str) -> Iterator[None]:
        """Add the time the ``with`` block takes to ``stage``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - t0)

    def header(self) -> str:
        """The ``Server-Timing`` header value: ``parse;dur=1.234, ...`` in milliseconds."""
        return ", ".join(f"{name};dur={sec * 1000:.3f}" for name, sec in self.stages.items())


class StageHistograms:
    """``splitkey_request_stage_seconds{route, stage}``: a histogram kept as plain counts, rendered when scraped.

    A query records 6-7 stages; prometheus_client's ``Histogram`` takes a few us per
    observation (a lock, checks and two counter updates each), here one lock is taken per
    request and each stage is a bisect and two additions. Exposed as that ``Histogram``
    would be, without its ``_created`` series. Series are (route, stage) pairs: both come
    from fixed sets (routes: service.middleware; stages: ``STAGES``).
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self._bounds = [*buckets, float("inf")]
        self._les = [floatToGoString(b) for b in self._bounds]
        #: (route, stage) -> [observations per bucket (not cumulative)..., sum of the values]
        self._series: dict[tuple[str, str], list[float]] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, route: str, stages: Mapping[str, float]) -> None:
        with self._lock:
            for stage, seconds in stages.items():
                series = self._series.get((route, stage))
                if series is None:
                    series = self._series[(route, stage)] = [0.0] * (len(self._bounds) + 1)
                series[bisect.bisect_left(self._bounds, seconds)] += 1  # the first bucket whose le >= seconds
                series[-1] += seconds

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["route", "stage"])
        with self._lock:
            snapshot = {key: list(series) for key, series in self._series.items()}
        for (route, stage), series in sorted(snapshot.items()):
            family.add_metric([route, stage], list(zip(self._les, accumulate(series[:-1]))), sum_value=series[-1])
        yield family


class Totals:
    """A counter whose counts are kept elsewhere (the repair loop, the record cache, each worker's own
    count, read at its last ping): ``set`` records the count read when scraped, and it is exported as a
    Prometheus counter (``<name>_total``). A worker that restarts counts from 0 again, which Prometheus
    reads as a counter reset."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...], registry: CollectorRegistry) -> None:
        if name.endswith("_total"):
            raise ValueError(f"name must be given without its _total suffix (added when exported), got {name!r}")
        self.name, self.documentation, self.labels = name, documentation, labels
        self._values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def set(self, value: float, *labels: str) -> None:
        if len(labels) != len(self.labels):
            raise ValueError(f"labels must be values for {', '.join(self.labels) or 'no label'}, got {labels!r}")
        self._values[labels] = float(value)

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labels)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, value in sorted(self._values.items()):
            family.add_metric(list(labels), value)
        yield family


def build_labels() -> dict[str, str]:
    """``splitkey_build_info``'s labels: this release (``service.core.VERSION``), Python's and Ray's (read from
    its installed package's metadata, without importing Ray)."""
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    return {"version": VERSION, "python": platform.python_version(), "ray": version("ray")}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        build = build_labels()
        Gauge("splitkey_build_info", "Always 1: the version of splitkey this front end runs, and of Python and "
              "Ray under it.", list(build), registry=r).labels(**build).set(1)
        self.stage_seconds = StageHistograms(
            "splitkey_request_stage_seconds", "Seconds per request stage (service.core.metrics.STAGES).", BUCKETS, r)
        self.requests = Counter("splitkey_requests", "Requests by route and status code.", ["route", "code"], registry=r)
        self.batch_items = Counter("splitkey_batch_items", "Items of batch requests by their own status code "
                                   "(200, or the item's error).", ["code"], registry=r)
        self.bytes_in = Counter("splitkey_request_body_bytes", "Request body bytes read.", ["route"], registry=r)
        self.bytes_out = Counter("splitkey_response_body_bytes", "Response body bytes written.", ["route"], registry=r)
        self.inflight = Gauge("splitkey_inflight_requests", "Requests admitted and not finished.", registry=r)
        self.inflight_body_bytes = Gauge("splitkey_inflight_body_bytes", "Request body bytes received and held "
                                         "(service.core.admission).", registry=r)
        self.rejected = Counter("splitkey_rejected_requests", "Requests refused by admission control (inflight, "
                                "body_bytes), closed for a slow body (slow_body), or whose answer was cut because the "
                                "client read it too slowly (slow_answer).", ["reason"], registry=r)
        self.workers = Gauge("splitkey_workers", "Shard workers by state.", ["state"], registry=r)
        self.worker_bytes = Gauge("splitkey_worker_held_bytes", "Resident context bytes per worker.", ["worker"],
                                  registry=r)
        self.worker_expired = Totals("splitkey_worker_expired_jobs", "Jobs each worker skipped since it started "
                                     "because their request's deadline had passed (as of its last ping).", ("worker",), r)
        self.worker_kernel = Gauge("splitkey_worker_cpu_kernel", "1 for the CPU kernel each worker serves "
                                   "decode-shaped calls with (numpy or fused), 0 for the other (as of its last ping).",
                                   ["worker", "kernel"], registry=r)
        self.worker_kernel_since = Gauge("splitkey_worker_cpu_kernel_since_seconds", "When (Unix time) each worker "
                                         "began serving with its CPU kernel: its start, or the switch to fused.",
                                         ["worker"], registry=r)
        self.contexts = Gauge("splitkey_contexts", "Resident contexts in the directory.", registry=r)
        self.shards = Gauge("splitkey_context_shards", "Context shards below their replica count (under_replicated) "
                            "or with no live replica (lost).", ["state"], registry=r)
        self.repairs = Totals("splitkey_replicas_rebuilt", "Replicas the repair loop rebuilt since start.", (), r)
        self.repair_rounds = Totals("splitkey_repair_rounds", "Rounds the repair loop has begun since start (it is "
                                    "alive while this grows).", (), r)
        self.record_cache_lookups = Totals("splitkey_record_cache_lookups", "Context resolutions since start, "
                                           "answered from this front end's record cache (hit) or from the directory "
                                           "(miss).", ("result",), r)
        self.record_cache_stale = Totals("splitkey_record_cache_stale", "Cached records a worker refused as stale "
                                         "since start.", (), r)
        self.record_cache_entries = Gauge("splitkey_record_cache_entries", "Context records this front end's cache "
                                          "holds.", registry=r)

        #: Labelled children of the per-request metrics, by (metric, label values): ``labels()`` checks
        #: and locks on every call (a few us each, several per request on the hot routes); the children
        #: themselves live as long as their metric. Bounded: routes are a fixed set (service.middleware).
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def _child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def count_request(self, route: str, code: int, bytes_in: int = 0, bytes_out: int = 0) -> None:
        """One request of ``route`` at its end: answered with status ``code`` (0: its answer is counted
        elsewhere), ``bytes_in`` body bytes read and ``bytes_out`` written."""
        if code:
            self._child(self.requests, route, str(code)).inc()
        if bytes_in:
            self._child(self.bytes_in, route).inc(bytes_in)
        if bytes_out:
            self._child(self.bytes_out, route).inc(bytes_out)

    def count_batch_items(self, codes: Iterable[int]) -> None:
        """The items of one answered batch, each by its own status code."""
        for code, n in collections.Counter(codes).items():
            self._child(self.batch_items, str(code)).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
