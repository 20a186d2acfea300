"""One attention request, from the checked ``AttentionRequest`` to ``(out, lse)``.

Keys of a request are, in this order: the keys of each named context (in the
order named), then the inline keys. Default positions follow docs/API.md
section 2 over that union: inline keys without ``k_pos`` continue after the last
context position (from 0 with no context), and queries without ``q_pos`` are
the ``n_q`` positions ending one past the last key position.
"""

from __future__ import annotations

import time
from typing import Any

from merge import empty, finalize
from service.cluster.orchestrator import Job, Orchestrator, inline_shard_count, shard_bounds
from service.cluster.pool import InlineWork, WorkerPool
from service.contexts.service import ContextService, Resolved
from service.errors import ContextLost, InvalidTensor, WorkersUnavailable
from service.metrics import Timings
from service.settings import ServiceSettings
from service.wire.request import AttentionRequest
from workers.dtypes import accumulation_dtype
from workers.problem import Arange, check_positions, end_of, last_positions
from workers.store import RecordStale
from workers.tasks import ShardQuery



def union_positions(req: AttentionRequest, next_pos: int) -> tuple[Any, Any]:
    """``(q_pos, k_pos of the inline keys)`` over the contexts' keys and the inline ones.

    Given positions were checked at the edge; defaults are made here and checked
    against the position range like any others.
    """
    n_k = 0 if req.kv is None else req.kv.dims.n_k
    k_pos: Any = Arange(next_pos, n_k) if req.kv is None or req.kv.k_pos is None else req.kv.k_pos
    q_pos = req.q_pos if req.q_pos is not None else last_positions(req.n_q, end_of(k_pos, start=next_pos))
    try:
        return check_positions("q_pos", q_pos, req.n_q), check_positions("k_pos", k_pos, n_k)
    except ValueError as exc:
        raise InvalidTensor(str(exc)) from None


def settled(exc: RecordStale) -> WorkersUnavailable:
    """What a client sees of a stale read that is not run again (503, to send again): reads of records
    just taken from the directory name no version (``Resolved.version``), so none is refused; this
    guards a refusal that should not happen."""
    return WorkersUnavailable(f"the context changed while the query read it ({exc}); send it again")


class AttentionService:
    def __init__(self, settings: ServiceSettings, pool: WorkerPool, orchestrator: Orchestrator,
                 contexts: ContextService) -> None:
        self.settings = settings
        self.pool = pool
        self.orch = orchestrator
        self.contexts = contexts

    async def attention(self, req: AttentionRequest, timings: Timings) -> tuple[Any, Any]:
        """``(out, lse)`` of the request; a query that read a stale cached record runs again from the directory
        (its stages then add both runs' time)."""
        resolved = await self.resolve(req, timings, fresh=False)
        try:
            return await self._attention(req, resolved, timings)
        except RecordStale as exc:
            if resolved is None or not resolved.cached:
                raise settled(exc) from exc
        except ContextLost:
            if resolved is None or not resolved.cached:
                raise
        self.contexts.forget(req.contexts)
        try:
            return await self._attention(req, await self.resolve(req, timings, fresh=True), timings)
        except RecordStale as exc:
            raise settled(exc) from exc

    async def resolve(self, req: AttentionRequest, timings: Timings, *, fresh: bool) -> Resolved | None:
        """The contexts named, resolved to their committed shards (404 if unknown; the ``lookup``
        stage), and the rules that need them: the query's heads read them, inline keys match them.
        None: no contexts."""
        if not req.contexts:
            return None
        with timings.measure("lookup"):
            resolved = await self.contexts.resolve(req.contexts, fresh=fresh)
        resolved.check(req)
        return resolved

    async def _attention(self, req: AttentionRequest, resolved: Resolved | None, timings: Timings) -> tuple[Any, Any]:
        # 1. The contexts were resolved (the lookup stage).
        t0 = time.perf_counter()
        # 2. Positions over the union: inline keys continue after the contexts.
        q_pos, k_pos = union_positions(req, resolved.next_pos if resolved is not None else 0)
        query = ShardQuery(q_pos=q_pos, options=req.options)
        # 3. Scatter: q and each inline shard go into the object store once.
        bounds: list[tuple[int, int]] = []
        if req.kv is not None:
            n_k = req.kv.dims.n_k
            bounds = shard_bounds(n_k, inline_shard_count(n_k, self.pool.size, self.settings.shards,
                                                          self.settings.min_shard_keys))
        kv = req.kv
        parts = [a for lo, hi in bounds for a in (kv.k[lo:hi], kv.v[lo:hi])] if kv is not None else []
        q, *refs = await self.pool.put(req.q, *parts)
        jobs: list[Job] = resolved.jobs(self.pool, self.settings.merge_fanin) if resolved is not None else []
        jobs += [Job(InlineWork(refs[2 * i], refs[2 * i + 1], k_pos[lo:hi]), None, f"inline shard {i}")
                 for i, (lo, hi) in enumerate(bounds)]
        timings.add("scatter", time.perf_counter() - t0)
        # 4. Compute and merge; one state is n_q * h_q * (d_v + 2) numbers of the accumulation dtype.
        dtypes: list[Any] = [req.q.dtype] + ([kv.k.dtype, kv.v.dtype] if kv is not None else [])
        dtypes += resolved.dtypes if resolved is not None else []
        d_v = kv.dims.d_v if kv is not None else resolved.dims.d_v if resolved is not None else 0
        acc_dtype = accumulation_dtype(*dtypes)
        if not jobs:  # contexts that hold no keys: the state over no keys (m = -inf, l = 0), nothing to send
            timings.add("compute", 0.0)
            return finalize(empty(req.n_q, req.h_q, d_v, acc_dtype))
        state_nbytes = req.n_q * req.h_q * (d_v + 2) * acc_dtype.itemsize
        return await self.orch.run(q, query, jobs, timings, state_nbytes)
