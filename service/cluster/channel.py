"""The front end's end of the direct channel to a shard worker (``workers.channel``, docs/SERVICE.md).

One connection per worker, opened on the first query that can use it and shared by
every request: each frame carries an ``id`` and replies come back in the order they
finish, so concurrent queries still meet in the worker's batcher. When the
connection breaks, every call waiting on it fails with :class:`ChannelClosed` and the
pool sends that call through Ray instead (``service.cluster.pool``), which also tells
a dead worker from a broken socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from merge import State
from service.cluster.surface import domain, failed
from workers import frames
from workers.channel import CANCEL_OP, read_frame
from workers.frames import RemoteError
from workers.tasks import ComputeStatus, ResidentQuery, ShardQuery, ShardRead

#: A context write's keys and values travel over the channel up to the frame's bound; larger go through Ray.
MAX_WRITE_BYTES = frames.MAX_BODY_BYTES
#: Seconds a context write's frame may take to send and be answered (the worker stores it meanwhile).
WRITE_TIMEOUT_S = 300.0
#: Seconds to connect and hear the worker's hello.
CONNECT_TIMEOUT_S = 5.0
#: A query (q, its positions, ALiBi slopes) and its state must each fit this to use the channel;
#: larger ones go through Ray's object store, whose call overhead is small beside them.
MAX_CALL_BYTES = 16 * 2**20


#: Set while a context write (create or append) runs (:func:`staged_writes`): the pool keeps its arrays
#: in this process (``service.cluster.pool.Staged``) for the workers' write channels, instead of
#: copying them into Ray's object store first.
STAGED_WRITES: contextvars.ContextVar[bool] = contextvars.ContextVar("splitkey_staged_writes", default=False)


@contextlib.contextmanager
def staged_writes() -> Iterator[None]:
    """Within: the arrays the pool is asked to ``put`` are a context write's (``service.routes.contexts``)."""
    token = STAGED_WRITES.set(True)
    try:
        yield
    finally:
        STAGED_WRITES.reset(token)


class ChannelClosed(ConnectionError):
    """The connection to a worker's channel is gone (the call did not complete; it may go through Ray)."""


class WorkerChannel:
    """An open, authenticated connection to one worker's channel."""

    def __init__(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.name = name
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._closed: BaseException | None = None
        self._task = asyncio.get_running_loop().create_task(self._read_replies())

    @classmethod
    async def open(cls, name: str, address: dict[str, Any], timeout_s: float = CONNECT_TIMEOUT_S) -> WorkerChannel:
        """Connect to ``address`` (``ShardWorker.channel()``: host, port, token) and say hello."""
        async def connect() -> WorkerChannel:
            reader, writer = await asyncio.open_connection(str(address["host"]), int(address["port"]))
            try:
                writer.writelines(frames.encode({"op": "hello", "token": str(address["token"])}))
                header, _ = await _read(reader)
                if header.get("op") != "hello":
                    raise ChannelClosed(f"worker {name}'s channel must answer hello, got {header.get('op')!r:.40}")
            except BaseException:
                writer.close()
                raise
            return cls(name, reader, writer)

        try:
            return await asyncio.wait_for(connect(), timeout_s)
        except (OSError, EOFError, TimeoutError, frames.FrameError, asyncio.IncompleteReadError) as exc:
            raise ChannelClosed(f"worker {name}'s channel could not be opened: {type(exc).__name__}") from exc

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def close(self) -> None:
        self._fail(ChannelClosed(f"worker {self.name}'s channel was closed"))
        self._task.cancel()

    async def resident(self, q: Any, query: ShardQuery, reads: Sequence[ShardRead],
                       fanin: int) -> tuple[ComputeStatus, State]:
        """``ShardWorker.partial_resident(q, query, reads, fanin)`` over the channel.

        Raises what the worker raised when it is one of the domain errors the front end
        handles (``ShardMissing``, ``RecordStale``, ``Expired``: ``surface.DOMAIN_ERRORS``), by its own
        class as a Ray call does; any other as the 500 of :func:`surface.failed`; and
        :class:`ChannelClosed` when the connection went before the answer.
        """
        header, arrays = await self._call(lambda i: frames.query_frame(i, q, query, reads, fanin), cancellable=True)
        if header.get("op") == "error":
            err = frames.parse_error(header)
            known = domain(err)
            raise failed(self.name, err.kind, err.message) if known is err else known
        return frames.parse_state(header, arrays)

    async def many(self, items: Sequence[ResidentQuery]) -> list[tuple[ComputeStatus, list[State]] | RemoteError]:
        """``ShardWorker.partial_resident_many(items)`` over the channel: per item its status and states (one
        per read), or the :class:`frames.RemoteError` it raised. A whole call the worker refused raises it."""
        header, arrays = await self._call(lambda i: frames.many_frame(i, items), cancellable=True)
        if header.get("op") == "error":
            raise frames.parse_error(header)
        return frames.parse_many_reply(header, arrays)

    async def write(self, frame: Any) -> Any:
        """A context write (``frames.append_frame``, ``frames.note_frame``; ``frame(call_id)`` gives its
        buffers) over the channel: its ``done`` answer. Raises :class:`frames.RemoteError` for what the
        worker raised, and :class:`ChannelClosed` when the connection went before the answer (the worker
        may or may not have run it: both writes may run again, ``ContextService``)."""
        header, _ = await self._call(frame)
        if header.get("op") == "error":
            raise frames.parse_error(header)
        return frames.parse_done(header)

    async def _call(self, frame: Any, *, cancellable: bool = False) -> tuple[dict[str, Any], list[Any]]:
        """Send ``frame(call_id)`` and await its answer. ``cancellable`` (a query: read-only): when this
        call is cancelled before its answer (its client went away, ``service.routes.common.Exchange``),
        the worker is told, and does not run it if it has not started (``workers.channel.CANCEL_OP``)."""
        if self._closed is not None:
            raise ChannelClosed(str(self._closed))
        call_id = next(self._ids)
        buffers = frame(call_id)  # FrameError (too large) before anything is sent
        waiting: asyncio.Future[tuple[dict[str, Any], list[Any]]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = waiting
        try:
            try:
                self._writer.writelines(buffers)
                await self._writer.drain()
            except (OSError, RuntimeError) as exc:  # the transport is closing or gone
                self._fail(ChannelClosed(f"worker {self.name}'s channel closed: {type(exc).__name__}"))
            return await waiting
        except asyncio.CancelledError:
            # Not answered: still waiting, or the wait itself cancelled with this task (an answer that came
            # first left it done, not cancelled: nothing is left to stop).
            if cancellable and (waiting.cancelled() or not waiting.done()) and self._closed is None:
                with contextlib.suppress(OSError, RuntimeError):  # buffered: sent with the next write at worst
                    self._writer.writelines(frames.encode({"op": CANCEL_OP, "id": next(self._ids), "of": call_id}))
            raise
        finally:
            self._waiting.pop(call_id, None)

    async def _read_replies(self) -> None:
        try:
            while True:
                header, arrays = await _read(self._reader)
                waiting = self._waiting.get(header.get("id"))  # type: ignore[arg-type]
                if waiting is not None and not waiting.done():
                    waiting.set_result((header, arrays))
        except asyncio.CancelledError:
            raise
        except (OSError, EOFError, frames.FrameError, asyncio.IncompleteReadError) as exc:
            self._fail(ChannelClosed(f"worker {self.name}'s channel closed: {type(exc).__name__}"))
        finally:
            self._fail(ChannelClosed(f"worker {self.name}'s channel closed"))

    def _fail(self, exc: ChannelClosed) -> None:
        if self._closed is None:
            self._closed = exc
            with contextlib.suppress(Exception):
                self._writer.close()
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(exc)


async def _read(reader: asyncio.StreamReader) -> tuple[dict[str, Any], list[Any]]:
    header_len, body_len = frames.sizes(await reader.readexactly(frames.PREFIX.size))
    head = await reader.readexactly(header_len)
    body = bytearray(await reader.readexactly(body_len))  # writable: the merge may work in place
    return frames.decode(head, body)


class WriteChannel:
    """A second connection to a worker's channel, for context writes: one at a time, sent from a thread.

    Bulk bytes never share the query connection (a decode query would wait behind 16 MiB of keys),
    and a blocking ``sendall`` of each array's memory sends it without a copy in this process (an
    asyncio transport joins or buffers what the socket does not take at once). Writes to one
    worker are stored one at a time there anyway, so one in flight per worker loses nothing.
    """

    def __init__(self, name: str, sock: socket.socket) -> None:
        self.name = name
        self._sock = sock
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False

    @classmethod
    def open(cls, name: str, address: dict[str, Any], timeout_s: float = CONNECT_TIMEOUT_S) -> WriteChannel:
        """Connect to ``address`` (``ShardWorker.channel()``) and say hello; blocking (run it in a thread)."""
        try:
            sock = socket.create_connection((str(address["host"]), int(address["port"])), timeout=timeout_s)
        except OSError as exc:
            raise ChannelClosed(f"worker {name}'s channel could not be opened: {type(exc).__name__}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for buf in frames.encode({"op": "hello", "token": str(address["token"])}):
                sock.sendall(buf)
            header, _ = read_frame(sock)
            if header.get("op") != "hello":
                raise ChannelClosed(f"worker {name}'s channel must answer hello, got {header.get('op')!r:.40}")
            sock.settimeout(WRITE_TIMEOUT_S)
        except (OSError, EOFError, frames.FrameError) as exc:
            sock.close()
            raise ChannelClosed(f"worker {name}'s channel could not be opened: {type(exc).__name__}") from exc
        except BaseException:
            sock.close()
            raise
        return cls(name, sock)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def call(self, frame: Any) -> tuple[dict[str, Any], list[Any]]:
        """Send ``frame(id)`` and wait for its reply; blocking. :class:`ChannelClosed` when the connection
        fails on the way: the write may or may not have been stored (the caller undoes it)."""
        with self._lock:
            if self._closed:
                raise ChannelClosed(f"worker {self.name}'s write channel was closed")
            call_id = next(self._ids)
            buffers = frame(call_id)  # FrameError (too large) before anything is sent
            try:
                for buf in buffers:
                    self._sock.sendall(buf)
                header, arrays = read_frame(self._sock)
            except (OSError, EOFError, frames.FrameError) as exc:
                self.close()
                raise ChannelClosed(f"worker {self.name}'s write channel closed: {type(exc).__name__}") from exc
            if header.get("id") != call_id:
                self.close()
                raise ChannelClosed(f"worker {self.name}'s write channel answered call {header.get('id')!r:.20}, "
                                    f"not {call_id}")
            return header, arrays
