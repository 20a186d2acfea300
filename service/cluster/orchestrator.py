"""Scatter a request's shards to the workers, await their states, merge them.

A request becomes a list of :class:`Job` in key order: inline shards (any
worker can take one) and resident context shards (only their replicas can).
Each job yields one state; the states merge over ``merge.tree_levels``, the same
fixed tree as ``merge_all``, so the answer is bitwise the same whichever worker
or replica computed each state and whenever it finished. Resident jobs whose shards
have the same replicas go to one of them in one call (:func:`grouped`): a context cut
in many shards costs a call per worker, not per shard, and still a state per shard.

Failure rules: a job whose worker dies is retried on another candidate; a job
with no candidate left fails the request (``ContextLost`` for a resident shard,
``WorkersUnavailable`` for an inline one); a job the worker did not start because the
request's deadline had passed (``Expired``) fails it with ``DeadlineExceeded`` (504), never
retried; a job its worker answered with an exception of its own fails it with ``Internal`` (500,
``service.cluster.surface.failed``), never retried; the merge never runs with a state missing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from merge import State, finalize, merge_all, tree_levels
from service.cluster.surface import InlineWork, ResidentWork, WorkerSurface
from service.core.errors import ContextLost, DeadlineExceeded, WorkersUnavailable
from service.core.metrics import Timings
from workers.store import Expired, ShardMissing
from workers.tasks import ComputeStatus, ShardQuery

#: States up to this size (all shards together) merge on the event loop; larger ones in a thread.
LOCAL_MERGE_INLINE_BYTES = 2**20


@dataclass(frozen=True, eq=False)
class Job:
    """One state to compute: the work, who may run it, and how to name it in errors."""

    work: InlineWork | ResidentWork
    candidates: tuple[int, ...] | None  # None: any worker
    label: str  # e.g. "inline shard 3" or "shard 2 of context ctx_..."


def grouped(jobs: Sequence[Job]) -> list[tuple[Job, tuple[int, ...]]]:
    """The calls that compute ``jobs``: each with the positions of its states among the jobs'.

    Resident jobs of one read whose shards have the same replicas join the first such job, their
    reads in key order (one call to one of those workers, a state per read back); every other job
    stays alone. Retries work as for one shard: any of the common replicas may run the group.
    """
    members: dict[tuple[int, ...], list[int]] = {}  # a replica set -> its one-read jobs, in key order
    reads: dict[int, ResidentWork] = {}
    for i, job in enumerate(jobs):
        if isinstance(job.work, ResidentWork) and job.candidates is not None and len(job.work.reads) == 1:
            members.setdefault(tuple(sorted(job.candidates)), []).append(i)
            reads[i] = job.work
    first_of = {idx[0]: idx for idx in members.values() if len(idx) > 1}
    joined = {i for idx in first_of.values() for i in idx[1:]}
    calls: list[tuple[Job, tuple[int, ...]]] = []
    for i, job in enumerate(jobs):
        if i in joined:
            continue
        idx = first_of.get(i)
        if idx is None:
            calls.append((job, (i,)))
            continue
        work = ResidentWork(tuple(r for j in idx for r in reads[j].reads), reads[i].fanin)
        calls.append((Job(work, job.candidates, f"{job.label} (and {len(idx) - 1} more shards on the same workers)"),
                      tuple(idx)))
    return calls


def shard_bounds(n_k: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous key ranges whose sizes differ by at most one."""
    return [(n_k * i // shards, n_k * (i + 1) // shards) for i in range(shards)]


def inline_shard_count(n_k: int, workers: int, requested: int | None, min_shard_keys: int) -> int:
    """Shards for ``n_k`` inline keys: the requested count (default: one per worker),
    but never shards smaller than ``min_shard_keys``, and at least one."""
    want = requested or workers
    return max(1, min(want, n_k // min_shard_keys))


def late(worker: str) -> DeadlineExceeded:
    """What a client sees of work ``worker`` did not start because the request's deadline had passed
    (``workers.store.Expired``): 504, as the front end's own timer answers."""
    return DeadlineExceeded(f"the request must finish within its deadline, got past it before worker {worker} "
                            f"could start its work")


class Orchestrator:
    def __init__(self, pool: WorkerSurface, *, fanin: int, remote_merge_bytes: int) -> None:
        self.pool = pool
        self.fanin = fanin
        self.remote_merge_bytes = remote_merge_bytes

    async def run(self, q: Any, query: ShardQuery, jobs: Sequence[Job], timings: Timings,
                  state_nbytes: int) -> tuple[Any, Any]:
        """Compute every job's state of ``q``, merge in job order, return ``(out, lse)``.

        ``state_nbytes`` is the size of one state (``n_q * h_q * (d_v + 2)`` numbers):
        with it the merge is chosen before anything runs. Remote merges keep each state
        in the object store (the status is awaited alone); local merges fetch status and
        state in one reply.
        """
        t0 = time.perf_counter()
        remote = len(jobs) > self.fanin and state_nbytes * len(jobs) > self.remote_merge_bytes
        # A remote merge keeps each shard's state on its worker: a call per shard. A local one groups.
        calls = [(job, (i,)) for i, job in enumerate(jobs)] if remote else grouped(jobs)
        runs = [self._run_job(q, query, job, keep_state=remote, state_nbytes=state_nbytes) for job, _ in calls]
        # One job (a decode query over a one-shard context) runs in this task: gather would start one for it.
        results = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
        t1 = time.perf_counter()
        timings.add("compute", t1 - t0)
        # Within compute: the longest pass a worker ran for these jobs (docs/SERVICE.md, step 4); the
        # rest of compute is the calls' round trips and the jobs' waits in the workers' queues.
        timings.add("worker", max(status.seconds for _, status, _ in results))
        if remote:
            state = await self._merge_remote([ref for _, _, ref in results], [w for w, _, _ in results])
        else:
            # Every state at its job's position (a group's come back in its reads' order): key order.
            states: list[Any] = [None] * len(jobs)
            for (_, positions), (_, _, st) in zip(calls, results):
                for pos, one in zip(positions, st if len(positions) > 1 else [st], strict=True):
                    states[pos] = one
            if state_nbytes * len(states) > LOCAL_MERGE_INLINE_BYTES:
                state = await asyncio.to_thread(merge_all, states, self.fanin)
            else:
                state = merge_all(states, self.fanin)
        out, lse = finalize(state)
        timings.add("merge", time.perf_counter() - t1)
        return out, lse

    async def _run_job(self, q: Any, query: ShardQuery, job: Job, keep_state: bool,
                       state_nbytes: int) -> tuple[int, ComputeStatus, Any]:
        """Run one job, retrying on other candidates; returns ``(worker, its status, state or its ObjectRef)``."""
        tried: set[int] = set()
        reasons: list[str] = []
        while True:
            try:
                idx = self.pool.pick(job.candidates, exclude=tried)
            except WorkersUnavailable:
                nobody = ("no live worker holds a copy (its holders are gone, or at a restart their copies could "
                          "not be read or did not fit: see the workers' logs)"
                          if isinstance(job.work, ResidentWork) else "no live worker")
                detail = f"{job.label} could not be computed: {'; '.join(reasons) or nobody}"
                raise (ContextLost(detail) if isinstance(job.work, ResidentWork) else WorkersUnavailable(detail)) \
                    from None
            tried.add(idx)
            try:
                status, state = await self.pool.compute(idx, q, query, job.work, keep_state=keep_state,
                                                        state_nbytes=state_nbytes)
            except WorkersUnavailable as exc:
                reasons.append(exc.detail)
                continue
            except ShardMissing as exc:
                reasons.append(f"{self.pool.slots[idx].name}: {exc.args[0] if exc.args else exc}")
                continue
            except Expired:
                raise late(self.pool.slots[idx].name) from None
            return idx, status, state

    async def _merge_remote(self, refs: list[Any], workers: list[int]) -> State:
        """Merge over the fixed tree with each node running on a worker.

        Node ``(a, b)`` of a level runs on the worker that produced input ``a``
        (or the least busy live one), so large states move worker to worker and
        only the root comes back here. A node that fails fails the request.
        """
        level, owners = refs, workers
        submitted = []
        for groups in tree_levels(len(refs), self.fanin):
            nxt, nxt_owners = [], []
            for a, b in groups:
                if b - a == 1:
                    nxt.append(level[a])
                    nxt_owners.append(owners[a])
                    continue
                idx = owners[a] if self.pool.slots[owners[a]].alive else self.pool.pick()
                ref, done = self.pool.merge_states(idx, *level[a:b])
                submitted.append(done)
                nxt.append(ref)
                nxt_owners.append(idx)
            level, owners = nxt, nxt_owners
        try:
            return await self.pool.root_state(level[0])
        finally:
            for done in submitted:
                done()
