"""Shard workers without Ray, for the unit tier: the part of the worker surface the orchestrator and the
planners call, computing real states of the shards they are given, and recording each call (which worker
got which reads). ``service.cluster.local.LocalPool`` runs real ``ShardWorker`` objects instead: tests of
faults, leases and repair use it (``faulty_pool``)."""

from __future__ import annotations

from types import SimpleNamespace

from service.cluster.surface import InlineWork, Roster
from workers.api import partial_attention
from workers.store import RecordStale
from workers.tasks import ComputeStatus, ResidentQuery, arrive, carry

H_KV, D = 2, 8
SHARD_KEYS = 10


class FakeWorkers(Roster):
    """The part of ``WorkerPool`` the orchestrator calls: workers that compute real states of the shards
    they hold; ``faults[worker]`` makes every read on it fail with that exception (a class is raised by
    the whole call, an instance answered per item)."""

    #: No cluster beside the workers (``WorkerSurface.cluster_errors``).
    cluster_errors: tuple[type[Exception], ...] = ()

    def __init__(self, n, shards, faults=None):
        self.slots = [SimpleNamespace(index=i, name=f"splitkey-worker-{i}", alive=True, outstanding=0) for i in range(n)]
        self.shards = shards  # (context, index) -> (k, v, k_pos)
        self.faults = faults or {}
        self.versions: dict[str, int] = {}  # context -> the version its shards are at (checked when a read names one)
        self.many: list[tuple[int, list[list[tuple[str, int]]]]] = []  # (worker, each item's reads)
        self.one: list[tuple[int, str]] = []  # (worker, job kind) of single calls

    async def put(self, *arrays):
        return [carry(a) for a in arrays]

    def state(self, q, query, read):
        """The read's state; ``RecordStale`` when it names a version other than the shard's (``versions``)."""
        held = self.versions.get(read.context_id)
        if read.version and held is not None and read.version != held:
            raise RecordStale(f"{read.context_id} is at version {held}, the query read version {read.version}")
        k, v, k_pos = self.shards[read.context_id, read.index]
        return partial_attention(arrive(q), k, v, q_pos=query.q_pos, k_pos=k_pos)

    async def compute_many(self, index, items):
        self.many.append((index, [[(r.context_id, r.index) for r in item.reads] for item in items]))
        fault = self.faults.get(index)
        if isinstance(fault, type):
            raise fault(f"worker {self.slots[index].name} died during the call")
        answers = []
        for item in items:
            try:
                if fault is not None:
                    raise fault
                answers.append((ComputeStatus(self.slots[index].name, 0.001, 0),
                                [self.state(item.q, item.query, r) for r in item.reads]))
            except Exception as exc:  # noqa: BLE001 - the item's own answer, as ShardWorker.partial_resident_many
                answers.append(exc)
        return answers

    async def compute(self, index, q, query, work, *, keep_state, state_nbytes=0):
        self.one.append((index, type(work).__name__))
        fault = self.faults.get(index)
        if fault is not None:
            raise fault if not isinstance(fault, type) else fault(f"worker {self.slots[index].name} died")
        if isinstance(work, InlineWork):
            state = partial_attention(arrive(q), work.k, work.v, q_pos=query.q_pos, k_pos=work.k_pos)
        elif len(work.reads) > 1:  # as WorkerPool.compute: one item of a batch call, a state per read
            (answer,) = await self.compute_many(index, [ResidentQuery(carry(q), query, work.reads)])
            if isinstance(answer, Exception):
                raise answer
            return answer
        else:
            (read,) = work.reads
            state = self.state(q, query, read)
        return ComputeStatus(self.slots[index].name, 0.002, 0), state
