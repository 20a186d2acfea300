"""Scatter a request's shards to the workers, await their states, merge them.

A request becomes a list of :class:`Job` in key order: inline shards (any
worker can take one) and resident context shards (only their replicas can).
Each job yields one state; the states merge over ``merge.tree_levels``, the same
fixed tree as ``merge_all``, so the answer is bitwise the same whichever worker
or replica computed each state and whenever it finished. Resident jobs whose shards
have the same replicas go to one of them in one call (:func:`grouped`): a context cut
in many shards costs a call per worker, not per shard, and still a state per shard.

A query is planned (:class:`Plan`: its ``q``, positions and options, and its jobs) the same way
whether it came alone or in a batch (``service.attention.AttentionService.plan``). One plan runs
through :meth:`Orchestrator.run`; a batch's plans run together through :meth:`Orchestrator.run_many`,
which chooses the replicas once for all of them and sends each worker every plan's reads it serves in
one call (``WorkerSurface.compute_many``). Both retry a job by the same rules (``_run_job``) and merge a
plan's states in key order over the same tree, so an answer is bitwise the same either way.

Failure rules: a job whose worker dies is retried on another candidate; a job
with no candidate left fails the request (``ContextLost`` for a resident shard,
``WorkersUnavailable`` for an inline one); a job the worker did not start because the
request's deadline had passed (``Expired``) fails it with ``DeadlineExceeded`` (504), never
retried; a job its worker answered with an exception of its own fails it with ``Internal`` (500,
``service.cluster.surface.failed``), never retried; the merge never runs with a state missing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from merge import State, empty, finalize, merge_all, tree_levels
from service.cluster.surface import DOMAIN_CLASSES, InlineWork, ResidentWork, WorkerSurface, failed
from service.core import request_id
from service.core.errors import ContextLost, DeadlineExceeded, Internal, ServiceError, WorkersUnavailable
from service.core.metrics import Timings
from workers.frames import RemoteError
from workers.store import Expired, ShardMissing
from workers.tasks import ComputeStatus, ResidentQuery, ShardQuery, ShardRead, carry

log = logging.getLogger(__name__)

#: States up to this size (all shards together) merge on the event loop; larger ones in a thread.
LOCAL_MERGE_INLINE_BYTES = 2**20


@dataclass(frozen=True, eq=False)
class Job:
    """One state to compute: the work, who may run it, and how to name it in errors."""

    work: InlineWork | ResidentWork
    candidates: tuple[int, ...] | None  # None: any worker
    label: str  # e.g. "inline shard 3" or "shard 2 of context ctx_..."


@dataclass(eq=False, slots=True)
class Plan:
    """One query ready to run: its ``q``, positions and options, and the jobs that compute it.

    Built by ``service.attention.AttentionService.plan`` for a single request and for each item
    of a batch alike; :meth:`Orchestrator.run` runs one, :meth:`Orchestrator.run_many` many.
    """

    q: Any  #: ``q`` in the accumulation dtype, as an array (a batch's calls carry it: ``workers.tasks.carry``)
    sent: Any  #: ``q`` as a job's call takes it (``WorkerSurface.put``: carried, or an ObjectRef when large)
    query: ShardQuery
    jobs: tuple[Job, ...]  #: in key order: a state each, merged in this order
    shape: tuple[int, int, int]  #: the answer's ``out [n_q, h_q, d_v]``
    dtype: np.dtype  #: the accumulation dtype (of the states and the answer)

    @property
    def state_nbytes(self) -> int:
        """The size of one state: ``n_q * h_q * (d_v + 2)`` numbers of the accumulation dtype."""
        n_q, h_q, d_v = self.shape
        return n_q * h_q * (d_v + 2) * self.dtype.itemsize

    @property
    def elements(self) -> int:
        """The elements of the answer's ``out``."""
        n_q, h_q, d_v = self.shape
        return n_q * h_q * d_v

    def empty(self) -> State:
        """The state over no keys (contexts that hold none: the plan has no job)."""
        return empty(*self.shape, self.dtype)


#: What :meth:`Orchestrator.run_many` answers for one plan: its ``(out, lse)``, or why it has none
#: (a ``ServiceError``, or ``workers.store.RecordStale``: the caller may plan it again from the directory).
Outcome: TypeAlias = tuple[Any, Any] | Exception


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


class _Run:
    """The states of one :meth:`Orchestrator.run_many` call as they come back, and each plan's first error."""

    def __init__(self, plans: Sequence[Plan], cluster_errors: tuple[type[Exception], ...]) -> None:
        self.plans = plans
        self.cluster_errors = cluster_errors  #: the pool's own (``WorkerSurface.cluster_errors``)
        self.states: list[list[State | None]] = [[None] * len(plan.jobs) for plan in plans]
        self.errors: list[Exception | None] = [None] * len(plans)
        self.passes: list[float] = []

    def done(self, p: int, positions: Sequence[int], seconds: float, states: Sequence[State]) -> None:
        self.passes.append(seconds)
        for j, state in zip(positions, states, strict=True):
            self.states[p][j] = state

    def fail(self, p: int, exc: Exception) -> None:
        if isinstance(exc, self.cluster_errors) and not isinstance(exc, (ServiceError, *DOMAIN_CLASSES)):
            # the cluster's fault, as the route answers a single one
            log.warning("request %s: Ray error in a batch item: %s", request_id.current(), exc)
            exc = WorkersUnavailable("the cluster must answer, got an error from Ray (the server's log names it)")
        if self.errors[p] is None:
            self.errors[p] = exc

    def merged(self, fanin: int) -> list[Outcome]:
        """Each plan's states merged in key order over the fixed tree, finalized; or its error. A merge that
        refuses its states (``merge`` checks they agree) fails its plan alone, as a 500 with the request id."""
        outcomes: list[Outcome] = []
        for p, (plan, states, error) in enumerate(zip(self.plans, self.states, self.errors)):
            if error is not None:
                outcomes.append(error)
                continue
            try:
                outcomes.append(finalize(merge_all(states, fanin) if plan.jobs else plan.empty()))  # type: ignore[arg-type]
            except ValueError:
                rid = request_id.current()
                log.exception("request %s plan %d: its states did not merge", rid, p)
                outcomes.append(Internal("the service failed on this item; the server log has the details under "
                                         f"request id {rid}"))
        return outcomes


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

    async def run_many(self, plans: Sequence[Plan], timings: Timings) -> list[Outcome]:
        """Every plan's ``(out, lse)``, or its error, in order; one plan's failure is its own.

        Replicas are chosen once for the call: each resident read goes to its least loaded live
        replica, counting the reads this call has given it already, and each worker gets every
        plan's reads it serves in **one** call (``WorkerSurface.compute_many``); its compute thread
        runs them together. Every other job (inline shards, a read with no live replica) runs as a
        single request's does (``_run_job``). A read that failed is retried there on its other
        replicas; a read the worker did not start in time fails its plan with 504, a worker's own
        exception with 500, neither retried. Each plan's states merge in key order over the fixed
        tree (``merge_all``), on the event loop or, when large, in one thread for all.
        """
        t0 = time.perf_counter()
        run = _Run(plans, self.pool.cluster_errors)
        batched, alone = self._assign(plans)
        await asyncio.gather(*(self._batched(w, reads, run) for w, reads in batched.items()),
                             *(self._alone(run, p, j) for p, j in alone))
        t1 = time.perf_counter()
        timings.add("compute", t1 - t0)
        if run.passes:  # the longest pass a worker ran for these plans, as for a single request
            timings.add("worker", max(run.passes))
        nbytes = sum(plan.state_nbytes * len(plan.jobs) for plan, error in zip(plans, run.errors) if error is None)
        outcomes = await asyncio.to_thread(run.merged, self.fanin) if nbytes > LOCAL_MERGE_INLINE_BYTES \
            else run.merged(self.fanin)
        timings.add("merge", time.perf_counter() - t1)
        return outcomes

    def _assign(self, plans: Sequence[Plan]) -> tuple[dict[int, dict[int, list[tuple[int, ShardRead]]]],
                                                      list[tuple[int, int]]]:
        """The replica choice of :meth:`run_many`: per worker, each plan's jobs (position and read, in key
        order) whose one read it serves; and the ``(plan, job)`` pairs that run alone."""
        load = {s.index: s.outstanding for s in self.pool.slots}
        slots = self.pool.slots
        batched: dict[int, dict[int, list[tuple[int, ShardRead]]]] = {}
        alone: list[tuple[int, int]] = []
        for p, plan in enumerate(plans):
            for j, job in enumerate(plan.jobs):
                work = job.work
                if isinstance(work, ResidentWork) and len(work.reads) == 1 and \
                        (live := [c for c in job.candidates or () if slots[c].alive]):
                    w = min(live, key=lambda x: (load[x], x))
                    load[w] += 1
                    batched.setdefault(w, {}).setdefault(p, []).append((j, work.reads[0]))
                else:
                    alone.append((p, j))
        return batched, alone

    async def _batched(self, worker: int, reads: dict[int, list[tuple[int, ShardRead]]], run: _Run) -> None:
        """One worker's reads of every plan, in one call; failed reads retried as :meth:`_run_job` retries."""
        plans = run.plans
        items = [ResidentQuery(carry(plans[p].q), plans[p].query, tuple(r for _, r in mine)) for p, mine in reads.items()]
        answers: list[Any]
        try:
            answers = await self.pool.compute_many(worker, items)
        except Exception as exc:  # noqa: BLE001 - sorted below
            if not isinstance(exc, (WorkersUnavailable, *self.pool.cluster_errors)):
                raise
            answers = [exc] * len(items)
        retries = []
        for (p, mine), got in zip(reads.items(), answers):
            if isinstance(got, (WorkersUnavailable, ShardMissing)):  # the worker gone, or its replica
                why = self._why(worker, got)
                retries += [self._alone(run, p, j, tried={worker}, reasons=[why]) for j, _ in mine]
            elif isinstance(got, BaseException):
                run.fail(p, self._item_error(worker, got))
            else:
                status, states = got
                run.done(p, [j for j, _ in mine], status.seconds, states)
        await asyncio.gather(*retries)

    async def _alone(self, run: _Run, p: int, j: int, tried: set[int] | None = None,
                     reasons: list[str] | None = None) -> None:
        """Job ``j`` of plan ``p`` as a single request runs it (retries on its other candidates)."""
        plan = run.plans[p]
        try:
            _, status, state = await self._run_job(plan.sent, plan.query, plan.jobs[j], keep_state=False,
                                                   state_nbytes=plan.state_nbytes, tried=tried, reasons=reasons)
        except Exception as exc:  # noqa: BLE001 - the plan's own answer
            run.fail(p, exc)
            return
        run.done(p, [j], status.seconds, [state])

    def _why(self, worker: int, exc: Exception) -> str:
        """Why a job failed on ``worker`` in a way another replica may not (named in ``ContextLost``)."""
        if isinstance(exc, WorkersUnavailable):
            return exc.detail
        return f"{self.pool.slots[worker].name}: {exc.args[0] if exc.args else exc}"

    def _item_error(self, worker: int, got: BaseException) -> Exception:
        """A batched read's exception as a single read's would be raised (``WorkerSurface.compute``): a domain
        error or Ray's own as it came, ``Expired`` as 504, a worker's own exception as :func:`failed` (500)."""
        name = self.pool.slots[worker].name
        if isinstance(got, Expired):
            return late(name)
        if isinstance(got, RemoteError):  # over the channel, not a domain error
            return failed(name, got.kind, got.message)
        if isinstance(got, (*DOMAIN_CLASSES, *self.pool.cluster_errors)):
            return got  # type: ignore[return-value]
        return failed(name, type(got).__name__, str(got))

    async def _run_job(self, q: Any, query: ShardQuery, job: Job, keep_state: bool, state_nbytes: int,
                       tried: set[int] | None = None, reasons: list[str] | None = None) -> tuple[int, ComputeStatus, Any]:
        """Run one job, retrying on other candidates; returns ``(worker, its status, state or its ObjectRef)``.
        ``tried``: workers already tried (``reasons``: why each failed), as :meth:`run_many` retries a read."""
        tried = set() if tried is None else tried
        reasons = [] if reasons is None else reasons
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
            except (WorkersUnavailable, ShardMissing) as exc:
                reasons.append(self._why(idx, exc))
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
