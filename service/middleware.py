"""Pure ASGI middleware: bearer auth, admission control and request accounting.

Pure ASGI (not BaseHTTPMiddleware) so request bodies stream through untouched.

* Auth: when an API key is set, every path except the health probes needs
  ``Authorization: Bearer <key>`` (compared in constant time), else 401.
* Admission: at most ``max_inflight`` requests on the work routes at once; one
  more gets 429 with ``Retry-After`` immediately instead of queueing without bound.
* Accounting: requests by route and status code, in-flight gauge, bytes out.
* Shutdown: while the service drains (``service.drain``) new work is refused with 503
  ``shutting_down``, and work cut by the grace period is answered the same way.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from service.drain import Drain
from service.errors import Overloaded, ServiceError, ShuttingDown, Unauthorized, render
from service.metrics import Metrics

#: Paths that answer without a key (orchestrators probe them unauthenticated).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})
#: Path prefixes that do work and count against admission control.
WORK_PREFIXES = ("/v1/attention", "/v1/contexts", "/v2/models/")


def route_label(path: str) -> str:
    """A low-cardinality route name for metrics (context ids stripped)."""
    if path.startswith("/v1/contexts/"):
        return "/v1/contexts/{id}/append" if path.endswith("/append") else "/v1/contexts/{id}"
    if path.startswith("/v2/models/"):
        return "/v2/models/attention/infer" if path.endswith("/infer") else "/v2/models/attention"
    return path


class ServiceMiddleware:
    def __init__(self, app: Any, *, api_key: str | None, max_inflight: int, retry_after_s: int,
                 metrics: Metrics, drain: Drain) -> None:
        self.app = app
        self.drain = drain
        self.api_key = api_key.encode() if api_key else None
        self.max_inflight = max_inflight
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.inflight = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = route_label(path)
        if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            await self._error(send, path, route, Unauthorized())
            return
        work = path.startswith(WORK_PREFIXES)
        if work and self.drain.draining:
            await self._error(send, path, route, ShuttingDown("the service must be running to take work, got a "
                                                              "request while it drains before it stops"))
            return
        if work and self.inflight >= self.max_inflight:
            self.metrics.rejected.labels(reason="inflight").inc()
            await self._error(send, path, route, Overloaded(
                f"in-flight requests must stay below {self.max_inflight}, got one more; retry later", self.retry_after_s))
            return
        status = {"code": 500}
        sent = {"bytes": 0}
        started = {"response": False}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                started["response"] = True
            elif message["type"] == "http.response.body":
                sent["bytes"] += len(message.get("body", b""))
            await send(message)

        task = None
        if work:
            self.inflight += 1
            self.metrics.inflight.inc()
            task = self.drain.track()
        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            if not (self.drain.cutting and not started["response"]):
                raise
            # Cut by the end of the grace period (service.drain): answered, not dropped.
            await self._error(send, path, route, ShuttingDown(
                f"the request must finish within the {self.drain.grace_s:g} s shutdown grace period, got cut"))
            status["code"] = 0  # counted by _error
        finally:
            if work:
                self.inflight -= 1
                self.metrics.inflight.dec()
                self.drain.done(task)
            if status["code"]:
                self.metrics.requests.labels(route=route, code=str(status["code"])).inc()
            self.metrics.bytes_out.labels(route=route).inc(sent["bytes"])

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False

    async def _error(self, send: Any, path: str, route: str, err: ServiceError) -> None:
        status, body, extra = render(err, path)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self.metrics.requests.labels(route=route, code=str(status)).inc()
