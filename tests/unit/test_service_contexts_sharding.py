"""service.contexts.sharding: how a new context is cut, how big a new shard is, which shards an append fills."""

import numpy as np
import pytest

from service.contexts.sharding import open_shards, plan_shards, reserve_of
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
