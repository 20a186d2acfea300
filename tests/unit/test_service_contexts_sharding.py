"""service.contexts.sharding: how a new context is cut, how big a new shard is, which shards an append fills."""

import numpy as np
import pytest

from service.contexts.sharding import (GROWING_SHARD_KEYS, open_shards, plan_append, plan_shards, reach_of,
                                       reserve_of)
from service.core.errors import InvalidOption
from service.wire.request import ContextWrite, InlineKV
from workers.problem import KVDims


def write(n_k: int, *, shards=None, expected_length=None) -> ContextWrite:
    k = np.zeros((n_k, 1, 4), np.float32)  # [n_k, h_kv, d]
    return ContextWrite(InlineKV(k, k, None, KVDims(n_k, 1, 4, 4)), replicas=None, shards=shards,
                        expected_length=expected_length)


@pytest.mark.parametrize(("n_k", "live", "shard_keys", "want"), [
    (10_000, 4, 2048, [2500] * 4),  # one shard per live worker while each holds shard_keys or more
    (5_000, 4, 2048, [1666, 1667, 1667]),  # fewer shards than workers: none below shard_keys but the last
    (100, 4, 2048, [100]),  # a small context is one shard
    (0, 4, 2048, [0]),  # an empty one too
])
def test_a_context_without_expected_length_is_cut_in_balanced_shards_that_grow(n_k, live, shard_keys, want):
    plan = plan_shards(write(n_k), live, shard_keys)
    assert [hi - lo for lo, hi in plan.bounds] == want and plan.sizes == want
    assert plan.bounds[0][0] == 0 and plan.bounds[-1][1] == n_k
    assert plan.reserve == 0 and plan.capacity >= shard_keys


def test_expected_length_sizes_every_shard_for_the_total_and_the_body_fills_them_in_order():
    plan = plan_shards(write(5_000, expected_length=20_000), 4, 2048)
    assert plan.capacity == 5_000 and plan.reserve == 5_000
    assert plan.bounds == [(0, 5_000), (5_000, 5_000), (5_000, 5_000), (5_000, 5_000)]
    assert plan.sizes == [5_000] * 4  # placement balances what each shard will hold, not what it holds now


def test_a_shard_count_asked_for_is_kept_and_one_over_the_keys_is_refused_naming_it():
    assert len(plan_shards(write(9, shards=3), 8, 2048).bounds) == 3
    with pytest.raises(InvalidOption, match=r"shards must be in \[1, 9\] \(one key at least each\), got 10"):
        plan_shards(write(9, shards=10), 8, 2048)


def test_a_new_shard_is_allocated_whole_only_for_a_context_with_expected_length():
    assert reserve_of({"shard_capacity": 4096, "expected_length": 10_000}) == 4096
    assert reserve_of({"shard_capacity": 4096, "expected_length": None}) == 0


def test_an_append_fills_the_last_shard_holding_keys_then_the_empty_ones_after_it():
    shards = [{"index": i, "length": n} for i, n in enumerate([10, 10, 3, 0, 0])]
    assert [s["index"] for s in open_shards(shards)] == [2, 3, 4]
    empty = [{"index": i, "length": 0} for i in range(2)]
    assert open_shards(empty) == empty


def _context(lengths, capacity, expected_length=None):
    return {"shard_capacity": capacity, "expected_length": expected_length,
            "shards": [{"index": i, "length": n, "workers": ["w"]} for i, n in enumerate(lengths)]}


def _apply(record, plan):
    """The record after the plan's writes: spans added to the shards they fill, new shards after them."""
    for index, _, keys in plan.fills:
        record["shards"][index]["length"] += keys
    for _, keys in plan.new:
        record["shards"].append({"index": len(record["shards"]), "length": keys, "workers": ["w"]})
    return record


def test_single_key_appends_keep_a_growing_contexts_shards_balanced_and_open_none():
    rec = _context([32768, 32768], GROWING_SHARD_KEYS)
    for _ in range(10_000):
        _apply(rec, plan_append(rec, 1, live=2, shard_keys=2048))
    assert [s["length"] for s in rec["shards"]] == [37768, 37768]


def test_a_context_grown_key_by_key_is_cut_as_one_created_whole():
    rec = _context([1], GROWING_SHARD_KEYS)
    for _ in range(9_999):
        _apply(rec, plan_append(rec, 1, live=2, shard_keys=2048))
    assert [s["length"] for s in rec["shards"]] == [5000, 5000]  # a create of 10,000 keys: 2 shards of 5000


def test_an_append_opens_the_shards_a_create_of_its_length_would_cut_and_fills_the_shortest():
    plan = plan_append(_context([2048], GROWING_SHARD_KEYS), 5000, live=3, shard_keys=2048)
    # 7048 keys: min(3 workers, ceil(7048 / 2048)) = 3 shards, levelled at 2349-2350 keys each.
    assert plan.fills == [(0, 0, 302)] and plan.new == [(302, 2349), (2651, 2349)]


def test_a_context_sized_with_expected_length_fills_its_planned_shards_in_order_then_levels_them():
    plan = plan_append(_context([100, 40, 0], 100, expected_length=300), 200, live=2, shard_keys=1)
    # 160 keys complete the plan in order; the 40 past it go to the shortest shards: 14, 13, 13.
    assert plan.fills == [(0, 0, 14), (1, 14, 73), (2, 87, 113)] and plan.new == []


def test_single_key_appends_past_a_plan_keep_its_shards_balanced_and_open_none():
    rec = _context([32768, 32768], 32768, expected_length=65536)  # a chunked upload's context
    for _ in range(10_000):
        _apply(rec, plan_append(rec, 1, live=2, shard_keys=2048))
    assert [s["length"] for s in rec["shards"]] == [37768, 37768]


def test_an_append_plan_gives_every_key_of_the_write_once_in_order_and_never_overfills(rng):
    for _ in range(500):
        cap = int(rng.integers(1, 60))
        lengths = [int(x) for x in rng.integers(0, cap + 1, size=int(rng.integers(1, 6)))]
        n = int(rng.integers(0, 300))
        expected = None if rng.random() < 0.5 else sum(lengths) + n
        plan = plan_append(_context(lengths, cap, expected), n, live=int(rng.integers(1, 6)),
                           shard_keys=int(rng.integers(1, 40)))
        spans = sorted([(lo, keys) for _, lo, keys in plan.fills] + plan.new)
        assert [lo for lo, _ in spans] == list(np.cumsum([0] + [k for _, k in spans])[:-1])
        assert sum(k for _, k in spans) == n and all(k > 0 for _, k in spans)
        reach = reach_of(_context(lengths, cap, expected))
        assert all(lengths[i] + keys <= reach for i, _, keys in plan.fills)
        assert all(keys <= reach for _, keys in plan.new)
