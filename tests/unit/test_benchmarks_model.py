"""benchmarks/model_fit.py and benchmarks/model.py: the fit recovers known constants, the predictions
are tables, without running anything (the terms: tests/unit/test_benchmarks_model_terms.py)."""

from dataclasses import replace

import pytest
from benchloader import benchmark_module, benchmark_package_module

terms = benchmark_package_module("model_terms")
fitting = benchmark_package_module("model_fit")


@pytest.fixture(scope="module")
def model():
    with benchmark_module("model.py") as module:
        yield module


def test_nnls_keeps_coefficients_non_negative():
    x = [1.0, 2.0, 3.0, 4.0]
    assert fitting.nnls([[1.0] * 4, x], [3.0 + 2.0 * v for v in x]) == pytest.approx([3.0, 2.0])
    assert fitting.nnls([[1.0] * 4, x], [10.0 - v for v in x])[1] == 0.0  # a negative slope is not a cost
    assert fitting.nnls([[1.0] * 4, [0.0] * 4], [1.0] * 4) == pytest.approx([1.0, 0.0])


KNOWN_STACK = {"frontend_s": 2e-3, "frontend_s_per_byte": 3e-9, "directory_s": 0.8e-3, "scatter_s": 1.1e-3,
               "scatter_s_per_byte": 1e-9, "return_s": 2e-3, "dispatch_s_per_shard": 0.4e-3,
               "return_s_per_byte": 2e-9, "merge_s": 0.1e-3, "merge_s_per_byte": 0.5e-9, "hop_s": 3e-3,
               "hop_s_per_byte": 1.5e-9, "worker_call_s": 0.3e-3}


def synthetic(stack, dev, share, net):
    """Cells as scaling.py measures them, made by the model itself from known constants; other
    processes take 0 or 0.6 of the 2 cores in turn."""
    obs = []
    for p in (terms.Problem(n_q=1), terms.Problem(n_q=256)):
        cells = [(s, w, f, 1) for w in (1, 2, 4) for s in (1, 2, 4, 8) for f in (2, 4, 8)]
        cells += [(s, 3, 2, 3) for s in (3, 6)]
        for i, (shards, workers, fanin, nodes) in enumerate(cells):
            others = 0.6 * (i % 2)
            probe = fitting.Observation("", p, 65536, shards, workers, nodes, fanin, *[0.0] * 7, others_cores=others)
            b = terms.request_s(p, 65536, shards, fanin, dev, stack, net if nodes > 1 else None, workers,
                                fitting.free_cores(share, 2.0, others), probe.remote_shards)
            obs.append(replace(probe, label=f"S={shards} W={workers} f={fanin} n={nodes}", frontend=b.frontend,
                               directory=b.directory, scatter=b.scatter, compute=b.compute,
                               state_return=b.state_return + b.network, merge=b.merge, total=b.total))
    return obs


def test_the_fit_recovers_known_constants_from_synthetic_cells():
    stack = terms.Stack(**KNOWN_STACK)
    dev = terms.Device("cpu", 12e9, 90e9, 0.0, 24e9, "test")
    net = terms.Network("loopback", 0.5e-3, 2e9, "test")
    obs = synthetic(stack, dev, 0.8, net)
    kernel = {"decode": {"gb_per_s": 12.0}, "prefill": {"gflop_per_s": 90.0}}
    f = fitting.fit(obs, kernel, machine_cores=2.0)
    assert f.core_share == pytest.approx(0.8, abs=0.005)
    for name, value in KNOWN_STACK.items():
        assert getattr(f.stack, name) == pytest.approx(value, rel=1e-3, abs=1e-12), name
    assert f.loopback.latency_s == pytest.approx(0.5e-3, rel=1e-3)
    assert f.loopback.bytes_per_s == pytest.approx(2e9, rel=1e-3)
    assert fitting.error_summary(obs, f)["max_abs_error"] < 1e-6


def test_the_collective_floor_beats_the_stack_and_a_ring_of_kv_blocks():
    p, dev, net, st = terms.DECODE_BF16, terms.H200, terms.NET_400, terms.Stack(**KNOWN_STACK)
    for g in (8, 128):
        floor = terms.collective_s(p, 10**6, g, 2, dev, net).total
        assert floor < terms.request_s(p, 10**6, g, 2, dev, st, net).total
        assert floor < terms.ring_kv_s(p, 10**6, g, dev, net)
        assert floor < terms.move_cache_s(p, 10**6, g, dev, net)
    # states along a ring: G - 1 hops against log2(G)
    assert terms.ring_states_s(p, 10**6, 128, dev, net) > 5 * terms.collective_s(p, 10**6, 128, 2, dev, net).total


def test_the_predictions_and_crossovers_are_tables(model):
    st = terms.Stack(**KNOWN_STACK)
    for text in (model.prediction_table(terms.DECODE_BF16, terms.H200, st, terms.NET_400),
                 model.crossover_table(terms.DECODE_BF16, terms.H100, st, terms.NET_100),
                 model.replica_table(terms.DECODE_BF16, terms.H200, st, terms.NET_400),
                 model.comparison_table(terms.DECODE_BF16, terms.H200, st, terms.NET_400)):
        lines = text.splitlines()
        assert len(lines) > 3 and all(line.startswith("|") for line in lines)
