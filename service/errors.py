"""Every error a client can see: one exception per kind, one table of codes and statuses.

Code anywhere in the service raises a :class:`ServiceError` subclass with a
detail that names the field and the bad value ("q must be ..., got ...");
:data:`ERRORS` gives each subclass its stable ``code`` and HTTP status
(docs/API.md section 7), and :func:`render` writes the one body format for
every route, the KServe ones included. No layer matches messages or builds a
status of its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass


class ServiceError(Exception):
    """An error the client sees; its ``code`` and ``status`` come from :data:`ERRORS`."""

    def __init__(self, detail: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = dict(headers or {})

    @property
    def code(self) -> str:
        return ERRORS[type(self)].code

    @property
    def status(self) -> int:
        return ERRORS[type(self)].status

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detail!r})"


class InvalidBody(ServiceError):
    """The body cannot be parsed (bad JSON, malformed safetensors, a broken KServe request)."""


class Unauthorized(ServiceError):
    """Missing or wrong API key; carries the ``WWW-Authenticate: Bearer`` challenge (RFC 9110)."""

    def __init__(self, detail: str = "Authorization must be 'Bearer <api key>', got a missing or wrong key") -> None:
        super().__init__(detail, {"WWW-Authenticate": "Bearer"})


class ContextNotFound(ServiceError):
    """An unknown context id."""


class LengthMismatch(ServiceError):
    """An append names a context length (``after``) other than the context's committed length."""


class BodyTooLarge(ServiceError):
    """The body, a safetensors header or one tensor is over its limit."""


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


class DeadlineExceeded(ServiceError):
    """The request ran past its deadline."""


class InsufficientCapacity(ServiceError):
    """No room on the workers for a context."""


@dataclass(frozen=True)
class ErrorKind:
    code: str  #: stable snake_case name, part of the public contract: add, never rename
    status: int


#: The one table: each error's code and HTTP status (docs/API.md section 7).
ERRORS: Mapping[type[ServiceError], ErrorKind] = {
    InvalidBody: ErrorKind("invalid_body", 400),
    Unauthorized: ErrorKind("unauthorized", 401),
    ContextNotFound: ErrorKind("context_not_found", 404),
    LengthMismatch: ErrorKind("length_mismatch", 409),
    BodyTooLarge: ErrorKind("body_too_large", 413),
    UnsupportedMediaType: ErrorKind("unsupported_media_type", 415),
    InvalidTensor: ErrorKind("invalid_tensor", 422),
    InvalidOption: ErrorKind("invalid_option", 422),
    Overloaded: ErrorKind("overloaded", 429),
    WorkersUnavailable: ErrorKind("workers_unavailable", 503),
    ContextLost: ErrorKind("context_lost", 503),
    ShuttingDown: ErrorKind("shutting_down", 503),
    DeadlineExceeded: ErrorKind("deadline_exceeded", 504),
    InsufficientCapacity: ErrorKind("insufficient_capacity", 507),
}

#: Routes under this prefix speak the Open Inference Protocol, whose clients read an ``error`` key.
KSERVE_PREFIX = "/v2"


def error_body(err: ServiceError, *, kserve: bool = False) -> bytes:
    """``{"detail", "code"}`` as UTF-8 JSON; KServe routes add the protocol's ``error`` (the same message)."""
    doc = {"error": err.detail} if kserve else {}
    doc.update(detail=err.detail, code=err.code)
    return json.dumps(doc, separators=(",", ":")).encode()


def render(err: ServiceError, path: str) -> tuple[int, bytes, dict[str, str]]:
    """``(status, body, headers)`` of the response to ``err`` on ``path``: the one place errors are written."""
    return err.status, error_body(err, kserve=path.startswith(KSERVE_PREFIX)), dict(err.headers)


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """OpenAPI ``responses=`` entries for FastAPI routes: the error body schema per status."""
    codes = [kind.code for kind in ERRORS.values()]
    schema = {
        "type": "object",
        "required": ["detail", "code"],
        "properties": {"detail": {"type": "string"}, "code": {"type": "string", "enum": codes}},
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
