"""Resident KV contexts: create, append, describe, list, delete, and plan queries over them.

The records live in the directory actor (``service.directory``); the keys live
on the workers in the kernel's streaming layout (``workers.store``). Writes are
all-or-nothing: a create or append that fails anywhere (no room: 507; a worker
gone: 503) undoes what it wrote before the error is returned, and only then is
the new record committed, so a query sees a context before or after an append,
never half of it.
"""

from __future__ import annotations

import asyncio
import copy
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from service.directory import DIRECTORY_NAME, DirectoryActor
from service.attention import check_all_finite
from service.errors import ApiError
from service.orchestrator import Job, shard_bounds
from service.placement import WorkerLoad, place
from service.pool import WorkerPool, WorkerUnavailable
from service.settings import ServiceSettings
from workers.dtypes import BFLOAT16
from workers.options import AttentionOptions, check_positions
from workers.store import CapacityError, ShardMissing

DTYPE_NAMES = {np.dtype(np.float16): "float16", BFLOAT16: "bfloat16", np.dtype(np.float32): "float32",
               np.dtype(np.float64): "float64"}
LEASE_TTL_S = 60.0
#: How long a directory call waits for a restarting directory, and how often it retries.
DIRECTORY_WAIT_S = 30.0
DIRECTORY_RETRY_S = 0.1
LEASE_POLL_S = 0.01


async def put_once(pairs: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Each shard's keys and values into the object store once, off the event loop:
    every replica's write then reads the same objects instead of its own serialised copy."""
    return await asyncio.to_thread(lambda: [(ray.put(k), ray.put(v)) for k, v in pairs])


def new_context_id() -> str:
    """An unguessable id (144 random bits), URL-safe."""
    return "ctx_" + secrets.token_urlsafe(18)


def describe(record: dict) -> dict:
    """The public description of a context (CONTRACT: id, length, h_kv, d, d_v, dtype, shards, replicas)."""
    return {
        "id": record["id"],
        "length": sum(s["length"] for s in record["shards"]),
        "h_kv": record["h_kv"],
        "d": record["d"],
        "d_v": record["d_v"],
        "dtype": record["dtype"],
        "shards": len(record["shards"]),
        "replicas": record["replicas"],
        "next_pos": record["next_pos"],
        "shard_lengths": [s["length"] for s in record["shards"]],
    }


class Directory:
    """Front-end handle of the directory actor."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    @classmethod
    async def connect(cls, settings: ServiceSettings, pool: WorkerPool, detached: bool) -> Directory:
        opts: dict[str, Any] = {"name": DIRECTORY_NAME, "namespace": settings.ray_namespace, "get_if_exists": True,
                                "max_restarts": -1, "num_cpus": 0}
        if detached:
            opts["lifetime"] = "detached"
        names = [s.name for s in pool.slots]
        handle = ray.remote(DirectoryActor).options(**opts).remote(names, settings.ray_namespace)
        await handle.ping.remote()
        return cls(handle)

    async def call(self, method: str, *args: Any) -> Any:
        """Call the directory; while Ray restarts it (it rebuilds from the workers), retry.

        A directory that stays away past ``DIRECTORY_WAIT_S`` is a 503, never a 500.
        """
        deadline = time.monotonic() + DIRECTORY_WAIT_S
        while True:
            try:
                return await getattr(self.handle, method).remote(*args)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError) as exc:
                if time.monotonic() > deadline:
                    raise ApiError("workers_unavailable",
                                   f"the contexts directory must be reachable, got {type(exc).__name__}") from None
                await asyncio.sleep(DIRECTORY_RETRY_S)


@dataclass
class Resolved:
    """The contexts named by one query, as committed when the query started."""

    records: list[dict]
    next_pos: int
    pool: WorkerPool

    @property
    def dims(self) -> tuple[int, int, int]:
        r = self.records[0]
        return r["h_kv"], r["d"], r["d_v"]

    def check_query(self, q: Any, options: AttentionOptions) -> None:
        h_kv, d, _ = self.dims
        if q.ndim != 3 or q.shape[2] != d or q.shape[1] % h_kv:
            raise ValueError(f"q must be [n_q, h_q, {d}] with h_q a multiple of h_kv = {h_kv} as the contexts, "
                             f"got {list(q.shape)}")
        if options.alibi_slopes is not None and len(options.alibi_slopes) != q.shape[1]:
            raise ValueError(f"alibi_slopes must have shape [{q.shape[1]}], got {list(np.shape(options.alibi_slopes))}")

    def check_inline(self, problem: Any) -> None:
        if (problem.h_kv, problem.d, problem.d_v) != self.dims:
            raise ValueError(f"k, v must have [h_kv, d, d_v] = {list(self.dims)} as the contexts, "
                             f"got {[problem.h_kv, problem.d, problem.d_v]}")

    def jobs(self, q_ref: Any, q_pos: Any, options: dict, fanin: int) -> list[Job]:
        index = {s.name: s.index for s in self.pool.slots}
        jobs = []
        for rec in self.records:
            for shard in rec["shards"]:
                if shard["length"] == 0:
                    continue
                cands = tuple(index[w] for w in shard["workers"] if w in index)
                label = f"shard {shard['index']} of context {rec['id']}"
                jobs.append(Job("partial_resident", (q_ref, q_pos, options, [(rec["id"], shard["index"], shard["length"])],
                                                     fanin), cands, label, resident=True))
        return jobs


class ContextService:
    def __init__(self, settings: ServiceSettings, pool: WorkerPool, directory: Directory) -> None:
        self.settings = settings
        self.pool = pool
        self.directory = directory
        self.owner = "frontend-" + secrets.token_hex(8)

    # -- queries --------------------------------------------------------------
    async def resolve(self, ids: list[str]) -> Resolved:
        records = await self.directory.call("get_many", list(ids))
        for ctx_id, rec in zip(ids, records):
            if rec is None:
                raise ApiError("context_not_found", f"contexts must name existing contexts, got unknown id {ctx_id!r}")
        dims = {(r["h_kv"], r["d"], r["d_v"]) for r in records}
        if len(dims) > 1:
            raise ApiError("invalid_option", f"contexts must share [h_kv, d, d_v], got {sorted(dims)}")
        next_pos = max(r["next_pos"] for r in records)
        return Resolved(records=records, next_pos=next_pos, pool=self.pool)

    # -- reads ----------------------------------------------------------------
    async def get(self, ctx_id: str) -> dict:
        rec = await self.directory.call("get", ctx_id)
        if rec is None:
            raise ApiError("context_not_found", f"id must name an existing context, got {ctx_id!r}")
        return describe(rec)

    async def list(self) -> list[dict]:
        return [describe(r) for r in await self.directory.call("list")]

    # -- writes ---------------------------------------------------------------
    async def create(self, k: Any, v: Any, k_pos: Any, *, replicas: int | None, shards: int | None) -> dict:
        self._check_kv(k, v)
        await check_all_finite({"k": k, "v": v})
        n, h_kv, d = (int(s) for s in k.shape)
        k_pos = self._positions(k_pos, n, start=0)
        replicas = 1 if replicas is None else replicas
        live = [s for s in self.pool.slots if s.alive]
        if not 1 <= replicas <= min(len(live), self.settings.max_replicas):
            raise ApiError("invalid_option", f"replicas must be in [1, {min(len(live), self.settings.max_replicas)}] "
                                             f"(live workers), got {replicas}")
        n_shards = shards if shards is not None else max(1, min(len(live), -(-n // self.settings.context_shard_keys)))
        if n_shards < 1 or n_shards > max(n, 1):
            raise ApiError("invalid_option", f"shards must be in [1, {max(n, 1)}] (one key at least each), got {n_shards}")
        capacity = max(-(-n // n_shards), self.settings.context_shard_keys)
        dtype = DTYPE_NAMES[np.dtype(k.dtype)]
        record = {"id": new_context_id(), "h_kv": h_kv, "d": d, "d_v": int(v.shape[2]), "dtype": dtype,
                  "replicas": replicas, "shard_capacity": capacity,
                  "next_pos": int(np.max(k_pos)) + 1 if n else 0, "version": 1, "shards": []}
        bounds = shard_bounds(n, n_shards)
        placement = await self._place([hi - lo for lo, hi in bounds], record)
        for i, (lo, hi) in enumerate(bounds):
            record["shards"].append({"index": i, "length": hi - lo, "workers": [self.pool.slots[w].name for w in placement[i]]})
        parts = await put_once([(k[lo:hi], v[lo:hi]) for lo, hi in bounds])
        writes = [(w, "create_shard", (record["id"], i, *parts[i], k_pos[lo:hi], dtype, capacity, record))
                  for i, (lo, hi) in enumerate(bounds) for w in placement[i]]
        try:
            await self._write_all(writes)
        except ApiError:
            await self._drop_everywhere(record["id"])
            raise
        await self.directory.call("commit", record, None)
        return describe(record)

    async def append(self, ctx_id: str, k: Any, v: Any, k_pos: Any) -> dict:
        owner = await self._acquire(ctx_id)
        try:
            old = await self.directory.call("get", ctx_id)
            if old is None:
                raise ApiError("context_not_found", f"id must name an existing context, got {ctx_id!r}")
            if np.dtype(k.dtype) != np.dtype(BFLOAT16 if old["dtype"] == "bfloat16" else old["dtype"]):
                raise ApiError("invalid_tensor", f"k must have the context's dtype {old['dtype']}, got {DTYPE_NAMES.get(np.dtype(k.dtype), k.dtype)}")
            self._check_kv(k, v)
            await check_all_finite({"k": k, "v": v})
            if (int(k.shape[1]), int(k.shape[2]), int(v.shape[2])) != (old["h_kv"], old["d"], old["d_v"]):
                raise ApiError("invalid_tensor", f"k, v must have [h_kv, d, d_v] = {[old['h_kv'], old['d'], old['d_v']]} "
                                                 f"as the context, got {[int(k.shape[1]), int(k.shape[2]), int(v.shape[2])]}")
            n = int(k.shape[0])
            k_pos = self._positions(k_pos, n, start=old["next_pos"])
            new = copy.deepcopy(old)
            new["version"] += 1
            if n:
                new["next_pos"] = max(old["next_pos"], int(np.max(k_pos)) + 1)
            cap = old["shard_capacity"]
            writes, undo = [], []
            start = 0
            last = new["shards"][-1] if new["shards"] else None
            if last is not None and last["length"] < cap and n:
                take = min(cap - last["length"], n)
                index = {s.name: s.index for s in self.pool.slots}
                holders = [index[w] for w in last["workers"] if w in index and self.pool.slots[index[w]].alive]
                if not holders:
                    raise ApiError("context_lost", f"shard {last['index']} of context {ctx_id} has no live replica left")
                last["workers"] = [self.pool.slots[w].name for w in holders]
                [(k_ref, v_ref)] = await put_once([(k[:take], v[:take])])
                for w in holders:
                    writes.append((w, "append_shard", (ctx_id, last["index"], k_ref, v_ref, k_pos[:take], cap,
                                                       last["length"])))
                    undo.append((w, "truncate_shard", (ctx_id, last["index"], last["length"])))
                last["length"] += take
                start = take
            rest = n - start
            sizes = [min(cap, rest - i) for i in range(0, rest, cap)]
            if sizes:
                placement = await self._place(sizes, new)
                lo = start
                starts = [start + sum(sizes[:i]) for i in range(len(sizes))]
                parts = await put_once([(k[a:a + n], v[a:a + n]) for a, n in zip(starts, sizes)])
                for (k_ref, v_ref), size, workers in zip(parts, sizes, placement):
                    idx = len(new["shards"])
                    new["shards"].append({"index": idx, "length": size, "workers": [self.pool.slots[w].name for w in workers]})
                    for w in workers:
                        writes.append((w, "create_shard", (ctx_id, idx, k_ref, v_ref, k_pos[lo:lo + size],
                                                           new["dtype"], cap, new)))
                        undo.append((w, "drop", (ctx_id, idx)))
                    lo += size
            try:
                await self._write_all(writes)
            except ApiError:
                await asyncio.gather(*(self._quiet(w, m, *a) for w, m, a in undo))
                raise
            await self.directory.call("commit", new, owner)
            await self._note(new)
            return describe(new)
        finally:
            await self.directory.call("release", ctx_id, owner)

    async def delete(self, ctx_id: str) -> dict:
        await self._acquire(ctx_id)
        rec = await self.directory.call("remove", ctx_id)
        if rec is None:
            raise ApiError("context_not_found", f"id must name an existing context, got {ctx_id!r}")
        desc = describe(rec)
        await self._drop_everywhere(ctx_id)
        return desc

    # -- helpers --------------------------------------------------------------
    def _check_kv(self, k: Any, v: Any) -> None:
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 3:
                raise ApiError("invalid_tensor", f"{name} must be 3-d [n_k, h_kv, {'d' if name == 'k' else 'd_v'}], got shape {list(x.shape)}")
            if np.dtype(x.dtype) not in DTYPE_NAMES:
                raise ApiError("invalid_tensor", f"{name} must have dtype float16, bfloat16, float32 or float64, got {x.dtype}")
        if tuple(k.shape[:2]) != tuple(v.shape[:2]):
            raise ApiError("invalid_tensor", f"v must be [n_k, h_kv, d_v] with [n_k, h_kv] = {list(k.shape[:2])} as k, got {list(v.shape)}")
        if np.dtype(k.dtype) != np.dtype(v.dtype):
            raise ApiError("invalid_tensor", f"v must have k's dtype {k.dtype}, got {v.dtype}")
        if k.shape[1] < 1 or k.shape[2] < 1 or v.shape[2] < 1:
            raise ApiError("invalid_tensor", f"h_kv, d and d_v must be >= 1, got k {list(k.shape)}, v {list(v.shape)}")

    def _positions(self, k_pos: Any, n: int, start: int) -> np.ndarray:
        if k_pos is None:
            return np.arange(start, start + n, dtype=np.int64)
        try:
            return np.asarray(check_positions("k_pos", k_pos, n, np))
        except ValueError as exc:
            raise ApiError("invalid_tensor", str(exc)) from exc

    async def _place(self, sizes: list[int], record: dict) -> list[list[int]]:
        per_key = record["h_kv"] * (record["d"] + record["d_v"]) * np.dtype(
            BFLOAT16 if record["dtype"] == "bfloat16" else record["dtype"]).itemsize + 8
        await self.pool.refresh(timeout_s=10.0)
        live = [WorkerLoad(s.index, s.node_id, int(s.info.get("bytes_held", 0))) for s in self.pool.slots if s.alive]
        try:
            return place([n * per_key for n in sizes], record["replicas"], live)
        except ValueError as exc:
            raise ApiError("workers_unavailable", f"replicas could not be placed: {exc}") from exc

    async def _write_all(self, writes: list[tuple[int, str, tuple]]) -> None:
        """Run every write; if any fails, raise the first failure as an ApiError (after all finished)."""
        results = await asyncio.gather(*(self.pool.call(w, m, *a) for w, m, a in writes), return_exceptions=True)
        for res in results:
            if isinstance(res, CapacityError):
                raise ApiError("insufficient_capacity", f"the context does not fit: {res}")
            if isinstance(res, WorkerUnavailable):
                raise ApiError("workers_unavailable", f"a worker failed during the write: {res}")
            if isinstance(res, ShardMissing):
                raise ApiError("context_lost", f"a replica was lost during the write: {res}")
            if isinstance(res, BaseException):
                raise res

    async def _note(self, record: dict) -> None:
        names = {w for s in record["shards"] for w in s["workers"]}
        index = {s.name: s.index for s in self.pool.slots}
        await asyncio.gather(*(self._quiet(index[n], "note_context", record["id"], record) for n in names if n in index))

    async def _drop_everywhere(self, ctx_id: str) -> None:
        await asyncio.gather(*(self._quiet(s.index, "drop", ctx_id, None) for s in self.pool.slots if s.alive))

    async def _quiet(self, worker: int, method: str, *args: Any) -> Any:
        try:
            return await self.pool.call(worker, method, *args)
        except (WorkerUnavailable, ShardMissing, ValueError):
            return None

    async def _acquire(self, ctx_id: str) -> str:
        """Take the context's lease for one operation; returns the owner token to commit and release with."""
        owner = f"{self.owner}-{secrets.token_hex(6)}"
        while not await self.directory.call("acquire", ctx_id, owner, LEASE_TTL_S):
            await asyncio.sleep(LEASE_POLL_S)
        return owner
