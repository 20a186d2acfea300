"""What the client raises: an error answer of the service, and an upload that stopped part way."""

from __future__ import annotations

import datetime
import email.utils
import json
import math
import time


class SplitkeyError(Exception):
    """An error answer of the service: HTTP ``status``, contract ``code`` and ``detail`` (docs/API.md section 7).

    ``retry_after`` is the answer's ``Retry-After`` in seconds (a 429), else None;
    ``request_id`` the id the server's log files the request under (quote it in a report).
    """

    def __init__(self, status: int, code: str, detail: str, retry_after: float | None = None, *,
                 request_id: str | None = None) -> None:
        super().__init__(f"{status} {code}: {detail}" + (f" (request id {request_id})" if request_id else ""))
        self.status, self.code, self.detail = status, code, detail
        self.retry_after = retry_after
        self.request_id = request_id


class UploadError(SplitkeyError):
    """An upload (``Client.create_context`` or ``Client.append``) that stopped.

    Exactly the first ``committed`` of the ``total`` keys sent are stored, a prefix:
    after a create, context ``context_id`` holds keys ``[0, committed)``; after an
    append, it holds what it held before followed by those. ``context_id`` is None
    when no context was created. ``status``, ``code`` and ``detail`` are the cause's
    (status 0 and code ``""`` when the connection failed and no answer came); the
    cause itself is ``__cause__``. Resume with ``append(context_id, k[committed:], ...)``.

    ``unknown``: keys past ``committed`` that may be stored too, or not: those of the last
    chunk sent, when its request may have reached the server and no answer came (a plain
    append, one chunk without ``after``, is never sent again: it could be stored twice; any
    chunk whose retries all lost their answers). Read the context's length before resuming
    (a create: ``GET /v1/contexts`` lists a context it may have made). 0 otherwise: then
    ``committed`` is exact.
    """

    def __init__(self, context_id: str | None, committed: int, total: int, status: int, code: str,
                 detail: str, *, appended: bool = False, request_id: str | None = None, unknown: int = 0) -> None:
        super().__init__(status, code, detail, request_id=request_id)
        self.context_id, self.committed, self.total, self.unknown = context_id, committed, total, unknown
        if unknown and context_id is None:
            where = ("no context was created, or one was and its answer was lost: GET /v1/contexts lists every "
                     "context")
        elif unknown:
            where = (f"the first {committed} were stored in context {context_id}, and the next {unknown} may "
                     f"have been too: the answer was lost; read the context's length before sending them again")
        elif appended:
            where = (f"the first {committed} were appended to context {context_id}" if committed
                     else f"none was appended to context {context_id}")
        else:
            where = f"keys [0, {committed}) are stored in context {context_id}" if context_id else "no context was created"
        answer = f"{status} {code}: {detail}" if status else detail  # status 0: no answer came
        self.args = (f"upload stopped with {committed} of {total} keys committed ({where}): {answer}",)


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` value asks to wait: delay-seconds (``"3"``; a fraction is taken too)
    or an HTTP-date (RFC 9110 section 10.2.3; a date past is 0); None for no value or one that is neither."""
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # an HTTP-date is GMT
            when = when.replace(tzinfo=datetime.timezone.utc)
        return max(0.0, when.timestamp() - (time.time() if now is None else now))
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def from_answer(status: int, data: bytes, retry_after: str | None) -> SplitkeyError:
    """The error an answer of ``status`` with body ``data`` (and ``Retry-After`` header) stands for."""
    wait = retry_after_seconds(retry_after)
    try:
        err = json.loads(data)
        rid = err.get("request_id")
        return SplitkeyError(status, str(err.get("code", "")), str(err.get("detail", "")), wait,
                             request_id=str(rid) if rid is not None else None)
    except (ValueError, AttributeError):
        return SplitkeyError(status, "", data[:200].decode(errors="replace"), wait)
