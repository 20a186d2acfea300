"""Many attention items in one request (``POST /v1/attention/batch``; docs/API.md section 10).

An inference engine sends, at every layer of every decode step, the queries of all
its running sequences, each over its own resident context. One request carries
them all, and the per-call costs are paid once per batch. The batch is a planner;
the single request's orchestrator runs what it plans:

1. the contexts of every item are resolved together (the front end's record cache,
   then one directory call for what it does not hold);
2. each item is planned as a single request is (``AttentionService.plan``); an item
   refused there has its error for an answer, and the answers of the rest must fit the
   batch's limits (``_check_total``);
3. the orchestrator runs every plan at once (``Orchestrator.run_many``): each resident
   shard on one of its live replicas, spreading the reads over the workers, with **one**
   call per worker for all the items' reads it serves (``ShardWorker.partial_resident_many``:
   its compute thread batches the items over the same shards into one pass,
   ``workers.batch``); inline shards as a single request's; failed reads retried on other
   replicas; each item's states merged in key order over the same fixed tree as a single
   request (``merge.merge_all``), so an item's answer is bitwise the answer the same
   query gets alone;
4. an item whose cached record was stale, or named a replica that is gone, is planned
   again from the directory and run once more (``AttentionService.rerun_fresh``, as a
   single request is).

An item may first append keys to its one context (``append``, before all of the above): the
route runs every item's append to its end (``BatchService.append``, outside the request's
deadline, as a context write always is), and only an item whose append is committed is
planned, over the context with its new keys. An append refused (409 after a length the
context does not hold, 404, 507, ...) is the item's answer. An append with ``after`` and
``upload`` that finds its own keys already stored there (the request sent again after its
answer was lost) counts as done, so a retried step appends once and is still answered.

An item's failure is its own answer; the others are unaffected.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from service.attention import AttentionService, JsonAnswerLimit, checked_answer
from service.cluster.orchestrator import Outcome, Plan
from service.cluster.surface import WorkerSurface
from service.contexts.records import ContextRecord
from service.contexts.resolved import Resolved
from service.contexts.service import ContextService
from service.core.errors import BodyTooLarge, ContextLost, ContextNotFound, Internal, LengthMismatch, ServiceError
from service.core.metrics import Timings
from service.core.settings import ServiceSettings
from service.wire.batch import Answer, AppendThenQuery, Item, ItemError, Query
from service.wire.request import AttentionRequest
from workers.store import RecordStale

#: The records of a batch's contexts, and which of them came from the front end's cache.
Found = tuple[dict[str, ContextRecord], set[str]]


@dataclass(eq=False, slots=True)
class Planned:
    """One item planned: its request, the contexts it resolved to, and its plan."""

    index: int
    req: AttentionRequest
    resolved: Resolved | None
    plan: Plan


class BatchService:
    def __init__(self, settings: ServiceSettings, pool: WorkerSurface, attention: AttentionService,
                 contexts: ContextService) -> None:
        self.settings = settings
        self.pool = pool
        self.attention = attention
        self.contexts = contexts

    async def append(self, items: Sequence[Item], timings: Timings) -> list[Query]:
        """Each item with its append done: its query, or the append's error. The appends run at once, each
        to its end (the route shields them from the deadline and from cancellation); ``timings`` gets their
        stages (put, lease, store, commit, note), summed over the items."""
        async def one(i: int, item: AppendThenQuery) -> Query:
            try:
                await self._append(item, timings)
            except ServiceError as exc:
                return ItemError.of(i, exc)
            return item.req

        appends = [one(i, it) for i, it in enumerate(items) if isinstance(it, AppendThenQuery)]
        done = iter(await asyncio.gather(*appends))
        return [next(done) if isinstance(it, AppendThenQuery) else it for it in items]

    async def _append(self, item: AppendThenQuery, timings: Timings) -> None:
        """Append the item's keys; a 409 whose ``after`` and ``upload`` name keys already stored by this
        upload (an earlier attempt of the same request) is success."""
        write = item.write
        try:
            await self.contexts.append(item.context_id, write, timings)
        except LengthMismatch:
            if write.after is None or write.upload is None:
                raise
            stored = (await self.contexts.get(item.context_id, write.upload))["upload"]
            if stored != {"id": write.upload, "start": write.after, "end": write.after + write.kv.dims.n_k}:
                raise

    async def run(self, items: Sequence[Query], timings: Timings,
                  json_limit: JsonAnswerLimit | None = None) -> list[Answer]:
        """Each item's ``(out, lse)`` or error, in order. ``json_limit``: the answers are to be written as
        JSON text, whose ``out`` tensors may hold at most that many elements in all (``_check_total``)."""
        answers: list[Answer | None] = [it if isinstance(it, ItemError) else None for it in items]
        reqs = [(i, it) for i, it in enumerate(items) if isinstance(it, AttentionRequest)]
        found = await self._lookup(reqs, timings)
        t0 = time.perf_counter()
        planned = await self._plan(reqs, found, answers)
        self._check_total(planned, json_limit)
        timings.add("scatter", time.perf_counter() - t0)
        again = await self._run(planned, answers, timings, fresh=False)
        if again:  # read a stale cached record: once more from the directory (its stages are not the batch's)
            scratch = Timings()
            await self._run(await self._replan(again, answers, scratch), answers, scratch, fresh=True)
        answered = [a for a in answers if a is not None]
        if len(answered) != len(items):  # every item is answered above: an item left out would shift the others
            raise Internal(f"batch answered {len(answered)} of {len(items)} items")
        return answered

    async def _lookup(self, reqs: Sequence[tuple[int, AttentionRequest]], timings: Timings) -> Found:
        """The records of every item's contexts (the ``lookup`` stage): one directory call for those the
        front end's cache does not hold."""
        ids = [c for _, req in reqs for c in req.contexts]
        if not ids:
            return {}, set()
        with timings.measure("lookup"):
            return await self.contexts.resolve_many(ids)

    async def _run(self, planned: Sequence[Planned], answers: list[Answer | None], timings: Timings, *,
                   fresh: bool) -> list[Planned]:
        """Run the plans together (``Orchestrator.run_many``) and answer each item (``_answer``)."""
        outcomes = await self.attention.orch.run_many([p.plan for p in planned], timings)
        return await self._answer(planned, outcomes, answers, fresh=fresh)

    async def _plan(self, reqs: Sequence[tuple[int, AttentionRequest]], found: Found,
                    answers: list[Answer | None]) -> list[Planned]:
        """Each item's plan over its contexts' records (``found``); an item refused gets its error in ``answers``."""
        planned = []
        for i, req in reqs:
            try:
                resolved = self._resolved(req, found)
                planned.append(Planned(i, req, resolved, await self.attention.plan(req, resolved)))
            except ServiceError as exc:
                answers[i] = ItemError.of(i, exc)
        return planned

    def _resolved(self, req: AttentionRequest, found: Found) -> Resolved | None:
        """The item's contexts from the batch's records, checked against it, as ``AttentionService.resolve``
        does for a single request (404 for an unknown one); None: it names none."""
        if not req.contexts:
            return None
        records, from_cache = found
        missing = next((c for c in req.contexts if c not in records), None)
        if missing is not None:
            raise ContextNotFound(f"contexts must name existing contexts, got unknown id {missing!r}")
        resolved = self.contexts.resolved([records[c] for c in req.contexts],
                                          cached=any(c in from_cache for c in req.contexts))
        resolved.check(req)
        return resolved

    async def _replan(self, again: Sequence[Planned], answers: list[Answer | None], timings: Timings) -> list[Planned]:
        """The items to run again, planned from records just read from the directory; an item refused gets its
        error in ``answers`` (404: its context was deleted meanwhile)."""
        async def one(p: Planned) -> Planned | None:
            try:
                resolved = await self.attention.resolve(p.req, timings, fresh=True)
                return Planned(p.index, p.req, resolved, await self.attention.plan(p.req, resolved))
            except ServiceError as exc:
                answers[p.index] = ItemError.of(p.index, exc)
                return None
        return [p for p in await asyncio.gather(*(one(p) for p in again)) if p is not None]

    async def _answer(self, planned: Sequence[Planned], outcomes: Sequence[Outcome], answers: list[Answer | None],
                      *, fresh: bool) -> list[Planned]:
        """Each planned item's outcome into ``answers``; returns the items to plan again from the directory (their
        cached records were stale: none when ``fresh``, their records just read from it)."""
        async def settle(p: Planned, exc: RecordStale | ContextLost) -> Planned | None:
            try:
                if fresh:  # read from the directory already: what its client gets
                    await self.attention.settle(p.req, exc, Timings())
                else:
                    await self.attention.rerun_fresh(p.req, p.resolved, exc, Timings())
                return p
            except ServiceError as err:
                answers[p.index] = ItemError.of(p.index, err)
                return None

        retry = []
        for p, outcome in zip(planned, outcomes, strict=True):
            if isinstance(outcome, (RecordStale, ContextLost)):
                retry.append(settle(p, outcome))
            elif isinstance(outcome, ServiceError):
                answers[p.index] = ItemError.of(p.index, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome  # a bug, not the item's answer: the request fails, as any would
            else:
                try:
                    answers[p.index] = checked_answer(*outcome)
                except ServiceError as exc:
                    answers[p.index] = ItemError.of(p.index, exc)
        return [p for p in await asyncio.gather(*retry) if p is not None]

    def _check_total(self, planned: Sequence[Planned], json_limit: JsonAnswerLimit | None = None) -> None:
        """413 for the whole batch when its answers would hold more ``out`` elements in all than one
        tensor may, or than a JSON answer may (``json_limit``) when they are to be written as JSON
        (items refused at planning, over the tensor limit among them, are their own errors), before
        any work is sent to the workers."""
        total = sum(p.plan.elements for p in planned)
        max_elements = self.attention.max_elements
        if total > max_elements:
            raise BodyTooLarge(f"items must give answers of at most {max_elements} out elements in "
                               f"all (n_q x h_q x d_v summed over the items), got {total}: send them in several batches")
        if json_limit is not None and total > json_limit.elements:
            raise BodyTooLarge(f"items must give JSON answers of at most {json_limit.elements} out elements in all (n_q x h_q "
                               f"x d_v summed over the items), got {total}: ask for application/octet-stream (Accept) "
                               "to get them as safetensors, or send them in several batches")
