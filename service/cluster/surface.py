"""The cluster's surface: what the front end asks of its shard workers, as one typed Protocol.

:class:`WorkerSurface` is every member the orchestrator, the attention and batch services,
the contexts service, the repair loop and the orphan sweep use of a pool of workers. It
has two implementations:

* ``service.cluster.pool.WorkerPool``: Ray actors (the service);
* ``service.cluster.local.LocalPool``: ``workers.actor.ShardWorker`` objects in this
  process, called in threads (no Ray: the unit tests of the code above the seam).

Both keep the same contract: a worker that is gone makes its call raise
:class:`service.core.errors.WorkersUnavailable` and is marked dead; a query a worker answers
with an exception other than a domain one (:data:`DOMAIN_ERRORS`) is :func:`failed` (500,
not retried); the other calls raise what the worker raised (its class, as Ray hands it over).

This module imports no Ray, and neither do the types of work a pool is given.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from merge import State
from service.core import request_id
from service.core.errors import Internal, WorkersUnavailable
from workers.frames import RemoteError
from workers.store import Expired, RecordStale, ShardMissing
from workers.tasks import ComputeStatus, ResidentQuery, ShardQuery, ShardRead, ShardWrite

log = logging.getLogger("service.cluster.pool")  # the log the service's operators know these lines from

#: Pings in a row that time out before a worker that answered before counts as dead (a death Ray
#: reports counts at once): with the repair loop's 5 s pings every ``heal_interval_s``, 15 s or more.
MISSED_PINGS = 3
#: Worker exceptions a channel reply may carry that the front end handles as it does from a Ray call.
DOMAIN_ERRORS: dict[str, type[Exception]] = {"ShardMissing": ShardMissing, "RecordStale": RecordStale,
                                              "Expired": Expired}
#: Their classes: a worker's exception that is none of them is a fault of the service (:func:`failed`).
DOMAIN_CLASSES: tuple[type[Exception], ...] = tuple(DOMAIN_ERRORS.values())


@dataclass(frozen=True, eq=False)
class InlineWork:
    """An inline shard: its keys and values (arrays or object refs) and their positions."""

    k: Any
    v: Any
    k_pos: Any


@dataclass(frozen=True)
class ResidentWork:
    """Resident shards one worker holds, read in key order: one read gives its state; several give a
    state per read, unmerged, in the order listed (the front end merges every state of the request
    in key order, so the answer does not depend on which reads shared a call). ``fanin`` is the
    worker-side merge's for a single read (a merge of one state is that state)."""

    reads: tuple[ShardRead, ...]
    fanin: int


def failed(worker: str, kind: str, message: str) -> Internal:
    """The 500 for a query that worker ``worker`` answered with a ``kind`` exception that is not a
    domain error: logged with its message, the client told the worker, the kind and the request id."""
    rid = request_id.current()
    log.warning("request %s: worker %s failed a query: %s: %s", rid, worker, kind, message)
    return Internal(f"the service failed on this request: worker {worker} raised {kind}; "
                    f"the server log has the details under request id {rid}")


def domain(exc: RemoteError) -> Exception:
    """A worker's exception as the front end handles it from a Ray call: a domain error by its own class
    (:data:`DOMAIN_ERRORS`), any other as it came."""
    known = DOMAIN_ERRORS.get(exc.kind)
    return known(exc.message) if known is not None else exc


def last_line(message: str) -> str:
    """The last non-blank line of an error message: Ray's for an actor that died in its constructor
    ends with that error (``FileNotFoundError: ... '/data/splitkey'``) after its traceback."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else message


class WorkerSlot(Protocol):
    """One worker as its pool sees it (read-only here: the pool keeps it)."""

    @property
    def index(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def alive(self) -> bool: ...
    @property
    def outstanding(self) -> int:
        """Calls sent to it and not answered yet."""
    @property
    def node_id(self) -> str: ...
    @property
    def info(self) -> dict:
        """What its last ping answered (``ShardWorker.ping``)."""
    @property
    def held(self) -> dict:
        """:attr:`info` while it is alive; nothing once counted dead."""
    @property
    def incarnation(self) -> str:
        """The worker instance behind the name, from its last ping ("" before one)."""


class _Slot(Protocol):
    """What :class:`Roster` reads of a slot (both pools' slots are plain dataclasses)."""

    index: int
    name: str
    alive: bool
    outstanding: int


S = TypeVar("S", bound=_Slot)


class Roster(Generic[S]):
    """Who the workers are and which one takes work: the one rule both pools share.

    Replica choice lives here once: :meth:`pick` gives the live candidate with the least
    outstanding work (ties: the lowest index), for the Ray pool and the in-process one alike.
    """

    slots: list[S]

    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def alive(self) -> list[S]:
        return [s for s in self.slots if s.alive]

    def indexes(self, names: Sequence[str], *, alive: bool = False) -> list[int]:
        """Indexes of the named workers this pool has (and, with ``alive``, that answer), in order.

        The index by name is built once per list of slots: a query's plan asks it for every shard, and
        a slot keeps its name for good (a replacement takes the dead worker's)."""
        cached: tuple[list[S], int, dict[str, int]] | None = getattr(self, "_names", None)
        if cached is None or cached[0] is not self.slots or cached[1] != len(self.slots):
            cached = (self.slots, len(self.slots), {s.name: s.index for s in self.slots})
            self._names = cached
        by_name = cached[2]
        return [by_name[n] for n in names if n in by_name and (not alive or self.slots[by_name[n]].alive)]

    def names(self, indexes: Sequence[int]) -> list[str]:
        return [self.slots[i].name for i in indexes]

    def pick(self, candidates: Sequence[int] | None = None, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """The live worker with the least outstanding work (ties: lowest index)."""
        pool = range(self.size) if candidates is None else candidates
        live = [i for i in pool if i not in exclude and self.slots[i].alive]
        if not live:
            raise WorkersUnavailable("no live worker is left to take this work")
        return min(live, key=lambda i: (self.slots[i].outstanding, i))


class _PingedSlot(_Slot, Protocol):
    """What a ping's bookkeeping reads and writes of a slot (:func:`answered`, :func:`missed_ping`)."""

    info: dict
    node_id: str
    incarnation: str
    missed: int


def answered(slot: _PingedSlot, info: dict) -> bool:
    """Note a ping's answer on ``slot``: alive, its node and what it holds. True when the name now stands for
    another worker than the one seen before (another front end replaced it; its direct channel is another)."""
    slot.info, slot.node_id, slot.alive = info, info.get("node_id", ""), True
    seen = str(info.get("incarnation", ""))
    replaced = bool(slot.incarnation) and seen != slot.incarnation
    slot.incarnation, slot.missed = seen, 0
    return replaced


def missed_ping(slot: _PingedSlot, timeout_s: float) -> bool:
    """Note a ping that timed out; True when ``slot`` is now counted dead.

    A ping that timed out is no proof of death (Ray says so when the actor died): a worker busy for
    long, or this event loop held up, looks the same. Counting it dead forgets its replicas, which for
    a context with one replica loses the keys: a worker that answered before is dead only after
    :data:`MISSED_PINGS` in a row.
    """
    slot.missed += 1
    if slot.incarnation and slot.missed < MISSED_PINGS:
        log.warning("worker %s did not answer a ping within %.3g s (%d in a row; dead at %d)",
                    slot.name, timeout_s, slot.missed, MISSED_PINGS)
        return False
    if slot.alive or slot.incarnation:
        log.warning("worker %s did not answer %d pings in a row: counted dead", slot.name, slot.missed)
    slot.alive = False
    return True


class WorkerSurface(Protocol):
    """The pool of shard workers, as every caller above the seam uses it (module docstring).

    Workers are named by their index in :attr:`slots`. The calls that return an ``Awaitable`` are
    submitted when called (their arguments are taken then), and answer when awaited.
    """

    @property
    def slots(self) -> Sequence[WorkerSlot]: ...
    @property
    def size(self) -> int: ...
    @property
    def alive(self) -> Sequence[WorkerSlot]: ...
    @property
    def call_errors(self) -> tuple[type[Exception], ...]:
        """What a call other than a query raises when the worker is gone or its method failed."""
    @property
    def cluster_errors(self) -> tuple[type[Exception], ...]:
        """Errors of the cluster itself (not of a worker's code) that a query may raise: Ray's for the Ray
        pool (an object lost, a task that could not run), none in process. The orchestrator answers them
        503 ``workers_unavailable``, as the route answers a single request's."""

    # -- who
    def indexes(self, names: Sequence[str], *, alive: bool = False) -> list[int]: ...
    def names(self, indexes: Sequence[int]) -> list[str]: ...
    def pick(self, candidates: Sequence[int] | None = None,
             exclude: set[int] | frozenset[int] = frozenset()) -> int: ...

    # -- health and lifecycle
    async def refresh(self, timeout_s: float = 60.0) -> None: ...
    async def answers(self, index: int, timeout_s: float) -> bool:
        """Whether worker ``index`` answers a ping within ``timeout_s`` (nothing is noted on its slot)."""
    async def fence(self, index: int) -> None:
        """Kill worker ``index`` (a hung one too: Ray's raylet kills a stopped process) and count it dead: its
        calls in flight raise ``WorkersUnavailable`` and never reach it after, and the repair loop replaces it."""
    def replace(self, slot: WorkerSlot) -> bool: ...
    def shutdown(self) -> None: ...

    # -- queries
    async def put(self, *arrays: Any) -> list[Any]: ...
    async def compute(self, index: int, q: Any, query: ShardQuery, work: InlineWork | ResidentWork,
                      *, keep_state: bool, state_nbytes: int = 0) -> tuple[ComputeStatus, Any]: ...
    async def compute_many(self, index: int, items: Sequence[ResidentQuery]) -> list[Any]: ...
    def merge_states(self, index: int, *states: Any) -> tuple[Any, Any]:
        """Submit one node of the merge tree on a worker: ``(state, done)``; the state goes on to other
        nodes, :meth:`root_state` awaits the root; call ``done()`` once that is awaited."""
    async def root_state(self, state: Any) -> State:
        """The merge tree's root, :meth:`merge_states`' state, here; ``WorkersUnavailable`` if a node was lost."""

    # -- resident shards
    def create_shard(self, index: int, write: ShardWrite, k: Any, v: Any,
                     record: Mapping[str, object]) -> Awaitable[Any]: ...
    def create_shards(self, index: int, writes: Sequence[ShardWrite], k: Any, v: Any,
                      record: Mapping[str, object]) -> Awaitable[Any]: ...
    def append_shard(self, index: int, write: ShardWrite, k: Any, v: Any, committed: int) -> Awaitable[Any]: ...
    def export_shard(self, index: int, context_id: str, shard: int, length: int) -> Awaitable[Any]: ...
    def truncate_shard(self, index: int, context_id: str, shard: int, length: int) -> Awaitable[Any]: ...
    def note_context(self, index: int, context_id: str, record: Mapping[str, object]) -> Awaitable[Any]: ...
    def drop(self, index: int, context_id: str, shard: int | None = None) -> Awaitable[Any]: ...
    def delete(self, index: int, context_id: str) -> Awaitable[Any]: ...
    def tombstones(self, index: int) -> Awaitable[Any]: ...
    def stored(self, index: int, context_ids: Sequence[str]) -> Awaitable[Any]: ...
    def forget_tombstones(self, index: int, context_ids: Sequence[str], older_than_s: float) -> Awaitable[Any]: ...
    def held(self, index: int) -> Awaitable[Any]: ...
    def release_unrecorded(self, index: int, context_ids: Sequence[str]) -> Awaitable[Any]: ...
