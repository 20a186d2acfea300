"""Stage timings and the metrics registry of one app."""

import importlib.metadata
import platform
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.core.metrics import BUCKETS, Metrics, Timings, Totals


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
    m.stage_seconds.observe("/v1/attention", t.stages)
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
        m.stage_seconds.observe(route, t.stages)
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
            m.stage_seconds.observe("/v1/attention", t.stages)
    threads = [threading.Thread(target=observe) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    text = m.render().decode()
    for stage in ("parse", "compute"):
        assert f'splitkey_request_stage_seconds_count{{route="/v1/attention",stage="{stage}"}} 8000.0' in text


def every_family_with_a_sample() -> Metrics:
    """A registry as a front end with workers and contexts exports it: every family has a series."""
    m = Metrics()
    t = Timings()
    t.add("compute", 0.01)
    m.stage_seconds.observe("/v1/attention", t.stages)
    m.count_request("/v1/attention", 200, bytes_in=10, bytes_out=20)
    m.count_batch_items([200, 404])
    m.inflight.set(1)
    m.inflight_body_bytes.set(5)
    m.rejected.labels(reason="inflight").inc()
    m.workers.labels(state="alive").set(2)
    m.worker_bytes.labels(worker="w0").set(1024)
    m.worker_expired.set(3, "w0")
    m.worker_kernel.labels(worker="w0", kernel="fused").set(1)
    m.worker_kernel_since.labels(worker="w0").set(1.7e9)
    m.contexts.set(4)
    m.shards.labels(state="lost").set(0)
    m.repairs.set(2)
    m.repair_rounds.set(9)
    m.record_cache_lookups.set(7, "hit")
    m.record_cache_lookups.set(1, "miss")
    m.record_cache_stale.set(1)
    m.record_cache_entries.set(6)
    return m


def test_the_exported_metrics_follow_prometheus_naming_conventions():
    """Parsed by prometheus_client's own parser: counters end in _total, gauges never do, byte and
    second quantities name their unit last, one type per family, each family documented."""
    text = every_family_with_a_sample().render().decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), f"a family exported twice: {names}"
    assert all(name.startswith("splitkey_") for name in names if not name.endswith("_created"))
    sample_names: dict[str, str] = {}
    for family in families:
        assert family.documentation, family.name
        for sample in family.samples:
            assert sample_names.setdefault(sample.name, family.name) == family.name, f"{sample.name} in two families"
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), family.name
            assert family.samples, f"{family.name} exported with no series"
        elif family.name.endswith("_created"):  # prometheus_client's creation time of each counter series
            assert family.type == "gauge"
            continue
        else:
            assert not family.name.endswith("_total"), f"{family.name} is a {family.type} named as a counter"
        base = family.name.removesuffix("_total")
        for unit in ("bytes", "seconds"):
            if unit in base.split("_"):
                assert base.endswith("_" + unit), f"{family.name}: the unit must come last"
    types = {f.name: f.type for f in families}
    assert {k: types[k] for k in ("splitkey_replicas_rebuilt", "splitkey_repair_rounds", "splitkey_worker_expired_jobs",
                                  "splitkey_record_cache_lookups", "splitkey_record_cache_stale")} == dict.fromkeys(
        ("splitkey_replicas_rebuilt", "splitkey_repair_rounds", "splitkey_worker_expired_jobs",
         "splitkey_record_cache_lookups", "splitkey_record_cache_stale"), "counter")
    assert types["splitkey_record_cache_entries"] == "gauge" and types["splitkey_worker_held_bytes"] == "gauge"
    assert 'splitkey_worker_expired_jobs_total{worker="w0"} 3.0' in text
    assert 'splitkey_record_cache_lookups_total{result="hit"} 7.0' in text


def test_build_info_names_the_versions_of_splitkey_python_and_ray():
    [family] = [f for f in text_string_to_metric_families(Metrics().render().decode()) if f.name == "splitkey_build_info"]
    [sample] = family.samples
    assert family.type == "gauge" and sample.value == 1.0
    assert sample.labels == {"version": importlib.metadata.version("splitkey"), "python": platform.python_version(),
                             "ray": importlib.metadata.version("ray")}


def test_a_count_kept_elsewhere_is_exported_as_a_counter_of_its_latest_value():
    m = Metrics()
    m.repair_rounds.set(3)
    m.repair_rounds.set(5)
    assert "splitkey_repair_rounds_total 5.0" in m.render().decode()
    with pytest.raises(ValueError, match=r"labels must be values for worker, got \(\)"):
        m.worker_expired.set(1)


def test_a_total_is_named_without_its_suffix():
    with pytest.raises(ValueError, match="name must be given without its _total suffix"):
        Totals("x_total", "doc", (), CollectorRegistry())
