"""The deadline of the request this task serves, for the work it sends to the workers (docs/SERVICE.md, "Deadlines").

``service.routes.common.with_deadline`` starts it where the request's 504 timer starts;
``service.cluster.pool`` sends each call to a worker the seconds left of it
(:func:`budget`), and the worker does not start work whose seconds ran out while it
waited (``workers.batch``). A relative budget, not a time: no two nodes' clocks are ever
compared. Each request runs in its own task, and the tasks it starts (``asyncio.gather``)
and threads it hands work to (``asyncio.to_thread``) copy its context, so they see it too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

#: ``time.monotonic()`` at which the current request's deadline passes; None outside one (internal work).
_at: ContextVar[float | None] = ContextVar("splitkey_deadline", default=None)


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
    return left if left > 0.0 else 0.0
