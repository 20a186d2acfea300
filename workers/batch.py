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
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

#: Query rows (``n_q * h_q`` summed over the jobs) a batch holds at most; the
#: stacked tile grows with them. A job bigger than this still runs, alone.
MAX_BATCH_ROWS = 1024


@dataclass(eq=False)
class Pending:
    """One job waiting for the compute thread."""

    payload: Any
    key: Hashable | None  #: jobs with equal keys may run together; None: always alone
    rows: int  #: rows it adds to a batch
    future: Future = field(default_factory=Future)


class Batcher:
    """A FIFO of jobs served by one thread, equal-key jobs batched (module doc).

    ``run(payloads)`` computes one batch and returns one result per payload, in order.
    """

    def __init__(self, run: Callable[[Sequence[Any]], Sequence[Any]], *, max_rows: int = MAX_BATCH_ROWS,
                 name: str = "splitkey-compute", nice: int = 0,
                 joins: Callable[[Any, Any], bool] | None = None) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self._run = run
        self._max_rows = max_rows
        self._nice = nice
        self._joins = joins
        self._queue: deque[Pending] = deque()
        self._ready = threading.Condition()
        self._running = False  #: a batch runs (on the compute thread, or a job in run_here's caller)
        self.batches = 0  #: batches run so far (for tests and metrics)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, payload: Any, key: Hashable | None = None, rows: int = 1) -> Future:
        """Queue a job; its future holds its result, or the exception its batch raised."""
        job = Pending(payload, key, rows)
        with self._ready:
            self._queue.append(job)
            self._ready.notify()
        return job.future

    def run_here(self, payload: Any, key: Hashable | None = None, rows: int = 1) -> Future | None:
        """Run the job in the calling thread when no batch runs and none waits: its future, done.
        None when the worker is busy: nothing was run or queued (the caller submits it).

        Saves the hand-off to the compute thread (a thread wake-up) for a job that would
        run alone anyway; the compute thread waits while it runs.
        """
        with self._ready:
            if self._queue or self._running:
                return None
            self._running = True
            self.batches += 1
        job = Pending(payload, key, rows)
        try:
            self._finish([job])
        finally:
            with self._ready:
                self._running = False
                if self._queue:  # arrived while it ran: the compute thread takes them now
                    self._ready.notify()
        return job.future

    def call(self, payload: Any, key: Hashable | None = None, rows: int = 1) -> Any:
        """Queue a job and wait for its result (what a Ray actor method's thread does)."""
        return self.submit(payload, key, rows).result()

    def _take(self) -> list[Pending]:
        """The oldest job and, when it has a key, the waiting jobs with that key, within the row bound."""
        first = self._queue.popleft()
        batch = [first]
        if first.key is None:
            return batch
        rows = first.rows
        for job in list(self._queue):
            if job.key == first.key and rows + job.rows <= self._max_rows and (
                    self._joins is None or self._joins(first.payload, job.payload)):
                self._queue.remove(job)
                batch.append(job)
                rows += job.rows
        return batch

    def _serve(self) -> None:
        if self._nice:
            lower_priority(self._nice)
        while True:
            with self._ready:
                while not self._queue or self._running:
                    self._ready.wait()
                batch = self._take()
                self._running = True
                self.batches += 1
            try:
                self._finish(batch)
            finally:
                with self._ready:
                    self._running = False

    def _finish(self, batch: list[Pending]) -> None:
        try:
            results = self._run([job.payload for job in batch])
        except BaseException as exc:  # noqa: BLE001 - every waiting caller gets the failure
            if len(batch) > 1:
                # One job's failure must not fail the others: run them one by one.
                for job in batch:
                    self._finish([job])
                return
            batch[0].future.set_exception(exc)
            return
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
