"""The worker's end of the direct channel: a TCP listener in the actor's process (docs/SERVICE.md).

A Ray actor call costs a few milliseconds on a small machine whatever it carries
(docs/BENCHMARKS.md, "Engine calls"); a decode query's arguments and answer are tens of
kilobytes. The front end therefore sends resident queries and small context writes to
each worker over a socket of its own, in :mod:`workers.frames` (JSON headers and raw
arrays, never pickle), and keeps Ray for everything else: creates, large appends,
repairs, merges on the workers, and any call the channel cannot carry. The contexts
directory serves the calls of a write on a listener of this module too
(``service.contexts.directory``).

Who may connect: the listener binds the address Ray uses for this node, on a port the
system picks, and a connection is served only after its first frame, ``hello``, names
the token this worker drew when it started. The token is handed out by the actor's
``channel()`` method, so only a caller that Ray lets call the actor (Ray's own auth)
learns it. A connection that does not say hello in time, sends a frame out of bounds,
or breaks the rules is closed; the worker goes on.

Threads: one accepts; each connection has a reader (decodes requests, hands each to
``submit``, which returns a future) and a writer for what the socket cannot take at once
(:class:`_Replies`). Replies go out as their futures finish, in any order: each names its
request's ``id``.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import math
import secrets
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from workers import frames
from workers.tasks import ShardWrite

log = logging.getLogger(__name__)

#: Seconds a new connection has to send its hello frame.
HELLO_TIMEOUT_S = 5.0
#: Connections served at once (the front ends of a cluster, one each); more are closed at once.
MAX_CONNECTIONS = 64

#: ``submit(header, arrays, alone)``: a request handed to the worker, as the future of its reply's
#: buffers; ``alone``: no other request waits on the connection, so the worker may run this one in the
#: connection's thread (``workers.batch.Batcher.run_here``) instead of waking its compute thread.
Submit = Callable[[dict[str, Any], list[Any], bool], Future]
#: ``stream(header, arrays)``: a request of op :data:`STREAMED_OP` whose arrays are read from the socket one at
#: a time as ``arrays`` is iterated (in the connection's thread); it takes them all and returns the future of
#: its reply, so that the worker stores a part of an append while the next part is still arriving.
Stream = Callable[[dict[str, Any], Iterator[Any]], Future]
#: The op by which a front end gives up a request it sent (``{"op": "cancel", "id": own id, "of": its id}``):
#: the request's future is cancelled, so a query still waiting is not run (``workers.batch``); no answer.
CANCEL_OP = "cancel"
#: The op whose arrays are streamed (an append's parts: :func:`append_frame`).
STREAMED_OP = "append"


class Listener:
    """Serves the direct channel of one worker until the process ends (or :meth:`close`)."""

    def __init__(self, submit: Submit, *, host: str, name: str, stream: Stream | None = None) -> None:
        self._submit = submit
        self._stream = stream
        self.name = name
        self.token = secrets.token_urlsafe(32)
        self._sock = socket.create_server((host, 0))
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        threading.Thread(target=self._accept, name=f"{name}-channel", daemon=True).start()

    def address(self) -> dict[str, Any]:
        """What a front end needs to connect: host, port and the token to say hello with."""
        return {"host": self.host, "port": self.port, "token": self.token}

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # too many: the front end falls back to Ray for this worker
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name=f"{self.name}-channel-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        replies = _Replies(conn)
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            header, _ = read_frame(conn)
            if header.get("op") != "hello" or not hmac.compare_digest(str(header.get("token", "")), self.token):
                return  # not one of ours: closed without an answer
            conn.settimeout(None)
            threading.Thread(target=replies.drain, name=f"{self.name}-channel-write", daemon=True).start()
            replies.send(frames.encode({"op": "hello", "worker": self.name}))
            calls: dict[int, Future] = {}  # this connection's requests not answered yet, by id
            while True:
                header, body_len, head = _read_head(conn)
                call_id = header.get("id")
                if not isinstance(call_id, int):
                    raise frames.FrameError(f"id must be an int, got {call_id!r:.40}")
                if self._stream is not None and header.get("op") == STREAMED_OP:
                    self._streamed(conn, replies, header, body_len)
                    continue
                body = _exactly(conn, body_len) if body_len < BIG_BODY_BYTES else _body(conn, body_len).data
                _, arrays = frames.decode(head, body)
                if header.get("op") == CANCEL_OP:  # the front end gave up request "of": not run if not started
                    gone = calls.get(header.get("of"))  # type: ignore[arg-type]
                    if gone is not None:
                        gone.cancel()
                    continue  # no answer: nobody waits for one
                try:
                    future = self._submit(header, arrays, not _pending(conn))
                except Exception as exc:  # noqa: BLE001 - a request the worker refuses is that request's answer
                    replies.send(frames.error_frame(call_id, exc))
                    continue
                calls[call_id] = future
                future.add_done_callback(functools.partial(self._done, replies, calls, call_id))
        except (OSError, EOFError, frames.FrameError) as exc:
            if not isinstance(exc, EOFError):
                log.info("%s: direct channel connection closed: %s", self.name, exc)
        finally:
            replies.close()
            conn.close()
            self._slots.release()

    def _streamed(self, conn: socket.socket, replies: _Replies, header: dict[str, Any], body_len: int) -> None:
        """Hand a streamed request its arrays as they arrive; its reply once its future is done. Whatever
        it refuses, the rest of its body is read (the connection stays framed) and its answer is the error."""
        call_id = int(header["id"])
        arrays = _arrays(conn, header, body_len)
        try:
            future = self._stream(header, arrays)  # type: ignore[misc]
        except frames.FrameError:
            raise
        except Exception as exc:  # noqa: BLE001 - a request the worker refuses is that request's answer
            for _ in arrays:  # the rest of the body, read and dropped
                pass
            replies.send(frames.error_frame(call_id, exc))
            return
        if next(arrays, None) is not None:
            raise frames.FrameError("a streamed request must take every array it carries")
        future.add_done_callback(functools.partial(self._done, replies, {}, call_id))

    def _done(self, replies: _Replies, calls: dict[int, Future], call_id: int, future: Future) -> None:
        """Send the reply to request ``call_id``: its future's buffers, or the error it raised (or its encoding did);
        nothing for a request cancelled by its front end."""
        calls.pop(call_id, None)
        if future.cancelled():
            return
        try:
            buffers: list[bytes | memoryview] = future.result()
        except Exception as exc:  # noqa: BLE001 - the request's own answer
            buffers = frames.error_frame(call_id, exc)
        replies.send(buffers)


def then(future: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of ``fn(result)`` once ``future`` has a result (its exception, or fn's, otherwise).
    Cancelling it cancels ``future`` (a query not started yet is then not run: ``workers.batch``)."""
    out: Future = Future()

    def done(f: Future) -> None:
        if out.cancelled():
            return
        if f.cancelled():
            out.cancel()
            return
        try:
            out.set_result(fn(f.result()))
        except Exception as exc:  # noqa: BLE001 - handed on to whoever waits
            out.set_exception(exc)

    future.add_done_callback(done)
    out.add_done_callback(lambda o: o.cancelled() and future.cancel())
    return out


def gather(futures: Sequence[Future], fn: Callable[[list[Any]], Any]) -> Future:
    """A future of ``fn(results)`` once every future is done; an exception stands in its future's place.
    Cancelling it cancels every one (those not started are then not run)."""
    out: Future = Future()
    results: list[Any] = [None] * len(futures)
    left = [len(futures)]
    lock = threading.Lock()

    def done(i: int, f: Future) -> None:
        if out.cancelled() or f.cancelled():
            out.cancel()
            return
        exc = f.exception()
        results[i] = exc if exc is not None else f.result()
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            try:
                out.set_result(fn(results))
            except Exception as err:  # noqa: BLE001 - handed on to whoever waits
                out.set_exception(err)

    for i, f in enumerate(futures):
        f.add_done_callback(functools.partial(done, i))
    out.add_done_callback(lambda o: o.cancelled() and [f.cancel() for f in futures])
    return out


class _Replies:
    """A connection's outgoing frames, whole and in the order they were sent.

    A reply goes out at once from the thread that finished it (the compute thread) when
    the socket takes all of it without waiting; what it does not take waits here, in
    order, for :meth:`drain`'s thread, so a front end that reads slowly never stalls the
    worker's computations. Saves a thread hand-off per query (docs/SERVICE.md).
    """

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._backlog: deque[memoryview] = deque()  # the first one may be partly sent (by drain, outside the lock)
        self._ready = threading.Condition()
        self._closed = False

    def send(self, buffers: list[bytes | memoryview]) -> None:
        data = memoryview(b"".join(buffers))
        with self._ready:
            if self._closed:
                return
            if not self._backlog:
                try:
                    data = data[self._conn.send(data, socket.MSG_DONTWAIT):]
                except BlockingIOError:
                    pass
                except OSError:
                    return  # the reader sees the connection go too
                if not data.nbytes:
                    return
            self._backlog.append(data)
            self._ready.notify()

    def drain(self) -> None:
        """Send the backlog (blocking) until :meth:`close`."""
        while True:
            with self._ready:
                while not self._backlog and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                data = self._backlog[0]  # stays first (so send() queues behind it) until it is all sent
            try:
                self._conn.sendall(data)
            except OSError:
                return
            with self._ready:
                self._backlog.popleft()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()


def _pending(conn: socket.socket) -> bool:
    """Whether bytes of another request (or the peer's close) wait on ``conn`` already."""
    try:
        conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True  # the next read reports it
    return True


def read_frame(conn: socket.socket) -> tuple[dict[str, Any], list[Any]]:
    """One whole frame off a blocking socket: ``(header, arrays)``; EOFError when the peer closed first."""
    prefix = _exactly(conn, frames.PREFIX.size)
    header_len, body_len = frames.sizes(prefix)
    head = _exactly(conn, header_len)
    return frames.decode(head, _exactly(conn, body_len))


def _read_head(conn: socket.socket) -> tuple[dict[str, Any], int, bytearray]:
    """A frame's header (parsed), its body's length and the header's bytes; the body is left on the socket."""
    header_len, body_len = frames.sizes(_exactly(conn, frames.PREFIX.size))
    head = _exactly(conn, header_len)
    header, _ = frames.decode(head, b"") if body_len == 0 else (_json_header(head), None)
    return header, body_len, head


def _json_header(head: bytearray) -> dict[str, Any]:
    try:
        header = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise frames.FrameError(f"header must be JSON, got {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays", []), list):
        raise frames.FrameError("header must be an object whose arrays is a list")
    return header


def _arrays(conn: socket.socket, header: dict[str, Any], body_len: int) -> Iterator[Any]:
    """The arrays a header names, each read from ``conn`` as it is taken (``frames.decode``'s rules: the
    body holds exactly them)."""
    at = 0
    for spec in header.get("arrays", []):
        dtype, shape = frames.spec_of(spec)
        n = math.prod(shape) * dtype.itemsize
        if at + n > body_len:
            raise frames.FrameError(f"body must hold the arrays the header names, got {body_len} bytes for at "
                                    f"least {at + n}")
        at += n
        yield _body(conn, n).view(dtype).reshape(shape)
    if at != body_len:
        raise frames.FrameError(f"body must hold exactly the arrays the header names ({at} bytes), got {body_len}")


#: Bodies from this size on are read into memory that is not zeroed first (a context write's keys).
BIG_BODY_BYTES = 2**20


def _body(conn: socket.socket, n: int) -> np.ndarray:
    """``n`` bytes read straight into a fresh, writable array: no pass that zeroes it first, as
    ``bytearray(n)`` makes (a context write's 16 MiB of keys is read once, then copied into its shard)."""
    buf = np.empty(n, np.uint8)
    view, got = buf.data, 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise EOFError("the peer closed the connection")
        got += k
    return buf


# -- context writes over the channel ----------------------------------------------------------------
#
# ``write`` frames carry what ``ShardWorker.create_shards`` and ``append_shard`` take through Ray: the
# shard writes (JSON), the context record of a create or the committed length of an append, and the
# arrays ``k, v`` and each write's ``k_pos``; the reply, ``written``, carries the shards' summaries.

#: The fields of a :class:`ShardWrite` a frame carries beside its ``k_pos`` array.
_WRITE_FIELDS = ("context_id", "index", "dtype", "max_capacity", "reserve", "span")


def write_frame(call_id: int, writes: Sequence[ShardWrite], k: Any, v: Any, *, record: dict | None = None,
                committed: int | None = None) -> list[bytes | memoryview]:
    """A create (``record`` given) or an append (``committed`` given) of ``writes`` with ``k``, ``v``."""
    if (record is None) == (committed is None):
        raise ValueError("write_frame needs exactly one of record (a create) and committed (an append)")
    header: dict[str, Any] = {"id": call_id, "op": "write",
                              "writes": [{f: getattr(w, f) for f in _WRITE_FIELDS} for w in writes]}
    if record is not None:
        header["record"] = record
    else:
        header["committed"] = committed
    return frames.encode(header, [k, v, *(np.asarray(w.k_pos, dtype=np.int64) for w in writes)])


def parse_write(header: dict[str, Any], arrays: Sequence[Any]) -> tuple[list[ShardWrite], Any, Any, dict | None,
                                                                         int | None]:
    """``(writes, k, v, record, committed)`` of a ``write`` frame (:func:`write_frame`); FrameError if malformed."""
    try:
        specs = header["writes"]
        if not isinstance(specs, list) or len(arrays) != 2 + len(specs):
            raise ValueError(f"a write frame must carry k, v and a k_pos per write, got {len(arrays)} arrays")
        writes = []
        for spec, k_pos in zip(specs, arrays[2:]):
            span = spec["span"]
            writes.append(ShardWrite(str(spec["context_id"]), int(spec["index"]), str(spec["dtype"]),
                                     int(spec["max_capacity"]), k_pos, reserve=int(spec["reserve"]),
                                     span=None if span is None else (int(span[0]), int(span[1]))))
        record, committed = header.get("record"), header.get("committed")
        if (record is None) == (committed is None) or not (record is None or isinstance(record, dict)):
            raise ValueError("a write frame must carry a record (a create) or committed (an append)")
        return writes, arrays[0], arrays[1], record, None if committed is None else int(committed)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise frames.FrameError(f"a write frame must name its writes: {type(exc).__name__}: {exc}") from None


def append_frame(call_id: int, write: ShardWrite, k: Any, v: Any, committed: int,
                 part_keys: int) -> list[bytes | memoryview]:
    """An append of ``k``, ``v`` (all of them: ``write.span`` is not sent) after ``committed`` keys, in parts
    of ``part_keys`` keys: the worker stores each part while the next one arrives (op :data:`STREAMED_OP`)."""
    n = int((k.bits if hasattr(k, "bits") else k).shape[0])
    bounds = [(lo, min(lo + part_keys, n)) for lo in range(0, n, max(part_keys, 1))] or [(0, 0)]
    spec = {f: getattr(write, f) for f in _WRITE_FIELDS if f != "span"}
    header = {"id": call_id, "op": STREAMED_OP, "write": spec, "committed": committed,
              "parts": [hi - lo for lo, hi in bounds]}
    parts = [a for lo, hi in bounds for a in (_rows(k, lo, hi), _rows(v, lo, hi))]
    return frames.encode(header, [np.asarray(write.k_pos, dtype=np.int64), *parts])


def _rows(a: Any, lo: int, hi: int) -> Any:
    """Keys ``[lo, hi)`` of an array, or of the bits a ``Carried`` holds (kept carried)."""
    return type(a)(a.bits[lo:hi]) if hasattr(a, "bits") else a[lo:hi]


def parse_append(header: dict[str, Any], k_pos: Any) -> tuple[ShardWrite, int, list[int]]:
    """``(write, committed, part keys)`` of an :func:`append_frame` whose first array, ``k_pos``, was read."""
    try:
        spec, parts = header["write"], header["parts"]
        if not isinstance(parts, list) or not all(type(p) is int and p >= 0 for p in parts):
            raise ValueError(f"parts must be a list of key counts, got {parts!r:.80}")
        if len(header.get("arrays", [])) != 1 + 2 * len(parts) or sum(parts) != len(k_pos):
            raise ValueError("an append frame must carry k_pos and each part's k and v")
        write = ShardWrite(str(spec["context_id"]), int(spec["index"]), str(spec["dtype"]),
                           int(spec["max_capacity"]), k_pos, reserve=int(spec["reserve"]))
        return write, int(header["committed"]), parts
    except (KeyError, TypeError, ValueError) as exc:
        raise frames.FrameError(f"an append frame must name its write: {type(exc).__name__}: {exc}") from None


def written_frame(call_id: int, infos: Sequence[dict]) -> list[bytes | memoryview]:
    """The reply to a ``write``: each shard's summary (``ShardInfo.summary``)."""
    return frames.encode({"id": call_id, "op": "written", "infos": list(infos)})


def _exactly(conn: socket.socket, n: int) -> bytearray:
    """``n`` bytes (writable: arrays decoded from them are), or EOFError when the peer closed first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise EOFError("the peer closed the connection")
        got += k
    return buf
