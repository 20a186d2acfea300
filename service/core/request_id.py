"""One id per request: in the ``X-Request-Id`` response header, in every error body, and in
the server's log lines about that request, so a client's report finds the log's details.

A client (or a proxy in front) may send its own ``X-Request-Id``; it is kept when it is a
short token of safe characters (it ends up in the log), else a fresh one is made.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from contextvars import ContextVar

HEADER = b"x-request-id"
#: What an incoming id may be: short, and nothing that could forge a log line or a header.
CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")

#: The id of the request this task serves (set by the middleware; each request runs in its own task).
_current: ContextVar[str] = ContextVar("splitkey_request_id", default="-")


def assign(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The request's id (the client's when acceptable, else 16 random hex digits); current from now on."""
    rid = next((value.decode() for name, value in headers if name == HEADER and CLIENT_ID.fullmatch(value)), None)
    rid = rid or secrets.token_hex(8)
    _current.set(rid)
    return rid


def current() -> str:
    """The id of the request being served here, or ``-`` outside one."""
    return _current.get()
