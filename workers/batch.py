"""Serving what is queued together: one compute thread per worker, batching requests over the same shards.

A shard worker runs as a threaded Ray actor: each call waits in its own thread on
a :class:`Batcher`, whose single compute thread runs the work. When the thread
finishes a batch it takes the oldest waiting job and, if that job is batchable,
every other waiting job with the same key (the same resident shards and query
shape: ``workers.plan.batchable`` decides what shares a pass), up to a bound on
rows; jobs it leaves keep their order. Nothing waits on a timer: an idle worker
starts the first job at once, and a batch is what arrived while the previous one
ran. Each job's result (or exception) goes back to its own caller. ``joins(first,
job)`` narrows who may join the oldest job's batch (the shard worker asks that
they read a shard in common).

A caller that would only hand a job over and sleep until its answer may instead
:meth:`Batcher.run_here`: when no batch runs and none waits, the job runs in the
caller's thread at once, saving the compute thread's wake-up. One batch still runs
at a time either way (``_running``), and what arrives meanwhile queues and batches
as before.

A job may carry a deadline (``time.monotonic()``; the shard worker sets it from the
budget its request had left when the call arrived). A job whose deadline has passed
when the compute thread takes a batch (or ``run_here`` would run it) is not run: it
leaves the queue and its future gets ``expired(message)``, so a worker under overload
spends no time on answers nobody waits for (docs/SERVICE.md, "Deadlines"). The check is
one comparison per job, against one clock reading per batch. A batch that runs past the
latest deadline of its jobs stops at the kernel's next block of keys (``workers.cutoff``),
and its jobs get ``expired`` too.

A job whose future was cancelled while it waited (its caller went away: ``workers.channel``'s
cancel) leaves the queue unrun the same way; once a job is taken, its future is running and can
no longer be cancelled.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from workers import cutoff

#: Query rows (``n_q * h_q`` summed over the jobs) a batch holds at most; the
#: stacked tile grows with them. A job bigger than this still runs, alone.
MAX_BATCH_ROWS = 1024


@dataclass(eq=False)
class Pending:
    """One job waiting for the compute thread."""

    payload: Any
    key: Hashable | None  #: jobs with equal keys may run together; None: always alone
    rows: int  #: rows it adds to a batch
    deadline: float = math.inf  #: ``time.monotonic()`` from which it is not started (inf: never expires)
    future: Future = field(default_factory=Future)


class Batcher:
    """A FIFO of jobs served by one thread, equal-key jobs batched (module doc).

    ``run(payloads)`` computes one batch and returns one result per payload, in order;
    ``expired(message)`` is the exception of a job whose deadline passed before it started
    (the shard worker's is ``workers.store.Expired``).
    """

    def __init__(self, run: Callable[[Sequence[Any]], Sequence[Any]], *, max_rows: int = MAX_BATCH_ROWS,
                 name: str = "splitkey-compute", nice: int = 0,
                 joins: Callable[[Any, Any], bool] | None = None,
                 expired: Callable[[str], BaseException] = TimeoutError) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self._run = run
        self._max_rows = max_rows
        self._nice = nice
        self._joins = joins
        self._expired = expired
        self._queue: deque[Pending] = deque()
        #: Jobs ``_take`` found past their deadline, failed once the lock is released (compute thread only).
        self._dropped: deque[Pending] = deque()
        self._ready = threading.Condition()
        self._running = False  #: a batch runs (on the compute thread, or a job in run_here's caller)
        self.batches = 0  #: batches run so far (for tests and metrics)
        #: jobs not run, or stopped between blocks of keys (``workers.cutoff``), because their deadline had
        #: passed (for tests and metrics)
        self.expired = 0
        #: jobs not run because their future was cancelled while they waited (for tests and metrics)
        self.cancelled = 0
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, payload: Any, key: Hashable | None = None, rows: int = 1,
               deadline: float = math.inf) -> Future:
        """Queue a job; its future holds its result, or the exception its batch raised (``expired``'s
        when ``deadline`` passes before it starts)."""
        job = Pending(payload, key, rows, deadline)
        with self._ready:
            self._queue.append(job)
            self._ready.notify()
        return job.future

    def run_here(self, payload: Any, key: Hashable | None = None, rows: int = 1,
                 deadline: float = math.inf) -> Future | None:
        """Run the job in the calling thread when no batch runs and none waits: its future, done.
        None when the worker is busy: nothing was run or queued (the caller submits it).

        Saves the hand-off to the compute thread (a thread wake-up) for a job that would
        run alone anyway; the compute thread waits while it runs.
        """
        with self._ready:
            if self._queue or self._running:
                return None
            now = time.monotonic()
            late = deadline <= now  # its time ran out on the way here: not run
            if late:
                self.expired += 1
            else:
                self._running = True
                self.batches += 1
        job = Pending(payload, key, rows, deadline)
        if late:
            job.future.set_exception(self._late(job, now))
            return job.future
        try:
            self._finish([job])
        finally:
            with self._ready:
                self._running = False
                if self._queue:  # arrived while it ran: the compute thread takes them now
                    self._ready.notify()
        return job.future

    def call(self, payload: Any, key: Hashable | None = None, rows: int = 1, deadline: float = math.inf) -> Any:
        """Queue a job and wait for its result (what a Ray actor method's thread does)."""
        return self.submit(payload, key, rows, deadline).result()

    def _take(self, now: float) -> list[Pending]:
        """The oldest job whose deadline is after ``now`` and, when it has a key, the waiting jobs with that
        key, within the row bound; empty when none is left. Jobs past their deadline that it meets (ahead
        of the oldest, or anywhere in the queue once it scans for batch mates) go to ``_dropped``, unrun."""
        first = None
        while first is None and self._queue:
            job = self._queue.popleft()
            if job.deadline <= now:
                self._dropped.append(job)
            elif job.future.set_running_or_notify_cancel():  # from now on it cannot be cancelled
                first = job
            else:
                self.cancelled += 1
        if first is None:
            return []
        batch = [first]
        if first.key is None:
            return batch
        rows = first.rows
        for job in list(self._queue):
            if job.deadline <= now:
                self._queue.remove(job)
                self._dropped.append(job)
            elif job.future.cancelled():
                self._queue.remove(job)
                self.cancelled += 1
            elif job.key == first.key and rows + job.rows <= self._max_rows and (
                    self._joins is None or self._joins(first.payload, job.payload)):
                self._queue.remove(job)
                if job.future.set_running_or_notify_cancel():
                    batch.append(job)
                    rows += job.rows
                else:
                    self.cancelled += 1
        return batch

    def _serve(self) -> None:
        if self._nice:
            lower_priority(self._nice)
        while True:
            with self._ready:
                while not self._queue or self._running:
                    self._ready.wait()
                now = time.monotonic()
                batch = self._take(now)
                self.expired += len(self._dropped)
                if batch:
                    self._running = True
                    self.batches += 1
            while self._dropped:  # outside the lock: a future's callbacks may send its answer
                job = self._dropped.popleft()
                with contextlib.suppress(InvalidStateError):  # cancelled meanwhile: nobody waits for it
                    job.future.set_exception(self._late(job, now))
            if not batch:
                continue
            try:
                self._finish(batch)
            finally:
                with self._ready:
                    self._running = False

    def _late(self, job: Pending, now: float) -> BaseException:
        return self._expired(f"the request's deadline passed {now - job.deadline:.3f} s before this work could "
                             f"start: not computed")

    def _finish(self, batch: list[Pending]) -> None:
        # Stopped at the kernel's next block of keys once no job of it waits any more (workers.cutoff).
        token = cutoff.DEADLINE.set(max(job.deadline for job in batch))
        try:
            results = self._run([job.payload for job in batch])
        except cutoff.Cut as cut:
            with self._ready:
                self.expired += len(batch)
            for job in batch:
                job.future.set_exception(self._expired(f"{cut}: not finished"))
            return
        except BaseException as exc:  # noqa: BLE001 - every waiting caller gets the failure
            if len(batch) > 1:
                # One job's failure must not fail the others: run them one by one.
                for job in batch:
                    self._finish([job])
                return
            batch[0].future.set_exception(exc)
            return
        finally:
            cutoff.DEADLINE.reset(token)
        for job, result in zip(batch, results):
            job.future.set_result(result)


def lower_priority(nice: int) -> None:
    """Give the calling thread the scheduling priority ``nice`` (Linux schedules threads one by one).

    Bulk work (context writes, prefaulting) runs below the queries that share the
    worker's CPU. Where a thread's priority cannot be set, it keeps the process's.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):  # not Linux, or not permitted
        pass
