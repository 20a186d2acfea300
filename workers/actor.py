"""The Ray shard worker: one process, one device, a kernel and a store of resident shards.

The class is plain Python (testable without Ray); ``service.cluster.pool`` wraps
it with ``ray.remote`` as a threaded actor and the resources it needs, and is the
only caller of its methods over Ray (``service.cluster.local`` calls them in one process). Configuration arrives through the constructor as a
:class:`workers.config.WorkerConfig`; work arrives as the typed payloads of
``workers.tasks``.

Each call runs in a thread of its own. Computations go through one compute thread
(``workers.batch``): queries over the same resident shards that wait together are
served in one pass over the keys; a query whose request's time (``ShardQuery.budget_s``,
counted from the call's arrival) runs out before that thread takes it is not computed
(``workers.store.Expired``). Context writes run in their calling thread, next
to the computations (the store lets readers read while a writer writes), so a long
upload does not hold up queries.

Every method returns plain data (``State``, ``ComputeStatus``, dicts of ints and
strings); Ray moves numpy arrays through its object store without copying them
on read.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from merge import State, merge_all, merge_group
from workers import frames
from workers.api import partial_attention_resident_many, partial_attention_shard
from workers.batch import Batcher
from workers.channel import Listener, gather, parse_append, parse_write, then, written_frame
from workers.config import WorkerConfig, settings_of
from workers.fused import available as fused_available
from workers.fused import ready_at as fused_ready_at
from workers.fused import warm, warm_in_background
from workers.options import CpuKernels
from workers.persist import ShardFiles
from workers.store import Expired, ShardInfo, ShardStore
from workers.tasks import ComputeStatus, ResidentQuery, ShardQuery, ShardRead, ShardWrite, arrive, carry
from workers.tracing import from_env, pass_spans
from workers.widen import load_widen16

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)


#: Scheduling priority of context writes: below queries (nice 0), so a long upload leaves them the CPU.
WRITE_NICE = 10


def _node_address() -> str:
    """The address Ray uses for this node (front ends on other nodes reach the channel there); loopback
    outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return "127.0.0.1"


def _deadline(budget_s: float | None) -> float:
    """The ``time.monotonic()`` after which a call that arrives now with ``budget_s`` seconds left is not
    started (``workers.batch``); inf without a budget. Relative: the front end's clock never matters."""
    return math.inf if budget_s is None else time.monotonic() + budget_s


def _run_each(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    return [call() for call in calls]


@dataclass(frozen=True, eq=False)
class InlineJob:
    """A state over one inline shard (never batched: its keys are its own)."""

    q: Any
    k: Any
    v: Any
    query: ShardQuery
    k_pos: Any


@dataclass(frozen=True, eq=False)
class ResidentJob:
    """States over the committed prefixes of resident shards: merged here in key order over ``fanin``,
    or (``fanin`` None) one per read, unmerged, for the front end's merge."""

    q: Any
    query: ShardQuery
    reads: tuple[ShardRead, ...]
    fanin: int | None


def _share_a_shard(first: ResidentJob, other: ResidentJob) -> bool:
    """Whether ``other`` reads a shard ``first`` reads, at the same committed length (it joins first's batch)."""
    return not set(first.reads).isdisjoint(other.reads)


class ShardWorker:
    """Computes partial states over inline shards and over the resident shards it holds."""

    def __init__(self, config: WorkerConfig, name: str, tracer: Tracer | None = None) -> None:
        """``tracer``: where this worker's pass spans go (``workers.tracing``); None: the one the ``OTEL_*``
        variables ask for where ``config.tracing`` says the front end traces, else none."""
        self.config = config
        self.name = name
        self.tracer = tracer if tracer is not None or not config.tracing else from_env(process="worker")
        #: Tells this worker from an earlier one of the same name (a replacement starts empty).
        self.incarnation = secrets.token_hex(8)
        self.xp: Any = np
        if config.device == "gpu":
            from workers.gpu.backend import array_module

            self.xp = array_module()
        files = ShardFiles(Path(config.persist_dir) / name) if config.persist_dir else None
        self.store = ShardStore(config.memory_budget_bytes, self.xp, files)
        self.store.restore()  # a restart with --persist-dir: what this worker held before
        self.calls = 0
        self.channel_calls = 0  #: of ``calls``, those that came over the direct channel
        #: Seconds the fused CPU kernel took to compile or load at start, per dtype (``workers.fused.warm``).
        self.warm_s: dict[str, float] = {}
        #: When this worker started serving (``time.time()``): its CPU kernel's "since" until a switch.
        self.started_at = time.time()
        if config.device == "cpu":
            load_widen16()  # float16 on the NumPy kernel: its widening loop, loaded before a request needs it
        if config.device == "cpu" and config.kernel.cpu_kernels is CpuKernels.FUSED:
            # Compile (or load from numba's disk cache) before the first request, not on it.
            self.warm_s = warm(threads=config.kernel.threads)
        elif config.device == "cpu" and config.kernel.cpu_kernels is CpuKernels.AUTO:
            warm_in_background(threads=config.kernel.threads)  # NumPy serves until it is done
        self.compute = Batcher(self._run, max_rows=config.batch_rows, name=f"{name}-compute",
                               joins=_share_a_shard, expired=Expired)
        # Context writes run one at a time on a thread of their own, below the queries (docs/CONTEXTS.md).
        self.writes = Batcher(_run_each, max_rows=1, name=f"{name}-writes", nice=WRITE_NICE)
        #: The direct channel for resident queries (``workers.channel``); None when the config says no.
        self.listener: Listener | None = None
        if config.channel:
            try:
                self.listener = Listener(self._channel_submit, host=_node_address(), name=name,
                                         stream=self._channel_append)
            except OSError as exc:  # no socket for it: the worker serves through Ray alone
                log.warning("worker %s: direct channel not opened (%s); queries come through Ray", name, exc)

    # -- health -----------------------------------------------------------------
    def ping(self) -> dict:
        node_id = ""
        try:
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:
            node_id = ""
        return {
            "name": self.name,
            "incarnation": self.incarnation,
            "device": self.config.device,
            "node_id": node_id,
            "pid": os.getpid(),
            "bytes_held": self.store.used,
            "budget_bytes": self.store.budget,
            "shards": len(self.store.held()),
            "calls": self.calls,
            "channel_calls": self.channel_calls,
            "batches": self.compute.batches,
            "expired": self.compute.expired,
            "cancelled": self.compute.cancelled,
            "config": settings_of(self.config),
            **self._cpu_kernels(),
        }

    def _cpu_kernels(self) -> dict:
        """The CPU kernel that serves decode-shaped work here and since when (``time.time()``): ``fused``
        only when asked for (``fused``, or ``auto`` once its background compile is done) and compiled (a
        broken compiled path falls back to ``numpy``); None on a GPU worker."""
        if self.config.device != "cpu":
            return {"cpu_kernels": None, "cpu_kernels_since": None}
        mode, ready = self.config.kernel.cpu_kernels, fused_ready_at()
        if mode is CpuKernels.FUSED and fused_available():
            return {"cpu_kernels": "fused", "cpu_kernels_since": self.started_at}
        if mode is CpuKernels.AUTO and ready is not None:
            return {"cpu_kernels": "fused", "cpu_kernels_since": max(ready, self.started_at)}
        return {"cpu_kernels": "numpy", "cpu_kernels_since": self.started_at}

    def channel(self) -> dict | None:
        """Where and how to reach this worker's direct channel (host, port, token); None without one."""
        return None if self.listener is None else self.listener.address()

    # -- compute ----------------------------------------------------------------
    # Compute methods return ``(status, state)``; the pool may call them with
    # ``num_returns=2`` so the front end awaits the small status and leaves the
    # state in the object store until the merge tree needs it.
    def partial(self, q: Any, k: Any, v: Any, query: ShardQuery, k_pos: Any) -> tuple[ComputeStatus, State]:
        """The state of ``q`` over one inline shard ``k, v`` at positions ``k_pos``."""
        deadline = _deadline(query.budget_s)
        self.calls += 1
        job = InlineJob(arrive(q), arrive(k), arrive(v), query, k_pos)
        result: tuple[ComputeStatus, State] = self.compute.call(job, deadline=deadline)
        return result

    def partial_resident(self, q: Any, query: ShardQuery, reads: tuple[ShardRead, ...],
                         fanin: int) -> tuple[ComputeStatus, State]:
        """The merged state of ``q`` over the committed prefix of each listed shard, in key order.

        The shards' states merge here over ``merge_all``'s fixed tree of ``fanin``.
        Queries over the same shards that wait together share one pass over their keys.
        """
        self.calls += 1
        result: tuple[ComputeStatus, State] = self._submit_resident(arrive(q), query, reads, fanin).result()
        return result

    def _submit_resident(self, q: Any, query: ShardQuery, reads: Sequence[ShardRead], fanin: int | None,
                         here: bool = False) -> Future:
        """One resident query to the compute thread (fanin None: a state per read, unmerged); its future.
        ``here``: run it in this thread instead when the worker is idle (``Batcher.run_here``). Called as
        the query arrives: its budget's clock starts here."""
        deadline = _deadline(query.budget_s)
        job = ResidentJob(q, query, tuple(reads), fanin)
        # Jobs of equal keys have queries that may share a pass over a shard (workers.plan.batchable).
        key = (tuple(q.shape), np.dtype(q.dtype).str)
        rows = int(q.shape[0]) * int(q.shape[1])
        done = self.compute.run_here(job, key=key, rows=rows, deadline=deadline) if here else None
        return done if done is not None else self.compute.submit(job, key=key, rows=rows, deadline=deadline)

    def _channel_submit(self, header: dict, arrays: list[Any], alone: bool = False) -> Future:
        """A request from the direct channel, queued as the Ray method queues it; the future of its reply.

        A query ``alone`` on its connection runs in the connection's thread when the worker is
        idle (CPU workers: the GPU backend keeps its device and streams on the compute thread)."""
        op, call_id = header.get("op"), int(header["id"])
        if op == "resident":
            q, query, reads, fanin = frames.parse_query(header, arrays)
            self.calls += 1
            self.channel_calls += 1
            inner = self._submit_resident(q, query, reads, fanin, here=alone and self.config.device == "cpu")
            return then(inner, lambda result: frames.state_frame(call_id, *result))
        if op == "many":
            items = frames.parse_many(header, arrays)
            self.calls += 1
            self.channel_calls += 1
            return gather(self._submit_many(items), lambda results: frames.many_reply(call_id, results))
        if op == "write":  # a context write (create or append) whose keys came over the channel
            writes, k, v, record, committed = parse_write(header, arrays)
            self.calls += 1
            self.channel_calls += 1
            if record is not None:
                done = self.writes.submit(functools.partial(self._create_all, writes, k, v, record))
                return then(done, lambda infos: written_frame(call_id, [info.summary() for info in infos]))
            if committed is None or len(writes) != 1:
                raise frames.FrameError("a write frame without a record must append to one shard")
            [write] = writes
            done = self.writes.submit(functools.partial(self.store.append, write, write.keys_of(k), write.keys_of(v),
                                                        committed=committed))
            return then(done, lambda info: written_frame(call_id, [info.summary()]))
        if op == "note":  # as note_context, on the writes thread (never in the connection's reader)
            context_id, record = frames.parse_note(header, arrays)
            done = self.writes.submit(functools.partial(self.store.note_context, context_id, record))
            return then(done, lambda _: frames.done_frame(call_id, None))
        raise frames.FrameError(f"op must be resident, many, write or note, got {str(op)[:40]!r}")

    def _channel_append(self, header: dict, arrays: Iterator[Any]) -> Future:
        """An append whose parts arrive over the channel one after another (``workers.channel.append_frame``):
        each part goes to the writes thread as it arrives, after the keys of the parts before it, so the
        shard takes a part while the next is on the wire. A part that fails fails the append, and the
        parts after it are not stored (the front end undoes the append: docs/CONTEXTS.md, "Consistency")."""
        call_id = int(header["id"])
        write, committed, parts = parse_append(header, next(arrays))
        self.calls += 1
        self.channel_calls += 1
        done: list[Future] = []
        at = 0
        for n in parts:
            k, v = next(arrays), next(arrays)
            part = ShardWrite(write.context_id, write.index, write.dtype, write.max_capacity, write.k_pos[at:at + n])
            done.append(self.writes.submit(functools.partial(self._append_part, part, k, v, committed + at,
                                                             done[-1] if done else None)))
            at += n

        def reply(results: list[Any]) -> list[bytes | memoryview]:
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            return written_frame(call_id, [results[-1].summary()])

        return gather(done, reply)

    def _append_part(self, write: ShardWrite, k: Any, v: Any, committed: int, before: Future | None) -> ShardInfo:
        """One part of a streamed append, after ``committed`` keys; not stored when the part before it failed
        (the writes thread runs them in order: ``before`` is done)."""
        if before is not None and before.exception() is not None:
            raise before.exception()  # type: ignore[misc]
        return self.store.append(write, k, v, committed=committed)

    def partial_resident_many(self, items: Sequence[ResidentQuery]) -> list[tuple[ComputeStatus, list[State]] | Exception]:
        """Each item's states, one per read in the order listed (unmerged), or the exception it raised.

        One call for every query of a batch request this worker serves: all go to the
        compute thread at once, so those over the same shards share a pass (as queries
        that arrive together do), and one item's failure (a shard missing, a stale
        record) is that item's answer, not the call's.
        """
        self.calls += 1
        futures = self._submit_many(items)
        results: list[tuple[ComputeStatus, list[State]] | Exception] = []
        for future in futures:
            try:
                results.append(future.result())
            except Exception as exc:  # noqa: BLE001 - the item's own answer
                results.append(exc)
        return results

    def _submit_many(self, items: Sequence[ResidentQuery]) -> list[Future]:
        """Each item to the compute thread at once (those over the same shards share a pass)."""
        return [self._submit_resident(arrive(item.q), item.query, item.reads, None) for item in items]

    def _run(self, jobs: Sequence[InlineJob | ResidentJob]) -> list[tuple[ComputeStatus, Any]]:
        """One batch on the compute thread: a single inline job, or resident jobs of one key that share shards."""
        t0 = time.perf_counter()
        t0_ns = time.time_ns()
        xp = self.xp
        kernel = self.config.kernel
        job = jobs[0]
        states: list[Any]  # per job: a State, or (fanin None) a State per read
        if isinstance(job, InlineJob):  # alone: its key is None
            q, k, v, q_pos = job.q, job.k, job.v, job.query.q_pos
            if xp is not np:
                q, k, v, q_pos = xp.asarray(q), xp.asarray(k), xp.asarray(v), xp.asarray(q_pos)
            states = [partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=job.k_pos, options=job.query.options,
                                              kernel=kernel)]
        else:
            resident = [j for j in jobs if isinstance(j, ResidentJob)]
            queries = [(xp.asarray(j.q), xp.asarray(j.query.q_pos), j.query.options) if xp is not np
                       else (j.q, j.query.q_pos, j.query.options) for j in resident]
            # Each shard any job reads, once, with the jobs that read it: one pass over its keys for all of
            # them (a shared prefix's shards serve every suffix's query), then each job merges its own.
            readers: dict[ShardRead, list[int]] = {}
            for i, j in enumerate(resident):
                for r in j.reads:
                    readers.setdefault(r, []).append(i)
            views = {r: self.store.view(r.context_id, r.index, r.length) for r in readers}  # ShardMissing first
            for r in readers:  # a cached record this worker cannot vouch for: the front end reads it again
                self.store.check_read(r)
            state_of: dict[tuple[int, ShardRead], State] = {}
            for r, idx in readers.items():
                for i, st in zip(idx, partial_attention_resident_many([queries[i] for i in idx], views[r],
                                                                      kernel=kernel)):
                    state_of[(i, r)] = st
            states = [[state_of[(i, r)] for r in j.reads] if j.fanin is None
                      else merge_all([state_of[(i, r)] for r in j.reads], fanin=j.fanin) for i, j in enumerate(resident)]
        seconds = time.perf_counter() - t0
        if self.tracer is not None:
            pass_spans(self.tracer, [j.query.trace for j in jobs], t0_ns, time.time_ns(),
                       {"splitkey.worker": self.name, "splitkey.batch": len(jobs)})
        out: list[tuple[ComputeStatus, Any]] = []
        for st in states:
            parts = st if isinstance(st, list) else [st]  # a list: a State per read, unmerged (fanin None)
            # Device arrays back to the host: every method returns numpy arrays.
            parts = [s if isinstance(s.m, np.ndarray) else State(m=s.m.get(), l=s.l.get(), acc=s.acc.get())
                     for s in parts]
            status = ComputeStatus(self.name, seconds, sum(s.nbytes for s in parts), batch=len(jobs))
            out.append((status, parts if isinstance(st, list) else parts[0]))
        return out

    def merge_states(self, *states: State) -> State:
        """One node of the distributed merge tree (same ``merge_group`` as a local merge)."""
        return merge_group(list(states))

    # -- resident shards ----------------------------------------------------------
    def create_shard(self, write: ShardWrite, k: Any, v: Any, context: dict) -> dict:
        """One new shard (:meth:`create_shards`)."""
        [info] = self.create_shards([write], k, v, context)
        return info

    def create_shards(self, writes: list[ShardWrite], k: Any, v: Any, context: dict) -> list[dict]:
        """New shards of one context, each of its write's keys of ``k`` and ``v``, in order, in one turn of the
        writes thread; each keeps ``context``. One call per worker, however many shards: sent once per shard,
        the record (which lists every shard) made a create of 1024 shards cost their square, 50 s on 2 cores,
        and its calls kept the worker's other calls waiting. Returns each shard's summary (no record)."""
        infos = self.writes.call(functools.partial(self._create_all, writes, arrive(k), arrive(v), context))
        return [info.summary() for info in infos]

    def _create_all(self, writes: list[ShardWrite], k: Any, v: Any, context: dict) -> list[ShardInfo]:
        return [self.store.create(w, w.keys_of(k), w.keys_of(v), context=context) for w in writes]

    def append_shard(self, write: ShardWrite, k: Any, v: Any, committed: int) -> dict:
        k, v = write.keys_of(arrive(k)), write.keys_of(arrive(v))
        info = self.writes.call(functools.partial(self.store.append, write, k, v, committed=committed))
        return info.summary()

    def export_shard(self, context_id: str, index: int, length: int) -> tuple[Any, Any, Any]:
        """The first ``length`` keys of a shard as ``(k, v, k_pos)`` in the contract layout (bfloat16 as
        its bits, ``workers.tasks.Carried``): the source of a replica rebuilt on another worker."""
        k, v, k_pos = self.writes.call(functools.partial(self.store.export, context_id, index, length))
        return carry(k), carry(v), k_pos

    def truncate_shard(self, context_id: str, index: int, length: int) -> None:
        self.store.truncate(context_id, index, length)

    def note_context(self, context_id: str, record: dict) -> None:
        self.store.note_context(context_id, record)

    def drop(self, context_id: str, index: int | None = None) -> int:
        return self.store.drop(context_id, index)

    def delete(self, context_id: str) -> int:
        """The context was deleted: tombstoned on disk, then dropped (``ShardStore.delete``)."""
        return self.store.delete(context_id)

    def tombstones(self) -> list[str]:
        return self.store.tombstones()

    def stored(self, context_ids: list[str]) -> list[str]:
        """Of ``context_ids``, those with files in this worker's folder (``ShardStore.stored``)."""
        return self.store.stored(context_ids)

    def forget_tombstones(self, context_ids: list[str], older_than_s: float) -> list[str]:
        """Remove the named tombstones no longer needed here (``ShardStore.forget_tombstones``)."""
        return self.store.forget_tombstones(context_ids, older_than_s)

    def held(self) -> list[dict]:
        return [info.to_dict() for info in self.store.held()]

    def unloaded(self) -> list[dict]:
        """The shards a restart left on disk, with their records (``ShardStore.unloaded``)."""
        return self.store.unloaded()

    def release_unrecorded(self, context_ids: list[str]) -> list[dict]:
        """Free the named contexts' shards this worker holds no record of, their files left on disk
        (``ShardStore.release_unrecorded``)."""
        return [r.to_dict() for r in self.store.release_unrecorded(context_ids)]
