"""``run_sweep(config) -> SweepResult``: the load generator as a library (docs/LOADTEST.md).

For each context length, each mode: set the workload up (upload what it reads),
run each arrival point after a few warm-up requests, check the sampled answers
against the float64 reference in one pass over the keys, and tear down. Contexts
are deleted at the end, also when the sweep is interrupted (Ctrl-C) or fails.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import numpy as np

from service.client.loadtest.arrivals import closed_loop, open_loop
from service.client.loadtest.config import SweepConfig
from service.client.loadtest.data import Source
from service.client.loadtest.metrics import PointMetrics, Sample, outcome, summarize
from service.client.loadtest.progress import LiveLine, UploadProgress
from service.client.loadtest.reference import Expected, answers64, error
from service.client.loadtest.workloads import WORKLOADS, Call, Contexts, Workload
from service.client.sync import Client
from service.client.timing import parse_server_timing
from service.client.upload import ATTEMPT_ERRORS


@dataclass
class SweepResult:
    """The points of a sweep, the requests if kept, and what went wrong."""

    config: SweepConfig
    points: list[PointMetrics] = field(default_factory=list)
    requests: dict[str, list[Sample]] = field(default_factory=dict)  # point label -> its samples (per_request)
    failures: list[str] = field(default_factory=list)  # one line per distinct failure
    environment: dict[str, Any] = field(default_factory=dict)
    uploads: list[dict[str, Any]] = field(default_factory=list)  # each upload's keys, GB, seconds and GB/s
    interrupted: bool = False

    @property
    def wrong(self) -> int:
        return sum(p.wrong for p in self.points)

    @property
    def failed(self) -> int:
        return sum(p.failed for p in self.points)

    def violations(self) -> list[str]:
        """``--fail-on`` thresholds some point crossed: ``"decode n_k=1024 c=4: p99_ms>500 (got 612)"``. A
        point where the metric has no value (no request completed, none verified) fails its gate too: a
        threshold that could not be checked is not passed."""
        out = []
        for p in self.points:
            for rule in self.config.fail_on:
                value = getattr(p, rule.metric)
                if value is None or math.isnan(float(value)):
                    out.append(f"{p.label}: {rule} (got no value)")
                elif rule.violated(float(value)):
                    out.append(f"{p.label}: {rule} (got {float(value):.4g})")
        return out

    def passed(self) -> bool:
        return not (self.wrong or self.failed or self.violations() or self.interrupted)

    def to_json(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        cfg.pop("api_key", None)  # never written out
        cfg["fail_on"] = [str(f) for f in self.config.fail_on]
        doc: dict[str, Any] = {"config": cfg, "environment": self.environment, "interrupted": self.interrupted,
                               "failures": self.failures, "uploads": self.uploads,
                               "points": [asdict(p) for p in self.points]}
        if self.requests:
            doc["requests"] = {label: [asdict(s) for s in samples] for label, samples in self.requests.items()}
        return doc


@dataclass
class _Checked:
    """A sampled request kept for verification: its sample, what it asked, its answer."""

    sample: Sample
    asked: Expected
    out: np.ndarray
    lse: np.ndarray


class _Point:
    """Sends the requests of one point and records them."""

    def __init__(self, workload: Workload, config: SweepConfig, live: LiveLine | None, first: int) -> None:
        self.workload, self.config, self.live, self.first = workload, config, live, first
        self.t0 = time.perf_counter()
        self.checked: list[_Checked] = []
        self.failures: dict[str, str] = {}
        self.lock = threading.Lock()

    def request(self, client: Client, i: int, due: float) -> Sample:
        call: Call = self.workload.call(i)
        stages: dict[str, float] = {}
        try:
            out, lse = call.send(client)
            status, code = 200, ""
            stages = parse_server_timing(client.last_server_timing if call.timing is None else call.timing)
        except ATTEMPT_ERRORS as exc:
            status, code = outcome(exc)
            with self.lock:
                self.failures.setdefault(f"{status} {code}", f"{status} {code}: {exc}")
        sample = Sample(i, due - self.t0, time.perf_counter() - due, status, code, stages, call.keys, call.n_q)
        if sample.ok and (i - self.first) % self.config.verify_every == 0:  # the point's first request too
            sample.verified = True
            with self.lock:
                self.checked.append(_Checked(sample, call.expected(), out, lse))
        if self.live is not None:
            self.live.add(sample.ok, sample.latency_s)
        return sample


def environment(admin: Client, config: SweepConfig) -> dict[str, Any]:
    """Where and on what the sweep ran: date, the load generator's host and machine, the shape and dtype,
    and the service's version, workers and device (what each plot's footer says too)."""
    shape = config.shape
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "client_machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "url": admin.url,
        "shape": f"h_q={shape.h_q} h_kv={shape.h_kv} d={shape.d} d_v={shape.d_v}",
        "dtype": shape.dtype,
    }
    try:
        cluster = admin.cluster()
        env["server_version"] = cluster.get("version", "unknown")
        env["service_workers"] = len(cluster.get("workers", []))
        env["service_device"] = cluster.get("device")
    except ATTEMPT_ERRORS as exc:
        env["server_version"] = env["service_workers"] = f"unknown ({exc})"
    return env


def run_sweep(config: SweepConfig, *, stream: TextIO | None = None, stop: threading.Event | None = None) -> SweepResult:
    """Run every point of ``config`` against the service; progress on ``stream`` (default stderr; os.devnull to hush).

    Raises what the setup of a workload raises (an upload the server refuses, an
    inline body over its limit) after deleting what was stored; failed requests
    during the points are counted, not raised.
    """
    stream = sys.stderr if stream is None else stream
    stop = stop or threading.Event()
    result = SweepResult(config)
    source = Source(config.seed, config.shape)
    admin = Client(config.url, api_key=config.api_key)
    result.environment = environment(admin, config)

    def progress_for(label: str, keys: int) -> UploadProgress:
        return UploadProgress(config.shape.key_bytes, stream, label=f"upload {label}", done=result.uploads.append)

    contexts = Contexts(admin, source, config, progress_for)
    failures: dict[str, str] = {}

    def cleanly(what: str, step: Callable[[], object]) -> None:
        """A clean-up step; one that fails (the service went away) is reported, not raised."""
        try:
            step()
        except ATTEMPT_ERRORS as exc:
            failures.setdefault(f"cleanup {what}", f"could not delete {what}: {exc}")

    try:
        for n_k in config.n_k:  # what the server cannot take is refused before any request
            for mode in config.modes:
                WORKLOADS[mode](config, source, n_k).check(admin)
        for n_k in config.n_k:
            for mode in config.modes:
                workload = WORKLOADS[mode](config, source, n_k)
                try:
                    workload.setup(admin, contexts)
                    _run_points(workload, config, result, failures, stream, stop)
                finally:
                    cleanly(f"the contexts of {mode}", functools.partial(workload.teardown, admin))
                if stop.is_set():
                    break
            cleanly(f"the context of {n_k} keys", functools.partial(contexts.drop, n_k))
            if stop.is_set():
                break
    except KeyboardInterrupt:
        result.interrupted = True
        stop.set()
    finally:
        for n_k in list(contexts.ids):
            cleanly(f"the context of {n_k} keys", functools.partial(contexts.drop, n_k))
        admin.close()
    result.failures = sorted(failures.values())
    return result


def _run_points(workload: Workload, config: SweepConfig, result: SweepResult, failures: dict[str, str],
                stream: TextIO, stop: threading.Event) -> None:
    """Warm-up, each arrival point, then the check of the sampled answers; points appended to ``result``."""
    runs: list[tuple[str, float, list[Sample], float, _Point]] = []
    rng = np.random.default_rng([config.seed, len(result.points)])
    interrupted = False
    try:
        _send_points(workload, config, runs, rng, stream, stop)
    except KeyboardInterrupt:  # the finished points are still summarised, unchecked
        stop.set()
        interrupted = True
    # One pass over the keys for every sampled answer of the mode (reference.answers64).
    checked = [] if interrupted else [c for *_, point in runs for c in point.checked]
    for c, (out64, lse64) in zip(checked, answers64(workload.source, [c.asked for c in checked])):
        c.sample.error = error(*c.asked.select(c.out, c.lse), out64, lse64)
    for arrival, load, samples, wall, point in runs:
        if interrupted:
            for s in samples:
                s.verified = False
            point.checked.clear()
        m = summarize(samples, wall, mode=workload.mode, n_k=workload.n_k, arrival=arrival, load=load,
                      key_bytes=config.shape.key_bytes, slo_ms=config.slo_ms)
        errs = [c.sample.error for c in point.checked if c.sample.error is not None]
        m.wrong = sum(1 for e in errs if not e <= config.tolerance)
        if m.wrong:
            failures.setdefault(f"wrong {m.label}", f"{m.label}: {m.wrong} of {len(errs)} checked answers differ from "
                                f"the float64 reference by more than {config.tolerance:g} (largest {max(errs):.3g})")
        failures.update(point.failures)
        result.points.append(m)
        if config.per_request:
            result.requests[m.label] = samples
    if interrupted:
        raise KeyboardInterrupt


def _send_points(workload: Workload, config: SweepConfig, runs: list[tuple[str, float, list[Sample], float, _Point]],
                 rng: np.random.Generator, stream: TextIO, stop: threading.Event) -> None:
    """Each arrival point after its warm-up, appended to ``runs`` as it finishes."""
    def make_client() -> Client:
        return Client(config.url, api_key=config.api_key, retries=0)  # each answer counted as it came: none resent

    index = 0
    for arrival, load in config.points():
        warm = _Point(workload, config, None, index)
        with make_client() as client:
            for _ in range(config.warmup):
                warm.request(client, index, time.perf_counter())
                index += 1
        label = f"{workload.mode} n_k={workload.n_k} " + (f"c={int(load)}" if arrival == "concurrency" else f"rate={load:g}/s")
        point = _Point(workload, config, LiveLine(label, stream), index)
        if arrival == "concurrency":
            samples, wall = closed_loop(make_client, point.request, int(load), config.requests, config.duration_s,
                                        first=index, stop=stop)
        else:
            samples, wall = open_loop(make_client, point.request, load, config.burstiness, config.requests,
                                      config.duration_s, max_inflight=config.max_inflight, first=index, rng=rng,
                                      stop=stop)
        if point.live is not None:
            point.live.close()
        index += len(samples)
        runs.append((arrival, load, samples, wall, point))
        if stop.is_set():
            break
