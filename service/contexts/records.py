"""Context records: what the directory commits for each context, and its public description.

A record is plain JSON-like data (it travels to the directory actor and to every
worker holding a shard, which keeps it for a directory rebuild), typed here:

    {"id", "h_kv", "d", "d_v", "dtype", "replicas", "shard_capacity", "expected_length",
     "next_pos", "version", "shards": [{"index", "length", "workers": [worker names]}]}

``length`` is the committed length: queries read only that prefix of a shard. A
context created with ``expected_length`` has every shard of its plan from the start,
each allocated for ``shard_capacity`` keys; the ones no key has reached yet are empty.
"""

from __future__ import annotations

import secrets
from typing import TypedDict

from workers.dtypes import dtype_of
from workers.layout import bytes_per_key


class ShardEntry(TypedDict):
    index: int
    length: int  #: committed keys
    workers: list[str]  #: names of the workers holding a replica


class ContextRecord(TypedDict):
    id: str
    h_kv: int
    d: int
    d_v: int
    dtype: str  #: public dtype name (workers.dtypes.DTYPES)
    replicas: int
    shard_capacity: int  #: keys a shard holds before a new one opens
    expected_length: int | None  #: keys the context was planned for at create (None: sized for its first body)
    next_pos: int  #: where default positions of appended keys start
    version: int  #: bumped by every commit; the newest wins a directory rebuild
    shards: list[ShardEntry]


def new_context_id() -> str:
    """An unguessable id (144 random bits), URL-safe."""
    return "ctx_" + secrets.token_urlsafe(18)


def key_bytes(record: ContextRecord) -> int:
    """Bytes one key of the context takes on a worker."""
    return bytes_per_key(record["h_kv"], record["d"], record["d_v"], dtype_of(record["dtype"]))


def length(record: ContextRecord) -> int:
    """Keys the context holds (committed)."""
    return sum(s["length"] for s in record["shards"])


def describe(record: ContextRecord) -> dict:
    """The public description of a context (docs/API.md section 6.5)."""
    return {
        "id": record["id"],
        "length": length(record),
        "h_kv": record["h_kv"],
        "d": record["d"],
        "d_v": record["d_v"],
        "dtype": record["dtype"],
        "shards": len(record["shards"]),
        "replicas": record["replicas"],
        "next_pos": record["next_pos"],
        "shard_lengths": [s["length"] for s in record["shards"]],
        "expected_length": record.get("expected_length"),
    }


#: A context's states (docs/CONTEXTS.md, "Health"): every shard at its replica count; some below
#: it but every shard held; some shard held by no live worker.
READY, DEGRADED, LOST = "ready", "degraded", "lost"


def health(record: ContextRecord, live: set[str]) -> dict:
    """The context's state given the names of the live workers: ``state``, ``live_replicas`` per
    shard, and the shards below their replica count (``degraded_shards``) or with none (``lost_shards``)."""
    counts = [sum(1 for w in s["workers"] if w in live) for s in record["shards"]]
    lost = [s["index"] for s, n in zip(record["shards"], counts) if n == 0]
    degraded = [s["index"] for s, n in zip(record["shards"], counts) if 0 < n < record["replicas"]]
    return {"state": LOST if lost else DEGRADED if degraded else READY, "live_replicas": counts,
            "degraded_shards": degraded, "lost_shards": lost}
