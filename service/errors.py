"""The HTTP error model (CONTRACT section 6): one exception, a table of codes, one body format.

Every client mistake becomes an :class:`ApiError` whose ``code`` is a stable
snake_case name and whose ``detail`` names the field and the bad value
("q must be ..., got ..."). The status follows from the code (:data:`STATUS`), so a
code can never travel with the wrong status. The body is JSON
``{"detail": ..., "code": ...}`` (:func:`error_body`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

#: Status of each error code. The codes are part of the public contract: add, never rename.
STATUS: Mapping[str, int] = {
    "invalid_body": 400,  # the body cannot be parsed (bad JSON, malformed safetensors)
    "unauthorized": 401,  # missing or wrong API key
    "context_not_found": 404,  # unknown context id
    "body_too_large": 413,  # body, safetensors header or one tensor over its limit
    "unsupported_media_type": 415,  # Content-Type is neither JSON nor safetensors
    "invalid_tensor": 422,  # well-formed, but a tensor is wrong (name, dtype, shape, values)
    "invalid_option": 422,  # well-formed, but an option or field is wrong
    "overloaded": 429,  # too many requests in flight; see Retry-After
    "workers_unavailable": 503,  # no Ray workers answering
    "context_lost": 503,  # a shard of a needed context was lost with its worker
    "deadline_exceeded": 504,  # the request ran past its deadline
    "insufficient_capacity": 507,  # no room on the workers for a context
}


class ApiError(Exception):
    """A client-visible error: ``status`` (from ``code``), ``code``, ``detail`` and extra ``headers``."""

    def __init__(self, code: str, detail: str, headers: Mapping[str, str] | None = None) -> None:
        if code not in STATUS:
            raise ValueError(f"code must be one of {', '.join(STATUS)}, got {code!r}")
        super().__init__(detail)
        self.code = code
        self.status = STATUS[code]
        self.detail = detail
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"ApiError({self.code!r}, {self.detail!r})"


def error_body(err: ApiError) -> bytes:
    """The JSON body of an error response: ``{"detail": ..., "code": ...}`` (UTF-8)."""
    return json.dumps({"detail": err.detail, "code": err.code}, separators=(",", ":")).encode()


def from_value_error(err: ValueError, code: str = "invalid_tensor") -> ApiError:
    """Wrap a library ``ValueError`` ("x must be ..., got ...") raised on client input."""
    return ApiError(code, str(err))


def unauthorized(detail: str = "a valid API key is required in the Authorization header") -> ApiError:
    """401 with ``WWW-Authenticate: Bearer`` (RFC 9110 asks for the challenge)."""
    return ApiError("unauthorized", detail, {"WWW-Authenticate": "Bearer"})


def overloaded(detail: str, retry_after_s: float) -> ApiError:
    """429 with ``Retry-After`` in whole seconds (rounded up, at least 1)."""
    if type(retry_after_s) not in (int, float) or not math.isfinite(retry_after_s):
        raise ValueError(f"retry_after_s must be a finite number, got {retry_after_s!r}")
    return ApiError("overloaded", detail, {"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def error_responses(*statuses: int) -> dict[int, dict]:
    """OpenAPI ``responses=`` entries for FastAPI routes: the error body schema per status."""
    schema = {
        "type": "object",
        "required": ["detail", "code"],
        "properties": {"detail": {"type": "string"}, "code": {"type": "string", "enum": list(STATUS)}},
    }
    out = {}
    for status in statuses:
        codes = [c for c, s in STATUS.items() if s == status]
        if not codes:
            raise ValueError(f"status must be one of {sorted(set(STATUS.values()))}, got {status!r}")
        out[status] = {
            "description": "error: " + ", ".join(codes),
            "content": {"application/json": {"schema": schema}},
        }
    return out
