"""Chunks in flight together (service.client.pipeline): in order, each stored once, and an honest count on failure.

The senders here stand in for one context on a server: they apply a chunk only when
its ``after`` is the context's length, as the server does under the context's lease,
and answer 409 otherwise. The real server runs in tests/e2e/test_service_client_upload.py.
"""

import threading
import time

from service.client.errors import SplitkeyError
from service.client.pipeline import Chunk, send_pipelined
from service.client.upload import Upload


class Context:
    """A context's length, changed only by a chunk that follows it exactly; writes take turns in the
    order they arrived (the front end's turn lock)."""

    def __init__(self) -> None:
        self.length = 0
        self.order: list[int] = []
        self.turn = threading.Condition()
        self.arrivals: list[int] = []

    def arrive(self, after: int) -> None:
        with self.turn:
            self.arrivals.append(after)

    def apply(self, after: int, keys: int) -> dict:
        """Once every write that arrived before this one is done."""
        with self.turn:
            self.turn.wait_for(lambda: self.arrivals[0] == after)
            try:
                if after != self.length:
                    raise SplitkeyError(409, "length_mismatch", f"after must be the context's length {self.length}, "
                                                                f"got {after}")
                self.length += keys
                self.order.append(after)
                return {"length": self.length}
            finally:
                self.arrivals.pop(0)
                self.turn.notify_all()


def chunks(sizes):
    out, after = [], 0
    for n in sizes:
        out.append(Chunk(n, {"k": n}, after))
        after += n
    return out


def sender(ctx, delay=None, lose_answer=None):
    """A connection: ``delay(after)`` seconds on the way (after its body is out, before it reaches the
    server); ``lose_answer(after)``: the chunk is stored but its answer never comes."""
    def send(path, query, tensors, sent):
        after = int(query.split("=")[1])
        if delay:  # held up on the way: the next chunk may arrive first
            sent()
            time.sleep(delay(after))
            ctx.arrive(after)
        else:  # the body is in when the client's send returns
            ctx.arrive(after)
            sent()
        got = ctx.apply(after, tensors["k"])
        if lose_answer and lose_answer(after):
            raise ConnectionResetError("the answer was lost")
        return got
    return send


def run(ctx, items, senders):
    seen = []
    upload = Upload(total=sum(c.keys for c in items), progress=lambda done, total: seen.append(done))
    done, desc = send_pipelined(senders, upload, "/append", items, lambda: ctx.length, lambda a: f"after={a}")
    return done, desc, upload, seen


def test_every_chunk_is_stored_once_in_order_and_reported_in_order():
    ctx = Context()
    items = chunks([5, 7, 3, 9, 4, 6])
    done, desc, upload, seen = run(ctx, items, [sender(ctx) for _ in range(3)])
    assert done == 6 and desc == {"length": 34} and upload.committed == 34
    assert ctx.order == [0, 5, 12, 15, 24, 28] and seen == [5, 12, 15, 24, 28, 34]


def test_a_chunk_that_overtakes_the_one_before_is_refused_and_the_count_stops_there():
    ctx = Context()
    items = chunks([5, 7, 3, 9])
    slow_first = sender(ctx, delay=lambda after: 0.2 if after == 0 else 0)  # chunk 1 reaches the lease first
    done, desc, upload, seen = run(ctx, items, [slow_first, sender(ctx)])
    assert ctx.order == [0] and done == 1 and upload.committed == 5 and seen == [5] and desc == {}


def test_a_chunk_stored_without_an_answer_is_counted_from_the_length():
    ctx = Context()
    items = chunks([5, 7, 3, 9])
    lossy = sender(ctx, lose_answer=lambda after: after == 5)  # chunk 1 is stored, its answer lost
    done, desc, upload, seen = run(ctx, items, [sender(ctx), lossy])
    # Chunk 2 may or may not have followed before the loop stopped: the length decides.
    assert done == len(ctx.order) >= 2 and upload.committed == ctx.length and seen[-1] == ctx.length
    assert desc == {}


def test_one_connection_sends_one_chunk_at_a_time():
    ctx = Context()
    done, _, upload, _ = run(ctx, chunks([1, 2, 3]), [sender(ctx)])
    assert done == 3 and upload.committed == 6 and ctx.order == [0, 1, 3]
