"""Stage timings and the metrics registry of one app."""

import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from service.core.metrics import BUCKETS, Metrics, Timings


def test_timings_accumulate_and_render_server_timing():
    t = Timings()
    t.add("parse", 0.001)
    t.add("parse", 0.002)
    t.add("merge", 0.0005)
    assert t.stages == pytest.approx({"parse": 0.003, "merge": 0.0005})
    assert t.header() == "parse;dur=3.000, merge;dur=0.500"
    assert np.isfinite(sum(t.stages.values()))


def test_timings_know_only_the_stages_of_a_request():
    with pytest.raises(ValueError, match="stage must be one of parse, lookup, scatter, .*, total, got 'prase'"):
        Timings().add("prase", 0.1)


def test_a_measured_block_adds_its_time_even_when_it_raises():
    t = Timings()
    with pytest.raises(KeyError), t.measure("store"):
        time.sleep(0.01)
        raise KeyError("x")
    with t.measure("store"):
        pass
    assert 0.01 <= t.stages["store"] < 5 and list(t.stages) == ["store"]


def test_stage_timings_feed_the_histogram_of_their_route():
    m = Metrics()
    t = Timings()
    t.add("compute", 0.25)
    m.observe_stages("/v1/attention", t)
    text = m.render().decode()
    assert 'splitkey_request_stage_seconds_count{route="/v1/attention",stage="compute"} 1.0' in text
    assert 'splitkey_request_stage_seconds_sum{route="/v1/attention",stage="compute"} 0.25' in text


def test_stage_histograms_render_as_prometheus_clients_histogram_would(rng):
    """The same observations give the same buckets, counts and sums as a prometheus_client
    Histogram (whose ``_created`` series we do not export), values on bucket edges included."""
    m = Metrics()
    registry = CollectorRegistry()
    ref = Histogram("splitkey_request_stage_seconds", "Seconds per request stage (service.core.metrics.STAGES).",
                    ["route", "stage"], buckets=BUCKETS, registry=registry)
    values = [*BUCKETS, 0.0, 1e-9, 500.0, *rng.exponential(0.01, 200)]
    for i, sec in enumerate(values):
        route, stage = ("/v1/attention", "compute") if i % 3 else ("/v1/contexts", "store")
        t = Timings()
        t.add(stage, float(sec))
        m.observe_stages(route, t)
        ref.labels(route, stage).observe(float(sec))

    def lines(text: bytes) -> list[str]:
        return sorted(line for line in text.decode().splitlines()
                      if "splitkey_request_stage_seconds" in line and "_created" not in line)
    ours = lines(m.render())
    assert len(ours) == 2 + 2 * (len(BUCKETS) + 3) and ours == lines(generate_latest(registry))


def test_stage_histograms_lose_no_observation_across_threads():
    m = Metrics()
    t = Timings()
    t.add("parse", 0.001)
    t.add("compute", 0.002)

    def observe() -> None:
        for _ in range(2000):
            m.observe_stages("/v1/attention", t)
    threads = [threading.Thread(target=observe) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    text = m.render().decode()
    for stage in ("parse", "compute"):
        assert f'splitkey_request_stage_seconds_count{{route="/v1/attention",stage="{stage}"}} 8000.0' in text
