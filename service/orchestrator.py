"""Scatter a request's shards to the workers, await their states, merge them.

A request becomes a list of :class:`Job` in key order: inline shards (any
worker can take one) and resident context shards (only their replicas can).
Each job yields one state; the states merge over ``merge.tree_levels``, the same
fixed tree as ``merge_all``, so the answer is bitwise the same whichever worker
or replica computed each state and whenever it finished.

Failure rules: a job whose worker dies is retried on another candidate; a job
with no candidate left fails the request (``ShardLost``); the merge never runs
with a state missing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from merge import State, finalize, merge_all, tree_levels
from service.pool import WorkerPool, WorkerUnavailable
from workers.store import ShardMissing

#: Arrays up to this size travel inside the task call instead of through ray.put.
INLINE_ARG_BYTES = 256 * 2**10
#: States up to this size (all shards together) merge on the event loop; larger ones in a thread.
LOCAL_MERGE_INLINE_BYTES = 2**20


class ShardLost(Exception):
    """No worker could compute one of the request's shards; the request must fail."""

    def __init__(self, message: str, *, context: bool) -> None:
        super().__init__(message)
        self.context = context  # True: a resident context shard (context_lost), else workers_unavailable


@dataclass(frozen=True)
class Job:
    """One state to compute: a worker method, its arguments, and who may run it."""

    method: str
    args: tuple
    candidates: tuple[int, ...] | None  # None: any worker
    label: str  # for error messages, e.g. "inline shard 3" or "shard 2 of context ctx_..."
    resident: bool = False


@dataclass
class Timings:
    """Seconds spent per stage of one request (Server-Timing and metrics)."""

    stages: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    def header(self) -> str:
        return ", ".join(f"{name};dur={sec * 1000:.3f}" for name, sec in self.stages.items())


def shard_bounds(n_k: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous key ranges whose sizes differ by at most one."""
    return [(n_k * i // shards, n_k * (i + 1) // shards) for i in range(shards)]


def inline_shard_count(n_k: int, workers: int, requested: int | None, min_shard_keys: int) -> int:
    """Shards for ``n_k`` inline keys: the requested count (default: one per worker),
    but never shards smaller than ``min_shard_keys``, and at least one."""
    want = requested or workers
    return max(1, min(want, n_k // min_shard_keys))


class Orchestrator:
    def __init__(self, pool: WorkerPool, *, fanin: int, remote_merge_bytes: int) -> None:
        self.pool = pool
        self.fanin = fanin
        self.remote_merge_bytes = remote_merge_bytes

    async def put(self, *arrays: Any) -> list[Any]:
        """Arrays as task arguments: large ones copied into the object store once (off the
        event loop), small ones passed by value (Ray inlines them in the call, which saves
        a round trip to the store)."""
        big = [i for i, a in enumerate(arrays) if a.nbytes > INLINE_ARG_BYTES]
        out = list(arrays)
        if big:
            refs = await asyncio.to_thread(lambda: [ray.put(arrays[i]) for i in big])
            for i, ref in zip(big, refs):
                out[i] = ref
        return out

    async def run(self, jobs: Sequence[Job], timings: Timings, state_nbytes: int) -> tuple[Any, Any]:
        """Compute every job's state, merge in job order, return ``(out, lse)``.

        ``state_nbytes`` is the size of one state (``n_q * h_q * (d_v + 2)`` numbers):
        with it the merge is chosen before anything runs. Remote merges keep each state
        in the object store (the status is awaited alone); local merges fetch status and
        state in one reply.
        """
        t0 = time.perf_counter()
        remote = len(jobs) > self.fanin and state_nbytes * len(jobs) > self.remote_merge_bytes
        results = await asyncio.gather(*(self._run_job(job, split=remote) for job in jobs))
        t1 = time.perf_counter()
        timings.add("compute", t1 - t0)
        if remote:
            state = await self._merge_remote([ref for _, ref, _ in results], [w for w, _, _ in results])
        else:
            states = [st for _, st, _ in results]
            if state_nbytes * len(states) > LOCAL_MERGE_INLINE_BYTES:
                state = await asyncio.to_thread(merge_all, states, self.fanin)
            else:
                state = merge_all(states, self.fanin)
        out, lse = finalize(state)
        timings.add("merge", time.perf_counter() - t1)
        return out, lse

    async def _run_job(self, job: Job, split: bool) -> tuple[int, Any, dict]:
        """Run one job, retrying on other candidates.

        Returns ``(worker, state, status)``; with ``split`` the state stays in the
        object store and a ref to it is returned instead.
        """
        tried: set[int] = set()
        reasons = []
        while True:
            try:
                idx = self.pool.pick(list(job.candidates) if job.candidates is not None else None, exclude=tried)
            except WorkerUnavailable:
                detail = "; ".join(reasons) or "no live worker"
                raise ShardLost(f"{job.label} could not be computed: {detail}", context=job.resident) from None
            tried.add(idx)
            try:
                if split:
                    status_ref, state = self.pool.submit_multi(idx, job.method, 2, *job.args)
                    status = await self.pool.result(idx, status_ref)
                else:
                    status, state = await self.pool.call(idx, job.method, *job.args)
            except WorkerUnavailable as exc:
                reasons.append(str(exc))
                continue
            except ShardMissing as exc:
                reasons.append(f"{self.pool.slots[idx].name}: {exc.args[0] if exc.args else exc}")
                continue
            return idx, state, status

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
                ref = self.pool.submit(idx, "merge_states", *level[a:b])
                submitted.append((idx, ref))
                nxt.append(ref)
                nxt_owners.append(idx)
            level, owners = nxt, nxt_owners
        try:
            return await _await(level[0])
        except ray.exceptions.RayError as exc:
            raise ShardLost(f"the merge tree lost a node: {type(exc).__name__}", context=False) from exc
        finally:
            for idx, _ in submitted:
                self.pool.slots[idx].outstanding -= 1


async def _await(ref: Any) -> Any:
    return await ref
