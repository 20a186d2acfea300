"""A small Python client: numpy arrays in and out, over safetensors.

Built on a small blocking HTTP/1.1 connection (``service.client.http1``): a small request
leaves in one write, a large body as the buffers that
:func:`service.wire.safetensors.encode_safetensors` returns (no join, no copy of the
tensors). One ``Client`` holds one keep-alive connection: use one per thread.

Contexts of any length are uploaded in chunks under the server's limits
(``service.client.upload``; docs/CONTEXTS.md, "Uploading long contexts"). Queries are sent
again after 429, 503 or a lost connection, ``retries`` times, within a per-call ``deadline``,
as :class:`service.client.aio.AsyncClient` sends them (``service.client.retry``; docs/SERVICE.md,
"Retries and deadlines").

    >>> c = Client("http://127.0.0.1:8000")
    >>> out, lse = c.attention(q, k, v, causal=True)
"""

from __future__ import annotations

import json
import math
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from service.client.batch import BatchAnswer, decode_batch, encode_batch
from service.client.errors import SplitkeyError, UploadError, from_answer
from service.client.http1 import Connection
from service.client.options import context_ids, window_bounds, wire_tensors
from service.client.pipeline import Chunk, SendChunk, send_pipelined
from service.client.retry import (
    answered_past,
    check_deadline,
    check_retries,
    deadline_passed,
    query_delay,
    timeout_text,
)
from service.client.upload import (
    ATTEMPT_ERRORS,
    TRANSPORT_ERRORS,
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

__all__ = ["BINARY", "Client", "SplitkeyError", "UploadError"]

BINARY = "application/octet-stream"
CREATE = "/v1/contexts"


def _query(options: Mapping[str, Any]) -> str:
    params = []
    for name, value in options.items():
        if value is None:
            continue
        if name in ("causal", "continues"):
            if not isinstance(value, (bool, np.bool_)):  # "false" is truthy: never guess
                raise ValueError(f"{name} must be a bool, got {value!r}")
            value = "true" if value else "false"
        elif name == "window":
            left, right = window_bounds(value)
            value = f"{'' if left is None else left},{'' if right is None else right}"
        elif name == "contexts":
            ids = context_ids(value)
            if not ids:  # none named: the parameter is left out, as for None
                continue
            value = ",".join(ids)
        params.append((name, str(value)))
    return urllib.parse.urlencode(params, safe=",")


T = TypeVar("T")


def _read_again(read: Callable[[], T], retries: int) -> T:
    """``read()``, a read of the server's state, sent again after 429, 503, 504 or a lost connection up to
    ``retries`` times, as an upload's chunks are (``service.client.upload.retry_delay``)."""
    attempt = 0
    while True:
        try:
            return read()
        except ATTEMPT_ERRORS as exc:
            delay = retry_delay(exc, attempt) if attempt < retries else None
            if delay is None:
                raise
            time.sleep(delay)
            attempt += 1


class Client:
    """``timeout``: seconds a connection may wait on the server (each send, each read). ``retries``:
    times a query (:meth:`attention`, :meth:`attention_batch`) is sent again after 429 (after at
    least its ``Retry-After``), 503 (with backoff) or a lost connection; uploads have their own. With
    ``retries=0`` a query is sent once: a kept connection lost before its answer raises too."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0, *, retries: int = 2) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://HOST[:PORT], got {url!r}")
        self.retries = check_retries(retries)
        if not timeout > 0:  # NaN too: a socket timeout that never ends, or ends at once
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.https = parts.scheme == "https"
        self.base = parts.path.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._conn: Connection | None = None
        self._limits: Limits | None = None
        #: The ``Server-Timing`` header of the last answer ("" if it had none):
        #: ``service.client.timing.parse_server_timing`` reads it as stage durations.
        self.last_server_timing = ""

    # -- attention ---------------------------------------------------------------
    def attention(self, q: Any, k: Any = None, v: Any = None, contexts: Sequence[str] | None = None, *,
                  q_pos: Any = None, k_pos: Any = None, alibi_slopes: Any = None, scale: float | None = None,
                  causal: bool | None = None, window: tuple[int | None, int | None] | None = None,
                  softcap: float | None = None, deadline: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(out [n_q, h_q, d_v], lse [n_q, h_q])`` of ``q`` over inline ``k, v`` and/or ``contexts``.

        Sent again after 429, 503 or a lost connection up to ``retries`` times; ``deadline``
        (seconds, retries and waits included) ends the call with :class:`TimeoutError`.
        """
        tensors = {"q": q, "k": k, "v": v, "q_pos": q_pos, "k_pos": k_pos, "alibi_slopes": alibi_slopes}
        query = _query({"scale": scale, "causal": causal, "window": window, "softcap": softcap,
                        "contexts": contexts})
        body = encode_safetensors(wire_tensors(tensors))
        res = decode_safetensors(self._query("/v1/attention", query, body, deadline), {"out", "lse"})
        return np.array(res["out"]), np.array(res["lse"])

    def attention_batch(self, items: Sequence[Mapping[str, Any]], *,
                        deadline: float | None = None) -> list[BatchAnswer]:
        """Many attention items in one request (``POST /v1/attention/batch``, docs/API.md section 10).

        Each item is a mapping of :meth:`attention`'s arguments (``q`` and any of ``k``,
        ``v``, ``contexts``, ``q_pos``, ``k_pos``, ``alibi_slopes``, ``scale``, ``causal``,
        ``window``, ``softcap``); each answer is ``(out, lse)`` or the :class:`SplitkeyError`
        of that item alone. An error of the whole request raises, once the retries and
        ``deadline`` of :meth:`attention` are spent.
        """
        body = encode_batch(items)
        return decode_batch(self._query("/v1/attention/batch", "", body, deadline), len(items))

    def _query(self, path: str, query: str, body: list[bytes | memoryview], deadline: float | None) -> bytes:
        """POST a query, sent again after 429/503/a lost connection up to ``retries`` times, within ``deadline``
        (``service.client.retry``: the policy ``AsyncClient`` follows too).

        Each attempt may take the time left (at most ``timeout`` per socket operation), all its
        reads together (``service.client.http1``); the time left is also sent
        as ``X-Request-Timeout`` so that the server gives up then too. No wait before a resend is
        begun that would end at or past the deadline: the deadline's :class:`TimeoutError` is
        raised at once instead, from the error that asked for the wait.
        """
        seconds = check_deadline(deadline)
        start = time.monotonic()
        attempt = 0
        while True:
            timeout = None  # the client's
            if seconds is not None:
                left = start + seconds - time.monotonic()
                if left <= 0:  # only after a resend without a wait: the attempt before used it all
                    raise deadline_passed(seconds)
                if left < (self.timeout or math.inf):
                    timeout = left
            try:
                # retries=0: sent once, not even again on a kept connection lost before its answer
                return self._request("POST", path, query, body=body, timeout=timeout,
                                     time_left=None if seconds is None else left, resend=self.retries > 0)
            except ATTEMPT_ERRORS as exc:
                if seconds is not None and timeout is not None and isinstance(exc, TimeoutError):
                    raise deadline_passed(seconds) from exc  # the socket waited out the time left
                if seconds is not None and answered_past(exc, start + seconds - time.monotonic()):
                    raise deadline_passed(seconds) from exc  # the server's 504 for the time left we sent
                delay = query_delay(exc, attempt, self.retries)
                if delay is None:
                    raise
                if seconds is not None and time.monotonic() + delay >= start + seconds:
                    raise deadline_passed(seconds) from exc
            time.sleep(delay)
            attempt += 1

    # -- contexts ----------------------------------------------------------------
    def create_context(self, k: Any, v: Any, k_pos: Any = None, *, replicas: int | None = None,
                       shards: int | None = None, chunk_keys: int | None = None, progress: Progress | None = None,
                       retries: int = 3, pipeline: int = 2, expected_length: int | None = None) -> dict:
        """Store ``k [n_k, h_kv, d]``, ``v [n_k, h_kv, d_v]`` (any ``n_k``) as a new context; its description.

        Sent in chunks of ``chunk_keys`` keys (default: from the server's limits,
        :meth:`limits`). One chunk is one ``POST /v1/contexts``; with more, the first
        creates the context with ``expected_length = n_k`` and the others are appends
        with ``after``. ``progress(done, total)`` is called after each committed chunk;
        a chunk that fails with 429, 503, 504 or a lost connection is sent again up to
        ``retries`` times. Up to ``pipeline`` chunks are in flight at once, each on a
        connection of its own (``service.client.pipeline``; 1: one at a time). Raises
        :class:`UploadError`, which says which keys are stored.

        ``expected_length``: the keys the context will hold once later appends are in
        (at least ``n_k``): its shards are planned and allocated for them now, so a
        context too large to hold in the client's memory can be sent piece by piece.
        """
        k, v, k_pos = _arrays(k, v, k_pos)
        upload = Upload(total=_keys(k), progress=progress, retries=retries)
        if expected_length is not None and (type(expected_length) is not int or expected_length < upload.total):
            raise ValueError(f"expected_length must be an int >= the {upload.total} keys given, got {expected_length!r}")
        bounds = self._chunk_bounds(upload, k, v, k_pos, chunk_keys)
        chunks = _chunks(k, v, k_pos, bounds)
        first, tensors = next(chunks)
        planned = expected_length if expected_length is not None else upload.total if len(bounds) > 1 else None
        options = {"replicas": replicas, "shards": shards, "expected_length": planned}
        desc = self._send(upload, CREATE, _query(options), tensors, keys=first)
        upload.context_id = desc["id"]
        upload.commit(first)
        return self._append_chunks(upload, chunks, base=0, pipeline=pipeline) or desc

    def append(self, context_id: str, k: Any, v: Any, k_pos: Any = None, *, chunk_keys: int | None = None,
               progress: Progress | None = None, retries: int = 3, pipeline: int = 2, after: int | None = None) -> dict:
        """Append ``k``, ``v`` (any ``n_k``) to a context; its new description.

        Chunked as :meth:`create_context`: one chunk without ``after`` is one plain append, not
        sent again once it may have arrived; with more, each is an append with ``after`` (the
        context's length before it), so a chunk sent again is stored once. ``after``: the
        context's length the keys must follow (an engine's step: the keys it has appended so
        far); the append is stored only where the context holds exactly that many keys (else
        :class:`UploadError`, 409 ``length_mismatch``), and even a single chunk is then sent
        again after a lost answer and stored once. Raises :class:`UploadError`.
        """
        check_after(after)
        k, v, k_pos = _arrays(k, v, k_pos)
        upload = Upload(total=_keys(k), progress=progress, retries=retries, context_id=context_id)
        bounds = self._chunk_bounds(upload, k, v, k_pos, chunk_keys)
        if len(bounds) == 1 and after is None:  # one plain append: sent again only when surely not stored
            desc = self._send(upload, self._append_path(context_id), "", {"k": k, "v": v, "k_pos": k_pos},
                              keys=upload.total)
            upload.commit(upload.total)
            return desc
        if after is None:
            try:
                after = self._length(context_id, upload.retries)
            except ATTEMPT_ERRORS as exc:
                raise upload.stopped(exc) from exc
        return self._append_chunks(upload, _chunks(k, v, k_pos, bounds), base=after, pipeline=pipeline)

    def get_context(self, context_id: str) -> dict:
        return json.loads(self._request("GET", f"/v1/contexts/{context_id}"))

    def _length(self, context_id: str, retries: int) -> int:
        """The context's length (:func:`_read_again`)."""
        return _read_again(lambda: int(self.get_context(context_id)["length"]), retries)

    def list_contexts(self) -> list[dict]:
        return json.loads(self._request("GET", "/v1/contexts"))["contexts"]

    def delete_context(self, context_id: str) -> dict:
        return json.loads(self._request("DELETE", f"/v1/contexts/{context_id}"))

    def cluster(self) -> dict:
        return json.loads(self._request("GET", "/v1/cluster"))

    def limits(self) -> Limits:
        """The request limits the server enforces (``GET /v1/limits``), fetched once per client.

        A server without the route (404 without a code) has the defaults. Sent again after
        429, 503, 504 or a lost connection up to ``retries`` times, as an upload's chunks are.
        """
        return self._fetch_limits(self.retries)

    def _fetch_limits(self, retries: int) -> Limits:
        if self._limits is None:
            try:
                self._limits = _read_again(lambda: Limits.from_json(json.loads(self._request("GET", "/v1/limits"))),
                                           retries)
            except SplitkeyError as exc:
                if exc.status != 404 or exc.code:
                    raise
                self._limits = DEFAULT_LIMITS  # a server without the route
        return self._limits

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- uploads -----------------------------------------------------------------
    @staticmethod
    def _append_path(context_id: str) -> str:
        return f"{CREATE}/{context_id}/append"

    def _chunk_bounds(self, upload: Upload, k: np.ndarray, v: np.ndarray, k_pos: np.ndarray | None,
                      requested: int | None) -> list[tuple[int, int]]:
        """``[lo, hi)`` of each chunk; k, v and k_pos must agree on ``n_k`` when there are several."""
        try:
            limits = self._fetch_limits(upload.retries)
        except ATTEMPT_ERRORS as exc:
            raise upload.stopped(exc) from exc
        return plan_chunks(limits, k, v, k_pos, requested)

    def _append_chunks(self, upload: Upload, chunks: Iterator[tuple[int, dict[str, Any]]], base: int,
                       pipeline: int) -> dict:
        """Append each chunk after the ``base + upload.committed`` keys stored; the last description ({} if none).

        Up to ``pipeline`` at a time while all goes well (``service.client.pipeline``);
        from the first chunk that does not, one at a time with retries.
        """
        if type(pipeline) is not int or pipeline < 1:
            raise ValueError(f"pipeline must be an int >= 1, got {pipeline!r}")
        items = [Chunk(keys, tensors) for keys, tensors in chunks]
        after = upload.start = base + upload.committed
        for item in items:
            item.after, after = after, after + item.keys
        context_id = str(upload.context_id)
        path = self._append_path(context_id)
        start = 0
        desc: dict = {}
        if pipeline > 1 and len(items) > 1:
            clones = [Client(self.url, api_key=self.api_key, timeout=self.timeout) for _ in range(pipeline - 1)]
            try:
                start, desc = send_pipelined([self._chunk_sender(), *(c._chunk_sender() for c in clones)], upload,
                                             path, items, lambda: self._stored_end(upload),
                                             lambda after: _query(upload.chunk_options(after)))
            finally:
                for c in clones:
                    c.close()
            if start == len(items) and not desc:  # the last chunks were found stored, not answered
                desc = self.get_context(context_id)
        for item in items[start:]:
            desc = self._send(upload, path, _query(upload.chunk_options(item.after)), item.tensors, after=item.after,
                              keys=item.keys)
            upload.commit(item.keys)
        return desc

    def _chunk_sender(self) -> SendChunk:
        """One chunk on this client's connection, no retries (``service.client.pipeline``)."""
        def send(path: str, query: str, tensors: Any, sent: Callable[[], None]) -> dict:
            try:
                return json.loads(self._request("POST", path, query, tensors, resend=False, sent=sent))
            finally:
                sent()  # the next chunk must not wait for a body that failed to go out
        return send

    def _upload_state(self, upload: Upload) -> dict | None:
        """The context's description with where ``upload``'s keys are (``?upload=``); None if it cannot be read."""
        try:
            return json.loads(self._request("GET", f"{CREATE}/{upload.context_id}", _query({"upload": upload.upload_id})))
        except ATTEMPT_ERRORS:
            return None

    def _stored_end(self, upload: Upload) -> int | None:
        desc = self._upload_state(upload)
        return None if desc is None else upload.stored_end(desc)

    def _send(self, upload: Upload, path: str, query: str, tensors: Mapping[str, Any], *,
              after: int | None = None, keys: int = 0) -> dict:
        """One chunk: sent, and sent again (at most ``upload.retries`` times) after a retryable failure.

        A chunk that carries ``after`` and is answered 409 ``length_mismatch`` on a
        later attempt was stored by an earlier one when the context now holds
        ``after + keys`` keys (so such a chunk is never sent again behind the loop's
        back). A lost connection is retried only for creates and for chunks with
        ``after``: a plain append might be stored twice.
        """
        resendable = after is not None or path == CREATE
        attempt = 0
        while True:
            try:
                # No resend inside the transport but for a create (as AsyncClient._send says why).
                return json.loads(self._request("POST", path, query, tensors, resend=path == CREATE))
            except ATTEMPT_ERRORS as exc:
                if attempt and after is not None and is_length_mismatch(exc):
                    stored = self._holding(upload, after + keys)
                    if stored is not None:
                        return stored
                may_resend = resendable or not isinstance(exc, TRANSPORT_ERRORS)
                delay = retry_delay(exc, attempt) if attempt < upload.retries and may_resend else None
                if delay is None:
                    raise upload.stopped(exc, keys if may_have_arrived(exc) else 0) from exc
            time.sleep(delay)
            attempt += 1

    def _holding(self, upload: Upload, end: int) -> dict | None:
        """The context's description if ``upload``'s keys reach ``end`` (an earlier attempt of the chunk
        ending there was stored), else None (also if it cannot be read)."""
        return holding(upload, self._upload_state(upload), end)

    # -- transport ---------------------------------------------------------------
    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = Connection(self.host, self.port, https=self.https, timeout=self.timeout)
        return self._conn

    def _request(self, method: str, path: str, query: str = "", tensors: Mapping[str, Any] | None = None, *,
                 resend: bool = True, sent: Callable[[], None] | None = None,
                 body: list[bytes | memoryview] | None = None, timeout: float | None = None,
                 time_left: float | None = None) -> bytes:
        """The answer's body; an error answer raises :class:`SplitkeyError`.

        The request body is the safetensors of ``tensors``, or ``body`` (buffers of one) as it is.
        ``timeout``: this request's socket timeout (None: the client's ``timeout``). ``time_left``:
        the seconds left of the call's deadline, sent as ``X-Request-Timeout`` (None: not sent).

        ``resend``: send once more on a fresh connection when the kept one turns out closed
        (the server closed it while idle); a lost connection otherwise raises (what
        ``http.client`` raises for it: ``service.client.http1``).
        ``sent()`` is called once the request's body is out, before its answer is read.
        """
        headers = {"Accept": BINARY + ", application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if tensors is not None:
            body = encode_safetensors(wire_tensors(tensors))
        if body is not None:
            headers["Content-Type"] = BINARY
        if time_left is not None:
            headers[TIMEOUT_HEADER] = timeout_text(time_left)
        target = urllib.parse.quote(self.base + path, safe="/") + (f"?{query}" if query else "")
        resp = self._connection().request(method, target, headers, body or (), resend=resend, sent=sent,
                                          timeout=timeout)
        self.last_server_timing = resp.headers.get("server-timing", "")
        if resp.status >= 400:
            raise from_answer(resp.status, resp.body, resp.headers.get("retry-after"))
        return resp.body


def _arrays(k: Any, v: Any, k_pos: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return np.asarray(k), np.asarray(v), None if k_pos is None else np.asarray(k_pos)


def _keys(a: np.ndarray) -> int:
    """``n_k`` of an array whose first axis is the keys (0 for a scalar: the server judges its rank)."""
    return int(a.shape[0]) if a.ndim else 0


def _chunks(k: np.ndarray, v: np.ndarray, k_pos: np.ndarray | None,
            bounds: list[tuple[int, int]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(keys, tensors)`` of each chunk: views of the arrays (the arrays themselves when there is one)."""
    if len(bounds) == 1:
        yield _keys(k), {"k": k, "v": v, "k_pos": k_pos}
        return
    for lo, hi in bounds:
        yield hi - lo, {"k": k[lo:hi], "v": v[lo:hi], "k_pos": None if k_pos is None else k_pos[lo:hi]}
