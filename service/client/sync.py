"""A small Python client: numpy arrays in and out, over safetensors.

Built on ``http.client``: it sends a body as the list of buffers that
:func:`service.wire.safetensors.encode_safetensors` returns (no join, no copy of
the tensors) with a Content-Length, which is as fast as curl here. One
``Client`` holds one keep-alive connection: use one per thread.

    >>> c = Client("http://127.0.0.1:8000")
    >>> out, lse = c.attention(q, k, v, causal=True)
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from service.wire.safetensors import decode_safetensors, encode_safetensors

BINARY = "application/octet-stream"


class SplitkeyError(Exception):
    """An error answer of the service: HTTP ``status``, contract ``code`` and ``detail``."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


def _query(options: Mapping[str, Any]) -> str:
    params = []
    for name, value in options.items():
        if value is None:
            continue
        if name == "causal":
            value = "true" if value else "false"
        elif name == "window":
            left, right = value
            value = f"{'' if left is None else int(left)},{'' if right is None else int(right)}"
        elif name == "contexts":
            value = ",".join(value)
        params.append((name, str(value)))
    return urllib.parse.urlencode(params, safe=",")


class Client:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://HOST[:PORT], got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.https = parts.scheme == "https"
        self.base = parts.path.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    # -- attention ---------------------------------------------------------------
    def attention(self, q: Any, k: Any = None, v: Any = None, contexts: Sequence[str] | None = None, *,
                  q_pos: Any = None, k_pos: Any = None, alibi_slopes: Any = None, scale: float | None = None,
                  causal: bool | None = None, window: tuple[int | None, int | None] | None = None,
                  softcap: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(out [n_q, h_q, d_v], lse [n_q, h_q])`` of ``q`` over inline ``k, v`` and/or ``contexts``."""
        tensors = {"q": q, "k": k, "v": v, "q_pos": q_pos, "k_pos": k_pos, "alibi_slopes": alibi_slopes}
        query = _query({"scale": scale, "causal": causal, "window": window, "softcap": softcap,
                        "contexts": list(contexts) if contexts else None})
        body = self._request("POST", "/v1/attention", query, tensors)
        res = decode_safetensors(body, {"out", "lse"})
        return np.array(res["out"]), np.array(res["lse"])

    # -- contexts ----------------------------------------------------------------
    def create_context(self, k: Any, v: Any, k_pos: Any = None, *, replicas: int | None = None,
                       shards: int | None = None) -> dict:
        query = _query({"replicas": replicas, "shards": shards})
        return json.loads(self._request("POST", "/v1/contexts", query, {"k": k, "v": v, "k_pos": k_pos}))

    def append(self, context_id: str, k: Any, v: Any, k_pos: Any = None) -> dict:
        return json.loads(self._request("POST", f"/v1/contexts/{context_id}/append", "", {"k": k, "v": v, "k_pos": k_pos}))

    def get_context(self, context_id: str) -> dict:
        return json.loads(self._request("GET", f"/v1/contexts/{context_id}"))

    def list_contexts(self) -> list[dict]:
        return json.loads(self._request("GET", "/v1/contexts"))["contexts"]

    def delete_context(self, context_id: str) -> dict:
        return json.loads(self._request("DELETE", f"/v1/contexts/{context_id}"))

    def cluster(self) -> dict:
        return json.loads(self._request("GET", "/v1/cluster"))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport ---------------------------------------------------------------
    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self._conn = cls(self.host, self.port, timeout=self.timeout)
        return self._conn

    def _request(self, method: str, path: str, query: str = "", tensors: Mapping[str, Any] | None = None) -> bytes:
        headers = {"Accept": BINARY + ", application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body: list[Any] | None = None
        if tensors is not None:
            arrays = {n: np.asarray(a) for n, a in tensors.items() if a is not None}
            body = encode_safetensors(arrays)
            headers["Content-Type"] = BINARY
            headers["Content-Length"] = str(sum(memoryview(b).nbytes for b in body))
        url = self.base + path + (f"?{query}" if query else "")
        for attempt in (0, 1):
            conn = self._connection()
            try:
                conn.request(method, url, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # A keep-alive connection the server closed while idle: reconnect once.
                self.close()
                if attempt:
                    raise
        if resp.status >= 400:
            try:
                err = json.loads(data)
                raise SplitkeyError(resp.status, err.get("code", ""), err.get("detail", ""))
            except (ValueError, AttributeError):
                raise SplitkeyError(resp.status, "", data[:200].decode(errors="replace")) from None
        return data
