"""The KServe v2 gRPC protocol (``inference.GRPCInferenceService``) beside HTTP: a persistent channel.

``splitkey serve --grpc-port PORT`` also serves the Open Inference Protocol over gRPC
on ``--host``, for clients that call many times per second (``tritonclient.grpc``, any
client generated from KServe's ``grpc_predict_v2.proto``). It is the same service as
the HTTP routes, in the same process and event loop: the same auth (``authorization:
Bearer KEY`` metadata, checked before a call's message is read: ``service.grpc_auth``;
the health RPCs are open, as the HTTP probes are), admission
control (``--max-inflight``, the in-flight byte budget), deadline (``--request-timeout``,
shortened by the call's own gRPC deadline or ``timeout`` parameter), request ids
(``x-request-id`` metadata in and out), errors (the contract's code and message, in the
status details and the ``splitkey-code`` trailing metadata) and metrics (route
``grpc:ModelInfer``). A request is translated into the HTTP binary form and read by the
same decoder (``service.wire.kserve_grpc``). docs/KSERVE.md, "gRPC", lists the RPCs.

Only imported when the port is set: grpcio and the generated messages (``tritonclient[grpc]``,
the ``grpc`` extra) are not needed otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.core import request_id
from service.grpc_auth import KeyFirst
from service.core.errors import (
    ERRORS,
    ErrorKind,
    Internal,
    InvalidBody,
    RouteNotFound,
    ServiceError,
    ShuttingDown,
    internals,
)
from service.core.metrics import Timings
from service.core.deadline import within
from service.routes.common import off_loop
from service.routes.ops import can_serve
from service.runtime import AppState
from service.wire.kserve import MODEL_NAME, MODEL_VERSION, decode_infer_request, model_metadata, server_metadata
from service.wire.kserve_grpc import infer_body, infer_response, not_served, served
from service.wire.request import attention_request

log = logging.getLogger(__name__)

ROUTE = "grpc:ModelInfer"
#: The largest message gRPC (protobuf) carries.
MAX_MESSAGE_BYTES = 2**31 - 1


def grpc_status(kind: ErrorKind) -> grpc.StatusCode:
    """The gRPC status of an error's row in the one table (``service.core.errors.ERRORS``), which names it."""
    return grpc.StatusCode[kind.grpc]


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The RPCs splitkey answers; the others are UNIMPLEMENTED (the generated base class)."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    # -- health (open, as GET /v2/health/live and /ready are) ------------------------------
    async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802 - the protocol's names
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return service_pb2.ServerReadyResponse(ready=self._ready())

    # -- metadata (behind the key, as GET /v2 and /v2/models/attention[/ready] are) -------
    async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return service_pb2.ModelReadyResponse(ready=_served(request) and self._ready())

    async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        return service_pb2.ServerMetadataResponse(**server_metadata())

    async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        if not _served(request):
            # Another model or version is not served: NOT_FOUND, as HTTP's 404 for its path (route_not_found).
            context.set_trailing_metadata((("splitkey-code", ERRORS[RouteNotFound].code),))
            await context.abort(grpc_status(ERRORS[RouteNotFound]),
                                f"name must be {MODEL_NAME} and version empty or {MODEL_VERSION}, got "
                                f"{request.name[:64]!r} version {request.version[:64]!r}")
        meta = model_metadata()
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["inputs"]],
            outputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["outputs"]])

    def _ready(self) -> bool:
        """As ``GET /readyz``: Ray joined, a worker answering, not draining (``service.routes.ops.can_serve``)."""
        rt = self.state.runtime
        return rt is not None and not self.state.drain.draining and can_serve(len(rt.pool.alive), rt.pool.size)

    # -- inference -------------------------------------------------------------------------
    async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        metadata = [(k.encode(), v.encode()) for k, v in context.invocation_metadata() if isinstance(v, str)]
        rid = request_id.assign(metadata)
        context.set_trailing_metadata((("x-request-id", rid),))
        state, t0, timings = self.state, time.perf_counter(), Timings()
        code = 200
        ticket = state.admission.ticket() if state.admission is not None else None
        task = state.drain.track()  # in flight for the shutdown drain, as an HTTP request is
        try:
            if isinstance(request, Undecodable):
                raise InvalidBody(f"the request must be a ModelInferRequest message, got {request.size} bytes that "
                                  "do not parse as one")
            if not served(request.model_name, request.model_version):
                code = 404
                context.set_trailing_metadata((("x-request-id", rid), ("splitkey-code", ERRORS[RouteNotFound].code)))
                await context.abort(grpc_status(ERRORS[RouteNotFound]),
                                    not_served(request.model_name, request.model_version))
            if state.drain.draining:
                raise ShuttingDown("the service must be running to take work, got a request while it drains "
                                   "before it stops")
            rt = state.runtime
            if rt is None:
                raise ShuttingDown("workers must be started before requests are served, got none yet")
            size = request.ByteSize()
            if ticket is not None:
                ticket.charge(size)
                ticket.admit()
            parsed, req = await off_loop(size, _decode, request, state)
            timings.add("parse", time.perf_counter() - t0)
            deadline = state.settings.request_timeout_s
            what = f"the server's {deadline:g} s limit"
            for limit, named in ((parsed.timeout_s, "its KServe timeout parameter of {:g} s"),
                                 (context.time_remaining(), "its gRPC deadline of {:.3g} s")):
                if limit is not None and max(limit, 1e-3) < deadline:
                    deadline = max(limit, 1e-3)
                    what = named.format(limit)
            out, lse = await within(rt.attention.attention(req, timings), deadline, what)
            t1 = time.perf_counter()
            response = await off_loop(out.nbytes + lse.nbytes, infer_response, service_pb2.ModelInferResponse,
                                      parsed.id, {"out": out, "lse": lse}, parsed.outputs)
            timings.add("encode", time.perf_counter() - t1)
            timings.add("total", time.perf_counter() - t0)
            state.metrics.stage_seconds.observe(ROUTE, timings.stages)
            context.set_trailing_metadata((("x-request-id", rid), ("server-timing", timings.header())))
            return response
        except ServiceError as err:
            code = err.status
            await self._abort(context, err, rid)
        except asyncio.CancelledError:
            if not state.drain.cutting:
                raise
            # Cut by the end of the shutdown grace period or a second signal (service.core.drain): answered.
            cut = ShuttingDown(state.drain.cut_detail())
            code = cut.status
            await self._abort(context, cut, rid)
        except grpc.aio.AbortError:
            raise
        except Exception:  # noqa: BLE001 - answered as the HTTP routes answer an unexpected failure
            code = 500
            log.exception("request %s: gRPC ModelInfer failed inside the service", rid)
            await self._abort(context, Internal(f"the service failed on this request; the server log has the "
                                                f"details under request id {rid}"), rid)
        finally:
            if ticket is not None:
                ticket.release()
            state.drain.done(task)
            state.metrics.count_request(ROUTE, code)
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    @staticmethod
    async def _abort(context: Any, err: ServiceError, rid: str) -> None:
        """End the call with ``err``'s gRPC status, its message (machine internals withheld, as
        ``service.core.errors.render`` does) and its contract code in the trailing metadata."""
        detail = err.detail
        leak = internals(detail)
        if leak is not None:
            log.warning("request %s: %s detail withheld from the client (it held %s): %s", rid, err.code, leak, detail)
            detail = f"{err.code.replace('_', ' ')}: the server log has the details under request id {rid}"
        context.set_trailing_metadata((("x-request-id", rid), ("splitkey-code", err.code)))
        await context.abort(grpc_status(err.kind), detail)


def _not_served(name: str) -> Any:
    """An RPC of the protocol that splitkey does not serve: behind the key as the others are, then
    ``UNIMPLEMENTED`` with a message (the generated base class raised, which gRPC logged as an error)."""
    async def rpc(self: Servicer, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{name} is not served: splitkey serves ServerLive, ServerReady, ServerMetadata, "
                            "ModelReady, ModelMetadata and ModelInfer (docs/KSERVE.md)")
    rpc.__name__ = name
    return rpc


for _name in dir(service_pb2_grpc.GRPCInferenceServiceServicer):
    if not _name.startswith("_") and _name not in Servicer.__dict__:
        setattr(Servicer, _name, _not_served(_name))


#: The protocol's service name (``inference.GRPCInferenceService``).
SERVICE = "inference.GRPCInferenceService"


@dataclass(frozen=True)
class Undecodable:
    """A ModelInfer request whose bytes are not a ``ModelInferRequest``: answered by the servicer as any bad
    request is (INVALID_ARGUMENT, ``splitkey-code``, counted), not by gRPC (UNKNOWN, a Python class name)."""

    size: int


def _lenient(raw: bytes) -> Any:
    """``ModelInferRequest.FromString``, or :class:`Undecodable` for bytes that do not parse."""
    try:
        return service_pb2.ModelInferRequest.FromString(raw)
    except DecodeError:
        return Undecodable(len(raw))


def _handlers(servicer: Servicer) -> dict[str, Any]:
    """The protocol's method handlers (as the generated ``add_GRPCInferenceServiceServicer_to_server`` builds
    them, taken from it), with ModelInfer's request parsed by :func:`_lenient`."""
    taken: dict[str, Any] = {}

    class Taker:
        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            pass

        def add_registered_method_handlers(self, service: str, method_handlers: dict[str, Any]) -> None:
            taken.update(method_handlers)

    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, Taker())
    taken["ModelInfer"] = grpc.unary_unary_rpc_method_handler(
        servicer.ModelInfer, request_deserializer=_lenient,
        response_serializer=service_pb2.ModelInferResponse.SerializeToString)
    return taken


def _served(request: Any) -> bool:
    """Whether a ``ModelReady``/``ModelMetadata`` request names the model served (:func:`served`)."""
    return served(request.name, request.version)


def _decode(request: Any, state: AppState) -> tuple[Any, Any]:
    body, header_len = infer_body(request, state.limits)
    parsed = decode_infer_request(body, header_len, state.limits)
    return parsed, attention_request(parsed.decoded)


async def start(state: AppState, host: str, port: int) -> tuple[Any, int]:
    """A started ``grpc.aio`` server on ``host:port`` (0: any free port): ``(server, bound port)``."""
    # Requests: the body limit and room for the message's framing. Answers are bounded by the element
    # limit, not by the request's (a small q over long value rows): as much as a message may hold,
    # 2**31 - 1 bytes, which a float64 answer of the largest size does not fit (docs/KSERVE.md).
    size = min(state.limits.max_body_bytes + (1 << 20), MAX_MESSAGE_BYTES)
    key = state.settings.api_key()
    server = grpc.aio.server(interceptors=[KeyFirst(key.encode() if key else None, state.metrics)], options=[("grpc.max_receive_message_length", size),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_concurrent_streams", max(16, state.settings.max_inflight))])
    handlers = _handlers(Servicer(state))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise RuntimeError(f"grpc_port must be free on {host}, got {port} in use")
    await server.start()
    log.info("KServe v2 gRPC on %s:%d (model %s, version %s)", host, bound, MODEL_NAME, MODEL_VERSION)
    return server, bound
