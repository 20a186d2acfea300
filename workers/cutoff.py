"""Work whose request's deadline has passed stops between blocks of keys (docs/SERVICE.md, "Deadlines").

``workers.batch`` runs each batch inside :func:`until`, with the latest deadline of its jobs
(``time.monotonic()``); the kernel's key loop (``workers.blockwise.stream``) calls :func:`check`
before each block, which raises :class:`Cut` once that deadline has passed. The compute thread
then goes on to the next batch instead of finishing answers that nobody waits for any more: the
front end has answered 504 already. A ContextVar: each thread sees the batch it runs (the
kernel's helper threads get a copy, ``workers.cpu``); outside a batch there is no deadline.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from contextvars import ContextVar

_deadline: ContextVar[float] = ContextVar("splitkey_work_deadline", default=math.inf)


class Cut(Exception):
    """The running work's deadline passed between two blocks of keys: it was stopped there."""


@contextlib.contextmanager
def until(deadline: float) -> Iterator[None]:
    """Work run in this block stops at the first :func:`check` after ``deadline`` (``time.monotonic()``)."""
    token = _deadline.set(deadline)
    try:
        yield
    finally:
        _deadline.reset(token)


def check() -> None:
    """Raise :class:`Cut` when the deadline of the work running here has passed."""
    deadline = _deadline.get()
    if deadline != math.inf and time.monotonic() >= deadline:
        raise Cut(f"the request's deadline passed {time.monotonic() - deadline:.3f} s ago, between two blocks of keys")
