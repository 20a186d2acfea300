"""What travels to a shard worker and back: typed, checked once where a request entered.

The service builds these from a validated request and the contexts directory;
``workers.actor.ShardWorker`` takes them as they are. ``q`` and the key/value
arrays travel beside them as top-level task arguments, so that Ray resolves
their object references and never copies them twice, each wrapped by
:func:`carry` (and unwrapped by the worker with :func:`arrive`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.dtypes import BFLOAT16
from workers.options import AttentionOptions


@dataclass(frozen=True, eq=False)
class Carried:
    """A bfloat16 array on its way to a worker, as its bits (uint16).

    NumPy pickles arrays of dtypes it knows from a plug-in (bfloat16) in band, as a
    byte string: ``ray.put`` of a bfloat16 array runs at about 0.5 GB/s here, of the
    same bytes as uint16 at memory speed (out of band, one copy into the store).
    """

    bits: Any  # the array viewed as uint16, same shape

    def array(self) -> Any:
        return self.bits.view(BFLOAT16)


def carry(a: Any) -> Any:
    """What goes to ``ray.put`` or into a call for array ``a``: itself, or its :class:`Carried` bits."""
    if isinstance(a, np.ndarray) and a.dtype == BFLOAT16:
        return Carried(a.view(np.uint16))
    return a


def arrive(x: Any) -> Any:
    """The array a worker received (inverse of :func:`carry`)."""
    return x.array() if isinstance(x, Carried) else x


@dataclass(frozen=True, eq=False)
class ShardQuery:
    """The query side of one request, the same for every shard it scatters to.

    ``budget_s``: the seconds the request had left of its deadline when the front end sent
    this call; the worker starts its own clock on arrival and does not start the work once
    they are spent (docs/SERVICE.md, "Deadlines"). Relative, so no two nodes' clocks are ever
    compared. None: no deadline (internal calls), the work always runs.

    ``trace``: the W3C ``traceparent`` of the request when it is traced (``workers.tracing``: the
    worker draws its passes for it); None otherwise.
    """

    q_pos: Any  # [n_q] int64 numpy array: absolute positions of the queries
    options: AttentionOptions
    budget_s: float | None = None
    trace: str | None = None

    def with_budget(self, budget_s: float | None) -> ShardQuery:
        """This query with ``budget_s`` seconds left (set by the front end as it sends each call). Built
        field by field, a third of ``dataclasses.replace``'s cost: a new field must be passed on here."""
        return ShardQuery(self.q_pos, self.options, budget_s, self.trace)


@dataclass(frozen=True)
class ShardRead:
    """The committed prefix of one resident shard: keys ``[0, length)`` of shard ``index``.

    ``version`` is the context record's version the front end read the shard from; ``fresh``
    when it read it from the directory for this query, not from its cache
    (``workers.store.ShardStore.check_read``: a fresh read is never refused). Version 0 is
    not checked.
    """

    context_id: str
    index: int
    length: int
    version: int = 0
    fresh: bool = False


@dataclass(frozen=True, eq=False)
class ResidentQuery:
    """One query of a batch over resident shards a worker holds (``ShardWorker.partial_resident_many``).

    ``q`` is carried (:func:`carry`); the worker answers one state per read, in the
    order listed, unmerged: the front end merges every shard's state of the query
    over the same fixed tree as a single request does, so a batched answer is
    bitwise the same as the single one.
    """

    q: Any  # [n_q, h_q, d]
    query: ShardQuery
    reads: tuple[ShardRead, ...]


@dataclass(frozen=True, eq=False)
class ShardWrite:
    """Keys written to one resident shard (with ``k`` and ``v`` beside it)."""

    context_id: str
    index: int
    dtype: str  # the stored dtype's public name (workers.dtypes.DTYPES)
    max_capacity: int  # keys the shard may grow to
    k_pos: Any  # [n] int64 numpy array
    #: Keys the shard's body is allocated for (and charged) at its create; 0: the keys written. Fewer than the
    #: keys written (a copy of a shard that has a tail): the rest go to the tail (workers.layout.ShardKV).
    reserve: int = 0
    span: tuple[int, int] | None = None  # keys [a, b) of the k and v sent beside it; None: all of them

    def keys_of(self, a: Any) -> Any:
        """This write's keys of an array sent beside it (k or v)."""
        return a if self.span is None else a[self.span[0]:self.span[1]]


@dataclass(frozen=True)
class ComputeStatus:
    """What a worker reports with each computed state (the state itself may stay in the object store)."""

    worker: str
    seconds: float  #: of the pass that computed it (shared by the whole batch)
    nbytes: int
    batch: int = 1  #: requests that shared the pass over the keys
