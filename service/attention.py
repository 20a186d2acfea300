"""One attention request, from the checked ``AttentionRequest`` to ``(out, lse)``.

Keys of a request are, in this order: the keys of each named context (in the
order named), then the inline keys. Default positions follow docs/API.md
section 2 over that union: inline keys without ``k_pos`` continue after the last
context position (from 0 with no context), and queries without ``q_pos`` are
the ``n_q`` positions ending one past the last key position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from merge import finalize
from service.cluster.orchestrator import Job, Orchestrator, Plan, inline_shard_count, shard_bounds
from service.cluster.surface import InlineWork, WorkerSurface
from service.contexts.resolved import Resolved
from service.contexts.service import ContextService
from service.core.errors import BodyTooLarge, ContextLost, InvalidTensor, WorkersUnavailable, client_input
from service.core.metrics import TRACEPARENT, Timings
from service.core.settings import ServiceSettings
from service.wire.request import AttentionRequest
from workers.dtypes import accumulation_dtype
from workers.problem import Arange, check_positions, end_of, last_positions
from workers.store import RecordStale
from workers.tasks import ShardQuery


def union_positions(req: AttentionRequest, next_pos: int | None) -> tuple[Any, Any]:
    """``(q_pos, k_pos of the inline keys)`` over the contexts' keys and the inline ones; ``next_pos``:
    the largest of the contexts' (None without contexts).

    Given positions were checked at the edge; defaults are made here and checked
    against the position range like any others.
    """
    n_k = 0 if req.kv is None else req.kv.dims.n_k
    start = 0 if next_pos is None else next_pos
    k_pos: Any = Arange(start, n_k) if req.kv is None or req.kv.k_pos is None else req.kv.k_pos
    q_pos = req.q_pos if req.q_pos is not None else last_positions(req.n_q, end_of(k_pos, start=next_pos))
    # A default is named as one: the client sent no such tensor, and sending it is the way out.
    q_name = "q_pos" if req.q_pos is not None else "the default q_pos (ending one past the largest key position)"
    k_name = "k_pos" if req.kv is not None and req.kv.k_pos is not None else "the default k_pos of the inline keys"
    with client_input():  # the keys first: a default q_pos derives from them
        k_pos = check_positions(k_name, k_pos, n_k)
        return check_positions(q_name, q_pos, req.n_q), k_pos


def checked_answer(out: Any, lse: Any) -> tuple[Any, Any]:
    """``(out, lse)``, or 422 when they hold NaN or ``out`` an infinity: the computation overflowed the
    accumulation dtype.

    The kernels put ``q`` times ``scale`` (over ``softcap``) in the accumulation dtype; past its
    range (float32: about 3.4e38) a score is infinite and the state NaN. And ``acc`` sums up to
    ``n_k`` weighted values: values near the range's edge (``|v| n_k`` past it) make it infinite,
    and a later rescale by 0 NaN. ``out`` itself, a weighted mean of finite values, never is. Either
    is refused with what to change, never answered (docs/API.md section 4, "Overflow").
    """
    if np.isnan(out).any() or np.isnan(lse).any() or np.isinf(out).any():
        raise InvalidTensor(f"q, k, v and the options must keep the computation within the {out.dtype} range "
                            f"(about {float(np.finfo(out.dtype).max):.1e}), got an overflow: a score beyond it "
                            f"(scale / softcap x q.k), or values v so large that their weighted sum passed it; use a "
                            f"smaller scale, a softcap of 0 or not tiny, smaller q, k or v, or float64 tensors")
    return out, lse


@dataclass(frozen=True)
class JsonAnswerLimit:
    """The ``out`` elements an answer written as JSON text may hold (``Limits.max_json_answer_elements``),
    and how a client of the route asks for the answer in binary instead (the 413's advice)."""

    elements: int
    binary_instead: str


#: ``POST /v1/attention`` and its batch: the answer's format follows ``Accept``.
V1_BINARY = "ask for application/octet-stream (Accept) to get it as safetensors"
#: ``POST /v2/models/attention/infer``: the format of each output is asked for in the body (docs/KSERVE.md).
KSERVE_BINARY = ("ask for out in binary (outputs[].parameters.binary_data = true, or parameters."
                 "binary_data_output = true)")


def check_answer_size(req: AttentionRequest, d_v: int, max_elements: int,
                      json_limit: JsonAnswerLimit | None = None) -> None:
    """413 when the answer ``out [n_q, h_q, d_v]`` would be over the element limit of any one tensor,
    or, when it is to be written as JSON text, over ``json_limit``.

    Each of ``q`` and ``v`` may be within the limit while their product is not (``q [16385, 1, 1]``
    over values ``[1, 1, 16384]``); the states the workers hold and send are as large, so this is
    checked before any of them is allocated (docs/API.md section 8). A JSON answer is ~20 bytes of
    text a number and takes ~1 us each to write: a 35 KB request could otherwise ask for gigabytes.
    """
    count = req.n_q * req.h_q * d_v
    if count > max_elements:
        raise BodyTooLarge(f"q [n_q, h_q, d] = {[req.n_q, req.h_q, req.d]} over keys with d_v = {d_v} must give an "
                           f"answer out [n_q, h_q, d_v] of at most {max_elements} elements, got {count}")
    if json_limit is not None and count > json_limit.elements:
        raise BodyTooLarge(f"q [n_q, h_q, d] = {[req.n_q, req.h_q, req.d]} over keys with d_v = {d_v} must give a JSON "
                           f"answer out [n_q, h_q, d_v] of at most {json_limit.elements} elements, got {count}: "
                           f"{json_limit.binary_instead}")


def settled(exc: RecordStale) -> WorkersUnavailable:
    """What a client sees of a stale read that is not run again (503, to send again): reads of records
    just taken from the directory name no version (``Resolved.version``), so none is refused; this
    guards a refusal that should not happen."""
    return WorkersUnavailable(f"the context changed while the query read it ({exc}); send it again")


class AttentionService:
    def __init__(self, settings: ServiceSettings, pool: WorkerSurface, orchestrator: Orchestrator,
                 contexts: ContextService) -> None:
        self.settings = settings
        self.pool = pool
        self.orch = orchestrator
        self.contexts = contexts
        #: The element limit of one tensor, which the answer's ``out`` is held to (check_answer_size).
        self.max_elements = settings.limits().max_elements

    async def attention(self, req: AttentionRequest, timings: Timings,
                        json_limit: JsonAnswerLimit | None = None) -> tuple[Any, Any]:
        """``(out, lse)`` of the request; a query that read a stale cached record runs again from the directory
        (its stages then add both runs' time). ``json_limit``: the answer is to be written as JSON text,
        held to that limit (``check_answer_size``)."""
        resolved = await self.resolve(req, timings, fresh=False)
        try:
            return await self._attention(req, resolved, timings, json_limit)
        except (RecordStale, ContextLost) as exc:
            await self.rerun_fresh(req, resolved, exc, timings)
        try:
            return await self._attention(req, await self.resolve(req, timings, fresh=True), timings, json_limit)
        except (RecordStale, ContextLost) as exc:
            await self.settle(req, exc, timings)
            raise  # settle raised

    async def rerun_fresh(self, req: AttentionRequest, resolved: Resolved | None, exc: RecordStale | ContextLost,
                          timings: Timings) -> None:
        """Return when a query that failed with ``exc`` is to run again from the directory: it read a cached
        record (stale, or naming a replica that is gone), now forgotten. Raise what its client gets otherwise
        (the single request and each batch item alike)."""
        if isinstance(exc, RecordStale):
            if resolved is None or not resolved.cached:
                raise settled(exc) from exc
        else:
            if resolved is None:
                raise exc
            if not resolved.cached:
                await self.resolve(req, timings, fresh=True)  # 404 if a delete raced the query
                raise exc
        self.contexts.forget(req.contexts)

    async def settle(self, req: AttentionRequest, exc: RecordStale | ContextLost, timings: Timings) -> NoReturn:
        """Raise what the client of a query run again from the directory gets when it failed with ``exc``."""
        if isinstance(exc, RecordStale):
            raise settled(exc) from exc
        # A shard gone from a record just read from the directory: the context was deleted
        # meanwhile (404, as a query sent after the delete gets) or it is lost (503, re-raised).
        await self.resolve(req, timings, fresh=True)
        raise exc

    async def resolve(self, req: AttentionRequest, timings: Timings, *, fresh: bool) -> Resolved | None:
        """The contexts named, resolved to their committed shards (404 if unknown; the ``lookup``
        stage), and the rules that need them: the query's heads read them, inline keys match them.
        None: no contexts."""
        if not req.contexts:
            return None
        t0 = time.perf_counter()
        resolved = await self.contexts.resolve(req.contexts, fresh=fresh)
        timings.add("lookup", time.perf_counter() - t0)
        resolved.check(req)
        return resolved

    async def plan(self, req: AttentionRequest, resolved: Resolved | None,
                   json_limit: JsonAnswerLimit | None = None) -> Plan:
        """The query's :class:`Plan` over its resolved contexts (``resolved``, checked against it) and its
        inline keys: a single request's and each batch item's alike. Raises what refuses it: an answer
        over the limits, positions out of range, the object store refusing its arrays."""
        # 1. The answer the contexts make is within the limits.
        kv = req.kv
        d_v = kv.dims.d_v if kv is not None else resolved.dims.d_v if resolved is not None else 0
        check_answer_size(req, d_v, self.max_elements, json_limit)
        # 2. Positions over the union: inline keys continue after the contexts.
        q_pos, k_pos = union_positions(req, resolved.next_pos if resolved is not None else None)
        query = ShardQuery(q_pos=q_pos, options=req.options, trace=TRACEPARENT.get())  # the workers' spans' parent
        # 3. Scatter: q and each inline shard go into the object store once.
        bounds: list[tuple[int, int]] = []
        if kv is not None:
            n_k = kv.dims.n_k
            bounds = shard_bounds(n_k, inline_shard_count(n_k, self.pool.size, self.settings.shards,
                                                          self.settings.min_shard_keys))
        # The accumulation dtype is set by q, the inline k and v, and each context's stored dtype
        # (docs/API.md section 2, "Precision"). Each shard's kernel accumulates in float64 only when
        # q or its own keys are float64: a float32 shard beside a float64 one would give a float32
        # state the merge refuses. With q in float64 (exact: every float is a float64) every shard
        # computes in it, as section 2 says.
        dtypes: list[Any] = [req.q.dtype] + ([kv.k.dtype, kv.v.dtype] if kv is not None else [])
        acc_dtype = accumulation_dtype(*dtypes, *(resolved.dtypes if resolved is not None else ()))
        q = req.q.astype(acc_dtype) if acc_dtype == np.float64 and req.q.dtype != np.float64 else req.q
        parts = [a for lo, hi in bounds for a in (kv.k[lo:hi], kv.v[lo:hi])] if kv is not None else []
        sent, *refs = await self.pool.put(q, *parts)
        jobs: list[Job] = resolved.jobs(self.pool, self.settings.merge_fanin) if resolved is not None else []
        jobs += [Job(InlineWork(refs[2 * i], refs[2 * i + 1], k_pos[lo:hi]), None, f"inline shard {i}")
                 for i, (lo, hi) in enumerate(bounds)]
        return Plan(q, sent, query, tuple(jobs), (req.n_q, req.h_q, d_v), acc_dtype)

    async def _attention(self, req: AttentionRequest, resolved: Resolved | None, timings: Timings,
                         json_limit: JsonAnswerLimit | None) -> tuple[Any, Any]:
        # 1-3. The contexts were resolved (the lookup stage); the plan checks the answer and scatters.
        t0 = time.perf_counter()
        plan = await self.plan(req, resolved, json_limit)
        timings.add("scatter", time.perf_counter() - t0)
        # 4. Compute and merge.
        if not plan.jobs:  # contexts that hold no keys: the state over no keys (m = -inf, l = 0), nothing to send
            timings.add("compute", 0.0)
            return finalize(plan.empty())
        return checked_answer(*await self.orch.run(plan.sent, plan.query, plan.jobs, timings, plan.state_nbytes))
