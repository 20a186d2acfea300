"""Admission control: request slots and the in-flight body budget, shared by every connection.

* A request on a work route holds one of ``max_inflight`` slots while it works, and only
  then: one with a body takes its slot once the whole body has arrived
  (``service.routes.common.Exchange.body``), one without a body at once. A connection still
  sending holds no slot, so slow clients cannot starve the others (docs/SECURITY.md).
* Body bytes are charged to one budget of ``max_inflight_bytes`` as they arrive (a body's
  buffer only takes memory as it fills, ``service.wire.body``) and given back when the
  request ends, so the bodies held at once never pass the budget, whatever is declared.
* Answers waiting unsent in a connection's buffer (over its high-water mark, 64 KiB) count
  against the same budget while they wait (:meth:`Admission.answers_waiting`, from
  ``service.http_protocol``, which also aborts a connection whose answer stops leaving):
  clients that do not read their answers get new bodies refused, not the memory taken.
  They hold no slot: the request ended when its answer was handed over.

Past either bound the request gets 429 with ``Retry-After``. Everything here runs on the
event loop, so the counts need no lock.
"""

from __future__ import annotations

from service.core.errors import Overloaded
from service.core.metrics import Metrics

#: Where the middleware leaves each work request's ticket, in the ASGI scope.
TICKET = "splitkey.ticket"


class Admission:
    def __init__(self, *, max_inflight: int, max_inflight_bytes: int, retry_after_s: int, metrics: Metrics) -> None:
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.inflight = 0  #: requests holding a slot
        self.body_bytes = 0  #: body bytes received and held by requests not yet finished

    def ticket(self) -> Ticket:
        return Ticket(self)

    def answers_waiting(self, delta: int) -> None:
        """``delta`` more (or, negative, fewer) bytes of answers wait unsent in the connections'
        buffers (``service.http_protocol``): counted with the bodies, so that while answers nobody
        reads hold memory, new bodies are refused (429) instead of taking more."""
        self.body_bytes += delta
        self.metrics.inflight_body_bytes.inc(delta)

    def answer_aborted(self) -> None:
        """A connection was aborted because its client read its answer too slowly (``service.http_protocol``):
        the request was already counted with the status it was answered, its cut delivery is counted here."""
        self.metrics.rejected.labels(reason="slow_answer").inc()


class Ticket:
    """One request's share: a slot once admitted, the body bytes charged so far; :meth:`release` returns both."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.admitted = False
        self.charged = 0

    def admit(self) -> None:
        """Take a slot (once); 429 when all ``max_inflight`` are taken."""
        a = self.admission
        if self.admitted:
            return
        if a.inflight >= a.max_inflight:
            a.metrics.rejected.labels(reason="inflight").inc()
            raise Overloaded(f"in-flight requests must be at most {a.max_inflight} at once, got one more; retry later",
                             a.retry_after_s)
        a.inflight += 1
        a.metrics.inflight.inc()
        self.admitted = True

    def expect(self, declared: int) -> None:
        """Refuse at once (429) a body whose declared length cannot fit in the budget's free part now."""
        a = self.admission
        if a.body_bytes + declared > a.max_inflight_bytes:
            self._over(f"Content-Length {declared}")

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` more of this request's body against the budget (429 past it)."""
        a = self.admission
        if a.body_bytes + nbytes > a.max_inflight_bytes:
            self._over(f"{self.charged + nbytes} bytes of this body")
        a.body_bytes += nbytes
        a.metrics.inflight_body_bytes.inc(nbytes)
        self.charged += nbytes

    def release(self) -> None:
        a = self.admission
        if self.admitted:
            a.inflight -= 1
            a.metrics.inflight.dec()
            self.admitted = False
        if self.charged:
            a.body_bytes -= self.charged
            a.metrics.inflight_body_bytes.dec(self.charged)
            self.charged = 0

    def _over(self, got: str) -> None:
        a = self.admission
        a.metrics.rejected.labels(reason="body_bytes").inc()
        raise Overloaded(f"request bodies in flight must stay within {a.max_inflight_bytes} bytes, "
                         f"{a.body_bytes} are held, got {got}; retry later", a.retry_after_s)
