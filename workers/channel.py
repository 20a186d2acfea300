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
import logging
import secrets
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from workers import frames

log = logging.getLogger(__name__)

#: Seconds a new connection has to send its hello frame.
HELLO_TIMEOUT_S = 5.0
#: Connections served at once (the front ends of a cluster, one each); more are closed at once.
MAX_CONNECTIONS = 64

#: ``submit(header, arrays, alone)``: a request handed to the worker, as the future of its reply's
#: buffers; ``alone``: no other request waits on the connection, so the worker may run this one in the
#: connection's thread (``workers.batch.Batcher.run_here``) instead of waking its compute thread.
Submit = Callable[[dict[str, Any], list[Any], bool], Future]


class Listener:
    """Serves the direct channel of one worker until the process ends (or :meth:`close`)."""

    def __init__(self, submit: Submit, *, host: str, name: str) -> None:
        self._submit = submit
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
            header, _ = _read(conn)
            if header.get("op") != "hello" or not hmac.compare_digest(str(header.get("token", "")), self.token):
                return  # not one of ours: closed without an answer
            conn.settimeout(None)
            threading.Thread(target=replies.drain, name=f"{self.name}-channel-write", daemon=True).start()
            replies.send(frames.encode({"op": "hello", "worker": self.name}))
            while True:
                header, arrays = _read(conn)
                call_id = header.get("id")
                if not isinstance(call_id, int):
                    raise frames.FrameError(f"id must be an int, got {call_id!r:.40}")
                try:
                    future = self._submit(header, arrays, not _pending(conn))
                except Exception as exc:  # noqa: BLE001 - a request the worker refuses is that request's answer
                    replies.send(frames.error_frame(call_id, exc))
                    continue
                future.add_done_callback(functools.partial(self._done, replies, call_id))
        except (OSError, EOFError, frames.FrameError) as exc:
            if not isinstance(exc, EOFError):
                log.info("%s: direct channel connection closed: %s", self.name, exc)
        finally:
            replies.close()
            conn.close()
            self._slots.release()

    def _done(self, replies: _Replies, call_id: int, future: Future) -> None:
        replies.send(self._answer(call_id, future))

    def _answer(self, call_id: int, future: Future) -> list[bytes | memoryview]:
        """The reply to request ``call_id``: its future's buffers, or the error it raised (or its encoding did)."""
        try:
            buffers: list[bytes | memoryview] = future.result()
            return buffers
        except Exception as exc:  # noqa: BLE001 - the request's own answer
            return frames.error_frame(call_id, exc)



def then(future: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of ``fn(result)`` once ``future`` has a result (its exception, or fn's, otherwise)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except Exception as exc:  # noqa: BLE001 - handed on to whoever waits
            out.set_exception(exc)

    future.add_done_callback(done)
    return out


def gather(futures: Sequence[Future], fn: Callable[[list[Any]], Any]) -> Future:
    """A future of ``fn(results)`` once every future is done; an exception stands in its future's place."""
    out: Future = Future()
    results: list[Any] = [None] * len(futures)
    left = [len(futures)]
    lock = threading.Lock()

    def done(i: int, f: Future) -> None:
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


def _read(conn: socket.socket) -> tuple[dict[str, Any], list[Any]]:
    prefix = _exactly(conn, frames.PREFIX.size)
    header_len, body_len = frames.sizes(prefix)
    head = _exactly(conn, header_len)
    body = _exactly(conn, body_len)
    return frames.decode(head, body)


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
