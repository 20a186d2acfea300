"""Pure ASGI middleware: request ids, bearer auth, admission control, request accounting.

Pure ASGI (not BaseHTTPMiddleware) so request bodies stream through untouched.

* Request id: every response carries ``X-Request-Id`` (``service.core.request_id``); error
  bodies carry it too, and the log lines about the request name it. ``X-Splitkey-Frontend``
  names the front end (process) that answered.
* Auth: when an API key is set, every path except the health probes needs
  ``Authorization: Bearer <key>`` (compared in constant time), else 401.
* Admission (``service.core.admission``): each work request gets a ticket in its scope; one
  without a body is admitted here, one with a body once the body has arrived. Past
  ``max_inflight`` (or the in-flight body budget) it gets 429 with ``Retry-After``
  immediately instead of queueing without bound.
* Accounting: requests by route and status code (a path with no route: ``unmatched``), in-flight
  gauge, bytes out.
* Shutdown: while the service drains (``service.core.drain``) new work is refused with 503
  ``shutting_down``, and work cut by the grace period is answered the same way.
* Access log: one line per request (``service.core.logs.access``): method, route, status, bytes
  read and written, duration, request id and the stages of its ``Server-Timing``.
* Faults: an exception no handler turned into an answer is logged with its traceback
  under the request id and answered 500 ``internal_error`` naming the id, nothing more.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from service.core import logs, request_id
from service.core.admission import TICKET, Admission
from service.core.drain import Drain
from service.core.errors import Internal, ServiceError, ShuttingDown, Unauthorized, render
from service.core.metrics import Metrics

log = logging.getLogger(__name__)

#: Paths that answer without a key (orchestrators probe them unauthenticated).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})
#: Path prefixes that do work and count against admission control.
WORK_PREFIXES = ("/v1/attention", "/v1/contexts", "/v2/models/")
#: Names the front end that answered, when several serve behind one proxy: random per process
#: (made at import, so an app object copied into another process, as Ray Serve does, names it anew).
FRONTEND_HEADER = b"x-splitkey-frontend"
FRONTEND = secrets.token_hex(6)
#: Methods whose requests carry no body: admitted as they come (the others once their body is in).
BODILESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})


#: The status the access log gives a request that ended with no answer sent (the client went away,
#: or the connection was aborted): nginx's "client closed request", as /metrics counts it (service.app).
CLOSED = 499

#: The route label of a path the app has no route for: metrics keep one series for all of them,
#: however many paths clients make up.
UNMATCHED = "unmatched"


def route_label(path: str, paths: frozenset[str]) -> str:
    """A low-cardinality route name for metrics: ``UNMATCHED`` for a path the app has no route for;
    a context's routes with the id stripped; the model's routes (metadata and ready, each also
    under ``versions/1``) as ``/v2/models/attention``, its inference as ``.../infer``."""
    if path.startswith("/v1/contexts/"):
        rest = path[len("/v1/contexts/"):].split("/")  # ID, or ID/append
        if rest[0] and (len(rest) == 1 or (len(rest) == 2 and rest[1] == "append")):
            return "/v1/contexts/{id}" if len(rest) == 1 else "/v1/contexts/{id}/append"
        return UNMATCHED
    if path not in paths:
        return UNMATCHED
    if path.startswith("/v2/models/"):
        return "/v2/models/attention/infer" if path.endswith("/infer") else "/v2/models/attention"
    return path


@dataclass(slots=True)
class Seen:
    """One request as it passes: the status sent (0: none yet), the body bytes read and written, the
    ``Server-Timing`` header of the answer, and whether its status is counted already (``_error``)."""

    status: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    timing: bytes = b""
    counted: bool = False


class ServiceMiddleware:
    def __init__(self, app: Any, *, api_key: str | None, admission: Admission, metrics: Metrics,
                 drain: Drain, paths: frozenset[str], request_id_header: bool = True) -> None:
        self.app = app
        self.paths = paths  #: the app's fixed paths (no parameters): each its own route label
        self.request_id_header = request_id_header
        self.drain = drain
        self.api_key = api_key.encode() if api_key else None
        self.admission = admission
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        path = scope["path"]
        route = route_label(path, self.paths)
        rid = request_id.assign(scope.get("headers", []))
        seen = Seen()

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                seen.status = message["status"]
                frontend = (FRONTEND_HEADER, FRONTEND.encode())
                extra = [frontend, (request_id.HEADER, rid.encode())] if self.request_id_header else [frontend]
                headers = message.get("headers", [])
                seen.timing = next((v for k, v in headers if k.lower() == b"server-timing"), b"")
                message = {**message, "headers": [*headers, *extra]}
            elif message["type"] == "http.response.body":
                seen.bytes_out += len(message.get("body", b""))
            await send(message)

        async def receive_wrapper() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                seen.bytes_in += len(message.get("body", b""))
            return message

        ticket = task = None
        try:
            if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(scope):
                await self._error(send_wrapper, path, route, Unauthorized(), seen)
                return
            work = route != UNMATCHED and path.startswith(WORK_PREFIXES)  # a made-up path is a 404, not work
            if work and self.drain.draining:
                await self._error(send_wrapper, path, route, ShuttingDown(
                    "the service must be running to take work, got a request while it drains before it stops"), seen)
                return
            if work:
                ticket = scope[TICKET] = self.admission.ticket()
                if scope["method"] in BODILESS:
                    try:
                        ticket.admit()
                    except ServiceError as err:
                        await self._error(send_wrapper, path, route, err, seen)
                        return
                task = self.drain.track()
            try:
                await self.app(scope, receive_wrapper, send_wrapper)
            except asyncio.CancelledError:
                if not (self.drain.cutting and not seen.status):
                    raise
                # Cut by the end of the grace period or a second signal (service.core.drain): answered.
                await self._error(send_wrapper, path, route, ShuttingDown(self.drain.cut_detail()), seen)
            except Exception:
                log.exception("request %s: %s %s failed inside the service", rid, scope["method"], path)
                if seen.status:
                    raise
                await self._error(send_wrapper, path, route, Internal(
                    f"the service failed on this request; the server log has the details under request id {rid}"),
                    seen)
        finally:
            if ticket is not None:
                ticket.release()
            if task is not None:
                self.drain.done(task)
            # An exception that escapes with no answer sent is counted 500 (uvicorn answers it so).
            code = 0 if seen.counted else seen.status or 500
            self.metrics.count_request(route, code, seen.bytes_in, seen.bytes_out)
            logs.access(scope["method"], route, seen.status or CLOSED, seen.bytes_in, seen.bytes_out,
                        time.perf_counter() - t0, rid, seen.timing)

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False

    async def _error(self, send: Any, path: str, route: str, err: ServiceError, seen: Seen) -> None:
        """Answer ``err`` (through ``send``, which adds the request id header and counts the bytes) and
        count its status at once: the request's own accounting then counts only its bytes."""
        status, body, extra = render(err, path)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self.metrics.count_request(route, status)
        seen.counted = True
