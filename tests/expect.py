"""Expectations shared by the tests of the service: the contract's error table, and one
context manager that checks a raised ``ServiceError`` against it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from service.core.errors import ServiceError
from service.wire.rules import RequestOptions
from workers.options import AttentionOptions

#: The error codes and statuses docs/API.md section 7 promises (written out here, not
#: read from the code, so that a wrong entry in service.core.errors.ERRORS fails the tests).
CONTRACT_STATUS = {
    "invalid_body": 400, "unauthorized": 401, "context_not_found": 404, "route_not_found": 404,
    "method_not_allowed": 405, "request_timeout": 408,
    "length_mismatch": 409, "body_too_large": 413,
    "unsupported_media_type": 415, "header_too_large": 431, "invalid_tensor": 422, "invalid_option": 422, "overloaded": 429,
    "internal_error": 500, "workers_unavailable": 503, "context_lost": 503, "shutting_down": 503, "too_many_connections": 503,
    "deadline_exceeded": 504,
    "insufficient_capacity": 507,
}


@contextmanager
def service_error(code: str, *fragments: str) -> Iterator[pytest.ExceptionInfo[ServiceError]]:
    """Expect a ServiceError with ``code`` (and its contract status) whose detail contains every fragment."""
    with pytest.raises(ServiceError) as info:
        yield info
    err = info.value
    assert (err.code, err.status) == (code, CONTRACT_STATUS[code]), repr(err)
    for fragment in fragments:
        assert fragment in err.detail, (fragment, err.detail)


def raised(fn, *args, **kwargs) -> ServiceError:
    """The ServiceError ``fn(*args, **kwargs)`` raises (the test fails if it raises none)."""
    with pytest.raises(ServiceError) as info:
        fn(*args, **kwargs)
    return info.value


def given_options(opts: RequestOptions) -> dict:
    """What a client changed from the defaults, as plain values (for comparing with a table)."""
    a, default = opts.attention, AttentionOptions()
    out = {name: getattr(a, name) for name in ("scale", "causal", "window", "softcap")
           if getattr(a, name) != getattr(default, name)}
    out.update({name: getattr(opts, name) for name in ("contexts", "replicas", "shards") if getattr(opts, name)})
    out.update({name: getattr(opts, name) for name in ("expected_length", "after") if getattr(opts, name) is not None})
    return out
