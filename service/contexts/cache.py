"""The front end's cache of committed context records (docs/CONTEXTS.md, "Resolving a query").

A query names contexts; resolving them is a call of the directory actor, about a
millisecond here, paid by every query. The cache keeps the records this front end
read or wrote and answers from them; it is never trusted alone:

* every shard a query reads carries the version of the record it came from
  (``workers.tasks.ShardRead.version``) and a worker that was noted a newer
  committed version refuses the read (``workers.store.RecordStale``); a write is
  acknowledged only after every holder was noted, so once a client has seen an
  append (through any front end) no query reads the older record;
* a record whose shards hold no keys is not served from here (no worker would see
  the query, so none could refuse it);
* a deleted context's shards are dropped before the delete is acknowledged: a read
  through a stale record finds its shard missing.

The service drops the entries of a query that failed so and resolves it again from
the directory, once. Entries are evicted least recently used beyond ``capacity``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from service.contexts.records import ContextRecord


class RecordCache:
    """Committed records by context id, newest version kept, at most ``capacity`` (0: nothing kept)."""

    def __init__(self, capacity: int) -> None:
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._records: OrderedDict[str, ContextRecord] = OrderedDict()
        self.hits = 0  #: resolutions answered here (for /metrics and tests)
        self.misses = 0  #: resolutions that went to the directory
        self.stale = 0  #: cached records a worker refused (dropped with :meth:`drop_stale`)

    def __len__(self) -> int:
        return len(self._records)

    def servable(self, ids: Sequence[str]) -> list[ContextRecord] | None:
        """The records of ``ids`` in order when every one is here and holds keys; else None (a miss)."""
        found = []
        for ctx_id in ids:
            rec = self._records.get(ctx_id)
            if rec is None or not any(s["length"] for s in rec["shards"]):
                self.misses += 1
                return None
            found.append(rec)
        for ctx_id in ids:
            self._records.move_to_end(ctx_id)
        self.hits += 1
        return found

    def put(self, record: ContextRecord) -> None:
        """Keep ``record`` unless a newer version of it is kept already."""
        if not self.capacity:
            return
        ctx_id = record["id"]
        old = self._records.get(ctx_id)
        if old is not None and old["version"] > record["version"]:
            return
        self._records[ctx_id] = record
        self._records.move_to_end(ctx_id)
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def drop(self, ids: Iterable[str]) -> None:
        for ctx_id in ids:
            self._records.pop(ctx_id, None)

    def drop_stale(self, ids: Iterable[str]) -> None:
        """Drop the records of a query a worker refused (or that found a replica gone); counted."""
        self.stale += 1
        self.drop(ids)
