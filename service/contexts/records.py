"""Context records: what the directory commits for each context, and its public description.

A record is plain JSON-like data (it travels to the directory actor and to every
worker holding a shard, which keeps it for a directory rebuild), typed here:

    {"id", "h_kv", "d", "d_v", "dtype", "replicas", "shard_capacity", "expected_length",
     "next_pos", "version", "shards": [{"index", "length", "workers": [worker names], "body"}],
     "uploads": [{"id", "start", "end"}], "writer"}

``length`` is the committed length: queries read only that prefix of a shard. A
context created with ``expected_length`` has every shard of its plan from the start,
each allocated for ``shard_capacity`` keys; the ones no key has reached yet are empty.
"""

from __future__ import annotations

import secrets
from typing import NotRequired, TypedDict

from workers.dtypes import dtype_of
from workers.layout import bytes_per_key


class ShardEntry(TypedDict):
    index: int
    length: int  #: committed keys
    workers: list[str]  #: names of the workers holding a replica
    #: Keys the shard's body was allocated for at its create (``workers.layout.ShardKV``): a copy made
    #: later (repair) is cut into body and tail alike, so that every replica answers the same bits.
    #: Absent in records written before 2026-12-06.
    body: NotRequired[int]


class UploadEntry(TypedDict):
    """Where one chunked upload's keys are: ``[start, end)`` of the context, contiguous (docs/CONTEXTS.md)."""

    id: str  #: the client's upload id
    start: int  #: the context's length before its first chunk
    end: int  #: the context's length after its last chunk


#: Uploads a record remembers, the most recent first: enough to answer a client that asks
#: after a lost answer, while several writers take turns.
MAX_UPLOADS = 8


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
    uploads: NotRequired[list[UploadEntry]]  #: recent chunked uploads, the latest first (absent: none yet)
    writer: NotRequired[str]  #: the lease owner of the append that made this version (absent: none since the create)


def new_context_id() -> str:
    """An unguessable id (144 random bits), URL-safe."""
    return "ctx_" + secrets.token_urlsafe(18)


def key_bytes(record: ContextRecord) -> int:
    """Bytes one key of the context takes on a worker."""
    return bytes_per_key(record["h_kv"], record["d"], record["d_v"], dtype_of(record["dtype"]))


def length(record: ContextRecord) -> int:
    """Keys the context holds (committed)."""
    return sum(s["length"] for s in record["shards"])


def upload_entry(record: ContextRecord, upload: str) -> UploadEntry | None:
    """Where upload ``upload``'s keys are in the context, if it is among the recent ones."""
    return next((e for e in record.get("uploads", []) if e["id"] == upload), None)


def continues_upload(record: ContextRecord, upload: str) -> bool:
    """Whether the context's last append was upload ``upload``'s: its keys end where the context does.

    A later append of any other writer (with an upload id or without) moves the context's
    length past the upload's end, so a chunk that continues it would leave that writer's
    keys between its own.
    """
    entry = upload_entry(record, upload)
    return entry is not None and entry["end"] == length(record)


def note_upload(record: ContextRecord, upload: str, start: int, end: int, continues: bool) -> None:
    """Record (in place) that upload ``upload``'s keys now reach ``end``; a first chunk starts it at ``start``."""
    entries = [e for e in record.get("uploads", []) if e["id"] != upload]
    first = upload_entry(record, upload) if continues else None
    entries.insert(0, {"id": upload, "start": start if first is None else first["start"], "end": end})
    record["uploads"] = entries[:MAX_UPLOADS]


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
