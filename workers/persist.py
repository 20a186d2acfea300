"""Resident shards on disk, so that contexts survive a restart (``splitkey serve --persist-dir``).

One worker's files, under ``root`` (``DIR/<worker name>``)::

    <context_id>/record.json                       the newest committed record noted here
    <context_id>/<index>/shard.json                dtype, capacity and growth limit of the shard
    <context_id>/<index>/<start>-<stop>.safetensors  keys [start, stop) of one write: k, v, k_pos

Every write of keys (a create, an append) is one segment file, written to a temporary
name, flushed to disk and renamed (and the folder flushed): a crash leaves either the
whole segment or none of it, never a torn one, and temporaries are removed at the next
start. A truncation (an append that did not commit) deletes the segments past the
committed length. What a restarted worker holds is, per shard, its segments from key 0
as far as they are contiguous; the directory then reads only the committed prefix that
the newest record names (``service.contexts.directory``), so a write that was stored
but never committed is never visible. bfloat16 is stored as its uint16 bits with the
dtype in the file's metadata. Files are read with ``safetensors`` (no pickle).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from workers.dtypes import BFLOAT16, dtype_of

TMP = ".tmp"
RECORD = "record.json"
SHARD = "shard.json"


@dataclass
class LoadedShard:
    """A shard as found on disk: its keys from 0, contiguous, and how it was allocated."""

    context_id: str
    index: int
    dtype: str
    reserve: int
    max_capacity: int
    k: np.ndarray  # [n, h_kv, d]
    v: np.ndarray  # [n, h_kv, d_v]
    k_pos: np.ndarray  # [n]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Any) -> None:
    """``write(tmp_path)``, flushed, then renamed to ``path`` (and the folder flushed)."""
    tmp = path.with_name(path.name + TMP)
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _segment_bounds(name: str) -> tuple[int, int] | None:
    stem, _, ext = name.partition(".")
    a, _, b = stem.partition("-")
    if ext != "safetensors" or not (a.isdigit() and b.isdigit()):
        return None
    return int(a), int(b)


class ShardFiles:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _shard_dir(self, context_id: str, index: int) -> Path:
        return self.root / context_id / str(index)

    # -- writes -------------------------------------------------------------------
    def create(self, context_id: str, index: int, dtype: str, reserve: int, max_capacity: int,
               dims: tuple[int, int, int]) -> None:
        """Start a shard (its old files, if any, go): what it is, before any keys; ``dims`` is
        ``(h_kv, d, d_v)``, so that a shard that holds no keys (yet) comes back as one."""
        folder = self._shard_dir(context_id, index)
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        _fsync_dir(folder.parent)
        meta = {"dtype": dtype, "reserve": int(reserve), "max_capacity": int(max_capacity),
                "dims": [int(x) for x in dims]}
        _atomic_write(folder / SHARD, lambda p: p.write_text(json.dumps(meta)))

    def write(self, context_id: str, index: int, start: int, k: np.ndarray, v: np.ndarray, k_pos: np.ndarray) -> None:
        """Keys ``[start, start + n)`` of a shard, durable when this returns."""
        n = int(k.shape[0])
        if n == 0:
            return
        folder = self._shard_dir(context_id, index)
        dtype = "bfloat16" if k.dtype == BFLOAT16 else str(k.dtype)
        tensors = {"k": _bits(k), "v": _bits(v), "k_pos": np.ascontiguousarray(k_pos, dtype=np.int64)}
        _atomic_write(folder / f"{start:012d}-{start + n:012d}.safetensors",
                      lambda p: save_file(tensors, str(p), metadata={"dtype": dtype}))

    def truncate(self, context_id: str, index: int, length: int) -> None:
        """Keep keys ``[0, length)``: segments past it go (a segment across it is cut)."""
        folder = self._shard_dir(context_id, index)
        if not folder.exists():
            return
        for path in sorted(folder.iterdir()):
            bounds = _segment_bounds(path.name)
            if bounds is None or bounds[1] <= length:
                continue
            if bounds[0] >= length:
                path.unlink()
            else:  # not made by this service's writes (they end on committed lengths), but kept exact
                t = load_file(str(path))
                keep = length - bounds[0]
                self.write(context_id, index, bounds[0], _from_bits(t["k"][:keep]), _from_bits(t["v"][:keep]),
                           t["k_pos"][:keep])
                path.unlink()
        _fsync_dir(folder)

    def drop(self, context_id: str, index: int | None = None) -> None:
        target = self.root / context_id if index is None else self._shard_dir(context_id, index)
        if target.exists():
            shutil.rmtree(target)
        if index is not None and (self.root / context_id).exists() and \
                not any(p.is_dir() for p in (self.root / context_id).iterdir()):
            shutil.rmtree(self.root / context_id)

    def save_record(self, context_id: str, record: dict) -> None:
        folder = self.root / context_id
        if folder.exists():  # a context this worker holds a shard of
            _atomic_write(folder / RECORD, lambda p: p.write_text(json.dumps(record)))

    # -- reads --------------------------------------------------------------------
    def load(self) -> tuple[list[LoadedShard], dict[str, dict]]:
        """Every shard found (its contiguous keys from 0) and every context's record; temporaries removed."""
        shards: list[LoadedShard] = []
        records: dict[str, dict] = {}
        for ctx_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for tmp in ctx_dir.rglob(f"*{TMP}"):
                tmp.unlink()
            if (ctx_dir / RECORD).exists():
                records[ctx_dir.name] = json.loads((ctx_dir / RECORD).read_text())
            for shard_dir in sorted(p for p in ctx_dir.iterdir() if p.is_dir() and p.name.isdigit()):
                loaded = self._load_shard(ctx_dir.name, int(shard_dir.name), shard_dir)
                if loaded is not None:
                    shards.append(loaded)
        return shards, records

    def _load_shard(self, context_id: str, index: int, folder: Path) -> LoadedShard | None:
        if not (folder / SHARD).exists():
            return None
        meta = json.loads((folder / SHARD).read_text())
        parts = []
        expect = 0
        for start, stop, path in sorted((*b, p) for p in folder.iterdir() if (b := _segment_bounds(p.name))):
            if start != expect:
                break  # a gap: what follows it was never part of a committed prefix
            parts.append(load_file(str(path)))
            expect = stop
        if not parts:
            if "dims" not in meta:  # written before shards recorded their dims: nothing to rebuild it from
                return None
            # No keys yet (a context created empty, or a shard planned for appends to come): a shard all the
            # same, or its context would come back without it.
            h_kv, d, d_v = meta["dims"]
            dt = dtype_of(meta["dtype"])
            k, v = np.zeros((0, h_kv, d), dt), np.zeros((0, h_kv, d_v), dt)
            return LoadedShard(context_id, index, meta["dtype"], meta["reserve"], meta["max_capacity"], k, v,
                               np.zeros(0, np.int64))
        k, v = (np.concatenate([_from_bits(t[x]) for t in parts]) for x in ("k", "v"))
        k_pos = np.concatenate([t["k_pos"] for t in parts])
        return LoadedShard(context_id, index, meta["dtype"], meta["reserve"], meta["max_capacity"], k, v, k_pos)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype == BFLOAT16 else a


def _from_bits(a: np.ndarray) -> np.ndarray:
    """uint16 is only ever bfloat16's bits here (no contract dtype is uint16)."""
    return a.view(dtype_of("bfloat16")) if a.dtype == np.uint16 else a
