"""An upload's chunks with several in flight: the next one travels while the server stores this one.

Appends to one context are applied one at a time, in the order of their ``after``
(docs/CONTEXTS.md, "Uploading long contexts"): the server reads and decodes a
chunk's body before it takes the context's lease, so while chunk i is copied into
the workers chunk i + 1 is already on the wire and being decoded. Chunk i + 1 is
sent only once chunk i's body is out, so it reaches the lease second; should it
come first anyway, the server refuses it (409 ``length_mismatch``) and it is sent
again.

:func:`send_pipelined` is the fast path and has no retries of its own. At the first
answer that is not a success it lets the chunks in flight finish, asks the server
where this upload's keys end, and returns how many chunks that is: the caller
goes on one chunk at a time from there, with its usual retries
(:meth:`service.client.sync.Client._send`).

Every chunk but the first carries ``continues`` with the upload's id: the server
stores it only right after the upload's own previous chunk. ``after`` alone would
not do: while chunk i is lost or refused, another writer's chunk of the same size
brings the context to chunk i + 1's ``after``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from service.client.upload import ATTEMPT_ERRORS, Upload

#: ``(path, query, tensors, sent) -> description``: one chunk's request on one
#: connection; ``sent()`` is called once its body is out.
SendChunk = Callable[[str, str, Any, Callable[[], None]], dict]


@dataclass
class Chunk:
    keys: int
    tensors: Any
    after: int = 0  # the context's length this chunk follows
    sent: threading.Event = field(default_factory=threading.Event)


def send_pipelined(senders: Sequence[SendChunk], upload: Upload, path: str, chunks: Sequence[Chunk],
                   stored_end: Callable[[], int | None], query: Callable[[int], str]) -> tuple[int, dict]:
    """Send ``chunks`` in order, ``len(senders)`` at a time (one connection each).

    ``upload.committed`` grows (and progress is reported) chunk by chunk as they are
    answered in order. Returns ``(done, description)``: the chunks the context holds
    (all of them unless something failed) and the last chunk's description when all
    were answered, else ``{}``. ``stored_end()`` asks the server where this upload's
    keys end in the context (None if it cannot say or none is stored); ``query(after)``
    is the query string of the chunk that follows ``after`` keys.
    """
    depth = len(senders)
    futures: list[Future] = []
    desc: dict = {}
    done = 0  # chunks answered with success, in order, and committed
    failed = False

    def settle(i: int) -> None:
        """Wait for chunk ``i``'s answer; commit it if it and every chunk before it succeeded."""
        nonlocal done, desc, failed
        try:
            got = futures[i].result()
        except ATTEMPT_ERRORS:
            failed = True
            return
        if not failed and done == i:
            done, desc = i + 1, got
            upload.commit(chunks[i].keys)

    with ThreadPoolExecutor(depth, thread_name_prefix="splitkey-upload") as pool:
        for i, chunk in enumerate(chunks):
            if i >= depth:
                settle(i - depth)  # frees its connection
                if failed:
                    break  # a chunk before this one did not go through: send no more
            if i:
                chunks[i - 1].sent.wait()  # this body starts once the previous one is out
            futures.append(pool.submit(senders[i % depth], path, query(chunk.after), chunk.tensors, chunk.sent.set))
        for i in range(max(0, len(futures) - depth), len(futures)):
            settle(i)
    if not failed and done == len(chunks):
        return done, desc
    return _held_chunks(upload, chunks, done, stored_end), {}


def _held_chunks(upload: Upload, chunks: Sequence[Chunk], done: int, stored_end: Callable[[], int | None]) -> int:
    """After a failure: the chunks the server holds, counted from where this upload's keys end
    (commits the ones not yet counted).

    A chunk whose answer was lost may still have been stored, and a later chunk then
    too: the upload's end says which (its keys are contiguous from its first chunk).
    When the server cannot say, the answered chunks stand.
    """
    end = stored_end()
    if end is None:
        return done
    for i in range(done, len(chunks)):
        if end < chunks[i].after + chunks[i].keys:
            break
        upload.commit(chunks[i].keys)
        done = i + 1
    return done
