"""How inline keys are cut into shards, how resident shards share calls (pure parts of the orchestrator),
and how many plans run at once (``Orchestrator.run_many`` over fake workers, tests/fake_workers.py)."""

import asyncio

import numpy as np
import pytest
from fake_workers import H_KV, SHARD_KEYS, D, FakeWorkers

from merge import finalize, merge_all
from service.cluster.orchestrator import Job, Orchestrator, Plan, grouped, inline_shard_count, shard_bounds
from service.cluster.pool import InlineWork, ResidentWork
from service.core.errors import ContextLost, DeadlineExceeded, Internal, WorkersUnavailable
from service.core.metrics import Timings
from workers.api import partial_attention
from workers.options import AttentionOptions
from workers.store import Expired, RecordStale, ShardMissing
from workers.tasks import ShardQuery, ShardRead


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


# -- run_many: many plans at once, over a pool of fake workers (no Ray) ---------------------------------



def _keys(rng, contexts, shards):
    """``shards`` shards of each context, their keys one after the other."""
    out = {}
    for c in contexts:
        for i in range(shards):
            k_pos = np.arange(i * SHARD_KEYS, (i + 1) * SHARD_KEYS)
            out[c, i] = (rng.standard_normal((SHARD_KEYS, H_KV, D), dtype=np.float32),
                         rng.standard_normal((SHARD_KEYS, H_KV, D), dtype=np.float32), k_pos)
    return out


def _plan(rng, context, shards, replicas, inline=None):
    """A decode query over ``context``'s shards (shard i held by ``replicas(i)``), and any inline keys."""
    q = rng.standard_normal((1, 2 * H_KV, D), dtype=np.float32)
    jobs = [Job(ResidentWork((ShardRead(context, i, SHARD_KEYS, 0),), 2), tuple(replicas(i)), f"shard {i} of {context}")
            for i in range(shards)]
    if inline is not None:
        jobs.append(Job(InlineWork(*inline), None, "inline shard 0"))
    query = ShardQuery(q_pos=np.array([10**6]), options=AttentionOptions())
    return Plan(q, q, query, tuple(jobs), (1, 2 * H_KV, D), np.dtype(np.float32))


def _alone(plan, shards, fanin=2):
    """The plan's answer as the states of its shards alone, merged in key order over the fixed tree."""
    states = []
    for job in plan.jobs:
        if isinstance(job.work, InlineWork):
            states.append(partial_attention(plan.q, job.work.k, job.work.v, q_pos=plan.query.q_pos, k_pos=job.work.k_pos))
        else:
            (read,) = job.work.reads
            k, v, k_pos = shards[read.context_id, read.index]
            states.append(partial_attention(plan.q, k, v, q_pos=plan.query.q_pos, k_pos=k_pos))
    return finalize(merge_all(states, fanin))


def _same(got, want):
    assert isinstance(got, tuple), got
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _run_many(pool, plans, timings=None):
    return asyncio.run(Orchestrator(pool, fanin=2, remote_merge_bytes=2**30).run_many(plans, timings or Timings()))


def test_run_many_sends_each_worker_every_plans_reads_in_one_call_and_answers_each_plan_bitwise_as_alone():
    rng = np.random.default_rng(0)
    shards = _keys(rng, ["ctx_a", "ctx_b"], 3)
    pool = FakeWorkers(2, shards)
    plans = [_plan(rng, "ctx_a", 3, lambda i: (i % 2,)), _plan(rng, "ctx_b", 3, lambda i: ((i + 1) % 2,))]
    timings = Timings()
    outcomes = _run_many(pool, plans, timings)
    assert sorted(pool.many) == [(0, [[("ctx_a", 0), ("ctx_a", 2)], [("ctx_b", 1)]]),
                                 (1, [[("ctx_a", 1)], [("ctx_b", 0), ("ctx_b", 2)]])]
    assert pool.one == []
    for plan, outcome in zip(plans, outcomes):
        _same(outcome, _alone(plan, shards))
    assert {"compute", "worker", "merge"} <= set(timings.stages)


def test_run_many_chooses_the_least_loaded_replica_counting_the_reads_it_gave_already():
    rng = np.random.default_rng(1)
    shards = _keys(rng, ["ctx_a"], 5)
    pool = FakeWorkers(3, shards)
    pool.slots[2].outstanding = 3  # busy with other requests' work
    plans = [_plan(rng, "ctx_a", 5, lambda i: (0, 1, 2)) for _ in range(2)]
    outcomes = _run_many(pool, plans)
    # 10 reads, each where the load is least (ties: the lower index): workers 0 and 1 in turn until they
    # carry as much as worker 2, then all three in turn; without counting its own reads all 10 go to worker 0
    reads = {w: sum(len(item) for item in items) for w, items in pool.many}
    assert reads == {0: 5, 1: 4, 2: 1}
    assert [len(items) for _, items in sorted(pool.many)] == [2, 2, 1]  # one call per worker, an item per plan
    for plan, outcome in zip(plans, outcomes):
        _same(outcome, _alone(plan, shards))


def test_inline_shards_and_reads_without_a_live_replica_run_alone_as_a_single_request_runs_them():
    rng = np.random.default_rng(2)
    shards = _keys(rng, ["ctx_a"], 2)
    pool = FakeWorkers(2, shards)
    pool.slots[1].alive = False
    inline = (rng.standard_normal((5, H_KV, D), dtype=np.float32), rng.standard_normal((5, H_KV, D), dtype=np.float32),
              np.arange(100, 105))
    with_inline = _plan(rng, "ctx_a", 2, lambda i: (0,), inline=inline)
    lost = _plan(rng, "ctx_a", 2, lambda i: (i,))  # shard 1 only on the dead worker
    outcomes = _run_many(pool, [with_inline, lost])
    _same(outcomes[0], _alone(with_inline, shards))
    assert isinstance(outcomes[1], ContextLost) and "shard 1 of ctx_a could not be computed" in outcomes[1].detail
    assert pool.one == [(0, "InlineWork")]


def test_a_read_on_a_worker_gone_is_retried_on_another_replica_and_the_answer_is_the_same():
    rng = np.random.default_rng(3)
    shards = _keys(rng, ["ctx_a"], 2)
    pool = FakeWorkers(2, shards, faults={0: WorkersUnavailable})
    plan = _plan(rng, "ctx_a", 2, lambda i: (0, 1))
    (outcome,) = _run_many(pool, [plan])
    _same(outcome, _alone(plan, shards))
    assert sorted(pool.one) == [(1, "ResidentWork")]  # the read that was on worker 0, alone on worker 1


def test_a_missing_shard_with_no_other_replica_fails_its_plan_alone_naming_why():
    rng = np.random.default_rng(4)
    shards = _keys(rng, ["ctx_a", "ctx_b"], 1)
    pool = FakeWorkers(2, shards, faults={0: ShardMissing("shard 0 of ctx_a is not held")})
    hurt, fine = _plan(rng, "ctx_a", 1, lambda i: (0,)), _plan(rng, "ctx_b", 1, lambda i: (1,))
    outcomes = _run_many(pool, [hurt, fine])
    assert isinstance(outcomes[0], ContextLost)
    assert "splitkey-worker-0: shard 0 of ctx_a is not held" in outcomes[0].detail
    _same(outcomes[1], _alone(fine, shards))


@pytest.mark.parametrize("fault, error, match", [
    (Expired("no time left"), DeadlineExceeded, "before worker splitkey-worker-0 could start"),
    (ValueError("bad head size"), Internal, "worker splitkey-worker-0 raised ValueError"),
    (RecordStale("version 3, held 4"), RecordStale, "version 3"),
])
def test_late_worker_failed_and_stale_reads_fail_their_plan_without_a_retry(fault, error, match):
    rng = np.random.default_rng(5)
    shards = _keys(rng, ["ctx_a", "ctx_b"], 1)
    pool = FakeWorkers(3, shards, faults={0: fault})
    hurt, fine = _plan(rng, "ctx_a", 1, lambda i: (0, 1)), _plan(rng, "ctx_b", 1, lambda i: (2,))
    outcomes = _run_many(pool, [hurt, fine])
    assert isinstance(outcomes[0], error) and match in str(outcomes[0])
    assert pool.one == []  # not retried on worker 1
    _same(outcomes[1], _alone(fine, shards))


def test_a_plan_without_jobs_answers_the_state_over_no_keys():
    plan = Plan(np.zeros((2, 4, D), np.float32), None, ShardQuery(np.array([0, 1]), AttentionOptions()), (),
                (2, 4, 3), np.dtype(np.float64))
    (outcome,) = _run_many(FakeWorkers(1, {}), [plan])
    out, lse = outcome
    assert out.shape == (2, 4, 3) and out.dtype == np.float64 and not out.any() and np.isneginf(lse).all()
    assert plan.state_nbytes == 2 * 4 * 5 * 8 and plan.elements == 2 * 4 * 3


def test_a_ray_error_on_a_batched_call_fails_its_plans_as_the_clusters_fault_and_others_are_answered():
    import ray

    rng = np.random.default_rng(6)
    shards = _keys(rng, ["ctx_a", "ctx_b"], 1)
    pool = FakeWorkers(2, shards, faults={0: ray.exceptions.RaySystemError})
    pool.cluster_errors = (ray.exceptions.RayError,)  # as the Ray pool names its own
    hurt, fine = _plan(rng, "ctx_a", 1, lambda i: (0,)), _plan(rng, "ctx_b", 1, lambda i: (1,))
    outcomes = _run_many(pool, [hurt, fine])
    assert isinstance(outcomes[0], WorkersUnavailable)
    assert outcomes[0].detail == "the cluster must answer, got an error from Ray (the server's log names it)"
    _same(outcomes[1], _alone(fine, shards))
