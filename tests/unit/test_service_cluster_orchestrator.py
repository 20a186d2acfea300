"""How inline keys are cut into shards, and how resident shards share calls (pure parts of the orchestrator)."""

import pytest

from service.cluster.orchestrator import Job, grouped, inline_shard_count, shard_bounds
from service.cluster.pool import InlineWork, ResidentWork
from workers.tasks import ShardRead


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


def _resident(index, candidates, context="ctx_a"):
    return Job(ResidentWork((ShardRead(context, index, 10, 0),), 8), candidates, f"shard {index} of context {context}")


def _inline(i):
    return Job(InlineWork(None, None, None), None, f"inline shard {i}")


def test_shards_with_the_same_replicas_share_one_call_with_their_reads_in_key_order():
    # shards alternate between workers 0 and 1, as placement leaves a context grown by appends
    jobs = [_resident(i, (i % 2,)) for i in range(6)]
    calls = grouped(jobs)
    assert [positions for _, positions in calls] == [(0, 2, 4), (1, 3, 5)]
    assert [[r.index for r in job.work.reads] for job, _ in calls] == [[0, 2, 4], [1, 3, 5]]
    assert [job.candidates for job, _ in calls] == [(0,), (1,)]
    assert calls[0][0].label == "shard 0 of context ctx_a (and 2 more shards on the same workers)"


def test_replica_sets_group_whatever_order_the_records_list_them_in():
    jobs = [_resident(0, (0, 1)), _resident(1, (1, 0)), _resident(2, (1, 2))]
    calls = grouped(jobs)
    assert [positions for _, positions in calls] == [(0, 1), (2,)]
    assert calls[1][0] is jobs[2]  # alone: left as it was


def test_inline_shards_and_lone_resident_shards_are_not_grouped():
    jobs = [_resident(0, (0,)), _resident(0, (1,), context="ctx_b"), _inline(0), _inline(1)]
    calls = grouped(jobs)
    assert [job for job, _ in calls] == jobs
    assert [positions for _, positions in calls] == [(0,), (1,), (2,), (3,)]


def test_every_job_is_computed_by_exactly_one_call():
    jobs = [_resident(i, ((i * 7) % 3,), context=f"ctx_{i % 2}") for i in range(20)] + [_inline(0)]
    positions = sorted(p for _, ps in grouped(jobs) for p in ps)
    assert positions == list(range(len(jobs)))
