"""The batch planner (``service.batch.BatchService``) on the in-process pool (no Ray).

Each item's shards go to one live replica, one call per worker; an item whose grouped read failed
goes through the single-request path (which retries elsewhere); an item's failure is its own answer;
an item's answer is bitwise what the same query gets alone.
"""

import asyncio

import numpy as np
from faulty_pool import bitwise, kv, started, write

from service.attention import AttentionService
from service.batch import BatchService
from service.cluster.orchestrator import Orchestrator
from service.core import deadline
from service.core.metrics import Timings
from service.wire.batch import ItemError
from service.wire.request import AttentionRequest
from workers.options import AttentionOptions


def request(q, *contexts):
    n_q, h_q, d = q.shape
    return AttentionRequest(q, None, None, AttentionOptions(), tuple(contexts), n_q, h_q, d)


async def services(workers):
    pool, _, contexts = await started(workers)
    s = pool.settings
    attention = AttentionService(s, pool, Orchestrator(pool, fanin=s.merge_fanin,
                                                       remote_merge_bytes=s.remote_merge_bytes), contexts)
    return pool, contexts, attention, BatchService(s, pool, attention, contexts)


async def three_contexts(rng, contexts, replicas):
    return [(await contexts.create(write(*kv(rng, n), replicas=replicas), Timings()))["id"] for n in (150, 70, 30)]


def items_of(rng, ids):
    qs = [rng.standard_normal((1, 4, 8)).astype(np.float32) for _ in range(4)]
    return [request(qs[0], ids[0]), request(qs[1], ids[1]), request(qs[2], ids[2]), request(qs[3], ids[0], ids[2])]


def test_each_items_answer_is_bitwise_its_answer_alone_with_one_call_per_worker(rng):
    async def main():
        pool, contexts, attention, batch = await services(3)
        try:
            items = items_of(rng, await three_contexts(rng, contexts, replicas=1))
            alone = [await attention.attention(it, Timings()) for it in items]
            del pool.sent[:]
            answers = await batch.run(items, Timings())
            assert all(bitwise(a, b) for a, b in zip(answers, alone))
            grouped = pool.calls_of("partial_resident_many")
            assert sorted(grouped) == sorted(set(grouped)) and not pool.calls_of("partial_resident")
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_an_item_whose_worker_died_is_answered_through_the_single_path_bitwise(rng):
    async def main():
        pool, contexts, attention, batch = await services(3)
        try:
            items = items_of(rng, await three_contexts(rng, contexts, replicas=2))
            alone = [await attention.attention(it, Timings()) for it in items]
            pool.kill(0)  # not noticed yet: the planner sends it its share
            answers = await batch.run(items, Timings())
            assert all(bitwise(a, b) for a, b in zip(answers, alone))
            assert 0 in pool.calls_of("partial_resident_many") and not pool.slots[0].alive
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_an_item_whose_shard_no_live_worker_holds_is_its_own_context_lost(rng):
    async def main():
        pool, contexts, attention, batch = await services(2)
        try:
            lost = (await contexts.create(write(*kv(rng, 150), replicas=1), Timings()))["id"]
            kept = (await contexts.create(write(*kv(rng, 150), replicas=2), Timings()))["id"]
            q = rng.standard_normal((1, 4, 8)).astype(np.float32)
            want = await attention.attention(request(q, kept), Timings())
            pool.kill(0)
            await pool.refresh()
            answers = await batch.run([request(q, lost), request(q, kept)], Timings())
            assert isinstance(answers[0], ItemError) and answers[0].status == 503
            assert answers[0].code == "context_lost" and answers[0].detail.startswith("items[0]: ")
            assert bitwise(answers[1], want)
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_items_a_worker_did_not_start_before_the_deadline_are_504_and_not_sent_again(rng):
    async def main():
        pool, contexts, _, batch = await services(2)
        try:
            items = items_of(rng, await three_contexts(rng, contexts, replicas=1))
            del pool.sent[:]
            with deadline.running(0.0):
                answers = await batch.run(items, Timings())
            assert all(isinstance(a, ItemError) and a.status == 504 for a in answers)
            assert not pool.calls_of("partial_resident")  # none went through the single path
        finally:
            pool.shutdown()

    asyncio.run(main())
