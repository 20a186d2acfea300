"""Malformed requests for tests/e2e/test_service_fuzz.py, built in code (no binary fixtures).

* :class:`Probe`: one request and the answer the contract (docs/API.md sections 6-8,
  docs/KSERVE.md) promises for it: a status, and the error code where it is clear.
* Corpora: :func:`safetensors_probes`, :func:`json_probes`, :func:`kserve_probes`,
  :func:`context_probes` (creates, appends to a stored context, near-miss ids). ``ctx``
  is the id of a stored context the probes aim at and must leave unchanged.
* Raw HTTP: :func:`raw_exchange` for requests httpx refuses to send (a bogus
  ``Content-Length``, chunked bodies over the limit).
* Hypothesis strategies for structured fuzzing of the binary formats:
  :func:`safetensors_requests` and :func:`kserve_requests` draw bodies that are mostly
  well framed, with dtypes, shapes, offsets, sizes and values pushed to their edges.
* Probes the fuzzing found wrong answers for, kept apart so that each bug has its own test:
  :func:`zero_element_probes`, :func:`kserve_timeout_probes`, :func:`deep_value_probes`,
  :func:`encoded_v1_probes`.
* :func:`answer_problem`: the one property every answer must have (success, or a JSON
  error of the contract), as a description of what is wrong, or None.
"""

from __future__ import annotations

import gzip
import json
import math
import select
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from expect import CONTRACT_STATUS
from hypothesis import strategies as st
from server import read_response

from workers import BFLOAT16

ATTENTION = "/v1/attention"
CONTEXTS = "/v1/contexts"
INFER = "/v2/models/attention/infer"
OCTET = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}
#: Statuses at or above 500 the contract documents for a client's request, by path prefix: a context
#: write that does not fit a worker's memory budget is 507 ``insufficient_capacity`` (docs/API.md
#: section 7), e.g. a create with a huge ``expected_length``. Nothing else may be 5xx.
DOCUMENTED_5XX = {CONTEXTS: {507: "insufficient_capacity"}}


# -- what every answer must be ---------------------------------------------------------------

def answer_problem(path: str, status: int, content_type: str | None, body: bytes) -> str | None:
    """None if the answer is a success or an error the contract allows, else what is wrong with it.

    Any status below 400 is a success here. A 4xx (and a documented 5xx) must be
    ``application/json`` holding ``{"detail": str, "code": str}`` with the code's own status
    from the contract's table (tests/expect.py), plus ``"error" == detail`` on the KServe routes,
    a path or method that does not exist included.
    """
    if status < 400:
        return None
    documented = next((codes for prefix, codes in DOCUMENTED_5XX.items() if path.startswith(prefix)), {})
    if status >= 500 and status not in documented:
        return f"status {status}: a client's request must never be answered with a server error"
    if (content_type or "").split(";")[0].strip().lower() != "application/json":
        return f"status {status} with Content-Type {content_type!r}: an error must be application/json"
    try:
        doc = json.loads(body)
    except ValueError:
        return f"status {status}: the error body is not JSON"
    if not isinstance(doc, dict) or not isinstance(doc.get("detail"), str):
        return f"status {status}: the error body must be an object with a string detail, got {doc!r:.200}"
    if "code" not in doc:  # a path or method that does not exist too (route_not_found, method_not_allowed)
        return f"status {status}: the error body has no code: {doc!r:.200}"
    code = doc["code"]
    if CONTRACT_STATUS.get(code) != status:
        return f"status {status} with code {code!r}: the contract gives that code status {CONTRACT_STATUS.get(code)}"
    if status >= 500 and documented.get(status) != code:
        return f"status {status} with code {code!r}: not a documented answer on {path}"
    if path.startswith("/v2") and doc.get("error") != doc["detail"]:
        return f"status {status}: a KServe error must carry error == detail, got {doc!r:.200}"
    return None


def error_code(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc.get("code") if isinstance(doc, dict) else None


# -- one request and what it must get ---------------------------------------------------------

@dataclass(frozen=True)
class Probe:
    """A request and its expected answer; ``{ctx}`` in ``path`` or ``params`` is the stored context's id."""

    name: str
    method: str
    path: str
    body: bytes = b""
    headers: Mapping[str, str | bytes] = field(default_factory=dict)
    params: Sequence[tuple[str, str]] = ()
    status: int | tuple[int, ...] = 400
    code: str | None = None

    def statuses(self) -> tuple[int, ...]:
        return self.status if isinstance(self.status, tuple) else (self.status,)

    def describe(self, ctx: str) -> str:
        params = [(k, v.format(ctx=ctx)) for k, v in self.params]
        return (f"{self.name}: {self.method} {self.path.format(ctx=ctx)} params={params} headers={dict(self.headers)} "
                f"body[:160]={self.body[:160]!r} ({len(self.body)} bytes)")


def post(name: str, path: str, body: bytes, headers: Mapping[str, str | bytes], status: int | tuple[int, ...],
         code: str | None = None, params: Sequence[tuple[str, str]] = ()) -> Probe:
    return Probe(name, "POST", path, body, headers, params, status, code)


# -- safetensors ------------------------------------------------------------------------------

#: safetensors dtype code of each numpy dtype the service takes.
ST_CODES = {np.dtype(np.float16): "F16", np.dtype(BFLOAT16): "BF16", np.dtype(np.float32): "F32",
            np.dtype(np.float64): "F64", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}
ST_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I32": 4, "I64": 8}


def raw_bytes(a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a)
    return (a.view(np.uint16) if a.dtype == BFLOAT16 else a.astype(a.dtype.newbyteorder("<"))).tobytes()


def st_layout(tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, Any], bytes]:
    """A correct header (as a dict, to be broken by the caller) and the data section, in the given order."""
    header: dict[str, Any] = {}
    data, offset = [], 0
    for name, a in tensors.items():
        b = raw_bytes(a)
        header[name] = {"dtype": ST_CODES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        data.append(b)
        offset += len(b)
    return header, b"".join(data)


def st_body(header: Any, data: bytes = b"", *, header_text: bytes | None = None, length: int | None = None) -> bytes:
    """``u64 length`` + header JSON (or ``header_text`` as given) + data; ``length`` overrides the length field."""
    text = json.dumps(header, allow_nan=True).encode() if header_text is None else header_text
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def qkv(n_q: int = 2, h_q: int = 4, h_kv: int = 2, d: int = 8, d_v: int = 8, n_k: int = 16,
        dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Small, well-formed attention tensors (deterministic values)."""
    def ramp(*shape: int) -> np.ndarray:
        return (np.arange(math.prod(shape), dtype=np.float64).reshape(shape) % 7 / 7 - 0.5).astype(dtype)
    return {"q": ramp(n_q, h_q, d), "k": ramp(n_k, h_kv, d), "v": ramp(n_k, h_kv, d_v)}


def with_entry(header: dict[str, Any], name: str, **changes: Any) -> dict[str, Any]:
    return {**header, name: {**header[name], **changes}}


def safetensors_probes() -> list[Probe]:
    """Malformed safetensors bodies on /v1/attention (docs/API.md section 6.2): framing, header, tensors, options."""
    t = qkv()
    header, data = st_layout(t)
    q_end, k_end = header["q"]["data_offsets"][1], header["k"]["data_offsets"][1]

    def bad(name: str, body: bytes, status: int | tuple[int, ...], code: str | None = None,
            params: Sequence[tuple[str, str]] = ()) -> Probe:
        return post("safetensors " + name, ATTENTION, body, OCTET, status, code, params)

    def body_with(**tensors: np.ndarray) -> bytes:
        return st_body(*st_layout(tensors))

    q, k, v = t["q"], t["k"], t["v"]
    nan_q = q.copy()
    nan_q[1, 2, 3] = np.nan
    inf_k = k.astype(np.float64)
    inf_k[0, 0, 0] = -np.inf
    f16_v = v.astype(np.float16)
    f16_v.view(np.uint16)[3, 1, 2] = 0x7E00  # a float16 NaN
    bf16_k = k.astype(BFLOAT16)
    bf16_k.view(np.uint16)[5, 0, 1] = 0x7F80  # bfloat16 +inf
    big = 2**20
    probes = [
        # framing: the length field and the header against the body
        bad("empty body", b"", 400, "invalid_body"),
        bad("seven bytes", b"\x10\x00\x00\x00\x00\x00\x00", 400, "invalid_body"),
        bad("truncated header", st_body(header, data)[:40], 400, "invalid_body"),
        bad("truncated data", st_body(header, data)[:-1], 400, "invalid_body"),
        bad("header length past the body", st_body(header, data, length=len(json.dumps(header)) + len(data) + 1),
            400, "invalid_body"),
        bad("header length 2**64-1", st_body(header, data, length=2**64 - 1), 400, "invalid_body"),
        bad("header length short of the JSON", st_body(header, data, length=len(json.dumps(header)) - 1),
            400, "invalid_body"),
        bad("header over 1 MiB", st_body({}, header_text=b" " * (2**20 + 8)), 413, "body_too_large"),
        bad("header not UTF-8", st_body(None, data, header_text=b"\xff\xfe{}"), 400, "invalid_body"),
        bad("header not JSON", st_body(None, data, header_text=b"{'q': 1}"), 400, "invalid_body"),
        bad("header JSON array", st_body([header], data), 400, "invalid_body"),
        bad("header JSON string", st_body("q", data), 400, "invalid_body"),
        bad("header JSON null", st_body(None, data), 400, "invalid_body"),
        bad("header nested 100k deep", st_body(None, header_text=b"[" * 100_000 + b"]" * 100_000), 400, "invalid_body"),
        bad("header with a repeated key", st_body(None, data, header_text=json.dumps(header).encode()[:-1]
                                                  + b', "q": ' + json.dumps(header["q"]).encode() + b"}"),
            400, "invalid_body"),
        bad("metadata not strings", st_body({"__metadata__": {"a": 1}, **header}, data), 400, "invalid_body"),
        bad("metadata a list", st_body({"__metadata__": ["a"], **header}, data), 400, "invalid_body"),
        # header entries
        bad("entry not an object", st_body({**header, "q": [1, 2]}, data), 400, "invalid_body"),
        bad("entry without offsets", st_body({**header, "q": {"dtype": "F32", "shape": [2, 4, 8]}}, data),
            400, "invalid_body"),
        bad("entry with an extra key", st_body(with_entry(header, "q", extra=1), data), 400, "invalid_body"),
        bad("unknown dtype F8_E4M3", st_body(with_entry(header, "q", dtype="F8_E4M3"), data), 422, "invalid_tensor"),
        bad("unknown dtype U8", st_body(with_entry(header, "q", dtype="U8"), data), 422, "invalid_tensor"),
        bad("lower-case dtype", st_body(with_entry(header, "q", dtype="f32"), data), 422, "invalid_tensor"),
        bad("dtype a number", st_body(with_entry(header, "q", dtype=32), data), 422, "invalid_tensor"),
        bad("q as I32", st_body(with_entry(header, "q", dtype="I32"), data), 422, "invalid_tensor"),
        bad("negative dim", st_body(with_entry(header, "q", shape=[2, -4, -8]), data), 400, "invalid_body"),
        bad("float dim", st_body(with_entry(header, "q", shape=[2, 4.0, 8]), data), 400, "invalid_body"),
        bad("bool dim", st_body(with_entry(header, "q", shape=[True, 4, 8]), data), 400, "invalid_body"),
        bad("shape a string", st_body(with_entry(header, "q", shape="2,4,8"), data), 400, "invalid_body"),
        bad("rank 2 q", st_body(with_entry(header, "q", shape=[8, 8]), data), 422, "invalid_tensor"),
        bad("rank 4 k", st_body(with_entry(header, "k", shape=[16, 2, 8, 1]), data), 422, "invalid_tensor"),
        # offsets
        bad("offsets reversed", st_body(with_entry(header, "q", data_offsets=[q_end, 0]), data), 400, "invalid_body"),
        bad("offsets overlapping", st_body(with_entry(header, "k", data_offsets=[q_end - 8, k_end - 8]), data),
            400, "invalid_body"),
        bad("offsets past the data", st_body(with_entry(header, "v", data_offsets=[k_end, len(data) + 8]), data),
            400, "invalid_body"),
        bad("offsets leave a gap",
            st_body(with_entry(header, "k", data_offsets=[q_end + 8, k_end + 8]), data + b"\0" * 8),
            400, "invalid_body"),
        bad("trailing data bytes", st_body(header, data + b"\0" * 4), 400, "invalid_body"),
        bad("negative offsets", st_body(with_entry(header, "q", data_offsets=[-8, q_end - 8]), data),
            400, "invalid_body"),
        bad("float offsets", st_body(with_entry(header, "q", data_offsets=[0.0, float(q_end)]), data),
            400, "invalid_body"),
        bad("three offsets", st_body(with_entry(header, "q", data_offsets=[0, q_end, q_end]), data),
            400, "invalid_body"),
        bad("offsets 2**64", st_body(with_entry(header, "v", data_offsets=[k_end, 2**64]), data), 400, "invalid_body"),
        bad("byte count below the shape", st_body(with_entry(header, "q", shape=[4, 4, 8]), data), 400, "invalid_body"),
        bad("byte count over the shape", st_body(with_entry(header, "q", shape=[1, 4, 8]), data), 400, "invalid_body"),
        bad("F64 label on F32 bytes", st_body(with_entry(header, "q", dtype="F64"), data), 400, "invalid_body"),
        # huge shapes: the element limit (2**28) before any byte is looked at, then the data section
        bad("2**60 elements with consistent offsets",
            st_body(with_entry(header, "v", shape=[big, big, big], data_offsets=[k_end, k_end + 4 * big**3]), data),
            413, "body_too_large"),
        bad("product beyond int64 with consistent offsets",
            st_body(with_entry(header, "v", shape=[2**32, 2**32, 2**32], data_offsets=[k_end, k_end + 4 * 2**96]),
                    data),
            413, "body_too_large"),
        bad("2**28 elements, bytes missing",
            st_body(with_entry(header, "v", shape=[2**14, 2**7, 2**7], data_offsets=[k_end, k_end + 4 * 2**28]), data),
            400, "invalid_body"),
        bad("huge shape, offsets of the small one", st_body(with_entry(header, "q", shape=[big, big, 8]), data),
            400, "invalid_body"),
        # values the service refuses (docs/API.md section 2: NaN and infinities in q, k, v)
        bad("NaN in q F32", body_with(q=nan_q, k=k, v=v), 422, "invalid_tensor"),
        bad("-inf in k F64", body_with(q=q, k=inf_k, v=v), 422, "invalid_tensor"),
        bad("NaN in v F16", body_with(q=q, k=k, v=f16_v), 422, "invalid_tensor"),
        bad("+inf in k BF16", body_with(q=q, k=bf16_k, v=v), 422, "invalid_tensor"),
        bad("NaN alibi slope", body_with(q=q, k=k, v=v, alibi_slopes=np.array([0.5, np.nan, 0.5, 0.5])), 422),
        bad("q_pos past 2**61", body_with(q=q, k=k, v=v, q_pos=np.array([0, 2**61 + 1], np.int64)),
            422, "invalid_tensor"),
        bad("k_pos below -2**61", body_with(q=q, k=k, v=v, k_pos=np.full(16, -(2**61) - 1, np.int64)),
            422, "invalid_tensor"),
        bad("q_pos as F32", body_with(q=q, k=k, v=v, q_pos=np.zeros(2, np.float32)), 422, "invalid_tensor"),
        bad("q_pos of the wrong length", body_with(q=q, k=k, v=v, q_pos=np.zeros(3, np.int64)), 422, "invalid_tensor"),
        # tensors missing, extra or not fitting together
        bad("no q", body_with(k=k, v=v), 422, "invalid_tensor"),
        bad("k without v", body_with(q=q, k=k), 422, "invalid_tensor"),
        bad("no keys and no contexts", body_with(q=q), 422, "invalid_tensor"),
        bad("extra tensor", body_with(q=q, k=k, v=v, x=q), 422, "invalid_tensor"),
        bad("h_q not a multiple of h_kv", body_with(q=np.zeros((2, 3, 8), np.float32), k=k, v=v),
            422, "invalid_tensor"),
        bad("d of q and k differ", body_with(q=np.zeros((2, 4, 4), np.float32), k=k, v=v), 422, "invalid_tensor"),
        bad("n_k of k and v differ", body_with(q=q, k=k, v=v[:15]), 422, "invalid_tensor"),
        bad("d = 0", body_with(q=np.zeros((2, 4, 0), np.float32), k=np.zeros((16, 2, 0), np.float32), v=v),
            422, "invalid_tensor"),
        # options in the URL query (docs/API.md section 6.3)
        bad("scale nan", st_body(header, data), 422, "invalid_option", [("scale", "nan")]),
        bad("scale inf", st_body(header, data), 422, "invalid_option", [("scale", "inf")]),
        bad("scale 1e9999", st_body(header, data), 422, "invalid_option", [("scale", "1e9999")]),
        bad("scale 0", st_body(header, data), 422, "invalid_option", [("scale", "0")]),
        bad("scale +1", st_body(header, data), 422, "invalid_option", [("scale", "+1")]),
        bad("scale twice", st_body(header, data), 422, "invalid_option", [("scale", "1"), ("scale", "2")]),
        bad("causal True", st_body(header, data), 422, "invalid_option", [("causal", "True")]),
        bad("window three sides", st_body(header, data), 422, "invalid_option", [("window", "1,2,3")]),
        bad("window negative", st_body(header, data), 422, "invalid_option", [("window", "-1,")]),
        bad("window past 2**62", st_body(header, data), 422, "invalid_option", [("window", "99999999999999999999,")]),
        bad("softcap -1", st_body(header, data), 422, "invalid_option", [("softcap", "-1")]),
        bad("unknown option", st_body(header, data), 422, "invalid_option", [("temperature", "0.7")]),
        bad("create option on a query", st_body(header, data), 422, "invalid_option", [("replicas", "1")]),
        bad("unknown context", st_body(header, data), 404, "context_not_found", [("contexts", "ctx_nope")]),
        bad("65 contexts", st_body(header, data), 422, "invalid_option",
            [("contexts", ",".join(f"c{i}" for i in range(65)))]),
        bad("repeated context", st_body(header, data), 422, "invalid_option", [("contexts", "{ctx},{ctx}")]),
        bad("context id with a slash", st_body(header, data), (404, 422), None, [("contexts", "a/b")]),
        bad("stored context of other dims", body_with(q=np.zeros((1, 4, 4), np.float32)), 422, "invalid_tensor",
            [("contexts", "{ctx}")]),
    ]
    return probes


# -- JSON -------------------------------------------------------------------------------------

def json_text(doc: Any) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


def json_probes() -> list[Probe]:
    """Malformed JSON bodies on /v1/attention (docs/API.md section 6.2): syntax, types, values, content types."""
    t = {name: a.tolist() for name, a in qkv(n_q=1, h_q=2, h_kv=1, d=2, d_v=2, n_k=3).items()}
    good = json_text(t)

    def bad(name: str, body: bytes, status: int | tuple[int, ...], code: str | None = None,
            headers: Mapping[str, str] = JSON) -> Probe:
        return post("json " + name, ATTENTION, body, headers, status, code)

    def fields(**changes: Any) -> bytes:
        return json_text({**t, **changes})

    def literal(name: str, text: str) -> bytes:  # a field whose value is JSON text json.dumps cannot write
        return json_text({**t, name: "@literal@"}).replace(b'"@literal@"', text.encode())

    probes = [
        # syntax
        bad("empty body", b"", 400, "invalid_body"),
        bad("truncated", good[: len(good) // 2], 400, "invalid_body"),
        bad("trailing garbage", good + b"}", 400, "invalid_body"),
        bad("not an object", b"[1, 2]", 400, "invalid_body"),
        bad("a bare string", b'"q"', 400, "invalid_body"),
        bad("100k nested lists", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_body"),
        bad("100k nested objects", b'{"q":' * 100_000 + b"1" + b"}" * 100_000, 400, "invalid_body"),
        bad("100k nested lists in q", b'{"q": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_body"),
        bad("repeated key", good[:-1] + b', "q": [[[1.0]]]}', 400, "invalid_body"),
        bad("not UTF-8", good.replace(b'"q"', b'"\xff"'), 400, "invalid_body"),
        bad("UTF-16", good.decode().encode("utf-16"), 400, "invalid_body"),
        bad("an int of 5000 digits", literal("scale", "1" * 5000), 400, "invalid_body"),
        # values JSON can spell but the contract refuses
        bad("NaN in q", fields(q=[[[float("nan"), 1.0], [1.0, 1.0]]]), 422, "invalid_tensor"),
        bad("Infinity in k", fields(k=[[[float("inf"), 1.0]]] * 3), 422, "invalid_tensor"),
        bad("-Infinity in v", fields(v=[[[float("-inf"), 1.0]]] * 3), 422, "invalid_tensor"),
        bad("1e400 in q", literal("k", "[[[1e400, 1]], [[1, 1]], [[1, 1]]]"), 422, "invalid_tensor"),
        bad("10**400 in q", literal("k", "[[[1" + "0" * 400 + ", 1]], [[1, 1]], [[1, 1]]]"), 422, "invalid_tensor"),
        bad("70000 as float16", fields(dtype="float16", v=[[[70000.0, 1.0]]] * 3), 422, "invalid_tensor"),
        bad("NaN scale", fields(scale=float("nan")), 422, "invalid_option"),
        bad("Infinity softcap", fields(softcap=float("inf")), 422, "invalid_option"),
        bad("scale 10**400", literal("scale", "1" + "0" * 400), 422, "invalid_option"),
        bad("scale 1e400", literal("scale", "1e400"), 422, "invalid_option"),
        bad("scale 0", fields(scale=0), 422, "invalid_option"),
        bad("NaN alibi slope", fields(alibi_slopes=[float("nan"), 0.5]), 422),
        bad("q_pos 10**400", literal("q_pos", "[1" + "0" * 400 + "]"), 422, "invalid_tensor"),
        bad("q_pos past 2**61", fields(q_pos=[2**61 + 1]), 422, "invalid_tensor"),
        bad("window past 2**62", fields(window=[2**62 + 1, None]), 422, "invalid_option"),
        bad("window 10**400", literal("window", "[1" + "0" * 400 + ", null]"), 422, "invalid_option"),
        # wrong types
        bad("q a string", fields(q="[[[1.0]]]"), 422, "invalid_tensor"),
        bad("q an object", fields(q={"data": [1.0]}), 422, "invalid_tensor"),
        bad("q a number", fields(q=1.0), 422, "invalid_tensor"),
        bad("bools in q", fields(q=[[[True, False], [True, True]]]), 422, "invalid_tensor"),
        bad("strings in q", fields(q=[[["1.0", "2.0"], ["1.0", "2.0"]]]), 422, "invalid_tensor"),
        bad("nulls in q", fields(q=[[[None, 1.0], [1.0, 1.0]]]), 422, "invalid_tensor"),
        bad("ragged q", fields(q=[[[1.0, 2.0], [1.0]]]), 422, "invalid_tensor"),
        bad("ragged k rows", fields(k=[[[1.0, 2.0]], [[1.0, 2.0], [3.0, 4.0]], [[1.0, 2.0]]]), 422, "invalid_tensor"),
        bad("rank 2 q", fields(q=[[1.0, 2.0]]), 422, "invalid_tensor"),
        bad("rank 4 q", fields(q=[[[[1.0, 2.0]]]]), 422, "invalid_tensor"),
        bad("empty inner axis", fields(q=[[]]), 422, "invalid_tensor"),
        bad("q_pos floats", fields(q_pos=[1.5]), 422, "invalid_tensor"),
        bad("q_pos bools", fields(q_pos=[True]), 422, "invalid_tensor"),
        bad("causal a string", fields(causal="yes"), 422, "invalid_option"),
        bad("causal 1", fields(causal=1), 422, "invalid_option"),
        bad("scale a string", fields(scale="0.5"), 422, "invalid_option"),
        bad("scale true", fields(scale=True), 422, "invalid_option"),
        bad("window a string", fields(window="128,"), 422, "invalid_option"),
        bad("window of three", fields(window=[1, 2, 3]), 422, "invalid_option"),
        bad("window floats", fields(window=[1.5, None]), 422, "invalid_option"),
        bad("window negative", fields(window=[-1, None]), 422, "invalid_option"),
        bad("contexts a string", fields(contexts="ctx_a"), 422, "invalid_option"),
        bad("contexts of numbers", fields(contexts=[1, 2]), 422, "invalid_option"),
        bad("dtype int8", fields(dtype="int8"), 422, "invalid_option"),
        bad("dtype a number", fields(dtype=32), 422, "invalid_option"),
        bad("unknown field", fields(temperature=0.7), 422, "invalid_option"),
        bad("unknown tensor name", fields(keys=t["k"]), 422),
        bad("create option", fields(replicas=1), 422, "invalid_option"),
        bad("null q", fields(q=None), 422, "invalid_tensor"),
        bad("k without v", fields(v=None), 422, "invalid_tensor"),
        bad("h_q not a multiple of h_kv", fields(k=[[[1.0, 2.0], [1.0, 2.0]]] * 3, v=[[[1.0, 2.0], [1.0, 2.0]]] * 3,
                                                q=[[[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]]), 422, "invalid_tensor"),
        bad("unknown context", fields(contexts=["ctx_nope"]), 404, "context_not_found"),
        # content types (docs/API.md section 6.2)
        bad("no Content-Type", good, 415, "unsupported_media_type", headers={}),
        bad("text/plain", good, 415, "unsupported_media_type", headers={"Content-Type": "text/plain"}),
        bad("multipart", b"--x\r\nContent-Disposition: form-data; name=\"q\"\r\n\r\n1\r\n--x--\r\n", 415,
            "unsupported_media_type", headers={"Content-Type": "multipart/form-data; boundary=x"}),
        bad("form-urlencoded", b"q=1", 415, "unsupported_media_type",
            headers={"Content-Type": "application/x-www-form-urlencoded"}),
        bad("charset latin-1", good, 415, "unsupported_media_type",
            headers={"Content-Type": "application/json; charset=latin-1"}),
        bad("charset utf-16", good.decode().encode("utf-16"), 415, "unsupported_media_type",
            headers={"Content-Type": "application/json; charset=utf-16"}),
        bad("application/jsonx", good, 415, "unsupported_media_type", headers={"Content-Type": "application/jsonx"}),
        bad("Content-Type of parameters only", good, 415, "unsupported_media_type",
            headers={"Content-Type": "; charset=utf-8"}),
        bad("JSON sent as octet-stream", good, 400, "invalid_body", headers=OCTET),
        bad("gzip-compressed JSON", gzip.compress(good), (400, 415), None,
            headers={**JSON, "Content-Encoding": "gzip"}),
    ]
    return probes


# -- contexts ---------------------------------------------------------------------------------

def context_probes(ctx: str) -> list[Probe]:
    """Malformed creates, appends aimed at the stored context ``ctx``, and ids that nearly name it."""
    kv = {name: a.tolist() for name, a in qkv(h_kv=2, d=8, d_v=8, n_k=4).items() if name != "q"}
    k, v = kv["k"], kv["v"]
    append = f"{CONTEXTS}/{ctx}/append"

    def create(name: str, body: bytes, status: int | tuple[int, ...], code: str | None = None,
               headers: Mapping[str, str] = JSON, params: Sequence[tuple[str, str]] = ()) -> Probe:
        return post("create " + name, CONTEXTS, body, headers, status, code, params)

    def to_ctx(name: str, body: bytes, status: int | tuple[int, ...], code: str | None = None,
               headers: Mapping[str, str] = JSON, params: Sequence[tuple[str, str]] = ()) -> Probe:
        return post("append " + name, append, body, headers, status, code, params)

    st_header, st_data = st_layout({"k": np.zeros((4, 2, 8), np.float32), "v": np.zeros((4, 2, 8), np.float32)})
    f16 = st_body(*st_layout({"k": np.zeros((4, 2, 8), np.float16), "v": np.zeros((4, 2, 8), np.float16)}))
    mixed = st_body(*st_layout({"k": np.zeros((4, 2, 8), np.float32), "v": np.zeros((4, 2, 8), np.float16)}))
    nan_k = json_text({"k": [[[float("nan")] * 8] * 2] * 4, "v": v})
    probes = [
        create("truncated", json_text(kv)[:30], 400, "invalid_body"),
        create("not an object", b"[]", 400, "invalid_body"),
        create("k without v", json_text({"k": k}), 422, "invalid_tensor"),
        create("no tensors", b"{}", 422, "invalid_tensor"),
        create("a query tensor", json_text({**kv, "q": k}), 422, "invalid_tensor"),
        create("NaN in k", nan_k, 422, "invalid_tensor"),
        create("replicas 0", json_text({**kv, "replicas": 0}), 422, "invalid_option"),
        create("replicas past the workers", json_text({**kv, "replicas": 9}), 422, "invalid_option"),
        create("replicas a string", json_text({**kv, "replicas": "1"}), 422, "invalid_option"),
        create("replicas 1.0", json_text({**kv, "replicas": 1.0}), 422, "invalid_option"),
        create("shards 0", json_text({**kv, "shards": 0}), 422, "invalid_option"),
        create("shards 1025", json_text({**kv, "shards": 1025}), 422, "invalid_option"),
        create("shards past the keys", json_text({**kv, "shards": 5}), 422, "invalid_option"),
        create("expected_length below the keys", json_text({**kv, "expected_length": 3}), 422, "invalid_option"),
        create("expected_length past 2**62", json_text({**kv, "expected_length": 2**62 + 1}), 422, "invalid_option"),
        create("expected_length 10**400", json_text(kv)[:-1] + b', "expected_length": 1' + b"0" * 400 + b"}",
               422, "invalid_option"),
        create("an append option", json_text({**kv, "after": 0}), 422, "invalid_option"),
        create("k_pos of the wrong length", json_text({**kv, "k_pos": [0, 1]}), 422, "invalid_tensor"),
        create("k_pos past 2**61", json_text({**kv, "k_pos": [0, 1, 2, 2**61 + 1]}), 422, "invalid_tensor"),
        create("safetensors k, v of two dtypes", mixed, 422, "invalid_tensor", OCTET),
        create("safetensors replicas=abc", st_body(st_header, st_data), 422, "invalid_option", OCTET,
               [("replicas", "abc")]),
        create("safetensors shards=0", st_body(st_header, st_data), 422, "invalid_option", OCTET, [("shards", "0")]),
        create("safetensors expected_length=-1", st_body(st_header, st_data), 422, "invalid_option", OCTET,
               [("expected_length", "-1")]),
        create("safetensors unknown option", st_body(st_header, st_data), 422, "invalid_option", OCTET,
               [("scale", "1")]),
        create("safetensors offsets overlap", st_body(with_entry(st_header, "v", data_offsets=[64, 64 + 256]),
                                                      st_data), 400, "invalid_body", OCTET),
        create("no Content-Type", json_text(kv), 415, "unsupported_media_type", {}),
        # appends to the stored context: every one must leave it as it was
        to_ctx("truncated", json_text(kv)[:-2], 400, "invalid_body"),
        to_ctx("float64 onto float32", json_text({**kv, "dtype": "float64"}), 422, "invalid_tensor"),
        to_ctx("float16 safetensors onto float32", f16, 422, "invalid_tensor", OCTET),
        to_ctx("other d", json_text({"k": [[[1.0] * 4] * 2] * 4, "v": v}), 422, "invalid_tensor"),
        to_ctx("other d_v", json_text({"k": k, "v": [[[1.0] * 4] * 2] * 4}), 422, "invalid_tensor"),
        to_ctx("other h_kv", json_text({"k": [[[1.0] * 8]] * 4, "v": [[[1.0] * 8]] * 4}), 422, "invalid_tensor"),
        to_ctx("NaN in k", nan_k, 422, "invalid_tensor"),
        to_ctx("Infinity in v", json_text({"k": k, "v": [[[float("inf")] * 8] * 2] * 4}), 422, "invalid_tensor"),
        to_ctx("k_pos past 2**61", json_text({**kv, "k_pos": [2**61 + 1] * 4}), 422, "invalid_tensor"),
        to_ctx("after a wrong length", json_text({**kv, "after": 10**6}), 409, "length_mismatch"),
        to_ctx("after -1", json_text({**kv, "after": -1}), 422, "invalid_option"),
        to_ctx("after a string", json_text({**kv, "after": "0"}), 422, "invalid_option"),
        to_ctx("after past 2**62", json_text({**kv, "after": 2**62 + 1}), 422, "invalid_option"),
        to_ctx("a create option", json_text({**kv, "replicas": 1}), 422, "invalid_option"),
        to_ctx("safetensors after=x", st_body(st_header, st_data), 422, "invalid_option", OCTET, [("after", "x")]),
        to_ctx("safetensors after twice", st_body(st_header, st_data), 422, "invalid_option", OCTET,
               [("after", "0"), ("after", "0")]),
        to_ctx("safetensors after a wrong length", st_body(st_header, st_data), 409, "length_mismatch", OCTET,
               [("after", "999999")]),
        to_ctx("safetensors truncated", st_body(st_header, st_data)[:-3], 400, "invalid_body", OCTET),
        to_ctx("text/plain", json_text(kv), 415, "unsupported_media_type", {"Content-Type": "text/plain"}),
        to_ctx("no body", b"", 400, "invalid_body"),
    ]
    # ids that nearly name the stored context: never it (docs/API.md section 6.5, 7)
    near = [ctx + "x", ctx[:-1], ctx.upper() if ctx.upper() != ctx else ctx.lower(), ctx + "%00", ctx + "%20",
            "%2E%2E", "ctx_" + "A" * 200, ctx + "%2Fappend", "ctx_%E2%82%AC", "%00"]
    for i, other in enumerate(near):
        # an escaped slash is routed as a slash: {ctx}/append exists, for POST only (405)
        status = (404, 405) if "%2F" in other else 404
        probes.append(Probe(f"GET near-miss id {i}", "GET", f"{CONTEXTS}/{other}", status=status))
        probes.append(Probe(f"DELETE near-miss id {i}", "DELETE", f"{CONTEXTS}/{other}", status=status))
        probes.append(post(f"append to near-miss id {i}", f"{CONTEXTS}/{other}/append", json_text(kv), JSON, 404))
    probes.append(Probe("DELETE on the append path", "DELETE", append, status=405))
    probes.append(Probe("PUT on the context", "PUT", f"{CONTEXTS}/{ctx}", json_text(kv), JSON, status=405))
    return probes


# -- KServe v2 --------------------------------------------------------------------------------

def kserve_input(name: str, a: np.ndarray, *, binary: bool = False) -> dict[str, Any]:
    datatype = {"F16": "FP16", "BF16": "BF16", "F32": "FP32", "F64": "FP64", "I32": "INT32", "I64": "INT64"}[
        ST_CODES[a.dtype]]
    entry: dict[str, Any] = {"name": name, "shape": list(a.shape), "datatype": datatype}
    if binary:
        entry["parameters"] = {"binary_data_size": a.nbytes}
    else:
        entry["data"] = a.reshape(-1).astype(np.float64 if a.dtype.kind == "f" or a.dtype == BFLOAT16 else np.int64
                                             ).tolist()
    return entry


def kserve_probes() -> list[Probe]:
    """Malformed Open Inference Protocol requests (docs/KSERVE.md): structure, tensors, parameters, binary framing."""
    t = qkv(n_q=1, h_q=2, h_kv=1, d=2, d_v=2, n_k=3)
    inputs = [kserve_input(n, a) for n, a in t.items()]
    good = {"inputs": inputs}

    def bad(name: str, doc: Any, status: int | tuple[int, ...], code: str | None = None,
            headers: Mapping[str, str | bytes] = JSON, binary: bytes = b"", header_len: str | bytes | None = None
            ) -> Probe:
        text = doc if isinstance(doc, bytes) else json_text(doc)
        h = dict(headers)
        if header_len is not None:
            h["Inference-Header-Content-Length"] = header_len
        elif binary:
            h["Inference-Header-Content-Length"] = str(len(text))
        return post("kserve " + name, INFER, text + binary, h, status, code)

    def replace(i: int, **changes: Any) -> dict[str, Any]:
        entry = {**inputs[i], **changes}
        return {"inputs": inputs[:i] + [{k: v for k, v in entry.items() if v is not None}] + inputs[i + 1:]}

    def params(**p: Any) -> dict[str, Any]:
        return {**good, "parameters": p}

    bin_inputs = [kserve_input(n, a, binary=True) for n, a in t.items()]
    raw = b"".join(raw_bytes(a) for a in t.values())
    good_text = json_text(good)
    probes = [
        bad("empty body", b"", 400, "invalid_body"),
        bad("truncated", good_text[:-5], 400, "invalid_body"),
        bad("not an object", b"[]", 400, "invalid_body"),
        bad("no inputs", {}, 400, "invalid_body"),
        bad("inputs an object", {"inputs": {"q": 1}}, 400, "invalid_body"),
        bad("inputs empty", {"inputs": []}, 422, "invalid_tensor"),
        bad("unknown request key", {**good, "model": "attention"}, 400, "invalid_body"),
        bad("input a list", {"inputs": [[1, 2]]}, 400, "invalid_body"),
        bad("input without name", replace(0, name=None), 400, "invalid_body"),
        bad("input without shape", replace(0, shape=None), 400, "invalid_body"),
        bad("input without datatype", replace(0, datatype=None), 400, "invalid_body"),
        bad("input with an unknown key", replace(0, extra=1), 400, "invalid_body"),
        bad("unknown input name", replace(0, name="query"), 422, "invalid_tensor"),
        bad("repeated input", {"inputs": inputs + [inputs[0]]}, 422, "invalid_tensor"),
        bad("datatype FP8", replace(0, datatype="FP8"), 422, "invalid_tensor"),
        bad("datatype fp32", replace(0, datatype="fp32"), 422, "invalid_tensor"),
        bad("datatype INT8 for q", replace(0, datatype="INT8"), 422, "invalid_tensor"),
        bad("datatype BYTES", replace(0, datatype="BYTES"), 422, "invalid_tensor"),
        bad("datatype a number", replace(0, datatype=32), 400, "invalid_body"),
        bad("negative dim", replace(0, shape=[1, -2, 2]), 400, "invalid_body"),
        bad("float dim", replace(0, shape=[1, 2.0, 2]), 400, "invalid_body"),
        bad("shape a string", replace(0, shape="1,2,2"), 400, "invalid_body"),
        bad("rank 2 q", replace(0, shape=[2, 2]), 422, "invalid_tensor"),
        bad("more data than the shape", replace(0, data=[1.0] * 5), 422, "invalid_tensor"),
        bad("less data than the shape", replace(0, data=[1.0] * 3), 422, "invalid_tensor"),
        bad("nested data of another shape", replace(0, data=[[1.0, 1.0], [1.0, 1.0]]), 422, "invalid_tensor"),
        bad("ragged data", replace(0, data=[[[1.0, 1.0], [1.0]]]), 422, "invalid_tensor"),
        bad("data a string", replace(0, data="1,1,1,1"), 422, "invalid_tensor"),
        bad("strings in data", replace(0, data=["1", "1", "1", "1"]), 422, "invalid_tensor"),
        bad("bools in data", replace(0, data=[True, False, True, True]), 422, "invalid_tensor"),
        bad("NaN in data", replace(0, data=[float("nan"), 1.0, 1.0, 1.0]), 422, "invalid_tensor"),
        bad("1e400 in data", good_text.replace(b"[-0.5", b"[1e400", 1), 422, "invalid_tensor"),
        bad("70000 as FP16", replace(2, datatype="FP16", data=[70000.0] * 6), 422, "invalid_tensor"),
        bad("INT32 overflow", {"inputs": inputs + [{"name": "q_pos", "shape": [1], "datatype": "INT32",
                                                    "data": [2**31]}]}, 422, "invalid_tensor"),
        bad("q_pos as FP32", {"inputs": inputs + [{"name": "q_pos", "shape": [1], "datatype": "FP32",
                                                   "data": [1.0]}]}, 422, "invalid_tensor"),
        bad("2**60 elements", replace(0, shape=[2**20, 2**20, 2**20], data=[1.0]), 413, "body_too_large"),
        bad("head dims that do not fit", replace(0, shape=[1, 2, 1], data=[1.0] * 2), 422, "invalid_tensor"),
        bad("no q", {"inputs": inputs[1:]}, 422, "invalid_tensor"),
        bad("k without v", {"inputs": inputs[:2]}, 422, "invalid_tensor"),
        bad("both data and binary_data_size", replace(0, parameters={"binary_data_size": 16}), 400, "invalid_body"),
        bad("neither data nor binary_data_size", replace(0, data=None), 400, "invalid_body"),
        bad("shared-memory input parameter", replace(0, parameters={"shared_memory_region": "r"}), 422,
            "invalid_option"),
        bad("input parameters a list", replace(0, parameters=[1]), 400, "invalid_body"),
        # request parameters (docs/KSERVE.md "Options")
        bad("unknown parameter", params(temperature=0.7), 422, "invalid_option"),
        bad("sequence_id parameter", params(sequence_id=1), 422, "invalid_option"),
        bad("null parameter", params(scale=None), 422, "invalid_option"),
        bad("scale a string", params(scale="0.5"), 422, "invalid_option"),
        bad("scale 0", params(scale=0), 422, "invalid_option"),
        bad("causal a string", params(causal="true"), 422, "invalid_option"),
        bad("window an int", params(window=128), 422, "invalid_option"),
        bad("window ten", params(window="ten,"), 422, "invalid_option"),
        bad("contexts a list", params(contexts=["a"]), 422, "invalid_option"),
        bad("unknown context", params(contexts="ctx_nope"), 404, "context_not_found"),
        bad("binary_data_output a string", params(binary_data_output="true"), 422, "invalid_option"),
        bad("timeout -1", params(timeout=-1), 422, "invalid_option"),
        bad("timeout 1.5", params(timeout=1.5), 422, "invalid_option"),
        bad("priority -1", params(priority=-1), 422, "invalid_option"),
        bad("parameters a list", {**good, "parameters": [1]}, 400, "invalid_body"),
        bad("id a number", {**good, "id": 5}, 400, "invalid_body"),
        bad("id of 257 characters", {**good, "id": "i" * 257}, 400, "invalid_body"),
        bad("outputs an object", {**good, "outputs": {"name": "out"}}, 400, "invalid_body"),
        bad("unknown output", {**good, "outputs": [{"name": "attn"}]}, 422, "invalid_option"),
        bad("repeated output", {**good, "outputs": [{"name": "out"}, {"name": "out"}]}, 422, "invalid_option"),
        bad("classification output", {**good, "outputs": [{"name": "out", "parameters": {"classification": 2}}]},
            422, "invalid_option"),
        bad("binary_data a string", {**good, "outputs": [{"name": "out", "parameters": {"binary_data": "yes"}}]},
            422, "invalid_option"),
        # content encodings (docs/KSERVE.md: compressed requests are 415)
        bad("Content-Encoding gzip, plain body", good, 415, "unsupported_media_type",
            headers={**JSON, "Content-Encoding": "gzip"}),
        bad("Content-Encoding gzip, gzip body", gzip.compress(good_text), 415, "unsupported_media_type",
            headers={**JSON, "Content-Encoding": "gzip"}),
        bad("Content-Encoding deflate", good, 415, "unsupported_media_type",
            headers={**JSON, "Content-Encoding": "deflate"}),
        # the binary tensor extension
        bad("binary bytes short", {"inputs": bin_inputs}, 400, "invalid_body", binary=raw[:-4]),
        bad("binary bytes long", {"inputs": bin_inputs}, 400, "invalid_body", binary=raw + b"\0" * 4),
        bad("binary_data_size past the body", {"inputs": [{**bin_inputs[0], "parameters": {"binary_data_size": 2**40}},
                                                          *bin_inputs[1:]]}, 400, "invalid_body", binary=raw),
        bad("binary_data_size 2**70", {"inputs": [{**bin_inputs[0], "parameters": {"binary_data_size": 2**70}},
                                                  *bin_inputs[1:]]}, 400, "invalid_body", binary=raw),
        bad("binary_data_size negative", {"inputs": [{**bin_inputs[0], "parameters": {"binary_data_size": -16}},
                                                     *bin_inputs[1:]]}, 400, "invalid_body", binary=raw),
        bad("binary_data_size a float", {"inputs": [{**bin_inputs[0], "parameters": {"binary_data_size": 16.0}},
                                                    *bin_inputs[1:]]}, 400, "invalid_body", binary=raw),
        bad("binary_data_size off the shape", {"inputs": [{**bin_inputs[0], "shape": [1, 2, 1]}, *bin_inputs[1:]]},
            400, "invalid_body", binary=raw),
        bad("binary NaN in q", {"inputs": bin_inputs},
            422, "invalid_tensor", binary=struct.pack("<f", float("nan")) + raw[4:]),
        bad("header length past the body", {"inputs": bin_inputs}, 400, "invalid_body", binary=raw,
            header_len=str(10**6)),
        bad("header length not a number", {"inputs": bin_inputs}, 400, "invalid_body", binary=raw, header_len="abc"),
        bad("header length negative", {"inputs": bin_inputs}, 400, "invalid_body", binary=raw, header_len="-1"),
        bad("header length a superscript two", {"inputs": bin_inputs}, 400, "invalid_body", binary=raw,
            header_len=b"\xb2"),
        bad("header length cuts the JSON", {"inputs": bin_inputs}, 400, "invalid_body", binary=raw, header_len="10"),
    ]
    return probes


# -- bugs kept apart (see the test functions that use them) -------------------------------------

def zero_element_probes() -> list[Probe]:
    """Tensors with no element but dims far past memory: 0 elements, so every byte count matches."""
    t = qkv()
    header, data = st_layout(t)
    q_end = header["q"]["data_offsets"][1]
    v_bytes = header["v"]["data_offsets"][1] - header["v"]["data_offsets"][0]
    huge = [0, 2**40, 2**40]
    kserve = [kserve_input(n, a) for n, a in qkv(n_q=1, h_q=2, h_kv=1, d=2, d_v=2, n_k=3).items()]
    shifted = {**header, "q": {"dtype": "F32", "shape": huge, "data_offsets": [0, 0]},
               "k": {**header["k"], "data_offsets": [o - q_end for o in header["k"]["data_offsets"]]},
               "v": {**header["v"], "data_offsets": [o - q_end for o in header["v"]["data_offsets"]]}}
    bin_q = {"name": "q", "shape": huge, "datatype": "FP32", "parameters": {"binary_data_size": 0}}
    bin_doc = json_text({"inputs": [bin_q, *kserve[1:]]})
    return [
        post("safetensors q [0, 2**40, 2**40]", ATTENTION, st_body(shifted, data[q_end:]), OCTET,
             422, "invalid_tensor"),
        post("safetensors q [0, 2**64, 2**64]", ATTENTION,
             st_body({**shifted, "q": {**shifted["q"], "shape": [0, 2**64, 2**64]}}, data[q_end:]), OCTET,
             422, "invalid_tensor"),
        post("safetensors k [2**40, 2**40, 0]", ATTENTION,
             st_body({"q": header["q"],
                      "k": {"dtype": "F32", "shape": [2**40, 2**40, 0], "data_offsets": [q_end, q_end]},
                      "v": {**header["v"], "data_offsets": [q_end, q_end + v_bytes]}}, data[:q_end] + data[-v_bytes:]),
             OCTET, 422, "invalid_tensor"),
        post("kserve JSON q [0, 2**40, 2**40]", INFER,
             json_text({"inputs": [{"name": "q", "shape": huge, "datatype": "FP32", "data": []}, *kserve[1:]]}), JSON,
             422, "invalid_tensor"),
        post("kserve binary q [0, 2**40, 2**40]", INFER, bin_doc, {**JSON, "Inference-Header-Content-Length":
                                                                     str(len(bin_doc))}, 422, "invalid_tensor"),
    ]


def kserve_timeout_probes() -> list[Probe]:
    """A ``timeout`` parameter (an int, microseconds) larger than a float can hold."""
    inputs = [kserve_input(n, a) for n, a in qkv(n_q=1, h_q=2, h_kv=1, d=2, d_v=2, n_k=3).items()]
    body = json_text({"inputs": inputs})[:-1] + b', "parameters": {"timeout": 1' + b"0" * 400 + b"}}"
    return [post("kserve timeout 10**400", INFER, body, JSON, 422, "invalid_option"),
            post("kserve timeout 2**1100", INFER, json_text({"inputs": inputs, "parameters": {"timeout": 2**1100}}),
                 JSON, 422, "invalid_option")]


def deep_value_probes(ctx: str, depths: range) -> list[Probe]:
    """Values nested ``depth`` lists (or objects) deep in fields the service quotes back in its error detail.

    Near the JSON parser's depth limit a value parses, and quoting it back may then
    recurse past the limit: every such request must still get a 4xx JSON error.
    """
    kv = b'"q": [[[1.0]]], "k": [[[1.0]]], "v": [[[1.0]]]'
    fields = {
        "attention scale": (ATTENTION, lambda x: b'{"scale": ' + x + b"}"),
        "attention window": (ATTENTION, lambda x: b"{" + kv + b', "window": ' + x + b"}"),
        "attention causal": (ATTENTION, lambda x: b'{"causal": ' + x + b"}"),
        "attention contexts": (ATTENTION, lambda x: b'{"contexts": [' + x + b"]}"),
        "attention q leaf": (ATTENTION, lambda x: b'{"q": [[[' + x + b"]]]}"),
        "create replicas": (CONTEXTS, lambda x: b'{"replicas": ' + x + b"}"),
        "append after": (f"{CONTEXTS}/{ctx}/append", lambda x: b'{"after": ' + x + b"}"),
        "kserve parameters.scale": (INFER, lambda x: b'{"inputs": [], "parameters": {"scale": ' + x + b"}}"),
        "kserve data": (INFER, lambda x: b'{"inputs": [{"name": "q", "shape": [1, 1, 1], "datatype": "FP32", '
                                         b'"data": ' + x + b"}]}"),
    }
    probes = []
    for name, (path, make) in fields.items():
        for depth in depths:
            for kind, value in (("lists", b"[" * depth + b"]" * depth),
                                ("objects", b'{"a": ' * depth + b"1" + b"}" * depth)):
                probes.append(post(f"{name}, {kind} {depth} deep", path, make(value), JSON, (400, 422)))
    return probes


def encoded_v1_probes() -> list[Probe]:
    """A /v1 body that says it is gzip-compressed but is not: served as if the header were absent."""
    t = json_text({name: a.tolist() for name, a in qkv(n_q=1, h_q=2, h_kv=1, d=2, d_v=2, n_k=3).items()})
    small = qkv(n_q=1, h_q=2, h_kv=1, d=2, d_v=2, n_k=3)
    kv = json_text({name: a.tolist() for name, a in small.items() if name != "q"})
    return [post("attention, Content-Encoding gzip on a plain body", ATTENTION, t,
                 {**JSON, "Content-Encoding": "gzip"}, 415, "unsupported_media_type"),
            post("create, Content-Encoding gzip on a plain body", CONTEXTS, kv,
                 {**JSON, "Content-Encoding": "gzip"}, 415, "unsupported_media_type")]


# -- raw HTTP ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class RawAnswer:
    status: int
    content_type: str | None
    body: bytes
    text: str


def parse_raw(text: str) -> RawAnswer:
    head, _, body = text.partition("\r\n\r\n")
    lines = head.split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return RawAnswer(0, None, b"", text)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return RawAnswer(status, headers.get("content-type"), body.encode("latin-1", "replace"), text)


def raw_exchange(port: int, head: bytes, chunks: Sequence[bytes] = (), timeout_s: float = 30.0,
                 pause_s: float = 0.005) -> RawAnswer:
    """Send ``head`` then each of ``chunks`` on a fresh connection, stopping once the server answers; read one answer.

    Before each chunk it waits up to ``pause_s`` for an answer: a server that refuses a body
    part-way answers and closes, and bytes sent after that would reset the connection under
    the answer. Status 0 when the server closed the connection without answering.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head)
        for chunk in chunks:
            if select.select([sock], [], [], pause_s)[0]:  # an answer before the whole body: stop sending
                break
            try:
                sock.sendall(chunk)
            except OSError:  # the server closed its side after answering
                break
        try:
            text = read_response(sock)
        except (ConnectionResetError, UnicodeDecodeError):
            text = ""
    return parse_raw(text)


def chunked(body: bytes, size: int = 65536) -> list[bytes]:
    """``body`` as HTTP/1.1 chunks (``Transfer-Encoding: chunked``), the last one included."""
    return [b"%x\r\n" % len(body[i:i + size]) + body[i:i + size] + b"\r\n" for i in range(0, len(body), size)] \
        + [b"0\r\n\r\n"]


# -- structured fuzzing of the binary formats (hypothesis) -------------------------------------

#: Names, dtypes, ranks and framing are drawn right most of the time (:func:`_rarely`), so that
#: most bodies get past the first checks and the edges further in (sizes, offsets, values,
#: options) are reached. Hypothesis starts from the simplest choice (the first of a list, the
#: smallest int), so the right value is always listed first.
NAMES = ["q", "k", "v", "q_pos", "k_pos", "alibi_slopes"]
BAD_NAMES = ["x", "Q", "", "__metadata__"]
FLOAT_ST, INT_ST = ["F32", "F16", "BF16", "F64"], ["I64", "I32"]
FLOAT_KS, INT_KS = ["FP32", "FP16", "BF16", "FP64"], ["INT64", "INT32"]
BAD_ST = ["U8", "F8_E4M3", "BOOL", "f32", "", "I8"]
BAD_KS = ["INT8", "UINT64", "BYTES", "BOOL", "fp32", ""]
KS_ITEMSIZE = {"FP16": 2, "BF16": 2, "FP32": 4, "FP64": 8, "INT32": 4, "INT64": 8, "INT8": 1, "UINT64": 8, "BOOL": 1}
INTEGER_TENSORS = {"q_pos", "k_pos"}
SMALL_DIMS = [1, 2, 0, 3, 4, 8]
#: Dims no tensor can have: past int32, int64 and memory, and negative.
EDGE_DIMS = [2**40, 2**31, 2**32, 2**63, 2**64, -1]


#: How rarely each part of a drawn request is made wrong: about one defect per request on average,
#: so that each check is met alone and the checks behind it are reached too.
RARE = 16


def _rarely(draw: st.DrawFn, one_in: int) -> bool:
    """True about once in ``one_in`` draws (False is the simpler choice). Tested against 1, not the
    bound: hypothesis draws the bounds of a range far more often than the values between them."""
    return draw(st.integers(0, one_in - 1)) == 1


def _pick(draw: st.DrawFn, usual: Sequence[Any], unusual: Sequence[Any], one_in: int = RARE) -> Any:
    return draw(st.sampled_from(unusual if _rarely(draw, one_in) else usual))


def _name(draw: st.DrawFn) -> str:
    return _pick(draw, NAMES, BAD_NAMES)


def _names(draw: st.DrawFn) -> list[str]:
    """Usually q, k and v and then some more (a request that can get far); sometimes any names."""
    base = [] if _rarely(draw, 8) else ["q", "k", "v"]
    return list(dict.fromkeys(base + [_name(draw) for _ in range(draw(st.integers(0, 3)))]))


def _dtype(draw: st.DrawFn, name: str, right_float: list[str], right_int: list[str], bad: list[str]) -> str:
    right, wrong = (right_int, right_float) if name in INTEGER_TENSORS else (right_float, right_int)
    return _pick(draw, right, wrong + bad)


def _sizes(draw: st.DrawFn) -> dict[str, int]:
    """One request's axis sizes (docs/API.md section 2), so that its tensors usually fit together."""
    sizes = {axis: draw(st.sampled_from(SMALL_DIMS)) for axis in ("n_q", "h_kv", "d", "d_v", "n_k")}
    sizes["h_q"] = sizes["h_kv"] * draw(st.sampled_from([1, 2, 3]))
    return sizes


LAYOUTS = {"q": ("n_q", "h_q", "d"), "k": ("n_k", "h_kv", "d"), "v": ("n_k", "h_kv", "d_v"), "q_pos": ("n_q",),
           "k_pos": ("n_k",), "alibi_slopes": ("h_q",)}


def _shape(draw: st.DrawFn, name: str, sizes: dict[str, int]) -> list[int]:
    """The tensor's layout in ``sizes``; rarely another rank, each dim rarely an edge, and rarely no
    element at all next to a dim past memory (every byte count is then 0, whatever the dims)."""
    if name not in LAYOUTS or _rarely(draw, RARE):
        return [draw(st.sampled_from(SMALL_DIMS)) for _ in range(draw(st.integers(0, 4)))]
    shape = [_pick(draw, [sizes[axis]], EDGE_DIMS + [0]) for axis in LAYOUTS[name]]
    if len(shape) > 1 and _rarely(draw, 10):
        zero = draw(st.integers(0, len(shape) - 1))
        edge = (zero + draw(st.integers(1, len(shape) - 1))) % len(shape)
        shape[zero], shape[edge] = 0, draw(st.sampled_from(EDGE_DIMS[:-1]))
    return shape


#: Fill patterns: zeros, ones (float32), NaN and infinity bit patterns of each width, all ones.
FILLS = [b"\x00", b"\x00\x00\x80\x3f", b"\x00\x00\xc0\x7f", b"\x00\x7e", b"\x80\x7f",
         b"\x00\x00\x00\x00\x00\x00\xf0\x7f", b"\xff"]
MAX_DATA = 1 << 16
QUERY = {
    "scale": ["0.125", "0", "-1", "nan", "1e400", "x"], "causal": ["true", "false", "1"],
    "window": ["1,", ",", "0,0", "-1,", "1,2,3"], "softcap": ["30", "0", "-0.5"],
    "contexts": ["{ctx}", "nope", "{ctx},{ctx}", ""], "replicas": ["1", "0"], "temperature": ["1"],
}


def _count(shape: Sequence[int]) -> int:
    return math.prod(shape) if all(s >= 0 for s in shape) else 0


@st.composite
def _data(draw: st.DrawFn, n: int) -> bytes:
    n = max(0, min(n, MAX_DATA))
    if n <= 64 and _rarely(draw, 4):
        return draw(st.binary(min_size=n, max_size=n))
    fill = draw(st.sampled_from(FILLS))
    return (fill * (n // len(fill) + 1))[:n]


@st.composite
def safetensors_requests(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, str]]]:
    """A safetensors body, mostly well framed, with names, dtypes, shapes, offsets and bytes at their edges,
    and a few URL query options (``{ctx}`` stands for the stored context's id)."""
    names, sizes = _names(draw), _sizes(draw)
    header: dict[str, Any] = {}
    offset = 0
    for name in names:
        dtype = _dtype(draw, name, FLOAT_ST, INT_ST, BAD_ST)
        shape = _shape(draw, name, sizes)
        nbytes = _count(shape) * ST_ITEMSIZE.get(dtype, 1)
        how = _pick(draw, ["exact"], ["short", "long", "reversed", "overlap", "gap", "negative", "past"])
        begin, end = {"exact": (offset, offset + nbytes), "short": (offset, offset + max(nbytes - 1, 0)),
                      "long": (offset, offset + nbytes + 1), "reversed": (offset + nbytes, offset),
                      "overlap": (max(offset - 4, 0), max(offset - 4, 0) + nbytes),
                      "gap": (offset + 4, offset + 4 + nbytes), "negative": (-1, nbytes - 1),
                      "past": (offset, offset + nbytes + 2**40)}[how]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        offset = max(offset, end)
    if _rarely(draw, RARE):
        header["__metadata__"] = _pick(draw, [{"a": "b"}], [{"a": 1}, [], "x", None], 2)
    text = json.dumps(header).encode() + b" " * draw(st.integers(0, 7))
    data = draw(_data(_pick(draw, [offset], [offset - 1, offset + 1, 0])))
    length = _pick(draw, [len(text)], [len(text) - 1, len(text) + 1, 2**63, 2**64 - 1])
    body = struct.pack("<Q", length) + text + data
    if _rarely(draw, 2 * RARE):
        body = body[: draw(st.integers(0, len(body)))]
    params = []
    if _rarely(draw, 3):
        name = draw(st.sampled_from(sorted(QUERY)))
        params.append((name, draw(st.sampled_from(QUERY[name]))))
    return body, params


KS_PARAMETERS = {
    "scale": [0.125, 0, -1, "0.1", None, 10**400], "causal": [True, "true", 1], "softcap": [30, -1],
    "window": ["1,", 5, "a,b"], "contexts": ["{ctx}", "nope", ""], "binary_data_output": [True, False, "yes"],
    "timeout": [10**6, 0, -1, 1.5, 2**63, 10**400], "priority": [1, -1], "sequence_id": [1],
}
KS_VALUES = [0.5, 1, -2]
BAD_KS_VALUES = [True, "1", None, float("nan"), float("inf"), 1e300, 2**63, 10**400]


@st.composite
def kserve_requests(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    """An Open Inference Protocol request, JSON or with binary tensors, its fields pushed to their edges."""
    inputs, binary, sizes = [], [], _sizes(draw)
    for name in _names(draw):
        datatype = _dtype(draw, name, FLOAT_KS, INT_KS, BAD_KS)
        shape = _shape(draw, name, sizes)
        count = _count(shape)
        entry: dict[str, Any] = {"name": name, "shape": shape, "datatype": datatype}
        if draw(st.booleans()):
            size = count * KS_ITEMSIZE.get(datatype, 1)
            given = _pick(draw, [size], [size - 1, size + 1, 2**40, -1, float(size)])
            entry["parameters"] = {"binary_data_size": given}
            binary.append(draw(_data(size)))
        else:
            n = _pick(draw, [min(count, 256)], [count + 1, max(count - 1, 0), 0])
            value = _pick(draw, [1] if name in INTEGER_TENSORS else KS_VALUES, BAD_KS_VALUES)
            entry["data"] = [value] * min(n, 256)
        inputs.append(entry)
    doc: dict[str, Any] = {"inputs": inputs}
    if _rarely(draw, 2):
        name = draw(st.sampled_from(sorted(KS_PARAMETERS)))
        doc["parameters"] = {name: draw(st.sampled_from(KS_PARAMETERS[name]))}
    if _rarely(draw, 4):
        doc["outputs"] = draw(st.sampled_from([[], [{"name": "out"}], [{"name": "x"}], "out",
                                               [{"name": "lse", "parameters": {"binary_data": True}}]]))
    text = json.dumps(doc, allow_nan=True).encode()
    headers = dict(JSON)
    tail = b"".join(binary)
    if binary or _rarely(draw, RARE):
        headers["Inference-Header-Content-Length"] = str(_pick(draw, [len(text)], [len(text) - 1, len(text) + 1, 0]))
        tail = tail[: _pick(draw, [len(tail)], [max(len(tail) - 1, 0)])]
    return text + tail, headers
