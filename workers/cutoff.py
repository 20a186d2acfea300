"""Work whose request's deadline has passed stops between blocks of keys (docs/SERVICE.md, "Deadlines").

``workers.batch`` runs each batch with :data:`DEADLINE` set to the latest deadline of its jobs
(``time.monotonic()``); the kernel's key loop (``workers.blockwise.stream``) calls :func:`check`
before each block, which raises :class:`Cut` once that deadline has passed. The compute thread
then goes on to the next batch instead of finishing answers that nobody waits for any more: the
front end has answered 504 already. A ContextVar: each thread sees the batch it runs (the
kernel's helper threads get a copy, ``workers.cpu``); outside a batch there is no deadline.
"""

from __future__ import annotations

import math
import time
from contextvars import ContextVar

#: The ``time.monotonic()`` after which the work running in this context stops at its next :func:`check`;
#: set (and reset) around each batch by ``workers.batch``.
DEADLINE: ContextVar[float] = ContextVar("splitkey_work_deadline", default=math.inf)


class Cut(Exception):
    """The running work's deadline passed between two blocks of keys: it was stopped there."""


def check() -> None:
    """Raise :class:`Cut` when the deadline of the work running here has passed."""
    deadline = DEADLINE.get()
    if deadline != math.inf and time.monotonic() >= deadline:
        raise Cut(f"the request's deadline passed {time.monotonic() - deadline:.3f} s ago, between two blocks of keys")
