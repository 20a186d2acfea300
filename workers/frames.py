"""Frames of the direct channel between the front end and a shard worker (docs/SERVICE.md, "The direct channel").

A frame is a fixed prefix, a JSON header and a body of raw arrays::

    prefix  <I header_len> <Q body_len>   (little-endian, 12 bytes)
    header  header_len bytes of UTF-8 JSON: {"id", "op", ..., "arrays": [{"dtype", "shape"}, ...]}
    body    body_len bytes: the arrays' C-order bytes, one after another, in the header's order

Nothing is ever unpickled: a header is JSON, an array is a dtype from :data:`WIRE_DTYPES`
and a shape, and the body must hold exactly the bytes the shapes name. Both sizes are
bounded (:data:`MAX_HEADER_BYTES`, :data:`MAX_BODY_BYTES`) before anything is allocated.

Ops: ``hello`` (the first frame of a connection: the worker's token), ``resident`` (what
``ShardWorker.partial_resident`` takes: ``q``, its positions and options, the seconds left
of its request's deadline (``budget``, null for none), the shard reads and the merge
fan-in), ``many`` (what ``ShardWorker.partial_resident_many`` takes: a batch's
queries on one worker), ``append`` (what ``ShardWorker.append_shard`` takes, for a small
append: the write's keys, values and positions) and ``note`` (``ShardWorker.note_context``:
a committed record) and their replies: ``state`` (a ``ComputeStatus`` and the state's
``m, l, acc``), ``many`` (per item its status and states, or its error), ``done`` (a write's
JSON answer) or ``error`` (the exception's type name and message).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from merge import State
from workers.dtypes import BFLOAT16
from workers.options import AttentionOptions
from workers.problem import Arange
from workers.tasks import Carried, ComputeStatus, ResidentQuery, ShardQuery, ShardRead
from workers.tracing import MAX_TRACEPARENT

PREFIX = struct.Struct("<IQ")
#: Largest JSON header (a query's reads are ~60 bytes each: thousands of shards fit).
MAX_HEADER_BYTES = 2**20
#: Largest body either side accepts; the front end sends larger queries through Ray (``service.cluster.channel``).
MAX_BODY_BYTES = 64 * 2**20

#: The dtypes a frame may carry, by name (bfloat16 travels as its 16 bits, named ``bfloat16``).
WIRE_DTYPES: Mapping[str, np.dtype] = {
    "float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64), "int64": np.dtype(np.int64),
}
_WIRE_NAMES = {dt: name for name, dt in WIRE_DTYPES.items()}
#: Most dimensions an array in a frame may have (q and acc have 3).
MAX_NDIM = 4


class FrameError(ValueError):
    """A frame that breaks this module's rules: the connection that sent it is closed."""


class RemoteError(Exception):
    """A worker's exception, by type name and message, as an ``error`` frame carried it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


# -- frames ------------------------------------------------------------------------------------

def encode(header: dict[str, Any], arrays: Sequence[Any] = ()) -> list[bytes | memoryview]:
    """The buffers of one frame (for ``sendall`` of each, or ``writelines``); ``header`` gains ``arrays``."""
    specs, parts = [], []
    for a in arrays:
        a = np.ascontiguousarray(a.array() if isinstance(a, Carried) else a)
        if a.dtype not in _WIRE_NAMES:
            raise FrameError(f"arrays must be of dtype {', '.join(WIRE_DTYPES)}, got {a.dtype}")
        specs.append({"dtype": _WIRE_NAMES[a.dtype], "shape": list(a.shape)})
        parts.append(memoryview(a.reshape(-1).view(np.uint8).data))
    head = json.dumps({**header, "arrays": specs}, separators=(",", ":")).encode()
    body_len = sum(p.nbytes for p in parts)
    if len(head) > MAX_HEADER_BYTES or body_len > MAX_BODY_BYTES:
        raise FrameError(f"a frame must fit {MAX_HEADER_BYTES} header and {MAX_BODY_BYTES} body bytes, "
                         f"got {len(head)} and {body_len}")
    return [PREFIX.pack(len(head), body_len), head, *parts]


def sizes(prefix: bytes | bytearray) -> tuple[int, int]:
    """``(header_len, body_len)`` from a frame's prefix, each checked against its bound."""
    header_len, body_len = PREFIX.unpack(prefix)
    if not 0 < header_len <= MAX_HEADER_BYTES:
        raise FrameError(f"header_len must be in [1, {MAX_HEADER_BYTES}], got {header_len}")
    if body_len > MAX_BODY_BYTES:
        raise FrameError(f"body_len must be at most {MAX_BODY_BYTES}, got {body_len}")
    return header_len, body_len


def decode(head: bytes | bytearray, body: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list[np.ndarray]]:
    """A frame's header and its arrays (views of ``body``: writable when ``body`` is a bytearray)."""
    try:
        header = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"header must be JSON, got {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays", []), list):
        raise FrameError("header must be an object whose arrays is a list")
    arrays, at = [], 0
    for spec in header.get("arrays", []):
        dtype, shape = spec_of(spec)
        n = math.prod(shape) * dtype.itemsize  # exact (no int64 wrap-around), and 30x faster than np.prod
        if at + n > len(body):
            raise FrameError(f"body must hold the arrays the header names, got {len(body)} bytes for at least "
                             f"{at + n}")
        arrays.append(np.frombuffer(body, dtype=dtype, count=n // dtype.itemsize, offset=at).reshape(shape))
        at += n
    if at != len(body):
        raise FrameError(f"body must hold exactly the arrays the header names ({at} bytes), got {len(body)}")
    return header, arrays


def spec_of(spec: Any) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape one ``arrays`` entry of a header names (checked)."""
    if not isinstance(spec, dict) or spec.get("dtype") not in WIRE_DTYPES:
        raise FrameError(f"arrays[].dtype must be one of {', '.join(WIRE_DTYPES)}, got {spec!r:.80}")
    shape = spec.get("shape")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(isinstance(n, int) and 0 <= n <= MAX_BODY_BYTES for n in shape)):
        raise FrameError(f"arrays[].shape must be a list of at most {MAX_NDIM} sizes, got {shape!r:.80}")
    return WIRE_DTYPES[spec["dtype"]], tuple(shape)


# -- a resident query and its answer ------------------------------------------------------------

def _query_parts(q: Any, query: ShardQuery, reads: Sequence[ShardRead]) -> tuple[dict[str, Any], list[Any]]:
    """One query's header fields and arrays (q, then q_pos unless it is a range, then the ALiBi slopes)."""
    opts = query.options
    arrays = [q]
    header: dict[str, Any] = {
        "budget": query.budget_s,
        "reads": [[r.context_id, r.index, r.length, r.version, r.fresh] for r in reads],
        "options": {"scale": opts.scale, "causal": opts.causal,
                    "window": None if opts.window is None else list(opts.window), "softcap": opts.softcap,
                    "alibi": opts.alibi_slopes is not None},
    }
    if isinstance(query.q_pos, Arange):
        header["q_arange"] = [query.q_pos.start, query.q_pos.n]
    else:
        arrays.append(np.asarray(query.q_pos, dtype=np.int64))
    if opts.alibi_slopes is not None:
        arrays.append(np.asarray(opts.alibi_slopes))
    if query.trace is not None:
        header["trace"] = query.trace
    return header, arrays


def _parse_query_parts(header: Mapping[str, Any], it: Iterator[np.ndarray]) -> tuple[Any, ShardQuery,
                                                                                      tuple[ShardRead, ...]]:
    try:
        opts = header["options"]
        q = next(it)
        q_pos: Any = Arange(int(header["q_arange"][0]), int(header["q_arange"][1])) if "q_arange" in header \
            else next(it)
        alibi = next(it) if opts["alibi"] else None
        options = AttentionOptions(scale=opts["scale"], causal=opts["causal"],
                                   window=None if opts["window"] is None else tuple(opts["window"]),
                                   softcap=opts["softcap"], alibi_slopes=alibi)
        reads = []
        for read in header["reads"]:
            # [context_id, index, length, version, fresh]; a front end before 2026-12-07 sent no fresh
            context_id, index, length, version, fresh = read if len(read) == 5 else (*read, False)
            if not isinstance(fresh, bool):
                raise TypeError(f"a read's fresh must be a bool, got {fresh!r}")
            reads.append(ShardRead(str(context_id), int(index), int(length), int(version), fresh))
    except (KeyError, TypeError, ValueError, StopIteration, IndexError) as exc:
        raise FrameError(f"a query must carry q, its positions, options and reads: {type(exc).__name__}: {exc}") \
            from None
    if q.ndim != 3 or q_pos.ndim != 1 or q_pos.shape[0] != q.shape[0] or q_pos.dtype != np.int64:
        raise FrameError(f"q must be [n_q, h_q, d] with int64 q_pos [n_q], got {q.shape} and {q_pos.shape}")
    budget = header.get("budget")  # absent (a front end of an older release): no deadline
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not 0 <= budget < math.inf):
        raise FrameError(f"budget must be null or a finite number of seconds >= 0, got {budget!r:.40}")
    trace = header.get("trace")  # absent: not traced
    if trace is not None and (not isinstance(trace, str) or len(trace) > MAX_TRACEPARENT):
        raise FrameError(f"trace must be null or a traceparent of at most {MAX_TRACEPARENT} characters, "
                         f"got {trace!r:.40}")
    return q, ShardQuery(q_pos=q_pos, options=options, budget_s=None if budget is None else float(budget),
                         trace=trace), tuple(reads)


def query_frame(call_id: int, q: Any, query: ShardQuery, reads: Sequence[ShardRead],
                fanin: int) -> list[bytes | memoryview]:
    """A ``resident`` request: ``ShardWorker.partial_resident(q, query, reads, fanin)`` over the channel."""
    header, arrays = _query_parts(q, query, reads)
    return encode({"id": call_id, "op": "resident", "fanin": fanin, **header}, arrays)


def parse_query(header: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> tuple[Any, ShardQuery,
                                                                                   tuple[ShardRead, ...], int]:
    """``(q, query, reads, fanin)`` of a ``resident`` request; a malformed one raises :class:`FrameError`."""
    it = iter(arrays)
    q, query, reads = _parse_query_parts(header, it)
    try:
        fanin = int(header["fanin"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FrameError(f"a resident request must carry fanin: {type(exc).__name__}: {exc}") from None
    if next(it, None) is not None:
        raise FrameError("a resident request must carry no arrays beyond its query's")
    return q, query, reads, fanin


def many_frame(call_id: int, items: Sequence[ResidentQuery]) -> list[bytes | memoryview]:
    """A ``many`` request: ``ShardWorker.partial_resident_many(items)`` (a batch's queries on one worker)."""
    headers, arrays = [], []
    for item in items:
        h, a = _query_parts(item.q, item.query, item.reads)
        headers.append(h)
        arrays += a
    return encode({"id": call_id, "op": "many", "items": headers}, arrays)


def parse_many(header: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> list[ResidentQuery]:
    items = header.get("items")
    if not isinstance(items, list) or not items:
        raise FrameError("a many request must carry a non-empty list of items")
    it = iter(arrays)
    out = [ResidentQuery(*_parse_query_parts(h if isinstance(h, dict) else {}, it)) for h in items]
    if next(it, None) is not None:
        raise FrameError("a many request must carry no arrays beyond its items'")
    return out


def state_frame(call_id: int, status: ComputeStatus, state: State) -> list[bytes | memoryview]:
    """A ``state`` reply: the status and ``m, l, acc`` (host arrays)."""
    header = {"id": call_id, "op": "state", "status": [status.worker, status.seconds, status.nbytes, status.batch]}
    return encode(header, [state.m, state.l, state.acc])


def parse_state(header: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> tuple[ComputeStatus, State]:
    try:
        worker, seconds, nbytes, batch = header["status"]
        m, l, acc = arrays
        return ComputeStatus(str(worker), float(seconds), int(nbytes), int(batch)), State(m=m, l=l, acc=acc)
    except (KeyError, TypeError, ValueError) as exc:
        raise FrameError(f"a state reply must carry a status and m, l, acc: {type(exc).__name__}: {exc}") from None


def many_reply(call_id: int, results: Sequence[tuple[ComputeStatus, list[State]] | BaseException]
               ) -> list[bytes | memoryview]:
    """A ``many`` reply: per item its status and states (one per read), or its exception."""
    items: list[dict[str, Any]] = []
    arrays: list[Any] = []
    for r in results:
        if isinstance(r, BaseException):
            items.append({"error": [type(r).__name__, str(r)[:2000]]})
            continue
        status, states = r
        items.append({"status": [status.worker, status.seconds, status.nbytes, status.batch], "states": len(states)})
        arrays += [a for st in states for a in (st.m, st.l, st.acc)]
    return encode({"id": call_id, "op": "many", "items": items}, arrays)


def parse_many_reply(header: Mapping[str, Any], arrays: Sequence[np.ndarray]
                     ) -> list[tuple[ComputeStatus, list[State]] | RemoteError]:
    out: list[tuple[ComputeStatus, list[State]] | RemoteError] = []
    it = iter(arrays)
    try:
        for item in header["items"]:
            if "error" in item:
                out.append(RemoteError(str(item["error"][0]), str(item["error"][1])))
                continue
            worker, seconds, nbytes, batch = item["status"]
            states = [State(m=next(it), l=next(it), acc=next(it)) for _ in range(int(item["states"]))]
            out.append((ComputeStatus(str(worker), float(seconds), int(nbytes), int(batch)), states))
    except (KeyError, TypeError, ValueError, StopIteration, IndexError) as exc:
        raise FrameError(f"a many reply must carry each item's status and states, or its error: "
                         f"{type(exc).__name__}: {exc}") from None
    return out


# -- context writes (small ones: an engine's append of a token) --------------------------------------

def note_frame(call_id: int, context_id: str, record: Mapping[str, Any]) -> list[bytes | memoryview]:
    """A ``note`` request: ``ShardWorker.note_context(context_id, record)`` (the record as JSON)."""
    return encode({"id": call_id, "op": "note", "context_id": context_id, "record": dict(record)})


def parse_note(header: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> tuple[str, dict[str, Any]]:
    record = header.get("record")
    if arrays or not isinstance(record, dict) or not isinstance(header.get("context_id"), str):
        raise FrameError("a note must carry a context id and its record, and no arrays")
    return header["context_id"], record


def done_frame(call_id: int, result: Any) -> list[bytes | memoryview]:
    """A ``done`` reply: a write's answer (JSON: a shard's summary, or null)."""
    return encode({"id": call_id, "op": "done", "result": result})


def parse_done(header: Mapping[str, Any]) -> Any:
    if header.get("op") != "done":
        raise FrameError(f"a write's reply must be done or error, got {str(header.get('op'))[:40]!r}")
    return header.get("result")


def _count(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ValueError(f"expected an integer >= 0, got {x!r:.40}")
    return x


def error_frame(call_id: int, exc: BaseException) -> list[bytes | memoryview]:
    """An ``error`` reply: the exception's type name and message (``RemoteError`` on the other side)."""
    return encode({"id": call_id, "op": "error", "kind": type(exc).__name__, "message": str(exc)[:2000]})


def parse_error(header: Mapping[str, Any]) -> RemoteError:
    return RemoteError(str(header.get("kind", "Exception")), str(header.get("message", "")))
