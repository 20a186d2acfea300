"""Uploads of any size: chunks sized under the server's limits, and when to send a chunk again.

Pure (no I/O): :class:`service.client.sync.Client` sends the chunks. A long upload is
a create with ``expected_length`` followed by appends with ``after`` (docs/API.md
section 6.3), so that a chunk sent twice is stored once; docs/CONTEXTS.md,
"Uploading long contexts", describes the whole protocol.
"""

from __future__ import annotations

import http.client
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.client.errors import SplitkeyError, UploadError
from service.client.retry import backoff
from service.wire.rules import Limits

#: Bytes of k and v per chunk when the caller names no chunk size. Measured on 2 cores
#: (benchmarks/results/2026-12-01/NOTES.md, "Uploads: where the time went first"): 16 MiB moves as many bytes per second as 64 MiB, and a
#: small query that lands during an upload waits behind one chunk's copy, not four.
DEFAULT_CHUNK_BYTES = 16 * 2**20
#: Bytes a chunk leaves for the safetensors length field and JSON header (three entries
#: whose numbers have at most 20 digits take under 420 bytes).
HEADER_ROOM = 512
#: Answers after which a chunk is sent again: not admitted (429), the write undid itself
#: (503), a deadline (504).
RETRY_STATUSES = frozenset({429, 503, 504})
#: The connection failed before an answer came: the chunk may or may not be stored.
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (ConnectionError, TimeoutError, http.client.HTTPException)
#: What ends one attempt of a chunk: an error answer or a failed connection.
ATTEMPT_ERRORS: tuple[type[Exception], ...] = (SplitkeyError, *TRANSPORT_ERRORS)



def may_have_arrived(exc: BaseException) -> bool:
    """Whether a request that failed with ``exc`` may have reached the server whole, its outcome
    unknown: a failed connection, but not one that was never made (refused) and not an answer."""
    if isinstance(exc, SplitkeyError) or not isinstance(exc, TRANSPORT_ERRORS):
        return False
    return not isinstance(exc, ConnectionRefusedError) and not isinstance(exc.__cause__, ConnectionRefusedError)


#: ``progress(done_keys, total_keys)``, called after each committed chunk.
Progress = Callable[[int, int], object]


def key_bytes(k: np.ndarray, v: np.ndarray, k_pos: np.ndarray | None) -> int:
    """Bytes one key takes in a safetensors body: its k and v rows, and its position if sent."""
    row = (int(np.prod(k.shape[1:])) * k.dtype.itemsize + int(np.prod(v.shape[1:])) * v.dtype.itemsize)
    return row + (k_pos.dtype.itemsize if k_pos is not None else 0)


def chunk_keys(limits: Limits, k: np.ndarray, v: np.ndarray, k_pos: np.ndarray | None = None,
               requested: int | None = None, target_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Keys per chunk: ``requested``, or as many as ``target_bytes`` of k and v allow; never more than a
    body of ``limits.max_body_bytes`` (less :data:`HEADER_ROOM`) holds, nor than ``limits.max_elements``
    elements of k or v; at least 1."""
    if requested is not None and (type(requested) is not int or requested < 1):
        raise ValueError(f"chunk_keys must be an int >= 1, got {requested!r}")
    per_key = max(key_bytes(k, v, k_pos), 1)
    elements = max(int(np.prod(k.shape[1:])), int(np.prod(v.shape[1:])), 1)
    most = min((limits.max_body_bytes - HEADER_ROOM) // per_key, limits.max_elements // elements)
    if requested is None:
        kv_bytes = max(per_key - (k_pos.dtype.itemsize if k_pos is not None else 0), 1)
        requested = target_bytes // kv_bytes
    return max(1, min(requested, most))


def chunk_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each chunk of ``n`` keys, ``size`` each but the last; one empty chunk when ``n == 0``."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)] or [(0, 0)]


def plan_chunks(limits: Limits, k: np.ndarray, v: np.ndarray, k_pos: np.ndarray | None,
                requested: int | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each chunk of an upload under ``limits``; k, v and k_pos must agree on ``n_k``
    when there are several (one chunk goes as it is: the server judges it)."""
    n = int(k.shape[0]) if k.ndim else 0
    bounds = chunk_bounds(n, chunk_keys(limits, k, v, k_pos, requested))
    if len(bounds) > 1:
        for name, a in (("v", v), ("k_pos", k_pos)):
            if a is not None and (int(a.shape[0]) if a.ndim else 0) != n:
                raise ValueError(f"{name} must have the n_k = {n} keys of k, got {int(a.shape[0]) if a.ndim else 0}")
    return bounds


def retry_delay(error: BaseException, attempt: int) -> float | None:
    """Seconds to wait before sending a chunk again after ``error`` ended attempt ``attempt`` (0: the
    first), or None when the chunk must not be sent again.

    A lost connection is retried at once the first time (a keep-alive connection the
    server closed while idle), then with backoff (``service.client.retry.backoff``, as a
    query's); 429 waits at least its ``Retry-After``.
    """
    if isinstance(error, SplitkeyError):
        if error.status not in RETRY_STATUSES:
            return None
        return max(backoff(attempt), error.retry_after or 0.0)
    if isinstance(error, TRANSPORT_ERRORS):
        return 0.0 if attempt == 0 else backoff(attempt)
    return None


def check_after(after: int | None) -> None:
    """An append's ``after``: None, or the context's length as an int >= 0."""
    if after is not None and (type(after) is not int or after < 0):
        raise ValueError(f"after must be an int >= 0 (the context's length), got {after!r}")

def is_length_mismatch(error: BaseException) -> bool:
    return isinstance(error, SplitkeyError) and error.code == "length_mismatch"


def holding(upload: Upload, desc: dict | None, end: int) -> dict | None:
    """``desc`` (a description fetched with ``?upload=``, without that entry) if ``upload``'s keys
    reach ``end`` in it, else None. The server keeps an upload's keys contiguous from its start,
    so a chunk of this upload that ends at or before ``end`` is stored; the context's length alone
    cannot say this (another writer's chunk of the same size gives the same length)."""
    if desc is None:
        return None
    stored = upload.stored_end(desc)
    if stored is None or stored < end:
        return None
    return {name: value for name, value in desc.items() if name != "upload"}


@dataclass
class Upload:
    """Where one upload stands: which context, how many of its keys are committed."""

    total: int
    progress: Progress | None = None
    retries: int = 3  #: times a chunk may be sent again
    context_id: str | None = None
    committed: int = 0  #: leading keys of the upload the context holds
    append: bool = field(init=False)  #: the keys go after those the context held (else they create it)
    #: Names the upload's appends to the server, which keeps them contiguous (``continues``).
    upload_id: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    start: int | None = None  #: the context's length before the upload's first append with ``after``

    def __post_init__(self) -> None:
        if type(self.retries) is not int or self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")
        self.append = self.context_id is not None  # one that names its context from the start appends

    def chunk_options(self, after: int) -> dict[str, Any]:
        """The options of the append that follows ``after`` keys: ``after``, the upload's id, and
        ``continues`` for every chunk but the first (:attr:`start`), so that the server refuses a
        chunk whose predecessor is another writer's (docs/CONTEXTS.md, "Uploading long contexts")."""
        if self.start is None:
            raise ValueError("start must be set before the upload's appends, got None")
        return {"after": after, "upload": self.upload_id, "continues": True if after != self.start else None}

    def stored_end(self, desc: Mapping[str, Any]) -> int | None:
        """Where this upload's keys end in the context, from its description fetched with
        ``?upload=`` (None: none of them is stored, or the server cannot say)."""
        entry = desc.get("upload")
        if not isinstance(entry, dict) or entry.get("id") != self.upload_id or entry.get("start") != self.start:
            return None
        end = entry.get("end")
        return end if type(end) is int else None

    def commit(self, keys: int) -> None:
        """A chunk of ``keys`` keys is committed."""
        self.committed += keys
        if self.progress is not None:
            self.progress(self.committed, self.total)

    def stopped(self, cause: BaseException, unknown: int = 0) -> UploadError:
        """The error that ends the upload, saying what is stored (raise it ``from cause``); ``unknown``:
        keys past :attr:`committed` that may be stored too (:func:`may_have_arrived`)."""
        rid = None
        if isinstance(cause, SplitkeyError):
            status, code, detail, rid = cause.status, cause.code, cause.detail, cause.request_id
        else:
            status, code, detail = 0, "", f"the connection failed: {type(cause).__name__}: {cause}"
        return UploadError(self.context_id, self.committed, self.total, status, code, detail,
                           appended=self.append, request_id=rid, unknown=unknown)
