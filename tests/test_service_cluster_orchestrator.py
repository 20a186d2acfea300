"""How inline keys are cut into shards (pure parts of the orchestrator)."""

import pytest

from service.cluster.orchestrator import inline_shard_count, shard_bounds


@pytest.mark.parametrize("n_k", [0, 1, 7, 100, 1001])
@pytest.mark.parametrize("shards", [1, 2, 3, 9])
def test_shard_bounds_cover_the_keys_in_order_with_sizes_differing_by_at_most_one(n_k, shards):
    b = shard_bounds(n_k, shards)
    assert len(b) == shards and b[0][0] == 0 and b[-1][1] == n_k
    assert all(b[i][1] == b[i + 1][0] for i in range(shards - 1))
    sizes = [hi - lo for lo, hi in b]
    assert max(sizes) - min(sizes) <= 1


def test_small_requests_do_not_fan_out():
    assert inline_shard_count(1000, workers=8, requested=None, min_shard_keys=4096) == 1
    assert inline_shard_count(10_000, workers=8, requested=None, min_shard_keys=4096) == 2
    assert inline_shard_count(10**6, workers=8, requested=None, min_shard_keys=4096) == 8
    assert inline_shard_count(10**6, workers=8, requested=3, min_shard_keys=4096) == 3
    assert inline_shard_count(0, workers=8, requested=None, min_shard_keys=4096) == 1
