"""benchmarks/model_terms.py: the cost model's terms, without running anything."""

import math
from dataclasses import replace

import pytest
from benchloader import benchmark_package_module

from merge import tree_levels

terms = benchmark_package_module("model_terms")


def test_bytes_moved_are_the_query_out_and_one_state_back_per_shard():
    p = terms.Problem(n_q=1, h_q=32, h_kv=8, d=128, d_v=128)  # float32 everywhere
    moved = terms.bytes_moved(p, 4)
    assert moved.query_out_bytes == 4 * 1 * 32 * 128 * 4
    assert moved.states_back_bytes == 4 * 1 * 32 * (128 + 2) * 4  # n_q * h_q * (d_v + 2) floats per shard
    assert terms.bytes_moved(replace(p, n_q=256), 1).states_back_bytes == 256 * 32 * 130 * 4


def test_states_do_not_grow_with_the_keys_but_the_cache_does():
    p = terms.DECODE_BF16
    assert terms.kv_bytes(p, 1) == 8 * (128 + 128) * 2  # 4 KiB per token of one layer in bfloat16
    assert terms.kv_bytes(p, 10**6) == 10**6 * terms.kv_bytes(p, 1)
    assert terms.state_bytes(p) == 32 * 130 * 4


@pytest.mark.parametrize(("shards", "fanin", "depth"), [(1, 2, 0), (2, 2, 1), (8, 2, 3), (9, 2, 4), (9, 8, 2),
                                                        (8, 8, 1), (64, 8, 2), (65, 8, 3), (1000, 2, 10)])
def test_tree_depth_is_the_ceiling_of_log_fanin(shards, fanin, depth):
    assert terms.tree_depth(shards, fanin) == depth


def test_tree_depth_counts_the_levels_of_the_merge_tree_the_service_builds():
    for fanin in (2, 3, 4, 8):
        for shards in range(1, 130):
            assert terms.tree_depth(shards, fanin) == len(tree_levels(shards, fanin))
            if shards > 1:  # and it is ceil(log_fanin(shards)), up to rounding of the float log
                assert terms.tree_depth(shards, fanin) == math.ceil(math.log(shards, fanin) - 1e-9)


def test_tree_depth_refuses_what_has_no_tree():
    with pytest.raises(ValueError):
        terms.tree_depth(0, 2)
    with pytest.raises(ValueError):
        terms.tree_depth(4, 1)


def test_the_merge_moves_to_the_workers_by_the_orchestrators_rule():
    decode, prefill = terms.Problem(n_q=1), terms.Problem(n_q=256)  # 16.6 KB and 4.26 MB states
    assert terms.remote_merge(decode, 1000, 8)  # 16.6 MB of states
    assert not terms.remote_merge(prefill, 2, 2)  # no more shards than the fan-in
    assert terms.remote_merge(prefill, 4, 2)  # 17 MB of states
    assert not terms.remote_merge(prefill, 4, 4)
    assert not terms.remote_merge(decode, 8, 2)  # 133 KB


def test_a_shard_is_read_bound_alone_and_compute_bound_with_enough_queries_per_pass():
    p, dev = terms.DECODE_BF16, terms.H200
    alone = terms.shard_compute_s(p, 10**6, dev)
    assert alone == pytest.approx(dev.call_s + terms.kv_bytes(p, 10**6) / dev.read_bytes_per_s)
    assert terms.shard_compute_s(p, 10**6, dev, batch=8) == alone  # still read-bound
    many = terms.shard_compute_s(p, 10**6, dev, batch=10_000)
    assert many == pytest.approx(dev.call_s + 10_000 * terms.attention_flops(p, 10**6) / dev.flops_per_s)


def test_workers_sharing_cores_slow_each_other_and_extra_shards_queue():
    p = terms.Problem(n_q=1)
    dev = terms.Device("cpu", 10e9, 100e9, 0.0, 1e10, "test")
    one = terms.compute_s(p, 65536, 1, dev, workers=1, cores=2)
    assert terms.compute_s(p, 65536, 2, dev, workers=2, cores=2) == pytest.approx(one / 2)
    assert terms.compute_s(p, 65536, 4, dev, workers=4, cores=2) == pytest.approx(one / 2)  # 4 on 2 cores
    assert terms.compute_s(p, 65536, 8, dev, workers=4, cores=2) == pytest.approx(one / 2)  # two each, in turn


def test_a_context_needs_devices_by_its_bytes():
    p = terms.DECODE_BF16
    per_device = terms.USABLE_MEMORY * terms.H200.memory_bytes / terms.kv_bytes(p, 1)  # tokens of one layer
    assert terms.devices_for_memory(p, 10**6, terms.H200) == 1
    assert terms.devices_for_memory(p, 10**8, terms.H200) == math.ceil(10**8 / per_device)
    assert terms.devices_for_memory(p, 10**6, terms.H200, layers=32) == math.ceil(32 * 10**6 / per_device)


def test_replicas_cover_the_target():
    assert terms.replicas_needed(1000, 300) == 4
    assert terms.replicas_needed(10, 300) == 1
