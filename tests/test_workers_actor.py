"""The shard worker class without Ray (Ray wraps it unchanged in service.cluster.pool)."""

import numpy as np
from reference import assert_close_to_reference

from merge import finalize, merge_all
from workers.actor import ShardWorker
from workers.config import WorkerConfig
from workers.options import AttentionOptions
from workers.problem import Arange
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
