"""A point's metrics from its requests: the names and definitions docs/LOADTEST.md gives."""

import math

import numpy as np
import pytest

from service.client.loadtest.metrics import Sample, summarize


def point(samples, wall=2.0, slo_ms=None):
    return summarize(samples, wall, mode="decode", n_k=1000, arrival="concurrency", load=4, key_bytes=100,
                     slo_ms=slo_ms)


def test_latency_percentiles_and_throughput_count_completed_requests_only():
    ok = [Sample(i, 0.0, (i + 1) / 1000, 200, keys=1000, n_q=2, stages={"compute": 0.004, "parse": 0.001})
          for i in range(100)]
    failed = [Sample(100, 0.0, 5.0, 429, "too_many_requests"), Sample(101, 0.0, 0.1, 0, "ConnectionResetError")]
    m = point(ok + failed)
    assert (m.completed, m.failed) == (100, 2)
    assert m.failed_by == {"0 ConnectionResetError": 1, "429 too_many_requests": 1}
    ms = np.arange(1, 101)
    assert m.latency_p50_ms == pytest.approx(np.percentile(ms, 50)) and m.latency_max_ms == pytest.approx(100)
    assert m.latency_p99_ms == pytest.approx(np.percentile(ms, 99)) and m.latency_mean_ms == pytest.approx(50.5)
    assert m.requests_per_s == 50.0  # 100 completed in 2 s
    assert m.pairs_per_s == 100 * 2 * 1000 / 2 and m.kv_gb_per_s == pytest.approx(100 * 1000 * 100 / 2 / 1e9)
    assert m.stages_ms == pytest.approx({"compute": 4.0, "parse": 1.0})
    assert m.goodput_per_s is None and m.slo_attainment is None
    assert m.label == "decode n_k=1000 c=4"


def test_goodput_counts_requests_within_the_slo_and_failures_miss_it():
    samples = [Sample(i, 0.0, t / 1000, 200) for i, t in enumerate([5, 10, 20, 40])] + [Sample(9, 0.0, 0.001, 503)]
    m = point(samples, wall=1.0, slo_ms=10)
    assert m.goodput_per_s == 2.0 and m.slo_attainment == pytest.approx(2 / 5)


def test_a_point_without_answers_has_no_latency_but_counts_its_failures():
    m = point([Sample(0, 0.0, 1.0, 504, "deadline_exceeded")], slo_ms=100)
    assert m.completed == 0 and m.failed == 1 and math.isnan(m.latency_p50_ms) and m.requests_per_s == 0
    assert m.slo_attainment == 0.0 and m.stages_ms == {}


def test_verified_errors_are_summarised():
    samples = [Sample(0, 0.0, 0.01, 200, verified=True, error=1e-7), Sample(1, 0.0, 0.01, 200),
               Sample(2, 0.0, 0.01, 200, verified=True, error=3e-7)]
    m = point(samples)
    assert m.verified == 2 and m.max_error == 3e-7


def test_percentiles_of_fewer_than_twenty_requests_carry_a_warning():
    few = point([Sample(i, 0.0, 0.01 * (i + 1), 200, keys=1000) for i in range(5)])
    assert few.thin and few.warnings == ["p50, p90 and p99 rest on 5 completed requests, fewer than 20: rough "
                                         "(raise --requests or --duration)"]
    enough = point([Sample(i, 0.0, 0.01, 200) for i in range(20)])
    assert not enough.thin and enough.warnings == []
    none = point([Sample(0, 0.0, 1.0, 503, "shutting_down")])
    assert not none.thin and none.warnings == []  # no percentile at all: nothing to warn of


def test_keys_per_second_count_the_keys_completed_requests_read():
    m = point([Sample(i, 0.0, 0.01, 200, keys=1000, n_q=4) for i in range(10)] + [Sample(10, 0.0, 1.0, 429, keys=1000)],
              wall=2.0)
    assert m.keys_per_s == 10 * 1000 / 2 and m.pairs_per_s == 4 * m.keys_per_s
