"""The batch as a planner (service.batch): items planned as single requests are, run by one orchestrator
over fake workers (tests/fake_workers.py), answered bitwise as the single path answers them."""

import asyncio

import numpy as np
import pytest
from fake_workers import H_KV, SHARD_KEYS, D, FakeWorkers

from service.attention import AttentionService
from service.batch import BatchService
from service.cluster.orchestrator import Orchestrator
from service.contexts.service import ContextService
from service.core.errors import BodyTooLarge, ContextNotFound
from service.core.metrics import Timings
from service.core.settings import ServiceSettings
from service.wire.batch import ItemError
from service.wire.request import AttentionRequest, InlineKV
from workers.options import AttentionOptions
from workers.problem import Arange, KVDims
from workers.store import ShardMissing


def record(ctx, shards, holders, version=1, dtype="float32"):
    """A context of ``shards`` full shards, shard i held by the workers ``holders(i)``."""
    return {"id": ctx, "h_kv": H_KV, "d": D, "d_v": D, "dtype": dtype, "replicas": 1, "shard_capacity": SHARD_KEYS,
            "expected_length": None, "next_pos": shards * SHARD_KEYS, "version": version,
            "shards": [{"index": i, "length": SHARD_KEYS, "workers": [f"splitkey-worker-{w}" for w in holders(i)]}
                       for i in range(shards)]}


class FakeContexts:
    """The part of ``ContextService`` the query paths call: a directory and the front end's record cache."""

    resolved = staticmethod(ContextService.resolved)

    def __init__(self, directory, cache=()):
        self.directory = {r["id"]: r for r in directory}
        self.cache = {r["id"]: r for r in cache}
        self.directory_calls = 0
        self.forgotten: list[tuple[str, ...]] = []

    async def resolve_many(self, ids):
        found, from_cache = {}, set()
        missing = [c for c in dict.fromkeys(ids) if c not in self.cache]
        for c in dict.fromkeys(ids):
            if c in self.cache:
                found[c] = self.cache[c]
                from_cache.add(c)
        if missing:
            self.directory_calls += 1
            for c in missing:
                if c in self.directory:
                    found[c] = self.cache[c] = self.directory[c]
        return found, from_cache

    async def resolve(self, ids, *, fresh=False):
        if not fresh and all(c in self.cache for c in ids):
            return self.resolved([self.cache[c] for c in ids], cached=True)
        self.directory_calls += 1
        for c in ids:
            if c not in self.directory:
                raise ContextNotFound(f"contexts must name existing contexts, got unknown id {c!r}")
            self.cache[c] = self.directory[c]
        return self.resolved([self.directory[c] for c in ids], cached=False)

    def forget(self, ids):
        self.forgotten.append(tuple(ids))
        for c in ids:
            self.cache.pop(c, None)


def keys(rng, contexts, shards, dtype=np.float32):
    return {(c, i): (rng.standard_normal((SHARD_KEYS, H_KV, D)).astype(dtype),
                     rng.standard_normal((SHARD_KEYS, H_KV, D)).astype(dtype),
                     np.arange(i * SHARD_KEYS, (i + 1) * SHARD_KEYS))
            for c in contexts for i in range(shards)}


def request(rng, *contexts, h_q=2 * H_KV, n_q=1, inline=0, dtype=np.float32):
    kv = None
    if inline:
        k, v = (rng.standard_normal((inline, H_KV, D)).astype(dtype) for _ in range(2))
        kv = InlineKV(k=k, v=v, k_pos=None, dims=KVDims(n_k=inline, h_kv=H_KV, d=D, d_v=D))
    q = rng.standard_normal((n_q, h_q, D)).astype(np.float32)
    return AttentionRequest(q=q, q_pos=None, kv=kv, options=AttentionOptions(), contexts=tuple(contexts),
                            n_q=n_q, h_q=h_q, d=D)


def services(pool, contexts):
    settings = ServiceSettings()
    orch = Orchestrator(pool, fanin=settings.merge_fanin, remote_merge_bytes=settings.remote_merge_bytes)
    attention = AttentionService(settings, pool, orch, contexts)
    return attention, BatchService(settings, pool, attention, contexts)


def same(got, want):
    assert isinstance(got, tuple), got
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def alone(attention, req):
    return asyncio.run(attention.attention(req, Timings()))


def test_batch_answers_each_item_bitwise_as_the_single_path_and_a_refused_item_alone():
    rng = np.random.default_rng(0)
    pool = FakeWorkers(3, keys(rng, ["ctx_a", "ctx_b"], 3))
    contexts = FakeContexts([record("ctx_a", 3, lambda i: (i % 3, (i + 1) % 3)), record("ctx_b", 3, lambda i: (2,))])
    attention, batch = services(pool, contexts)
    refused = ItemError(422, "invalid_tensor", "items[5]: q must be finite")
    items = [request(rng, "ctx_a"), request(rng, "ctx_b", n_q=3), request(rng, "ctx_a", "ctx_b"),
             request(rng, "ctx_a", inline=7), request(rng, "ctx_gone"), refused, request(rng, "ctx_a", h_q=3),
             request(rng, inline=5)]
    timings = Timings()
    answers = asyncio.run(batch.run(items, timings))
    assert contexts.directory_calls == 1  # every item's contexts in one directory call
    for i in (0, 1, 2, 3, 7):
        same(answers[i], alone(attention, items[i]))
    assert answers[4].status == 404 and answers[4].detail.startswith("items[4]: contexts must name existing")
    assert answers[5] is refused
    assert answers[6].status == 422 and answers[6].code == "invalid_tensor" and answers[6].detail.startswith("items[6]: ")
    assert {"lookup", "scatter", "compute", "worker", "merge"} <= set(timings.stages)


def test_batch_items_sharing_workers_go_in_one_call_per_worker():
    rng = np.random.default_rng(1)
    pool = FakeWorkers(2, keys(rng, ["ctx_a"], 4))
    _, batch = services(pool, FakeContexts([record("ctx_a", 4, lambda i: (i % 2,))]))
    answers = asyncio.run(batch.run([request(rng, "ctx_a") for _ in range(5)], Timings()))
    assert all(isinstance(a, tuple) for a in answers)
    assert sorted((w, len(items)) for w, items in pool.many) == [(0, 5), (1, 5)] and pool.one == []


def test_an_item_whose_cached_record_was_stale_is_forgotten_and_planned_again_from_the_directory_once():
    rng = np.random.default_rng(2)
    pool = FakeWorkers(2, keys(rng, ["ctx_a", "ctx_b"], 2))
    pool.versions = {"ctx_a": 2, "ctx_b": 1}  # ctx_a committed an append since the front end cached it
    fresh = [record("ctx_a", 2, lambda i: (i,), version=2), record("ctx_b", 2, lambda i: (1,))]
    contexts = FakeContexts(fresh, cache=[record("ctx_a", 2, lambda i: (i,), version=1), fresh[1]])
    attention, batch = services(pool, contexts)
    items = [request(rng, "ctx_a"), request(rng, "ctx_b")]
    answers = asyncio.run(batch.run(items, Timings()))
    assert contexts.forgotten == [("ctx_a",)] and contexts.directory_calls == 1
    for item, answer in zip(items, answers):
        same(answer, alone(attention, item))


def test_an_item_whose_cached_record_named_a_replica_gone_is_planned_again_from_the_directory():
    rng = np.random.default_rng(3)
    pool = FakeWorkers(2, keys(rng, ["ctx_a"], 1), faults={0: ShardMissing("shard 0 of ctx_a is not held")})
    contexts = FakeContexts([record("ctx_a", 1, lambda i: (1,))], cache=[record("ctx_a", 1, lambda i: (0,))])
    attention, batch = services(pool, contexts)
    item = request(rng, "ctx_a")
    (answer,) = asyncio.run(batch.run([item], Timings()))
    assert contexts.forgotten == [("ctx_a",)]
    assert [w for w, _ in pool.many] == [0, 1]  # the cached replica, then the directory's
    same(answer, alone(attention, item))


def test_a_lost_context_read_from_the_directory_is_its_items_503_and_the_others_are_answered():
    rng = np.random.default_rng(4)
    pool = FakeWorkers(2, keys(rng, ["ctx_a", "ctx_b"], 1), faults={0: ShardMissing("shard 0 of ctx_a is not held")})
    contexts = FakeContexts([record("ctx_a", 1, lambda i: (0,)), record("ctx_b", 1, lambda i: (1,))])
    attention, batch = services(pool, contexts)
    items = [request(rng, "ctx_a"), request(rng, "ctx_b")]
    lost, fine = asyncio.run(batch.run(items, Timings()))
    assert lost.status == 503 and lost.code == "context_lost" and "splitkey-worker-0: shard 0 of ctx_a" in lost.detail
    assert contexts.forgotten == []
    same(fine, alone(attention, items[1]))


def test_answers_over_the_batch_element_limit_are_refused_before_any_work_is_sent():
    rng = np.random.default_rng(5)
    pool = FakeWorkers(1, keys(rng, ["ctx_a"], 1))
    attention, batch = services(pool, FakeContexts([record("ctx_a", 1, lambda i: (0,))]))
    attention.max_elements = 2 * 2 * H_KV * D  # two items' answers
    with pytest.raises(BodyTooLarge, match="at most 64 out elements in all"):
        asyncio.run(batch.run([request(rng, "ctx_a") for _ in range(3)], Timings()))
    assert pool.many == [] and pool.one == []


def test_a_plan_holds_the_context_shards_in_key_order_then_the_inline_ones_with_q_in_the_accumulation_dtype():
    rng = np.random.default_rng(6)
    pool = FakeWorkers(2, {})
    attention, _ = services(pool, FakeContexts([]))
    resolved = ContextService.resolved([record("ctx_a", 2, lambda i: (1 - i, i)), record("ctx_b", 1, lambda i: (1,))],
                                       cached=True)
    req = request(rng, "ctx_a", "ctx_b", inline=3, n_q=2, dtype=np.float64)
    plan = asyncio.run(attention.plan(req, resolved))
    assert [job.label for job in plan.jobs] == ["shard 0 of context ctx_a", "shard 1 of context ctx_a",
                                                "shard 0 of context ctx_b", "inline shard 0"]
    assert [job.candidates for job in plan.jobs] == [(1, 0), (0, 1), (1,), None]
    assert [r.version for job in plan.jobs[:3] for r in job.work.reads] == [1, 1, 1]  # cached: checked by the workers
    assert plan.q.dtype == np.float64 and plan.dtype == np.float64  # float64 inline keys: all in float64
    # inline keys continue after the contexts (past ctx_a's 20 keys); the queries end one past them
    assert plan.jobs[3].work.k_pos == Arange(20, 3) and plan.query.q_pos.tolist() == [21, 22]
    assert plan.shape == (2, 2 * H_KV, D) and plan.state_nbytes == 2 * 2 * H_KV * (D + 2) * 8
