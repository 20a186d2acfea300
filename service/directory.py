"""The contexts directory: a named Ray actor holding every context's committed record.

Front ends are stateless: they read and commit records here, so a restarted
front end, or a second one on the same cluster, sees the same contexts. If the
directory itself restarts, its constructor rebuilds the records from what the
workers report holding (each worker keeps the newest committed record of every
context it holds a shard of).

A record (plain dict, JSON-friendly):

    {"id", "h_kv", "d", "d_v", "dtype", "replicas", "shard_capacity", "next_pos",
     "version", "shards": [{"index", "length", "workers": [worker names]}]}

``length`` is the committed length: queries read only that prefix of a shard.
Appends to one context are serialised by a lease (:meth:`DirectoryActor.acquire`).
"""

from __future__ import annotations

import logging
import time

import ray

log = logging.getLogger(__name__)

DIRECTORY_NAME = "splitkey-directory"


class DirectoryActor:
    def __init__(self, worker_names: list[str], namespace: str) -> None:
        self.records: dict[str, dict] = {}
        self.leases: dict[str, tuple[str, float]] = {}
        self.rebuilt_from = self._rebuild(worker_names, namespace)

    def _rebuild(self, worker_names: list[str], namespace: str) -> int:
        """Rebuild records from the workers' reports; returns how many workers answered."""
        reports: dict[str, list[dict]] = {}
        answered = 0
        for name in worker_names:
            try:
                handle = ray.get_actor(name, namespace=namespace)
                held = ray.get(handle.held.remote(), timeout=30)
            except (ValueError, ray.exceptions.RayError) as exc:
                log.warning("directory rebuild: %s did not answer: %s", name, exc)
                continue
            answered += 1
            for info in held:
                reports.setdefault(info["context_id"], []).append({**info, "worker": name})
        for ctx_id, infos in reports.items():
            newest = max((i["context"] for i in infos if i["context"]), key=lambda r: r.get("version", 0), default=None)
            if newest is None:
                continue
            record = {**newest, "shards": []}
            for shard in newest["shards"]:
                holders = [i["worker"] for i in infos if i["index"] == shard["index"] and i["length"] >= shard["length"]]
                record["shards"].append({**shard, "workers": holders})
            self.records[ctx_id] = record
        return answered

    # -- records ------------------------------------------------------------------
    def get(self, ctx_id: str) -> dict | None:
        return self.records.get(ctx_id)

    def get_many(self, ids: list[str]) -> list[dict | None]:
        return [self.records.get(i) for i in ids]

    def list(self) -> list[dict]:
        return [self.records[k] for k in sorted(self.records)]

    def commit(self, record: dict, owner: str | None = None) -> None:
        """Store a record; for an existing context only under the caller's lease."""
        ctx_id = record["id"]
        if ctx_id in self.records and owner is not None and not self._holds(ctx_id, owner):
            raise ValueError(f"lease on {ctx_id} must be held by {owner}, got another holder")
        self.records[ctx_id] = record

    def remove(self, ctx_id: str) -> dict | None:
        self.leases.pop(ctx_id, None)
        return self.records.pop(ctx_id, None)

    def forget_worker(self, ctx_id: str, shard_index: int, worker: str) -> None:
        """A replica turned out lost: stop routing to it."""
        rec = self.records.get(ctx_id)
        if rec is None:
            return
        for shard in rec["shards"]:
            if shard["index"] == shard_index and worker in shard["workers"]:
                shard["workers"] = [w for w in shard["workers"] if w != worker]

    # -- leases -------------------------------------------------------------------
    def acquire(self, ctx_id: str, owner: str, ttl_s: float) -> bool:
        now = time.monotonic()
        held = self.leases.get(ctx_id)
        if held is not None and held[0] != owner and held[1] > now:
            return False
        self.leases[ctx_id] = (owner, now + ttl_s)
        return True

    def release(self, ctx_id: str, owner: str) -> None:
        if self._holds(ctx_id, owner):
            del self.leases[ctx_id]

    def _holds(self, ctx_id: str, owner: str) -> bool:
        held = self.leases.get(ctx_id)
        return held is not None and held[0] == owner and held[1] > time.monotonic()

    def ping(self) -> dict:
        return {"contexts": len(self.records), "rebuilt_from": self.rebuilt_from}
