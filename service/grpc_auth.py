"""The API key of the gRPC port, checked from a call's metadata before its message is read.

gRPC reads a unary call's whole request message (up to the port's receive limit, the
body limit: 2 GiB by default) before the method runs, so a key checked inside the
method let a client without one make the server hold gigabytes per call. This
interceptor sees the call's metadata first: a call without the key (on any method but
the open health RPCs, ``ServerLive`` and ``ServerReady``, as ``/v2/health/*`` over HTTP)
is answered ``UNAUTHENTICATED`` by a handler that never reads the request. Its message
and the ``splitkey-code`` trailing metadata are those of HTTP's 401 (docs/KSERVE.md, "gRPC").
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from service.core import request_id
from service.core.errors import Unauthorized
from service.core.metrics import Metrics

SERVICE = "/inference.GRPCInferenceService/"
#: Methods answered without the key: the health probes, open as their HTTP forms are.
OPEN_METHODS = frozenset({SERVICE + "ServerLive", SERVICE + "ServerReady"})
#: Requests counted in the metrics by route (``service.grpc_server.ROUTE``), refusals included.
COUNTED = {SERVICE + "ModelInfer": "grpc:ModelInfer"}


def has_key(metadata: Iterable[tuple[str, Any]] | None, api_key: bytes) -> bool:
    """Whether ``authorization: Bearer KEY`` (scheme in any case) is among the call's metadata."""
    for name, value in metadata or ():
        if name == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key):
                return True
    return False


class KeyFirst(grpc.aio.ServerInterceptor):
    """Calls without the key end ``UNAUTHENTICATED`` before their request is read."""

    def __init__(self, api_key: bytes | None, metrics: Metrics) -> None:
        self.api_key, self.metrics = api_key, metrics

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: Any) -> Any:
        method = handler_call_details.method
        if (self.api_key is None or method in OPEN_METHODS
                or has_key(handler_call_details.invocation_metadata, self.api_key)):
            return await continuation(handler_call_details)
        return grpc.stream_unary_rpc_method_handler(self._refuse(method, handler_call_details.invocation_metadata))

    def _refuse(self, method: str, metadata: Any) -> Callable[[Any, Any], Awaitable[Any]]:
        # A stream handler: gRPC reads a request stream's messages only when the handler asks
        # for them, and this one never does (a unary client's call looks the same on the wire).
        async def refuse(requests: Any, context: Any) -> Any:
            rid = request_id.assign([(k.encode(), v.encode()) for k, v in metadata or () if isinstance(v, str)])
            err = Unauthorized()
            if method in COUNTED:
                self.metrics.count_request(COUNTED[method], err.status)
            context.set_trailing_metadata((("x-request-id", rid), ("splitkey-code", err.code)))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, err.detail)
        return refuse
