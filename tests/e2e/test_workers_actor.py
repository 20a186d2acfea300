"""The shard worker class without Ray (Ray wraps it unchanged in service.cluster.pool)."""

import numpy as np
from reference import assert_close_to_reference

from merge import finalize, merge_all
from workers.actor import ShardWorker
from workers.config import WorkerConfig
from workers.options import AttentionOptions
from workers.problem import Arange
from workers.store import ShardMissing
from workers.tasks import ShardQuery, ShardRead, ShardWrite


def test_inline_and_resident_partials_merge_to_the_reference(rng):
    w = ShardWorker(WorkerConfig(), "w0")
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    k = rng.standard_normal((50, 2, 8)).astype(np.float32)
    v = rng.standard_normal((50, 2, 8)).astype(np.float32)
    q_pos = np.array([48, 49])
    query = ShardQuery(q_pos=q_pos, options=AttentionOptions(causal=True))
    w.create_shard(ShardWrite("ctx", 0, "float32", 100, np.arange(30)), k[:30], v[:30], {"version": 1})
    s1, st1 = w.partial_resident(q, query, (ShardRead("ctx", 0, 30),), 2)
    s2, st2 = w.partial(q, k[30:], v[30:], query, Arange(30, 20))
    assert s1.worker == "w0" and s2.nbytes == st2.nbytes
    out, lse = finalize(merge_all([st1, w.merge_states(st2)]))
    assert_close_to_reference(out, lse, q, k, v, causal=True)
    assert w.ping()["shards"] == 1 and w.ping()["bytes_held"] > 0


def test_partial_resident_many_answers_each_item_unmerged_and_bitwise_as_alone(rng):
    from workers.store import RecordStale
    from workers.tasks import ResidentQuery

    w = ShardWorker(WorkerConfig(), "w0")
    k = rng.standard_normal((90, 2, 8)).astype(np.float32)
    v = rng.standard_normal((90, 2, 8)).astype(np.float32)
    for i, (a, b) in enumerate(((0, 40), (40, 90))):
        w.create_shard(ShardWrite("ctx", i, "float32", 100, np.arange(a, b)), k[a:b], v[a:b], {"version": 1})
    w.note_context("ctx", {"version": 2})
    reads = (ShardRead("ctx", 0, 40, 2), ShardRead("ctx", 1, 50, 2))
    qs = [rng.standard_normal((n, 4, 8)).astype(np.float32) for n in (1, 3)]
    query = ShardQuery(q_pos=np.array([89]), options=AttentionOptions())
    causal = ShardQuery(q_pos=np.array([60, 70, 89]), options=AttentionOptions(causal=True))
    items = [ResidentQuery(qs[0], query, reads), ResidentQuery(qs[1], causal, reads),
             ResidentQuery(qs[0], query, (ShardRead("ctx", 0, 40, 1),)),  # a stale record
             ResidentQuery(qs[0], query, (ShardRead("gone", 0, 5, 1),))]  # a shard this worker lacks
    got = w.partial_resident_many(items)
    assert isinstance(got[2], RecordStale) and isinstance(got[3], ShardMissing)
    for (status, states), q, qry in zip(got[:2], qs, (query, causal)):
        assert len(states) == 2 and status.worker == "w0"
        alone = [w.partial_resident(q, qry, (r,), 2)[1] for r in reads]
        for st, one in zip(states, alone):
            assert np.array_equal(st.m, one.m) and np.array_equal(st.l, one.l) and np.array_equal(st.acc, one.acc)
        out, lse = finalize(merge_all(states))
        assert_close_to_reference(out, lse, q, k, v, q_pos=qry.q_pos, causal=qry.options.causal)
