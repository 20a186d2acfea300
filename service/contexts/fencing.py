"""A context write's deadline on each worker it calls, and the fence around a worker that hangs.

A worker that stops answering (SIGSTOP, a hung process or node) used to hold a write for as long as
it did: the append waited for its call, holding the context's lease, and answered only once the
worker went on (docs/CONTEXTS.md, "A worker that hangs during a write"). Every worker call a write
makes (its shards' writes, their undo, the note of its commit, a delete, a repair's copy) now goes
through :meth:`Fence.call`:

1. it waits for the call up to ``write_timeout_s``;
2. then it pings the worker (up to ``write_timeout_s`` again): a worker that answers is working
   (a large write, a busy machine), and the call is waited for again, step 1;
3. one that answers neither is fenced (``WorkerSurface.fence``: killed and counted dead, for the
   repair loop to forget its replicas and replace it), and the call raises ``WorkersUnavailable``
   once the kill is seen to end it, or after ``write_timeout_s`` more. Only the worker the call
   was made to is fenced: a slot replaced since, or a replacement that has not answered a ping yet
   (starting, not hung), is given up without a kill.

So a write to a hung worker answers within 4 x ``write_timeout_s`` and the request's own time (parsing,
the directory: milliseconds): a placement's ping when it opens a shard (``ContextService._place``), the
wait, the ping and the kill's end (Ray ended a paused worker about 5 s after the kill, docs/CONTEXTS.md),
the last three within 3 x ``write_timeout_s`` together. It is never applied later: the fenced worker is killed,
not waited for, so the call it hung in can never store its keys behind a later write's back; and a
worker's keys past a shard's committed length are never read, and cut by the next append
(``workers.store``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from service.cluster.surface import WorkerSurface
from service.core.errors import WorkersUnavailable

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Fence:
    """The write deadline of one front end's pool (module docstring)."""

    def __init__(self, pool: WorkerSurface, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.pool = pool
        self.timeout_s = timeout_s

    async def call(self, index: int, call: Awaitable[_T]) -> _T:
        """``call`` (made to worker ``index``) awaited within the write deadline; raises
        ``WorkersUnavailable`` when the worker hung and was fenced, and whatever the call raised."""
        began = self.pool.slots[index].incarnation  # the worker the call went to
        task = asyncio.ensure_future(call)
        try:
            while not await self._finished(task):
                waited = time.monotonic()
                if not await self.pool.answers(index, self.timeout_s):
                    if began and self.pool.slots[index].incarnation == began:
                        # The wait, the ping and the kill's end take 3 x timeout_s at most, together: the
                        # time the ping and the kill took beyond theirs comes off the last wait.
                        await self._fence(index, task, waited + 2 * self.timeout_s)
                    raise self._gone(index, task)
            return task.result()
        except asyncio.CancelledError:
            task.cancel()
            raise

    async def _finished(self, task: asyncio.Future[_T]) -> bool:
        await asyncio.wait({task}, timeout=self.timeout_s)
        return task.done()

    def _gone(self, index: int, task: asyncio.Future[_T]) -> WorkersUnavailable:
        """The 503 for a call to a worker not to fence: one that has not started yet (a replacement that
        never answered a ping: not hung, and holding nothing a write could need), or one replaced since the
        call was made (killed by its replacement, ``WorkerSurface.replace``)."""
        task.add_done_callback(_retrieved)
        name = self.pool.slots[index].name
        return WorkersUnavailable(f"worker {name} did not answer within {self.timeout_s:g} s: it is starting or was "
                                  f"replaced; the write was not stored: send it again")

    async def _fence(self, index: int, task: asyncio.Future[_T], until: float) -> None:
        """Kill the hung worker, wait (until ``until``, ``time.monotonic()``) for the kill to end its call, and
        raise the call's 503."""
        name = self.pool.slots[index].name
        log.warning("worker %s answered neither a context write nor a ping within %g s each: it is killed "
                    "and will be replaced", name, self.timeout_s)
        await self.pool.fence(index)
        await asyncio.wait({task}, timeout=max(0.0, until - time.monotonic()))
        if not task.done():  # the kill not seen yet: the worker is counted dead, and its answer is dropped
            task.add_done_callback(_retrieved)
            log.warning("worker %s: its call had not ended %g s after the kill", name, self.timeout_s)
        elif not task.cancelled():
            task.exception()  # retrieved: the kill's error, or an answer that came too late to count
        raise WorkersUnavailable(
            f"worker {name} answered neither the write nor a ping within {self.timeout_s:g} s: it was killed and "
            f"is being replaced; the write was not stored: send it again")


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Take a late call's outcome (so that asyncio does not log it as never retrieved)."""
    if not task.cancelled():
        task.exception()
