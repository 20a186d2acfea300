"""Every error a client can see: one exception per kind, one table of codes and statuses.

Code anywhere in the service raises a :class:`ServiceError` subclass with a
detail that names the field and the bad value ("q must be ..., got ...");
:data:`ERRORS` gives each subclass its stable ``code``, its HTTP status
(docs/API.md section 7) and the name of its gRPC status (the KServe gRPC server,
``service.grpc_server``), and :func:`render` writes the one body format for
every route, the KServe ones included. The library's checks raise typed errors
of their own (``workers.errors``, ``ValueError`` subclasses): :data:`LIBRARY`
gives each the row it is answered with, and :func:`client_input` applies it where
the service checks what a client sent through them. No layer matches messages or
builds a status of its own.

A detail says what the client needs in the service's words and nothing about the
machine: :func:`render` withholds one that carries a traceback, a file path, an
address, a process or Ray id or a terminal escape (:func:`internals`), logs it under
the request id, and sends a generic detail naming that id instead (docs/SECURITY.md).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from service.core import request_id
from workers.errors import InvalidAttentionOption, InvalidInput

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error the client sees; its ``code`` and ``status`` come from :data:`ERRORS`."""

    def __init__(self, detail: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = dict(headers or {})

    @property
    def kind(self) -> ErrorKind:
        """This error's row of :data:`ERRORS`."""
        return ERRORS[type(self)]

    @property
    def code(self) -> str:
        return self.kind.code

    @property
    def status(self) -> int:
        return self.kind.status

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detail!r})"


class RequestTimeout(ServiceError):
    """The body did not arrive in time (too slow, or stalled); the connection is closed."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail, {"Connection": "close"})


class InvalidBody(ServiceError):
    """The body cannot be parsed (bad JSON, malformed safetensors, a broken KServe request)."""


class Unauthorized(ServiceError):
    """Missing or wrong API key; carries the ``WWW-Authenticate: Bearer`` challenge (RFC 9110)."""

    def __init__(self, detail: str = "Authorization must be 'Bearer <api key>', got a missing or wrong key") -> None:
        super().__init__(detail, {"WWW-Authenticate": "Bearer"})


class ContextNotFound(ServiceError):
    """An unknown context id."""


class RouteNotFound(ServiceError):
    """A path the service has no route for."""


class MethodNotAllowed(ServiceError):
    """A method the path's route does not take; ``Allow`` names the ones it does."""

    def __init__(self, detail: str, allow: str) -> None:
        super().__init__(detail, {"Allow": allow})


class LengthMismatch(ServiceError):
    """An append names a context length (``after``) other than the context's committed length."""


class BodyTooLarge(ServiceError):
    """The body, a safetensors header or one tensor is over its limit."""


class HeadTooLarge(ServiceError):
    """The request line and headers are over their limit; the connection is closed (it is never read on)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail, {"Connection": "close"})


class UnsupportedMediaType(ServiceError):
    """The Content-Type (or Content-Encoding) is not one the service reads."""


class InvalidTensor(ServiceError):
    """Well-formed, but a tensor is wrong: name, dtype, shape or values."""


class InvalidOption(ServiceError):
    """Well-formed, but an option or field is wrong."""


class Overloaded(ServiceError):
    """Too many requests in flight; carries ``Retry-After`` in whole seconds (rounded up, at least 1)."""

    def __init__(self, detail: str, retry_after_s: float) -> None:
        if isinstance(retry_after_s, bool) or not isinstance(retry_after_s, (int, float)) \
                or not math.isfinite(retry_after_s):
            raise ValueError(f"retry_after_s must be a finite number, got {retry_after_s!r}")
        super().__init__(detail, {"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class WorkersUnavailable(ServiceError):
    """No Ray worker could take the work (died, its node went away, or none are up yet)."""


class ContextLost(ServiceError):
    """A shard of a needed context has no live replica left."""


class ShuttingDown(ServiceError):
    """The service is draining before it stops (SIGTERM): no new work; work cut by the grace period."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail, {"Retry-After": "1", "Connection": "close"})


class TooManyConnections(ServiceError):
    """The front end holds as many connections as it may and none is idle (service.core.connections);
    carries ``Retry-After`` in whole seconds."""

    def __init__(self, detail: str, retry_after_s: int) -> None:
        if type(retry_after_s) is not int or retry_after_s < 1:
            raise ValueError(f"retry_after_s must be an int >= 1, got {retry_after_s!r}")
        super().__init__(detail, {"Retry-After": str(retry_after_s), "Connection": "close"})


class DeadlineExceeded(ServiceError):
    """The request ran past its deadline."""


class InsufficientCapacity(ServiceError):
    """No room on the workers for a context."""


class Internal(ServiceError):
    """A fault of the service itself (a bug): the client gets the request id, the log the traceback."""


@dataclass(frozen=True)
class ErrorKind:
    code: str  #: stable snake_case name, part of the public contract: add, never rename
    status: int  #: the HTTP status
    #: the gRPC status the KServe gRPC server ends a call with: a ``grpc.StatusCode`` member's name
    #: (this module does not import grpc; ``service.grpc_server`` looks the name up)
    grpc: str


#: The one table: each error's code, HTTP status (docs/API.md section 7) and gRPC status (docs/KSERVE.md,
#: "gRPC"). method_not_allowed and header_too_large are about HTTP methods and heads, which no gRPC call
#: has: UNKNOWN, gRPC's status for an error it has no other word for.
ERRORS: Mapping[type[ServiceError], ErrorKind] = {
    InvalidBody: ErrorKind("invalid_body", 400, "INVALID_ARGUMENT"),
    Unauthorized: ErrorKind("unauthorized", 401, "UNAUTHENTICATED"),
    ContextNotFound: ErrorKind("context_not_found", 404, "NOT_FOUND"),
    RouteNotFound: ErrorKind("route_not_found", 404, "NOT_FOUND"),
    MethodNotAllowed: ErrorKind("method_not_allowed", 405, "UNKNOWN"),
    RequestTimeout: ErrorKind("request_timeout", 408, "DEADLINE_EXCEEDED"),
    LengthMismatch: ErrorKind("length_mismatch", 409, "FAILED_PRECONDITION"),
    BodyTooLarge: ErrorKind("body_too_large", 413, "RESOURCE_EXHAUSTED"),
    UnsupportedMediaType: ErrorKind("unsupported_media_type", 415, "INVALID_ARGUMENT"),
    HeadTooLarge: ErrorKind("header_too_large", 431, "UNKNOWN"),
    InvalidTensor: ErrorKind("invalid_tensor", 422, "INVALID_ARGUMENT"),
    InvalidOption: ErrorKind("invalid_option", 422, "INVALID_ARGUMENT"),
    Overloaded: ErrorKind("overloaded", 429, "RESOURCE_EXHAUSTED"),
    Internal: ErrorKind("internal_error", 500, "INTERNAL"),
    WorkersUnavailable: ErrorKind("workers_unavailable", 503, "UNAVAILABLE"),
    ContextLost: ErrorKind("context_lost", 503, "UNAVAILABLE"),
    ShuttingDown: ErrorKind("shutting_down", 503, "UNAVAILABLE"),
    TooManyConnections: ErrorKind("too_many_connections", 503, "UNAVAILABLE"),
    DeadlineExceeded: ErrorKind("deadline_exceeded", 504, "DEADLINE_EXCEEDED"),
    InsufficientCapacity: ErrorKind("insufficient_capacity", 507, "RESOURCE_EXHAUSTED"),
}

#: The library's typed errors (``workers.errors``) and the error of :data:`ERRORS` each is answered
#: with, the library's message (it names the argument and quotes the value) as its detail.
LIBRARY: Mapping[type[ValueError], type[ServiceError]] = {
    InvalidInput: InvalidTensor,
    InvalidAttentionOption: InvalidOption,
}


def library_error(exc: ValueError) -> ServiceError | None:
    """The :class:`ServiceError` a typed library error is answered with (:data:`LIBRARY`), or None for
    another ``ValueError`` (a fault of the service, not the client's: it stays what it is)."""
    answer = next((LIBRARY[cls] for cls in type(exc).__mro__ if cls in LIBRARY), None)
    return None if answer is None else answer(str(exc))


@contextmanager
def client_input() -> Iterator[None]:
    """Around library checks of what a client sent: a typed library error raised inside becomes its
    :class:`ServiceError` (:func:`library_error`); anything else passes through unchanged."""
    try:
        yield
    except tuple(LIBRARY) as exc:
        answer = library_error(exc)
        if answer is None:  # pragma: no cover - each class caught is a row
            raise
        raise answer from None


#: Routes under this prefix speak the Open Inference Protocol, whose clients read an ``error`` key.
KSERVE_PREFIX = "/v2"


#: What must never reach a client in a detail, by name (each matched on its own).
INTERNALS: Mapping[str, re.Pattern[str]] = {
    "a traceback": re.compile(r"Traceback \(most recent call last\)|\bFile \"[^\"]*\", line \d+"),
    "a terminal escape": re.compile(r"\x1b\["),
    "a file path": re.compile(r"(?<![\w.])/(?:home|root|tmp|usr|opt|var|etc|srv|mnt|proc|run|dev|lib|lib64|work|nix)"
                              r"/|site-packages|dist-packages|\.py\b"),
    "an address": re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])"),
    "a process id": re.compile(r"\bpid\s*[=:]?\s*\d+", re.IGNORECASE),
    # Ray's ids are 16 to 56 bytes of hex (actors 32 digits, tasks 48, objects/nodes/workers 56), random
    # but for a few bytes: a run of 28 or more with both digits and letters (a run of digits alone is
    # a client's number echoed, of letters alone a client's name: both the detail must keep).
    "a Ray id": re.compile(r"(?<![0-9a-fA-F])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{28,}(?![0-9a-fA-F])"
                           r"|\b(?:Actor|Node|Worker|Task|Job|Object)ID\b"),
    # Ray's exception classes (RayActorError, ActorDiedError, ObjectLostError, ...): the server's log names them.
    "a Ray exception": re.compile(r"\b(?:Ray\w*Error|Actor\w*Error|Object\w*Error|OwnerDiedError|"
                                  r"TaskCancelledError|WorkerCrashedError|RaySystemError)\b"),
    # How a connection between the processes broke, as Python names it: the log says it, a detail says
    # "the connection was lost".
    "a connection error": re.compile(r"\b(?:OSError|EOFError|Connection\w*Error|BrokenPipeError|"
                                     r"IncompleteReadError|ChannelClosed)\b"),
}


#: The client's value quoted after "got" in a detail: how the checks echo what was sent
#: (``got {show(value)}``, ``got unknown id {id!r}``); ``show`` cuts a long value short
#: after its opening quote (``"ccc...``), so a quote may run to the end of the line.
QUOTED = re.compile(r"\bgot\b[^'\"\n]{0,40}(?:'[^'\n]*'?|\"[^\"\n]*\"?)")


def internals(detail: str) -> str | None:
    """The name of the first kind of machine detail in ``detail`` (:data:`INTERNALS`), or None.

    A long run of hex digits counts as a Ray id only outside the quoted value after "got": there
    it is the client's own value echoed back (a context id, a number), which the detail must name
    (Ray's own messages name their ids unquoted, or as ``ActorID`` and the like)."""
    unquoted = QUOTED.sub("got ''", detail)
    return next((name for name, pattern in INTERNALS.items()
                 if pattern.search(unquoted if name == "a Ray id" else detail)), None)


def error_body(err: ServiceError, *, kserve: bool = False, rid: str | None = None,
               detail: str | None = None) -> bytes:
    """``{"detail", "code", "request_id"}`` as UTF-8 JSON; KServe routes add the protocol's ``error`` (the
    same message). ``detail`` replaces the error's own; ``request_id`` is left out when ``rid`` is None."""
    detail = err.detail if detail is None else detail
    doc = {"error": detail} if kserve else {}
    doc.update(detail=detail, code=err.code)
    if rid is not None:
        doc["request_id"] = rid
    return json.dumps(doc, separators=(",", ":")).encode()


def render(err: ServiceError, path: str) -> tuple[int, bytes, dict[str, str]]:
    """``(status, body, headers)`` of the response to ``err`` on ``path``: the one place errors are written.

    The body carries the current request id; a detail with machine internals in it is
    logged and replaced by one that names the request id (module docstring).
    """
    rid = request_id.current()
    detail = err.detail
    leak = internals(detail)
    if leak is not None:
        log.warning("request %s: %s detail withheld from the client (it held %s): %s", rid, err.code, leak, detail)
        detail = f"{err.code.replace('_', ' ')}: the server log has the details under request id {rid}"
    body = error_body(err, kserve=path.startswith(KSERVE_PREFIX), rid=rid, detail=detail)
    return err.status, body, dict(err.headers)


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """OpenAPI ``responses=`` entries for FastAPI routes: the error body schema per status."""
    codes = [kind.code for kind in ERRORS.values()]
    schema = {
        "type": "object",
        "required": ["detail", "code", "request_id"],
        "properties": {"detail": {"type": "string"}, "code": {"type": "string", "enum": codes},
                       "request_id": {"type": "string"}},
    }
    out: dict[int | str, dict] = {}
    for status in statuses:
        with_status = [kind.code for kind in ERRORS.values() if kind.status == status]
        if not with_status:
            known = sorted({kind.status for kind in ERRORS.values()})
            raise ValueError(f"status must be one of {known}, got {status!r}")
        out[status] = {
            "description": "error: " + ", ".join(with_status),
            "content": {"application/json": {"schema": schema}},
        }
    return out
