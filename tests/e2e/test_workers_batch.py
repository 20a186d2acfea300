"""The compute thread of a shard worker: what waits together on the same shards runs together."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from reference import assert_close_to_reference

from merge import finalize
from workers.actor import ShardWorker, _share_a_shard
from workers.batch import Batcher
from workers.config import WorkerConfig
from workers.options import AttentionOptions
from workers.tasks import ShardQuery, ShardRead, ShardWrite


def queued(batcher: Batcher, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(batcher._queue) < n:
        assert time.monotonic() < deadline
        time.sleep(0.001)


# -- through a shard worker -------------------------------------------------------------------

def worker_with_context(rng, n_k=3000, dtype=np.float32):
    w = ShardWorker(WorkerConfig(), "w0")
    k = rng.standard_normal((n_k, 2, 32)).astype(dtype)
    v = rng.standard_normal((n_k, 2, 16)).astype(dtype)
    w.create_shard(ShardWrite("ctx", 0, np.dtype(dtype).name, n_k, np.arange(n_k)), k, v, {"version": 1})
    return w, k, v


def test_concurrent_queries_on_a_worker_share_a_pass_and_keep_their_bits(rng):
    w, k, v = worker_with_context(rng)
    reads = (ShardRead("ctx", 0, 3000),)
    qs = [(rng.standard_normal((1, 8, 32)).astype(np.float32), np.array([2999 - i])) for i in range(8)]
    opts = AttentionOptions(causal=True)
    alone = [w.partial_resident(q, ShardQuery(qp, opts), reads, 2)[1] for q, qp in qs]
    # Hold the compute thread on a first query until eight more wait behind it.
    held, release = threading.Event(), threading.Event()

    def held_run(jobs):
        if not held.is_set():
            held.set()
            assert release.wait(30)
        return w._run(jobs)

    w.compute = Batcher(held_run, joins=_share_a_shard)
    with ThreadPoolExecutor(9) as pool:
        first = pool.submit(w.partial_resident, qs[0][0], ShardQuery(qs[0][1], opts), reads, 2)
        assert held.wait(10)
        futures = [pool.submit(w.partial_resident, q, ShardQuery(qp, opts), reads, 2) for q, qp in qs]
        queued(w.compute, 8)
        release.set()
        assert first.result(60)[0].batch == 1
        results = [f.result(60) for f in futures]
    assert [status.batch for status, _ in results] == [8] * 8
    for (q, q_pos), (_, state), solo in zip(qs, results, alone):
        assert state.m.tobytes() == solo.m.tobytes() and state.acc.tobytes() == solo.acc.tobytes()
        out, lse = finalize(state)
        assert_close_to_reference(out, lse, q, k, v, causal=True, q_pos=q_pos)


def test_a_query_over_a_shard_the_worker_lacks_fails_alone(rng):
    from workers.store import ShardMissing

    w, _, _ = worker_with_context(rng, n_k=100)
    q = rng.standard_normal((1, 8, 32)).astype(np.float32)
    with pytest.raises(ShardMissing):
        w.partial_resident(q, ShardQuery(np.array([5]), AttentionOptions()), (ShardRead("nope", 0, 3),), 2)
    status, _ = w.partial_resident(q, ShardQuery(np.array([5]), AttentionOptions()), (ShardRead("ctx", 0, 100),), 2)
    assert status.batch == 1 and w.ping()["batches"] >= 2


def test_queries_over_contexts_that_share_a_prefix_share_the_prefix_pass(rng):
    w = ShardWorker(WorkerConfig(), "w0")
    parts = {}
    for ctx, n, start in (("prefix", 2000, 0), ("s1", 300, 2000), ("s2", 500, 2000), ("other", 700, 0)):
        k = rng.standard_normal((n, 2, 32)).astype(np.float32)
        v = rng.standard_normal((n, 2, 16)).astype(np.float32)
        w.create_shard(ShardWrite(ctx, 0, "float32", n, np.arange(start, start + n)), k, v, {"version": 1})
        parts[ctx] = (k, v, np.arange(start, start + n))
    reads = {ctx: ShardRead(ctx, 0, len(parts[ctx][0])) for ctx in parts}
    asks = [("prefix", "s1"), ("prefix", "s2"), ("other",), ("prefix", "s2")]
    qs = [rng.standard_normal((1, 8, 32)).astype(np.float32) for _ in asks]
    query = ShardQuery(np.array([2600]), AttentionOptions(causal=True))
    alone = [w.partial_resident(q, query, tuple(reads[c] for c in ask), 2)[1] for q, ask in zip(qs, asks)]
    held, release = threading.Event(), threading.Event()
    runs = []

    def held_run(jobs):
        runs.append([tuple(r.context_id for r in j.reads) for j in jobs])
        if not held.is_set():
            held.set()
            assert release.wait(30)
        return w._run(jobs)

    w.compute = Batcher(held_run, joins=_share_a_shard)
    with ThreadPoolExecutor(5) as pool:
        pool.submit(w.partial_resident, qs[0], query, (reads["s1"],), 2)
        assert held.wait(10)
        futures = [pool.submit(w.partial_resident, q, query, tuple(reads[c] for c in ask), 2)
                   for q, ask in zip(qs, asks)]
        queued(w.compute, 4)
        release.set()
        results = [f.result(60) for f in futures]
    # The three queries over the prefix ran in one batch (one pass over its keys); the other alone.
    assert runs[1:] == [[("prefix", "s1"), ("prefix", "s2"), ("prefix", "s2")], [("other",)]]
    assert [status.batch for status, _ in results] == [3, 3, 1, 3]
    for q, ask, (_, state), solo in zip(qs, asks, results, alone):
        assert state.m.tobytes() == solo.m.tobytes() and state.acc.tobytes() == solo.acc.tobytes()
        k, v, k_pos = (np.concatenate([parts[c][i] for c in ask]) for i in range(3))
        out, lse = finalize(state)
        assert_close_to_reference(out, lse, q, k, v, causal=True, q_pos=np.array([2600]), k_pos=k_pos)


def test_work_whose_budget_ran_out_while_the_worker_was_busy_is_not_computed_and_the_rest_is_exact(rng):
    """Queries (resident, inline, and a batch's items) wait behind a held first query; those sent with
    0.2 s left are not computed once it ends, those with time left (or no deadline) are, exactly."""
    from workers.store import Expired
    from workers.tasks import ResidentQuery

    w, k, v = worker_with_context(rng)
    reads = (ShardRead("ctx", 0, 3000),)
    opts = AttentionOptions(causal=True)
    qs = [rng.standard_normal((1, 8, 32)).astype(np.float32) for _ in range(4)]
    q_pos = np.array([2999])
    alone = [w.partial_resident(q, ShardQuery(q_pos, opts), reads, 2)[1] for q in qs]
    held, release = threading.Event(), threading.Event()
    computed: list[list] = []  # the q of every job each batch computed

    def held_run(jobs):
        computed.append([j.q for j in jobs])
        if not held.is_set():
            held.set()
            assert release.wait(30)
        return w._run(jobs)

    w.compute = Batcher(held_run, joins=_share_a_shard, expired=Expired)
    forever = ShardQuery(q_pos, opts)  # no deadline
    late, left = forever.with_budget(0.2), forever.with_budget(3600.0)
    with ThreadPoolExecutor(6) as pool:
        first = pool.submit(w.partial_resident, qs[0], forever, reads, 2)
        assert held.wait(10)
        waiting = {
            "late": pool.submit(w.partial_resident, qs[1], late, reads, 2),
            "left": pool.submit(w.partial_resident, qs[2], left, reads, 2),
            "inline late": pool.submit(w.partial, qs[1], k[:100], v[:100], late, np.arange(100)),
            "many": pool.submit(w.partial_resident_many, [ResidentQuery(qs[1], late, reads),
                                                          ResidentQuery(qs[3], left, reads)]),
            "none": pool.submit(w.partial_resident, qs[3], forever, reads, 2),
        }
        queued(w.compute, 6)
        time.sleep(0.3)  # the late ones' 0.2 s run out while the first query holds the compute thread
        release.set()
        first.result(60)
        for name in ("late", "inline late"):
            with pytest.raises(Expired, match="deadline passed"):
                waiting[name].result(60)
        late_item, (item_status, item_states) = waiting["many"].result(60)
        results = [waiting["left"].result(60), waiting["none"].result(60)]
    assert isinstance(late_item, Expired)
    assert w.compute.expired == 3 and w.ping()["expired"] == 3
    # One pass computed the three in time (the batch's live item among them); q 1 (the late ones) never ran.
    assert [sorted(id(q) for q in batch) for batch in computed[1:]] == [sorted([id(qs[2]), id(qs[3]), id(qs[3])])]
    assert item_status.batch == 3 and len(item_states) == 1
    for state, q, solo in ((results[0][1], qs[2], alone[2]), (results[1][1], qs[3], alone[3]),
                           (item_states[0], qs[3], alone[3])):
        assert state.m.tobytes() == solo.m.tobytes() and state.acc.tobytes() == solo.acc.tobytes()
        out, lse = finalize(state)
        assert_close_to_reference(out, lse, q, k, v, causal=True, q_pos=q_pos)
