"""When a query is sent again, and how long a call may take: the policy both clients share.

:class:`service.client.sync.Client` and :class:`service.client.aio.AsyncClient` both decide
with these functions, so they cannot drift apart (docs/SERVICE.md, "Retries and deadlines",
says it for users). Pure: no I/O, no clock.

A query (``attention``, ``attention_batch``) only reads, so it may be sent again after an
answer that says "not now" (429, after at least its ``Retry-After``; 503) or after a
connection that failed before its answer came, ``retries`` times, all within the call's
``deadline``. Uploads decide per chunk (``service.client.upload.retry_delay``) with the
same backoff.
"""

from __future__ import annotations

import math
import numbers

from service.client.errors import SplitkeyError

#: Answers after which a query is sent again: not admitted now (429), workers not ready (503).
QUERY_RETRY_STATUSES = frozenset({429, 503})
#: Wait before the second attempt; doubled for each further one, up to MAX_BACKOFF_S.
BACKOFF_S = 0.25
MAX_BACKOFF_S = 4.0


def backoff(attempt: int) -> float:
    """Seconds to wait after attempt ``attempt`` (0: the first) failed: :data:`BACKOFF_S` doubled per
    attempt, at most :data:`MAX_BACKOFF_S`."""
    return min(MAX_BACKOFF_S, BACKOFF_S * 2 ** attempt)


def query_delay(error: BaseException, attempt: int, retries: int) -> float | None:
    """Seconds to wait before sending a query again after ``error`` ended attempt ``attempt`` (0: the
    first), or None when it must not be sent again: ``retries`` resends are spent, or the answer is
    one a resend cannot change.

    ``error`` is a :class:`SplitkeyError` (an error answer) or what the client's transport raises
    for a connection that failed or gave no answer within its timeout (the caller catches only
    those). A 429 waits at least its ``Retry-After``; a lost connection is sent again at once the
    first time (a keep-alive connection the server closed while idle), then with backoff.
    """
    if attempt >= retries:
        return None
    if isinstance(error, SplitkeyError):
        if error.status not in QUERY_RETRY_STATUSES:
            return None
        return max(backoff(attempt), error.retry_after or 0.0)
    return 0.0 if attempt == 0 else backoff(attempt)


def timeout_text(seconds: float) -> str:
    """``seconds`` left of a call's deadline as its ``X-Request-Timeout`` header (``service.wire.rules.TIMEOUT_HEADER``): the server's
    deadline for the query is then at most that (docs/API.md section 6.6, "Deadline"). Whole
    milliseconds rounded up, at least one (the header must be > 0): the server never gives up
    before the client does."""
    return f"{max(math.ceil(seconds * 1000), 1) / 1000:.3f}"


def answered_past(error: BaseException, left: float) -> bool:
    """Whether ``error`` is the server's 504 for a query whose ``X-Request-Timeout`` ran out, the
    call's deadline with it (``left``: its seconds left now): the call then ends with the
    deadline's :class:`TimeoutError`, as when the client's own timer fires first. A 504 that came
    while the call had time left is the server's own ``--request-timeout``, raised as it is.

    The server counts the header from when the request reached it, after the client's clock
    started, so its 504 for the header comes when the client's time is out too."""
    return isinstance(error, SplitkeyError) and error.status == 504 and left <= 0


def check_retries(retries: object) -> int:
    """``retries`` if it is an int >= 0; else ValueError naming it."""
    if type(retries) is not int or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")
    return retries


def check_deadline(deadline: object) -> float | None:
    """``deadline`` (seconds) if it is None or a number > 0; else ValueError naming it."""
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, numbers.Real) or not float(deadline) > 0:
        raise ValueError(f"deadline must be > 0 seconds, got {deadline!r}")
    return float(deadline)


def deadline_passed(deadline: float) -> TimeoutError:
    """What a call raises when its ``deadline`` ends, or when the wait before its next attempt would
    end at or past it (raise it ``from`` the last attempt's error, if any)."""
    return TimeoutError(f"the call did not finish within its deadline of {deadline:g} s")
