"""How many HTTP connections the front end holds at once, in all and per client address.

Every connection holds a file descriptor, and the process has :func:`open_files_limit` of
them for everything: Ray's connections, the workers' channels, files. Unbounded, 21,000 idle
connections took all 20,000 and every request failed until they closed. :class:`Connections`
counts what is open (``service.http_protocol`` reports each connection) and decides on each new
one, per :class:`ConnectionLimits`:

1. under both limits: it is held;
2. at a limit: the connection idle longest (no request in progress: waiting for its first
   request or for the next on a kept-alive connection) of the same scope (that client, or
   any) is closed to make room, and the new one is held;
3. none idle: the new one is refused, answered 503 ``too_many_connections`` with
   ``Retry-After`` and closed. A refusal holds its descriptor while its answer is sent (a
   lingering close, 2 s at most); past :attr:`ConnectionLimits.refusing` of them at once, new
   connections are closed with no answer at all.
"""

from __future__ import annotations

import resource
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

#: The open-file limit ``ray.init`` raises the soft limit to, at most (Ray's own choice; this
#: process raises it first, so the connection limit is sized from what the process will have).
RAY_OPEN_FILES = 65536


def open_files_limit() -> int:
    """The soft RLIMIT_NOFILE once raised as ``ray.init`` raises it (to the hard limit, at most
    :data:`RAY_OPEN_FILES`; never lowered)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return RAY_OPEN_FILES
    wanted = RAY_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, RAY_OPEN_FILES)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):  # a container may forbid it: sized from what there is
            return soft
        return wanted
    return soft


@dataclass(frozen=True)
class ConnectionLimits:
    total: int  #: connections held at once (refusals being answered are bounded apart: :attr:`refusing`)
    per_client: int | None  #: connections one client address holds at once; None: no bound

    def __post_init__(self) -> None:
        if type(self.total) is not int or self.total < 1:
            raise ValueError(f"total must be an int >= 1, got {self.total!r}")
        if self.per_client is not None and (type(self.per_client) is not int or self.per_client < 1):
            raise ValueError(f"per_client must be None or an int >= 1, got {self.per_client!r}")

    @property
    def refusing(self) -> int:
        """Refusals answered at once (each holds a descriptor until its answer is sent): an eighth of
        the total, at least one."""
        return max(1, self.total // 8)

    @classmethod
    def sized(cls, total: int | None, per_client: int | None, open_files: int) -> ConnectionLimits:
        """``total``, or by default half of ``open_files`` less the refusals' share: the other half is
        left to Ray's connections, the workers' channels and files (a front end with 2 workers holds
        46 descriptors idle, docs/SERVICE.md "Connections")."""
        if total is None:
            total = max(1, open_files * 4 // 9)  # with its refusals (an eighth more), half of the limit
        return cls(total=total, per_client=per_client)


Close = Callable[[], None]


class Connections:
    """The connections held now, in all and by client address; which are idle (in the order they
    became idle) and how to close them; how many refusals are being answered."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._held: dict[object, str] = {}  # connection -> client address
        self._clients: Counter[str] = Counter()
        self._idle: dict[object, Close] = {}  # insertion order: idle longest first
        self.refusing = 0  #: refusals whose answer is being sent

    @property
    def held(self) -> int:
        return len(self._held)

    def admit(self, conn: object, client: str, close: Close) -> bool:
        """Hold ``conn`` from ``client``, idle until :meth:`busy` (``close`` closes it, should it be
        chosen to make room later), closing an idle one for it where a limit is reached; False when
        there is no room: the caller refuses it."""
        per_client = self.limits.per_client
        if per_client is not None and self._clients[client] >= per_client and not self._close_idle(client):
            return False
        if len(self._held) >= self.limits.total and not self._close_idle(None):
            return False
        self._held[conn] = client
        self._clients[client] += 1
        self._idle[conn] = close
        return True

    def _close_idle(self, client: str | None) -> bool:
        """Close the connection idle longest (``client``'s; None: anyone's); False if none is idle."""
        victim = next((c for c in self._idle if client is None or self._held[c] == client), None)
        if victim is None:
            return False
        close = self._idle[victim]
        self.gone(victim)
        close()
        return True

    def busy(self, conn: object) -> None:
        """``conn`` is in a request: it is not closed for another."""
        self._idle.pop(conn, None)

    def idle(self, conn: object, close: Close) -> None:
        """``conn`` waits for its next request: it may be closed for another."""
        if conn in self._held:
            self._idle.pop(conn, None)
            self._idle[conn] = close

    def gone(self, conn: object) -> None:
        """``conn`` is closed or closing for good: no longer held (again: nothing)."""
        client = self._held.pop(conn, None)
        if client is None:
            return
        self._idle.pop(conn, None)
        self._clients[client] -= 1
        if not self._clients[client]:
            del self._clients[client]

    def may_answer_refusal(self) -> bool:
        """Whether a refusal may be answered (and counted until :meth:`refusal_sent`), else closed bare."""
        if self.refusing >= self.limits.refusing:
            return False
        self.refusing += 1
        return True

    def refusal_sent(self) -> None:
        self.refusing -= 1
