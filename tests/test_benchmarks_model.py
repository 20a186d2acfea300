"""benchmarks/model.py: the cost model's terms, its fit and its predictions, without running anything."""

import math
from dataclasses import replace

import pytest
from benchloader import benchmark_module

from merge import tree_levels


@pytest.fixture(scope="module")
def model():
    with benchmark_module("model.py") as module:
        yield module


def test_bytes_moved_are_the_query_out_and_one_state_back_per_shard(model):
    p = model.Problem(n_q=1, h_q=32, h_kv=8, d=128, d_v=128)  # float32 everywhere
    moved = model.bytes_moved(p, 4)
    assert moved.query_out_bytes == 4 * 1 * 32 * 128 * 4
    assert moved.states_back_bytes == 4 * 1 * 32 * (128 + 2) * 4  # n_q * h_q * (d_v + 2) floats per shard
    assert model.bytes_moved(replace(p, n_q=256), 1).states_back_bytes == 256 * 32 * 130 * 4


def test_states_do_not_grow_with_the_keys_but_the_cache_does(model):
    p = model.DECODE_BF16
    assert model.kv_bytes(p, 1) == 8 * (128 + 128) * 2  # 4 KiB per token of one layer in bfloat16
    assert model.kv_bytes(p, 10**6) == 10**6 * model.kv_bytes(p, 1)
    assert model.state_bytes(p) == 32 * 130 * 4


@pytest.mark.parametrize(("shards", "fanin", "depth"), [(1, 2, 0), (2, 2, 1), (8, 2, 3), (9, 2, 4), (9, 8, 2),
                                                        (8, 8, 1), (64, 8, 2), (65, 8, 3), (1000, 2, 10)])
def test_tree_depth_is_the_ceiling_of_log_fanin(model, shards, fanin, depth):
    assert model.tree_depth(shards, fanin) == depth


def test_tree_depth_counts_the_levels_of_the_merge_tree_the_service_builds(model):
    for fanin in (2, 3, 4, 8):
        for shards in range(1, 130):
            assert model.tree_depth(shards, fanin) == len(tree_levels(shards, fanin))
            if shards > 1:  # and it is ceil(log_fanin(shards)), up to rounding of the float log
                assert model.tree_depth(shards, fanin) == math.ceil(math.log(shards, fanin) - 1e-9)


def test_tree_depth_refuses_what_has_no_tree(model):
    with pytest.raises(ValueError):
        model.tree_depth(0, 2)
    with pytest.raises(ValueError):
        model.tree_depth(4, 1)


def test_the_merge_moves_to_the_workers_by_the_orchestrators_rule(model):
    decode, prefill = model.Problem(n_q=1), model.Problem(n_q=256)  # 16.6 KB and 4.26 MB states
    assert model.remote_merge(decode, 1000, 8)  # 16.6 MB of states
    assert not model.remote_merge(prefill, 2, 2)  # no more shards than the fan-in
    assert model.remote_merge(prefill, 4, 2)  # 17 MB of states
    assert not model.remote_merge(prefill, 4, 4)
    assert not model.remote_merge(decode, 8, 2)  # 133 KB


def test_a_shard_is_read_bound_alone_and_compute_bound_with_enough_queries_per_pass(model):
    p, dev = model.DECODE_BF16, model.H200
    alone = model.shard_compute_s(p, 10**6, dev)
    assert alone == pytest.approx(dev.call_s + model.kv_bytes(p, 10**6) / dev.read_bytes_per_s)
    assert model.shard_compute_s(p, 10**6, dev, batch=8) == alone  # still read-bound
    many = model.shard_compute_s(p, 10**6, dev, batch=10_000)
    assert many == pytest.approx(dev.call_s + 10_000 * model.attention_flops(p, 10**6) / dev.flops_per_s)


def test_workers_sharing_cores_slow_each_other_and_extra_shards_queue(model):
    p = model.Problem(n_q=1)
    dev = model.Device("cpu", 10e9, 100e9, 0.0, 1e10, "test")
    one = model.compute_s(p, 65536, 1, dev, workers=1, cores=2)
    assert model.compute_s(p, 65536, 2, dev, workers=2, cores=2) == pytest.approx(one / 2)
    assert model.compute_s(p, 65536, 4, dev, workers=4, cores=2) == pytest.approx(one / 2)  # 4 on 2 cores
    assert model.compute_s(p, 65536, 8, dev, workers=4, cores=2) == pytest.approx(one / 2)  # two each, in turn


def test_nnls_keeps_coefficients_non_negative(model):
    x = [1.0, 2.0, 3.0, 4.0]
    assert model.nnls([[1.0] * 4, x], [3.0 + 2.0 * v for v in x]) == pytest.approx([3.0, 2.0])
    assert model.nnls([[1.0] * 4, x], [10.0 - v for v in x])[1] == 0.0  # a negative slope is not a cost
    assert model.nnls([[1.0] * 4, [0.0] * 4], [1.0] * 4) == pytest.approx([1.0, 0.0])


KNOWN_STACK = {"frontend_s": 2e-3, "frontend_s_per_byte": 3e-9, "directory_s": 0.8e-3, "scatter_s": 1.1e-3,
               "scatter_s_per_byte": 1e-9, "return_s": 2e-3, "dispatch_s_per_shard": 0.4e-3,
               "return_s_per_byte": 2e-9, "merge_s": 0.1e-3, "merge_s_per_byte": 0.5e-9, "hop_s": 3e-3,
               "hop_s_per_byte": 1.5e-9, "worker_call_s": 0.3e-3}


def synthetic(model, stack, dev, share, net):
    """Cells as scaling.py measures them, made by the model itself from known constants; other
    processes take 0 or 0.6 of the 2 cores in turn."""
    obs = []
    for p in (model.Problem(n_q=1), model.Problem(n_q=256)):
        cells = [(s, w, f, 1) for w in (1, 2, 4) for s in (1, 2, 4, 8) for f in (2, 4, 8)]
        cells += [(s, 3, 2, 3) for s in (3, 6)]
        for i, (shards, workers, fanin, nodes) in enumerate(cells):
            others = 0.6 * (i % 2)
            probe = model.Observation("", p, 65536, shards, workers, nodes, fanin, *[0.0] * 7, others_cores=others)
            b = model.request_s(p, 65536, shards, fanin, dev, stack, net if nodes > 1 else None, workers,
                                model.free_cores(share, 2.0, others), probe.remote_shards)
            obs.append(replace(probe, label=f"S={shards} W={workers} f={fanin} n={nodes}", frontend=b.frontend,
                               directory=b.directory, scatter=b.scatter, compute=b.compute,
                               state_return=b.state_return + b.network, merge=b.merge, total=b.total))
    return obs


def test_the_fit_recovers_known_constants_from_synthetic_cells(model):
    stack = model.Stack(**KNOWN_STACK)
    dev = model.Device("cpu", 12e9, 90e9, 0.0, 24e9, "test")
    net = model.Network("loopback", 0.5e-3, 2e9, "test")
    obs = synthetic(model, stack, dev, 0.8, net)
    kernel = {"decode": {"gb_per_s": 12.0}, "prefill": {"gflop_per_s": 90.0}}
    f = model.fit(obs, kernel, machine_cores=2.0)
    assert f.core_share == pytest.approx(0.8, abs=0.005)
    for name, value in KNOWN_STACK.items():
        assert getattr(f.stack, name) == pytest.approx(value, rel=1e-3, abs=1e-12), name
    assert f.loopback.latency_s == pytest.approx(0.5e-3, rel=1e-3)
    assert f.loopback.bytes_per_s == pytest.approx(2e9, rel=1e-3)
    assert model.error_summary(obs, f)["max_abs_error"] < 1e-6


def test_the_collective_floor_beats_the_stack_and_a_ring_of_kv_blocks(model):
    p, dev, net, st = model.DECODE_BF16, model.H200, model.NET_400, model.Stack(**KNOWN_STACK)
    for g in (8, 128):
        floor = model.collective_s(p, 10**6, g, 2, dev, net).total
        assert floor < model.request_s(p, 10**6, g, 2, dev, st, net).total
        assert floor < model.ring_kv_s(p, 10**6, g, dev, net)
        assert floor < model.move_cache_s(p, 10**6, g, dev, net)
    # states along a ring: G - 1 hops against log2(G)
    assert model.ring_states_s(p, 10**6, 128, dev, net) > 5 * model.collective_s(p, 10**6, 128, 2, dev, net).total


def test_a_context_needs_devices_by_its_bytes(model):
    p = model.DECODE_BF16
    per_device = model.USABLE_MEMORY * model.H200.memory_bytes / model.kv_bytes(p, 1)  # tokens of one layer
    assert model.devices_for_memory(p, 10**6, model.H200) == 1
    assert model.devices_for_memory(p, 10**8, model.H200) == math.ceil(10**8 / per_device)
    assert model.devices_for_memory(p, 10**6, model.H200, layers=32) == math.ceil(32 * 10**6 / per_device)


def test_replicas_cover_the_target(model):
    assert model.replicas_needed(1000, 300) == 4
    assert model.replicas_needed(10, 300) == 1


def test_the_predictions_and_crossovers_are_tables(model):
    st = model.Stack(**KNOWN_STACK)
    for text in (model.prediction_table(model.DECODE_BF16, model.H200, st, model.NET_400),
                 model.crossover_table(model.DECODE_BF16, model.H100, st, model.NET_100),
                 model.replica_table(model.DECODE_BF16, model.H200, st, model.NET_400),
                 model.comparison_table(model.DECODE_BF16, model.H200, st, model.NET_400)):
        lines = text.splitlines()
        assert len(lines) > 3 and all(line.startswith("|") for line in lines)
