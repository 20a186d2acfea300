"""The workloads of a load test (docs/LOADTEST.md, "Workloads"): what request ``i`` sends and what it reads.

Each workload turns a request number into a :class:`Call`: a function that sends it
with a client (one or two HTTP requests: a turn of a conversation appends, then asks)
and the :class:`~service.client.loadtest.reference.Expected` that its answer is checked
against. Contexts are shared: the base context of ``n_k`` keys (stream 0) is uploaded
once per length (:class:`Contexts`) and read by every mode but ``inline``; each
workload deletes the contexts it made itself.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from service.client.loadtest.config import SweepConfig
from service.client.loadtest.data import TURN_STREAM, Segment, Source
from service.client.loadtest.reference import CHECK_ROWS, Expected, check_rows
from service.client.sync import Client
from service.client.upload import HEADER_ROOM, Progress

T = TypeVar("T")
#: Stream numbers (data.Source): the base context, the inline keys, the shared-prefix suffixes.
BASE_STREAM, INLINE_STREAM, SUFFIX_STREAM = 0, 1, 2
#: Turns of one conversation: its turn t is stream TURN_STREAM + conversation * TURNS + t.
TURNS = 2**20
#: Keys drawn at a time for an upload (a multiple of data.GENERATE_KEYS); the client cuts them
#: into chunks under the server's limits.
UPLOAD_PIECE = 65536

#: ``send(client) -> (out, lse)``: the request's answer (after any append it makes first).
Send = Callable[[Client], tuple[np.ndarray, np.ndarray]]
#: ``progress_for(label, keys) -> progress(done, total)`` for an upload of ``keys`` keys.
ProgressFor = Callable[[str, int], Progress | None]


@dataclass
class Call:
    """Request ``index``: how to send it, what it reads, and its size."""

    index: int
    send: Send
    expected: Callable[[], Expected]
    keys: int  # keys the request's queries read (n_k of the attention)
    n_q: int
    #: The attention answer's Server-Timing when other requests followed it (a turn's append);
    #: None: the client's last answer is the attention's.
    timing: str | None = None


def ahead(pieces: Iterator[T]) -> Iterator[T]:
    """The items of ``pieces``, each next one drawn on a thread while the caller sends the last.

    Drawing a piece (random numbers, a cast) took as long as sending it; overlapped,
    an upload runs at the rate of the slower of the two. Two pieces are held at a time.
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="loadtest-draw") as pool:
        nxt = pool.submit(next, pieces, None)
        while True:
            item = nxt.result()
            if item is None:
                return
            nxt = pool.submit(next, pieces, None)
            yield item


def upload(client: Client, source: Source, stream: int, n: int, *, pos0: int = 0, replicas: int = 1,
           chunk_keys: int | None = None, progress: Progress | None = None) -> str:
    """Store keys ``[0, n)`` of ``stream`` at positions ``pos0 ..`` as a new context, piece by piece; its id.

    The first piece creates the context with ``expected_length = n`` (its shards are
    planned for all of it); the others are appends. ``progress(done, n)`` after each chunk.
    """
    ctx: str | None = None
    for start, k, v in ahead(source.pieces(stream, 0, n, UPLOAD_PIECE)):
        k_pos = pos0 + np.arange(start, start + k.shape[0]) if pos0 else None

        def step(done: int, _total: int, base: int = start) -> None:
            if progress is not None:
                progress(base + done, n)

        if ctx is None:
            ctx = client.create_context(k, v, k_pos, replicas=replicas, chunk_keys=chunk_keys, progress=step,
                                        expected_length=n)["id"]
        else:
            client.append(ctx, k, v, k_pos, chunk_keys=chunk_keys, progress=step)
    if ctx is None:
        raise ValueError(f"a context must hold at least one key, got n={n}")
    return ctx


class Contexts:
    """The base contexts of a sweep, one per length, uploaded on first use and deleted by :meth:`close`."""

    def __init__(self, client: Client, source: Source, config: SweepConfig, progress_for: ProgressFor) -> None:
        self.client, self.source, self.config, self.progress_for = client, source, config, progress_for
        self.ids: dict[int, str] = {}

    def base(self, n_k: int) -> str:
        if n_k not in self.ids:
            self.ids[n_k] = upload(self.client, self.source, BASE_STREAM, n_k, replicas=self.config.replicas,
                                   chunk_keys=self.config.chunk_keys,
                                   progress=self.progress_for(f"context of {n_k} keys", n_k))
        return self.ids[n_k]

    def drop(self, n_k: int) -> None:
        ctx = self.ids.pop(n_k, None)
        if ctx is not None:
            self.client.delete_context(ctx)


class Workload:
    """One mode at one context length. :meth:`setup`, then :meth:`call` per request, then :meth:`teardown`."""

    mode = ""

    def __init__(self, config: SweepConfig, source: Source, n_k: int) -> None:
        self.config, self.source, self.n_k = config, source, n_k
        self.created: list[str] = []  # contexts this workload made (deleted by teardown)

    def check(self, client: Client) -> None:
        """Raise ValueError if the server cannot take this workload (before any request of the sweep)."""

    def setup(self, client: Client, contexts: Contexts) -> None:
        """Upload what the requests read."""

    def call(self, i: int) -> Call:
        raise NotImplementedError

    def teardown(self, client: Client) -> None:
        while self.created:
            client.delete_context(self.created.pop())

    @property
    def base(self) -> Segment:
        return Segment(BASE_STREAM, 0, self.n_k, 0)


class Decode(Workload):
    """``n_q`` queries (default 1: a decode step) over the base context."""

    mode = "decode"

    def setup(self, client: Client, contexts: Contexts) -> None:
        self.ctx = contexts.base(self.n_k)

    def call(self, i: int) -> Call:
        n_q = self.config.n_q
        q = self.source.query(i, n_q)
        return Call(i, lambda c: c.attention(q, contexts=[self.ctx]),
                    lambda: Expected(q, np.full(n_q, self.n_k), (self.base,)), self.n_k, n_q)


class Inline(Workload):
    """``n_q`` queries with the ``n_k`` keys in the request body (the same keys every time)."""

    mode = "inline"

    def check(self, client: Client) -> None:
        body = self.n_k * self.config.shape.key_bytes + self.config.n_q * self.config.shape.h_q * self.config.shape.d * 8
        limit = client.limits().max_body_bytes
        if body + HEADER_ROOM > limit:
            raise ValueError(f"n_k = {self.n_k} makes an inline body of {body} bytes, over the server's "
                             f"{limit}-byte limit: use --mode decode (a stored context) for this length")

    def setup(self, client: Client, contexts: Contexts) -> None:
        self.check(client)
        self.k, self.v = self.source.kv(INLINE_STREAM, 0, self.n_k)

    def call(self, i: int) -> Call:
        n_q = self.config.n_q
        q = self.source.query(i, n_q)
        seg = Segment(INLINE_STREAM, 0, self.n_k, 0)
        return Call(i, lambda c: c.attention(q, self.k, self.v),
                    lambda: Expected(q, np.full(n_q, self.n_k), (seg,)), self.n_k, n_q)


class SharedPrefix(Workload):
    """``groups`` contexts of ``suffix_keys`` keys after one shared prefix (the base context); request
    ``i`` asks over the prefix and suffix ``i % groups``: the cascade case."""

    mode = "shared-prefix"

    def setup(self, client: Client, contexts: Contexts) -> None:
        self.prefix = contexts.base(self.n_k)
        cfg = self.config
        for g in range(cfg.groups):
            self.created.append(upload(client, self.source, SUFFIX_STREAM + g, cfg.suffix_keys, pos0=self.n_k,
                                       replicas=cfg.replicas, chunk_keys=cfg.chunk_keys))
        self.suffixes = list(self.created)

    def call(self, i: int) -> Call:
        cfg = self.config
        g = i % cfg.groups
        q = self.source.query(i, cfg.n_q)
        names = [self.prefix, self.suffixes[g]]
        segs = (self.base, Segment(SUFFIX_STREAM + g, 0, cfg.suffix_keys, self.n_k))
        return Call(i, lambda c: c.attention(q, contexts=names),
                    lambda: Expected(q, np.full(cfg.n_q, self.n_k + cfg.suffix_keys), segs),
                    self.n_k + cfg.suffix_keys, cfg.n_q)


@dataclass
class Conversation:
    """A chat after the base context: its own context of the turns so far (none before the first)."""

    number: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    ctx: str | None = None
    turns: list[Segment] = field(default_factory=list)  # stored turns, in order
    length: int = 0  # keys stored
    timing: str = ""  # Server-Timing of the last turn's attention answer

    def next_turn(self, keys: int, pos0: int) -> Segment:
        return Segment(TURN_STREAM + self.number * TURNS + len(self.turns), 0, keys, pos0 + self.length)

    def store(self, client: Client, seg: Segment, k: np.ndarray, v: np.ndarray, replicas: int,
              created: list[str]) -> str:
        """Append the turn ``seg`` (its keys ``k``, ``v``; the conversation's context is created at its
        first turn); the context's id."""
        if self.ctx is None:
            self.ctx = str(client.create_context(k, v, seg.pos0 + np.arange(seg.n), replicas=replicas)["id"])
            created.append(self.ctx)
        else:
            client.append(self.ctx, k, v)  # positions continue after the last turn's
        self.turns.append(seg)
        self.length += seg.n
        return self.ctx


class Turns(Workload):
    """Conversations over the base context; request ``i`` is a turn of conversation ``i % conversations``.

    Turns of one conversation take turns (a lock), as a chat's do; the latency of a
    request is its whole turn.
    """

    def setup(self, client: Client, contexts: Contexts) -> None:
        self.ctx = contexts.base(self.n_k)
        self.chats = [Conversation(c) for c in range(self.config.conversations)]

    def turn(self, client: Client, chat: Conversation, i: int) -> tuple[tuple[np.ndarray, np.ndarray], Expected]:
        """Send turn ``i`` of ``chat`` (its lock held): the answer and what it asked.

        Keeps the attention answer's Server-Timing in ``chat.timing`` (an append may follow it).
        """
        raise NotImplementedError

    def call(self, i: int) -> Call:
        chat = self.chats[i % len(self.chats)]
        asked: list[Expected] = []

        def send(client: Client) -> tuple[np.ndarray, np.ndarray]:
            with chat.lock:
                answer, exp = self.turn(client, chat, i)
                call.timing = chat.timing
            asked.append(exp)
            call.keys = sum(seg.n for seg in exp.segments)
            return answer

        def expected() -> Expected:
            if not asked:
                raise ValueError(f"request {i} was not sent: nothing to check")
            return asked[0]

        # What a turn reads is known once it is sent (``keys`` is then set to it).
        call = Call(i, send, expected, self.n_k, self.n_q)
        return call

    @property
    def n_q(self) -> int:
        return self.config.n_q


class MultiTurn(Turns):
    """A turn appends ``turn_keys`` keys to the conversation, then asks ``n_q`` queries over base + conversation."""

    mode = "multi-turn"

    def turn(self, client: Client, chat: Conversation, i: int) -> tuple[tuple[np.ndarray, np.ndarray], Expected]:
        cfg = self.config
        seg = chat.next_turn(cfg.turn_keys, self.n_k)
        ctx = chat.store(client, seg, *self.source.kv(seg.stream, seg.lo, seg.hi), cfg.replicas, self.created)
        q = self.source.query(i, cfg.n_q)
        out = client.attention(q, contexts=[self.ctx, ctx])
        chat.timing = client.last_server_timing
        return out, Expected(q, np.full(cfg.n_q, self.n_k + chat.length), (self.base, *chat.turns))


class Prefill(Turns):
    """A turn sends ``prefill_n_q`` new tokens (their q, k, v, causal) over base + conversation, then
    appends their keys to the conversation, as a chat's prefill does."""

    mode = "prefill"

    @property
    def n_q(self) -> int:
        return self.config.prefill_n_q

    def turn(self, client: Client, chat: Conversation, i: int) -> tuple[tuple[np.ndarray, np.ndarray], Expected]:
        cfg = self.config
        n = cfg.prefill_n_q
        seg = chat.next_turn(n, self.n_k)
        k, v = self.source.kv(seg.stream, seg.lo, seg.hi)
        q = self.source.query(i, n)
        names = [self.ctx] + ([chat.ctx] if chat.ctx else [])
        # Default positions: the inline keys continue after the contexts, the queries are the last n.
        out = client.attention(q, k, v, contexts=names, causal=True)
        chat.timing = client.last_server_timing  # before the append's answer replaces it
        asked = Expected(q, seg.pos0 + np.arange(n), (self.base, *chat.turns, seg), causal=True,
                         rows=check_rows(n, CHECK_ROWS))
        chat.store(client, seg, k, v, cfg.replicas, self.created)
        return out, asked


WORKLOADS: dict[str, type[Workload]] = {w.mode: w for w in (Decode, Inline, Prefill, SharedPrefix, MultiTurn)}
