"""The batch planner (``service.batch.BatchService``) on the in-process pool (no Ray).

Each item's shards go to one live replica, one call per worker; an item whose grouped read failed
goes through the single-request path (which retries elsewhere); an item's failure is its own answer;
an item's answer is bitwise what the same query gets alone.
"""

import asyncio

import numpy as np
from faulty_pool import bitwise, kv, read, started, write

from service.attention import AttentionService
from service.batch import BatchService
from service.cluster.orchestrator import Orchestrator
from service.core import deadline
from service.core.metrics import Timings
from service.wire.batch import AppendThenQuery, ItemError
from service.wire.request import AttentionRequest, ContextWrite, InlineKV
from workers.options import AttentionOptions
from workers.problem import KVDims


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


def appending(q, context_id, k, v, *, after, upload="step-1"):
    """An item that appends ``k, v`` to its context after ``after`` keys, then asks ``q`` over it."""
    write = ContextWrite(InlineKV(k, v, None, KVDims(*k.shape, v.shape[2])), replicas=None, shards=None,
                         after=after, upload=upload)
    return AppendThenQuery(write, request(q, context_id))


def test_an_items_append_is_committed_before_it_is_answered_as_a_separate_append_then_query_would_be(rng):
    async def main():
        pool, contexts, _, batch = await services(3)
        k, v = kv(rng, 40)
        mine, theirs = [(await contexts.create(write(k[:30], v[:30]), Timings()))["id"] for _ in range(2)]
        q = rng.standard_normal((1, 4, 8)).astype(np.float32)
        queries = await batch.append([appending(q, mine, k[30:], v[30:], after=30), request(q, theirs)], Timings())
        assert queries[0].contexts == (mine,) and (await contexts.get(mine))["length"] == 40
        got = await batch.run(queries, Timings())
        await contexts.append(theirs, write(k[30:], v[30:]), Timings())
        assert bitwise(got[0], await read(pool, contexts, [theirs], q))
        assert not bitwise(got[1], got[0])  # the other item read its context before that append
    asyncio.run(main())


def test_an_append_sent_again_with_its_after_and_upload_is_stored_once_and_answered_again(rng):
    async def main():
        _, contexts, _, batch = await services(3)
        k, v = kv(rng, 40)
        ctx = (await contexts.create(write(k[:30], v[:30]), Timings()))["id"]
        q = rng.standard_normal((1, 4, 8)).astype(np.float32)
        item = appending(q, ctx, k[30:], v[30:], after=30)
        first = await batch.run(await batch.append([item], Timings()), Timings())
        again = await batch.run(await batch.append([item], Timings()), Timings())
        assert (await contexts.get(ctx))["length"] == 40 and bitwise(first[0], again[0])
    asyncio.run(main())


def test_an_append_after_a_length_the_context_does_not_hold_is_its_items_409_and_the_others_are_answered(rng):
    async def main():
        _, contexts, _, batch = await services(3)
        k, v = kv(rng, 40)
        ctx = (await contexts.create(write(k[:30], v[:30]), Timings()))["id"]
        q = rng.standard_normal((1, 4, 8)).astype(np.float32)
        stale = appending(q, ctx, k[30:], v[30:], after=20, upload="another")
        queries = await batch.append([stale, request(q, ctx)], Timings())
        assert isinstance(queries[0], ItemError) and queries[0].status == 409
        assert queries[0].detail == "items[0]: after must be the context's length 30, got 20"
        answers = await batch.run(queries, Timings())
        assert answers[0] is queries[0] and not isinstance(answers[1], ItemError)
        assert (await contexts.get(ctx))["length"] == 30
    asyncio.run(main())
