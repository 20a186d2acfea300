"""An asyncio client: the same calls as :class:`service.client.sync.Client`, awaitable.

Made for an engine's decode loop, which calls many times per second from one event
loop: one pool of keep-alive connections reused by every call (``service.client.aio_http``,
a small HTTP/1.1 transport: a general-purpose one cost 3 ms per call here), the batch call,
chunked uploads, and retries that are safe for what they retry:

* queries (``attention``, ``attention_batch``) only read, so they are sent again
  after a 429 (waiting at least its ``Retry-After``), a 503 (backing off: 0.25 s,
  doubled per attempt, at most 4 s) or a lost connection, ``retries`` times;
* upload chunks follow the upload protocol of the synchronous client
  (``service.client.upload``): a create, then appends with ``after``, so a chunk
  sent twice is stored once;
* ``deadline`` (seconds, per call, retries included) ends a call that takes longer
  with :class:`TimeoutError`, as does a wait before a resend that would end past it
  (raised at once, from the error that asked for the wait).

The query policy is ``service.client.retry``'s, which the synchronous client follows too
(docs/SERVICE.md, "Retries and deadlines").

    >>> async with AsyncClient("http://127.0.0.1:8000") as c:
    ...     out, lse = await c.attention(q, contexts=[ctx_id])

docs/ENGINE.md, "A decode loop", has an engine's decode loop.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from service.client.aio_http import HttpPool, TransportError
from service.client.batch import BatchAnswer, decode_batch, encode_batch
from service.client.errors import SplitkeyError, UploadError, from_answer
from service.client.options import wire_tensors
from service.client.sync import BINARY, CREATE, _arrays, _chunks, _keys, _query
from service.client.retry import (
    answered_past,
    backoff,
    check_deadline,
    check_retries,
    deadline_passed,
    query_delay,
    timeout_text,
)
from service.client.upload import (
    Progress,
    Upload,
    check_after,
    holding,
    is_length_mismatch,
    may_have_arrived,
    plan_chunks,
    retry_delay,
)
from service.wire.rules import DEFAULT_LIMITS, TIMEOUT_HEADER, Limits
from service.wire.safetensors import decode_safetensors, encode_safetensors

__all__ = ["AsyncClient", "SplitkeyError", "TransportError", "UploadError"]

#: A failed connection, or no answer within ``timeout``: the request may be sent again (queries always;
#: chunks as the upload protocol allows).
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (TransportError, TimeoutError)
#: What ends one attempt: an error answer or a failed connection.
ATTEMPT_ERRORS: tuple[type[Exception], ...] = (SplitkeyError, TransportError, TimeoutError)


def _resend_delay(error: BaseException, attempt: int) -> float | None:
    """``service.client.upload.retry_delay`` for this client's errors: it knows :class:`SplitkeyError`,
    and a failed connection waits as the sync client's does (at once the first time, then backoff)."""
    if isinstance(error, TRANSPORT_ERRORS):
        return 0.0 if attempt == 0 else backoff(attempt)
    return retry_delay(error, attempt)


T = TypeVar("T")


async def _read_again(read: Callable[[], Awaitable[T]], retries: int) -> T:
    """``await read()``, a read of the server's state, sent again as the sync client's ``_read_again`` says."""
    attempt = 0
    while True:
        try:
            return await read()
        except ATTEMPT_ERRORS as exc:
            delay = _resend_delay(exc, attempt)
            if attempt >= retries or delay is None:
                raise
            await asyncio.sleep(delay)
            attempt += 1


class AsyncClient:
    def __init__(self, url: str, api_key: str | None = None, *, timeout: float = 600.0, retries: int = 2,
                 max_connections: int = 16) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://HOST[:PORT], got {url!r}")
        check_retries(retries)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.retries = retries
        self.timeout = timeout
        self.base = parts.path.rstrip("/")
        self._headers = {"Accept": BINARY + ", application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._pool = HttpPool(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80),
                              https=parts.scheme == "https", max_connections=max_connections)
        self._limits: Limits | None = None
        #: The ``Server-Timing`` header of the last answer ("" if it had none).
        self.last_server_timing = ""

    # -- queries -----------------------------------------------------------------
    async def attention(self, q: Any, k: Any = None, v: Any = None, contexts: Sequence[str] | None = None, *,
                        q_pos: Any = None, k_pos: Any = None, alibi_slopes: Any = None, scale: float | None = None,
                        causal: bool | None = None, window: tuple[int | None, int | None] | None = None,
                        softcap: float | None = None, deadline: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(out [n_q, h_q, d_v], lse [n_q, h_q])`` of ``q`` over inline ``k, v`` and/or ``contexts``."""
        tensors = {"q": q, "k": k, "v": v, "q_pos": q_pos, "k_pos": k_pos, "alibi_slopes": alibi_slopes}
        query = _query({"scale": scale, "causal": causal, "window": window, "softcap": softcap,
                        "contexts": contexts})
        body = encode_safetensors(wire_tensors(tensors))
        data = await self._query("/v1/attention", query, body, deadline)
        res = decode_safetensors(data, {"out", "lse"})
        return np.array(res["out"]), np.array(res["lse"])

    async def attention_batch(self, items: Sequence[Mapping[str, Any]], *,
                              deadline: float | None = None) -> list[BatchAnswer]:
        """Many items in one request; each answer ``(out, lse)`` or that item's :class:`SplitkeyError`
        (``service.client.sync.Client.attention_batch``)."""
        data = await self._query("/v1/attention/batch", "", encode_batch(items), deadline)
        return decode_batch(data, len(items))

    async def _query(self, path: str, query: str, body: list[bytes | memoryview], deadline: float | None) -> bytes:
        """POST a query, sent again after 429/503/a lost connection up to ``retries`` times, within ``deadline``
        (``service.client.retry``: the policy ``Client`` follows too)."""
        seconds = check_deadline(deadline)
        loop = asyncio.get_running_loop()
        timer = asyncio.timeout(seconds)  # in this task, as _request's
        try:
            async with timer:
                attempt = 0
                while True:
                    left = None if seconds is None else cast(float, timer.when()) - loop.time()
                    try:
                        # retries=0: sent once, not even again on a kept connection lost before its answer
                        return await self._request("POST", path, query, body, time_left=left,
                                                   resend=self.retries > 0)
                    except ATTEMPT_ERRORS as exc:
                        if seconds is not None and answered_past(exc, cast(float, timer.when()) - loop.time()):
                            raise deadline_passed(seconds) from exc  # the server's 504 for the time left we sent
                        delay = query_delay(exc, attempt, self.retries)
                        if delay is None:
                            raise
                        if seconds is not None and loop.time() + delay >= cast(float, timer.when()):
                            raise deadline_passed(seconds) from exc  # a wait that would end past it: not begun
                    await asyncio.sleep(delay)
                    attempt += 1
        except TimeoutError as exc:
            if seconds is not None and timer.expired():
                raise deadline_passed(seconds) from exc
            raise

    # -- contexts ----------------------------------------------------------------
    async def create_context(self, k: Any, v: Any, k_pos: Any = None, *, replicas: int | None = None,
                             shards: int | None = None, chunk_keys: int | None = None,
                             progress: Progress | None = None, retries: int = 3,
                             expected_length: int | None = None) -> dict:
        """Store ``k``, ``v`` (any ``n_k``) as a new context, in chunks; its description. As
        ``Client.create_context`` (one chunk in flight at a time); raises :class:`UploadError`."""
        k, v, k_pos = _arrays(k, v, k_pos)
        upload = Upload(total=_keys(k), progress=progress, retries=retries)
        if expected_length is not None and (type(expected_length) is not int or expected_length < upload.total):
            raise ValueError(f"expected_length must be an int >= the {upload.total} keys given, got {expected_length!r}")
        bounds = await self._chunk_bounds(upload, k, v, k_pos, chunk_keys)
        chunks = _chunks(k, v, k_pos, bounds)
        first, tensors = next(chunks)
        planned = expected_length if expected_length is not None else upload.total if len(bounds) > 1 else None
        desc = await self._send(upload, CREATE, _query({"replicas": replicas, "shards": shards,
                                                        "expected_length": planned}), tensors, keys=first)
        upload.context_id = desc["id"]
        upload.commit(first)
        after = upload.start = upload.committed
        path = f"{CREATE}/{desc['id']}/append"
        for keys, tensors in chunks:
            desc = await self._send(upload, path, _query(upload.chunk_options(after)), tensors, after=after, keys=keys)
            upload.commit(keys)
            after += keys
        return desc

    async def append(self, context_id: str, k: Any, v: Any, k_pos: Any = None, *, chunk_keys: int | None = None,
                     progress: Progress | None = None, retries: int = 3, after: int | None = None) -> dict:
        """Append ``k``, ``v`` (any ``n_k``) to a context, in chunks; its new description (as ``Client.append``,
        ``after`` included; one chunk in flight at a time)."""
        check_after(after)
        k, v, k_pos = _arrays(k, v, k_pos)
        upload = Upload(total=_keys(k), progress=progress, retries=retries, context_id=context_id)
        bounds = await self._chunk_bounds(upload, k, v, k_pos, chunk_keys)
        path = f"{CREATE}/{context_id}/append"
        if len(bounds) == 1 and after is None:  # one plain append, sent again only when surely not stored
            only = await self._send(upload, path, "", {"k": k, "v": v, "k_pos": k_pos}, keys=upload.total)
            upload.commit(upload.total)
            return only
        if after is None:
            try:
                after = await self._length(context_id, upload.retries)
            except ATTEMPT_ERRORS as exc:
                raise upload.stopped(exc) from exc
        upload.start = after
        desc: dict = {}
        for keys, tensors in _chunks(k, v, k_pos, bounds):
            desc = await self._send(upload, path, _query(upload.chunk_options(after)), tensors, after=after, keys=keys)
            upload.commit(keys)
            after += keys
        return desc

    async def get_context(self, context_id: str) -> dict:
        return json.loads(await self._request("GET", f"/v1/contexts/{context_id}"))

    async def _length(self, context_id: str, retries: int) -> int:
        """The context's length (:func:`_read_again`)."""
        async def read() -> int:
            return int((await self.get_context(context_id))["length"])
        return await _read_again(read, retries)

    async def list_contexts(self) -> list[dict]:
        return json.loads(await self._request("GET", "/v1/contexts"))["contexts"]

    async def delete_context(self, context_id: str) -> dict:
        return json.loads(await self._request("DELETE", f"/v1/contexts/{context_id}"))

    async def cluster(self) -> dict:
        return json.loads(await self._request("GET", "/v1/cluster"))

    async def limits(self) -> Limits:
        """The server's request limits (``GET /v1/limits``), fetched once; the defaults for a server without it.
        Sent again after 429, 503, 504 or a lost connection up to ``retries`` times, as an upload's chunks are."""
        return await self._fetch_limits(self.retries)

    async def _fetch_limits(self, retries: int) -> Limits:
        async def read() -> Limits:
            return Limits.from_json(json.loads(await self._request("GET", "/v1/limits")))
        if self._limits is None:
            try:
                self._limits = await _read_again(read, retries)
            except SplitkeyError as exc:
                if exc.status != 404 or exc.code:
                    raise
                self._limits = DEFAULT_LIMITS  # a server without the route
        return self._limits

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- uploads -----------------------------------------------------------------
    async def _chunk_bounds(self, upload: Upload, k: np.ndarray, v: np.ndarray, k_pos: np.ndarray | None,
                            requested: int | None) -> list[tuple[int, int]]:
        try:
            limits = await self._fetch_limits(upload.retries)
        except ATTEMPT_ERRORS as exc:
            raise upload.stopped(exc) from exc
        return plan_chunks(limits, k, v, k_pos, requested)

    async def _send(self, upload: Upload, path: str, query: str, tensors: Mapping[str, Any], *,
                    after: int | None = None, keys: int = 0) -> dict:
        """One chunk, sent again after a retryable failure as ``Client._send`` decides (``service.client.upload``)."""
        resendable = after is not None or path == CREATE
        body = encode_safetensors(wire_tensors(tensors))
        attempt = 0
        while True:
            try:
                # No resend inside the transport but for a create: a plain append sent again may be
                # stored twice, and a chunk with ``after`` is sent again by this loop, which tells its
                # own earlier copy (409 length_mismatch on a later attempt) from another writer's.
                return json.loads(await self._request("POST", path, query, body, resend=path == CREATE))
            except ATTEMPT_ERRORS as exc:
                if attempt and after is not None and is_length_mismatch(exc):
                    try:
                        state = json.loads(await self._request("GET", f"{CREATE}/{upload.context_id}",
                                                               _query({"upload": upload.upload_id})))
                    except ATTEMPT_ERRORS:
                        state = None
                    stored = holding(upload, state, after + keys)
                    if stored is not None:
                        return stored
                transport = isinstance(exc, TRANSPORT_ERRORS)
                may_resend = resendable or not transport
                delay = _resend_delay(exc, attempt)
                if attempt >= upload.retries or not may_resend or delay is None:
                    raise upload.stopped(exc, keys if may_have_arrived(exc) else 0) from exc
            await asyncio.sleep(delay)
            attempt += 1

    # -- transport ---------------------------------------------------------------
    async def _request(self, method: str, path: str, query: str = "",
                       body: list[bytes | memoryview] | None = None, *, resend: bool = True,
                       time_left: float | None = None) -> bytes:
        """The answer's body; an error answer raises :class:`SplitkeyError`, no answer within ``timeout``
        :class:`TimeoutError`, a failed connection :class:`TransportError`. ``time_left``: the seconds
        left of the call's deadline, sent as ``X-Request-Timeout`` (None: not sent)."""
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = BINARY
        if time_left is not None:
            headers[TIMEOUT_HEADER] = timeout_text(time_left)
        target = urllib.parse.quote(self.base + path, safe="/") + (f"?{query}" if query else "")
        async with asyncio.timeout(self.timeout):  # in this task (wait_for would start one per request)
            resp = await self._pool.request(method, target, headers, body or (), resend=resend)
        self.last_server_timing = resp.headers.get("server-timing", "")
        if resp.status >= 400:
            raise from_answer(resp.status, resp.body, resp.headers.get("retry-after"))
        return resp.body
