"""The deadline of the request this task serves, for the work it sends to the workers (docs/SERVICE.md, "Deadlines").

:func:`within` starts it where the request's 504 timer starts;
``service.cluster.pool`` sends each call to a worker the seconds left of it
(:func:`budget`), and the worker does not start work whose seconds ran out while it
waited (``workers.batch``). A relative budget, not a time: no two nodes' clocks are ever
compared. Each request runs in its own task, and the tasks it starts (``asyncio.gather``)
and threads it hands work to (``asyncio.to_thread``) copy its context, so they see it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Iterator
from contextvars import ContextVar
from typing import TypeVar

from service.core.errors import DeadlineExceeded

T = TypeVar("T")

#: ``time.monotonic()`` at which the current request's deadline passes; None outside one (internal work).
_at: ContextVar[float | None] = ContextVar("splitkey_deadline", default=None)


async def within(work: Awaitable[T], seconds: float, what: str | None = None) -> T:
    """Run a read (a query) within the request deadline of ``seconds`` (504 past it); ``what`` names
    the limit that set it, for the 504's detail (the seconds themselves when None).

    In the request's own task (``asyncio.timeout``), not a task of its own as ``asyncio.wait_for``
    makes on Python 3.11: one task and one turn of the event loop less per query. While it runs,
    the calls it sends the workers carry the seconds left of the same deadline (:func:`budget`), so
    a worker does not start work this request has given up on; ``work`` is a coroutine, run in this
    task's context.
    """
    try:
        with running(seconds):
            async with asyncio.timeout(seconds):
                return await work
    except TimeoutError:
        raise DeadlineExceeded(f"the request must finish within {what or f'{seconds:.3g} s'}, got longer") from None


@contextlib.contextmanager
def running(seconds: float) -> Iterator[None]:
    """The current request's deadline is ``seconds`` from now while this block runs."""
    token = _at.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _at.reset(token)


def budget() -> float | None:
    """The seconds left of the current request's deadline (0 once it passed); None outside a request."""
    at = _at.get()
    if at is None:
        return None
    left = at - time.monotonic()
    return max(0.0, left)
