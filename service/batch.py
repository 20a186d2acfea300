"""Many attention items in one request (``POST /v1/attention/batch``; docs/API.md section 10).

An inference engine sends, at every layer of every decode step, the queries of all
its running sequences, each over its own resident context. One request carries
them all, and the per-call costs are paid once per batch:

1. the contexts of every item are resolved together (the front end's record cache,
   then one directory call for what it does not hold);
2. every shard of every item is assigned to one of its live replicas, spreading
   the reads over the workers; each worker gets **one** call with all the items'
   reads it serves (``ShardWorker.partial_resident_many``), and its compute thread
   batches the items over the same shards into one pass (``workers.batch``);
3. each item's states, one per shard, merge in key order over the same fixed tree
   as a single request (``merge.merge_all``), so an item's answer is bitwise the
   answer the same query gets alone.

Items the grouped path does not take (inline keys, contexts holding no keys) and
items whose grouped read failed (a worker gone, a shard missing, a stale cached
record) run through the single-request path (``AttentionService.attention``),
which retries on other replicas and re-reads the directory, except an item a worker
did not start because the request's deadline had passed: it is answered 504 (the
request itself is past its deadline). An item's failure is its own answer; the others
are unaffected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from merge import State, finalize, merge_all
from service.core import request_id
from service.attention import (
    AttentionService,
    answer_elements,
    JsonAnswerLimit,
    check_answer_size,
    checked_answer,
    request_dtypes,
    union_positions,
    widened_q,
)
from service.cluster.orchestrator import LOCAL_MERGE_INLINE_BYTES, late
from service.cluster.surface import WorkerSurface
from service.contexts.records import ContextRecord
from service.contexts.resolved import Resolved
from service.contexts.service import ContextService
from service.core.errors import BodyTooLarge, ContextNotFound, Internal, InvalidTensor, ServiceError, WorkersUnavailable
from service.core.metrics import Timings
from service.core.settings import ServiceSettings
from service.wire.batch import Answer, Item, ItemError
from service.wire.request import AttentionRequest
from workers.dtypes import accumulation_dtype
from workers.store import Expired
from workers.tasks import ResidentQuery, ShardQuery, ShardRead, carry

log = logging.getLogger(__name__)


@dataclass
class Planned:
    """One item on the grouped path: its query, its shards in key order and, once back, a state for each."""

    index: int
    req: AttentionRequest
    query: ShardQuery
    reads: list[tuple[ShardRead, tuple[int, ...]]]  #: each shard and its live replicas (pool indexes)
    cached: bool  #: its records came from the front end's cache
    states: list[State | None] = field(default_factory=list)
    q: Any = None  #: the item's q in its accumulation dtype (service.attention.widened_q)
    failed: bool = False
    late: ServiceError | None = None  #: its answer when a worker did not start it in time (not retried)


class BatchService:
    def __init__(self, settings: ServiceSettings, pool: WorkerSurface, attention: AttentionService,
                 contexts: ContextService) -> None:
        self.settings = settings
        self.pool = pool
        self.attention = attention
        self.contexts = contexts

    async def run(self, items: Sequence[Item], timings: Timings, json_limit: JsonAnswerLimit | None = None) -> list[Answer]:
        """Each item's ``(out, lse)`` or error, in order. ``json_limit``: the answers are to be written as
        JSON text, whose ``out`` tensors may hold at most that many elements in all (``_check_total``)."""
        answers: list[Answer | None] = [it if isinstance(it, ItemError) else None for it in items]
        grouped = [(i, it) for i, it in enumerate(items) if isinstance(it, AttentionRequest)
                   and it.contexts and it.kv is None]
        single = [i for i, it in enumerate(items) if isinstance(it, AttentionRequest) and (not it.contexts or it.kv is not None)]
        found: tuple[dict[str, ContextRecord], set[str]] = ({}, set())  # records, and which came from the cache
        if grouped:
            with timings.measure("lookup"):
                found = await self.contexts.resolve_many([c for _, req in grouped for c in req.contexts])
        t0 = time.perf_counter()
        sizes: dict[int, int] = {i: answer_elements(it, it.kv.dims.d_v) for i in single
                                 if isinstance(it := items[i], AttentionRequest) and it.kv is not None}
        planned = self._plan(grouped, found, answers, single, sizes)
        self._check_total(sizes, answers, json_limit)
        timings.add("scatter", time.perf_counter() - t0)
        t1 = time.perf_counter()
        alone = asyncio.gather(*(self._single(i, items[i]) for i in single))  # type: ignore[arg-type]
        passes = await self._compute(planned)
        t2 = time.perf_counter()
        timings.add("compute", t2 - t1)
        if passes:  # the grouped reads' longest pass on a worker (items sent alone are not timed here)
            timings.add("worker", max(passes))
        retry = [p for p in planned if p.failed and p.late is None]
        for p in retry:  # a cached record may be why: the single path reads the directory
            if p.cached:
                self.contexts.forget(p.req.contexts)
        done = [p for p in planned if not p.failed and p.late is None]
        for p in planned:
            if p.late is not None:
                answers[p.index] = ItemError.of(p.index, p.late)
        nbytes = sum(st.nbytes for p in done for st in p.states if st is not None)
        merged = (await asyncio.to_thread(self._merge, done) if nbytes > LOCAL_MERGE_INLINE_BYTES
                  else self._merge(done))
        for p, answer in zip(done, merged):
            answers[p.index] = answer
        timings.add("merge", time.perf_counter() - t2)
        for i, answer in zip(single, await alone):
            answers[i] = answer
        for p, answer in zip(retry, await asyncio.gather(*(self._single(p.index, p.req) for p in retry))):
            answers[p.index] = answer
        answered = [a for a in answers if a is not None]
        if len(answered) != len(items):  # every item is answered above: an item left out would shift the others
            raise Internal(f"batch answered {len(answered)} of {len(items)} items")
        return answered

    def _merge(self, done: list[Planned]) -> list[Answer]:
        """Each item's states merged in key order over the single request's fixed tree, finalized.

        A merge that refuses its states (``merge`` checks they agree) fails its item alone, as a
        500 with the request id: a bug, never an answer, and not the other items' answers.
        """
        answers: list[Answer] = []
        for p in done:
            try:
                answers.append(checked_answer(*finalize(merge_all(p.states, self.settings.merge_fanin))))  # type: ignore[arg-type]
            except InvalidTensor as exc:
                answers.append(ItemError.of(p.index, exc))
            except ValueError:
                rid = request_id.current()
                log.exception("request %s item %d: its states did not merge", rid, p.index)
                answers.append(ItemError.of(p.index, Internal(
                    f"the service failed on this item; the server log has the details under request id {rid}")))
        return answers

    async def _single(self, index: int, req: AttentionRequest) -> Answer:
        """One item through the single-request path; its error is its answer."""
        try:
            out, lse = await self.attention.attention(req, Timings())
            return out, lse
        except ServiceError as exc:
            return ItemError.of(index, exc)

    def _check_total(self, sizes: dict[int, int], answers: list[Answer | None], json_limit: JsonAnswerLimit | None) -> None:
        """413 for the whole batch when its answers would hold more ``out`` elements in all than one
        tensor may, or than a JSON answer may (``json_limit``) when they are to be written as JSON
        (``sizes``: each item's; items refused, or over the tensor limit alone, are their own errors),
        before any work is sent."""
        total = sum(n for i, n in sizes.items() if answers[i] is None and n <= self.attention.max_elements)
        if total > self.attention.max_elements:
            raise BodyTooLarge(f"items must give answers of at most {self.attention.max_elements} out elements in "
                               f"all (n_q x h_q x d_v summed over the items), got {total}: send them in several batches")
        if json_limit is not None and total > json_limit.elements:
            raise BodyTooLarge(f"items must give JSON answers of at most {json_limit.elements} out elements in all (n_q x h_q "
                               f"x d_v summed over the items), got {total}: ask for application/octet-stream (Accept) "
                               "to get them as safetensors, or send them in several batches")

    def _plan(self, grouped: list[tuple[int, AttentionRequest]], found: tuple[dict[str, ContextRecord], set[str]],
              answers: list[Answer | None], single: list[int], sizes: dict[int, int]) -> list[Planned]:
        """The grouped items with their shards (``found``: the records of their contexts, and which came
        from the cache); items refused here get their error in ``answers``, items without keys in a
        context go to ``single``; ``sizes`` gets each item's answer elements."""
        records, from_cache = found
        planned = []
        for i, req in grouped:
            try:
                missing = next((c for c in req.contexts if c not in records), None)
                if missing is not None:
                    raise ContextNotFound(f"contexts must name existing contexts, got unknown id {missing!r}")
                resolved: Resolved = self.contexts.resolved([records[c] for c in req.contexts],
                                                            cached=any(c in from_cache for c in req.contexts))
                resolved.check(req)
                check_answer_size(req, resolved.dims.d_v, self.attention.max_elements)
                q_pos, _ = union_positions(req, resolved.next_pos)
            except ServiceError as exc:
                answers[i] = ItemError.of(i, exc)
                continue
            sizes[i] = answer_elements(req, resolved.dims.d_v)
            reads = [(r, tuple(self.pool.indexes(names, alive=True))) for r, names in resolved.reads()]
            if not reads or any(not live for _, live in reads):  # no keys, or a shard to look for elsewhere
                single.append(i)
                continue
            q = widened_q(req.q, accumulation_dtype(*request_dtypes(req, resolved)))
            planned.append(Planned(i, req, ShardQuery(q_pos=q_pos, options=req.options), reads, resolved.cached,
                                   states=[None] * len(reads), q=q))
        return planned

    async def _compute(self, planned: list[Planned]) -> list[float]:
        """Every planned read on one live replica, one call per worker; fills ``states`` or marks ``failed``.
        Returns the seconds of the passes the workers ran for the items they answered."""
        load = {s.index: s.outstanding for s in self.pool.slots}
        calls: dict[int, list[tuple[Planned, list[int]]]] = {}
        for p in planned:
            mine: dict[int, list[int]] = {}
            for j, (_, live) in enumerate(p.reads):
                w = min(live, key=lambda x: (load[x], x))  # the least loaded replica, counting this batch
                load[w] += 1
                mine.setdefault(w, []).append(j)
            for w, js in mine.items():
                calls.setdefault(w, []).append((p, js))
        workers = list(calls)
        results = await asyncio.gather(*(self._call(w, calls[w]) for w in workers), return_exceptions=True)
        passes: list[float] = []
        for w, result in zip(workers, results):
            for k, (p, js) in enumerate(calls[w]):
                got = result[k] if isinstance(result, list) else result
                if isinstance(got, Expired):
                    p.late = late(self.pool.slots[w].name)
                    continue
                if isinstance(got, BaseException):
                    p.failed = True
                    continue
                status, states = got
                passes.append(status.seconds)
                for j, st in zip(js, states):
                    p.states[j] = st
        return passes

    async def _call(self, worker: int, work: list[tuple[Planned, list[int]]]) -> list[Any]:
        items = [ResidentQuery(carry(p.q), p.query, tuple(p.reads[j][0] for j in js)) for p, js in work]
        try:
            return await self.pool.compute_many(worker, items)
        except WorkersUnavailable as exc:
            return [exc] * len(items)
