"""Resident shards on disk, so that contexts survive a restart (``splitkey serve --persist-dir``).

One worker's files, under ``root`` (``DIR/<worker name>``)::

    <context_id>/record.json                       the newest committed record noted here
    <context_id>/<index>/shard.json                dtype, capacity and growth limit of the shard
    <context_id>/<index>/<start>-<stop>.safetensors  keys [start, stop) of one write: k, v, k_pos
    .deleted/<context_id>                          a tombstone: the context was deleted (empty file)

Every write of keys (a create, an append) is one segment file, written to a temporary
name, flushed to disk and renamed (and the folder flushed): a crash leaves either the
whole segment or none of it, never a torn one, and temporaries are removed at the next
start. A truncation (an append that did not commit) deletes the segments past the
committed length. What a restarted worker holds is, per shard, its segments from key 0
as far as they are contiguous; the directory then reads only the committed prefix that
the newest record names (``service.contexts.directory``), so a write that was stored
but never committed is never visible. bfloat16 is stored as its uint16 bits with the
dtype in the file's metadata. Files are read with ``safetensors`` (no pickle).

Each segment's metadata also holds a digest of its tensors (``sha256``: each tensor's
name, dtype, shape and bytes, :func:`_digest`). Loading checks every segment it reads
against its digest and against ``shard.json`` (dtype, dims, a length that matches its
name): a shard whose files fail a check is not loaded, with one warning naming it and
the file, and the rest of the store is (docs/RELIABILITY.md, "A damaged store"). A
record that is not a readable JSON object of the expected shape is skipped the same way
(why each context has no record here is kept in :attr:`ShardFiles.unrecorded`: whether another
holder has one is the directory's to say, and a context no holder has one of is released
from memory, its files left as they are: ``ShardStore.release_unrecorded``).
Segments written before digests were stored load unverified (one info line per load).
``record.json`` holds the record beside the digest of its canonical JSON text (a changed
committed length would read as a valid, shorter context: a wrong answer); a record whose
digest does not match is damaged, and one written before records had digests loads unverified.

A write the filesystem refuses for lack of room (``ENOSPC``, or ``EDQUOT``: a quota; also as
safetensors words it, :func:`_no_space_errno`) raises :class:`NoSpace`, with the temporary it was
writing removed; the store undoes the rest of that write (``workers.store.StorageFull``). Any other
error of a write is raised as it is (its temporary removed too).

A delete leaves a tombstone (:meth:`ShardFiles.tombstone`) on every live worker, durable before
the delete answers, and removes the context's files; a folder of a tombstoned context found at
a load (a holder that was dead at the delete, replaced or restarted) is removed, not loaded.
The service also buries, on every worker, the contexts any worker has a tombstone of
(``service.contexts.tombstones``). A tombstone is an empty file and ids are never reused; one
is removed (:meth:`ShardFiles.forget_tombstones`) only once no worker's folder holds files of its
context and it is older than the service's horizon (``service.contexts.tombstones.forget``).
Names read from ``.deleted`` are used only if they are context ids
(:data:`CONTEXT_ID`): no other name ever becomes a path.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from workers.dtypes import BFLOAT16, DTYPES, dtype_of

log = logging.getLogger(__name__)

TMP = ".tmp"
RECORD = "record.json"
SHARD = "shard.json"
#: A segment's tensors, in the order its digest covers them.
TENSORS = ("k", "v", "k_pos")
#: The segment metadata key of its digest (absent in segments written before digests were stored).
DIGEST = "sha256"
#: The folder of tombstones: a context id never starts with a dot, so no context folder is named so.
TOMBS = ".deleted"
#: What a context id is (``service.contexts.records.new_id``: ``ctx_`` and a url-safe token).
CONTEXT_ID = re.compile(r"ctx_[A-Za-z0-9_-]{1,128}")
#: The names a context's folder may have: one path component, no dots (so never ``..`` nor
#: :data:`TOMBS`), no separators. Every context id is one; the front end checks ids before any
#: call reaches a worker, and this check keeps a worker's writes and removals inside its root
#: whatever a caller passes.
FOLDER_NAME = re.compile(r"[A-Za-z0-9_-]{1,160}")


def check_context_id(context_id: str) -> str:
    """``context_id`` if it is one (:data:`CONTEXT_ID`), else raise ValueError (it would name a path)."""
    if not isinstance(context_id, str) or not CONTEXT_ID.fullmatch(context_id):
        raise ValueError(f"context_id must match {CONTEXT_ID.pattern}, got {str(context_id)[:80]!r}")
    return context_id


#: The errnos of a write refused for lack of room: the filesystem is full, or the user's quota is.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
#: How safetensors' writer names the OS error under a SafetensorError, which keeps no errno of its own
#: (Rust's ``io::Error``: "Error while serializing: I/O error: No space left on device (os error 28)").
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class NoSpace(OSError):
    """A write to the store's folder was refused for lack of room (an errno of :data:`NO_SPACE`); the
    file it was writing is not left behind (``errno`` and ``strerror`` are the refusal's)."""


def _no_space_errno(exc: BaseException) -> int | None:
    """The errno of :data:`NO_SPACE` that ``exc`` reports (an OSError, or a SafetensorError that names
    its OS error), else None: any other error is not a full disk."""
    if isinstance(exc, OSError):
        code = exc.errno
    elif isinstance(exc, SafetensorError) and (m := _OS_ERROR.search(str(exc))) is not None:
        code = int(m[1])
    else:
        return None
    return code if code in NO_SPACE else None


@contextlib.contextmanager
def _refused_for_space() -> Iterator[None]:
    """Around writes to the store: a refusal for lack of room becomes :class:`NoSpace` (from the
    original); every other error passes through unchanged."""
    try:
        yield
    except NoSpace:
        raise
    except (OSError, SafetensorError) as exc:
        code = _no_space_errno(exc)
        if code is None:
            raise
        raise NoSpace(code, os.strerror(code)) from exc


class Damaged(ValueError):
    """A file of the store is not what this module wrote (unreadable, or failing a check): the shard or
    record it belongs to is not loaded."""


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
    #: Where the first segment past the contiguous keys starts, if one is there (a gap); None: no segment past them.
    next_start: int | None = None
    #: Segments loaded without a digest to check them by (written before digests were stored).
    unverified: int = 0


@dataclass(frozen=True)
class ShardMeta:
    """A shard's ``shard.json``; ``dims`` ``(h_kv, d, d_v)`` is None in shards written before it was stored."""

    dtype: str
    reserve: int
    max_capacity: int
    dims: tuple[int, int, int] | None


@dataclass(frozen=True)
class Segment:
    """One segment's keys, checked: ``k`` ``[n, h_kv, d]`` and ``v`` ``[n, h_kv, d_v]`` in the shard's dtype."""

    k: np.ndarray
    v: np.ndarray
    k_pos: np.ndarray
    verified: bool  #: its digest was there and matched

    @property
    def dims(self) -> tuple[int, int, int]:
        return int(self.k.shape[1]), int(self.k.shape[2]), int(self.v.shape[2])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Any) -> None:
    """``write(tmp_path)``, flushed, then renamed to ``path`` (and the folder flushed). A write that
    fails before the rename removes its temporary and raises (:class:`NoSpace` for lack of room)."""
    tmp = path.with_name(path.name + TMP)
    with _refused_for_space():
        try:
            write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            # The torn temporary goes now (the next start removes any left); the write's own error is raised.
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(path.parent)


def _segment_bounds(name: str) -> tuple[int, int] | None:
    stem, _, ext = name.partition(".")
    a, _, b = stem.partition("-")
    if ext != "safetensors" or not (a.isdigit() and b.isdigit()):
        return None
    return int(a), int(b)


def _digest(tensors: dict[str, np.ndarray], dtype: str) -> str:
    """sha256 of a segment: its declared dtype, then each tensor's name, dtype, shape and bytes, in
    :data:`TENSORS` order (so that a changed header is caught as well as a changed byte)."""
    h = hashlib.sha256(dtype.encode())
    for name in TENSORS:
        a = np.ascontiguousarray(tensors[name])
        h.update(f"\n{name} {a.dtype.str} {list(a.shape)}\n".encode())
        h.update(a.data)  # read in place (no copy); hashlib releases the GIL while it hashes
    return h.hexdigest()


def _storage_dtype(dtype: str) -> np.dtype:
    """The dtype a shard of ``dtype`` keeps its k and v in on disk (bfloat16: its uint16 bits)."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else dtype_of(dtype)


class ShardFiles:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        #: context_id -> why the last :meth:`load` found no record of it here (none, damaged, empty).
        self.unrecorded: dict[str, str] = {}

    def _folder(self, context_id: str) -> Path:
        """The folder of ``context_id``'s shards; ValueError when the id is not one path component
        (:data:`FOLDER_NAME`)."""
        if not isinstance(context_id, str) or not FOLDER_NAME.fullmatch(context_id):
            raise ValueError(f"context_id must match {FOLDER_NAME.pattern}, got {str(context_id)[:80]!r}")
        return self.root / context_id

    def _shard_dir(self, context_id: str, index: int) -> Path:
        return self._folder(context_id) / str(index)

    # -- writes -------------------------------------------------------------------
    def create(self, context_id: str, index: int, dtype: str, reserve: int, max_capacity: int,
               dims: tuple[int, int, int]) -> None:
        """Start a shard (its old files, if any, go): what it is, before any keys; ``dims`` is
        ``(h_kv, d, d_v)``, so that a shard that holds no keys (yet) comes back as one."""
        folder = self._shard_dir(context_id, index)
        if folder.exists():
            shutil.rmtree(folder)
        with _refused_for_space():  # a full disk may refuse the folders too (NoSpace)
            folder.mkdir(parents=True)
            _fsync_dir(folder.parent)
        meta = {"dtype": dtype, "reserve": int(reserve), "max_capacity": int(max_capacity),
                "dims": [int(x) for x in dims]}
        _atomic_write(folder / SHARD, lambda p: p.write_text(json.dumps(meta)))

    def write(self, context_id: str, index: int, start: int, k: np.ndarray, v: np.ndarray, k_pos: np.ndarray) -> None:
        """Keys ``[start, start + n)`` of a shard, with their digest, durable when this returns."""
        n = int(k.shape[0])
        if n == 0:
            return
        folder = self._shard_dir(context_id, index)
        dtype = "bfloat16" if k.dtype == BFLOAT16 else str(k.dtype)
        tensors = {"k": _bits(k), "v": _bits(v), "k_pos": np.ascontiguousarray(k_pos, dtype=np.int64)}
        metadata = {"dtype": dtype, DIGEST: _digest(tensors, dtype)}
        _atomic_write(folder / f"{start:012d}-{start + n:012d}.safetensors",
                      lambda p: save_file(tensors, str(p), metadata=metadata))

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
                meta = _read_shard_meta(folder / SHARD)
                seg = _read_segment(path, bounds[1] - bounds[0], meta.dtype)  # checked: a damaged one is not rewritten
                keep = length - bounds[0]
                self.write(context_id, index, bounds[0], seg.k[:keep], seg.v[:keep], seg.k_pos[:keep])
                path.unlink()
        _fsync_dir(folder)

    def drop(self, context_id: str, index: int | None = None) -> None:
        folder = self._folder(context_id)
        target = folder if index is None else self._shard_dir(context_id, index)
        if target.exists():
            shutil.rmtree(target)
        if index is not None and folder.exists() and not any(p.is_dir() for p in folder.iterdir()):
            shutil.rmtree(folder)

    def tombstone(self, context_id: str) -> None:
        """Note on disk that the context was deleted (durable when this returns), then remove its files."""
        folder = self.root / TOMBS
        folder.mkdir(exist_ok=True)
        _atomic_write(folder / check_context_id(context_id), lambda p: p.write_bytes(b""))
        self.drop(context_id)

    def tombstones(self) -> set[str]:
        """The ids of the contexts deleted here; a name that is not a context id is skipped with a warning."""
        folder = self.root / TOMBS
        if not folder.is_dir():
            return set()
        found = set()
        for path in folder.iterdir():
            if CONTEXT_ID.fullmatch(path.name) and path.is_file():
                found.add(path.name)
            elif not path.name.endswith(TMP):
                log.warning("%s is not a tombstone (a file named by a context id): skipped", path)
        return found

    def stored(self, context_ids: Iterable[str]) -> set[str]:
        """The ids of ``context_ids`` that have files here."""
        return {c for c in context_ids if self._folder(c).exists()}

    def forget_tombstones(self, context_ids: Iterable[str], older_than_s: float) -> list[str]:
        """Remove the tombstones of ``context_ids`` written more than ``older_than_s`` seconds ago (by the
        file's time) whose context has no files here; returns the ids whose tombstone was removed."""
        if older_than_s < 0:
            raise ValueError(f"older_than_s must be >= 0, got {older_than_s!r}")
        folder = self.root / TOMBS
        removed = []
        for context_id in sorted(set(context_ids) - self.stored(context_ids)):
            path = folder / check_context_id(context_id)
            try:
                if time.time() - path.stat().st_mtime < older_than_s:
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(context_id)
        if removed:
            _fsync_dir(folder)
        return removed

    def save_record(self, context_id: str, record: dict) -> None:
        """Keep the context's record, with its digest (:func:`_record_digest`), durable when this returns."""
        folder = self._folder(context_id)
        if folder.exists():  # a context this worker holds a shard of
            text = json.dumps({DIGEST: _record_digest(record), "record": record})
            _atomic_write(folder / RECORD, lambda p: p.write_text(text))

    # -- reads --------------------------------------------------------------------
    def load(self) -> tuple[list[LoadedShard], dict[str, dict]]:
        """Every shard found (its contiguous keys from 0) and every context's record; temporaries removed.

        A damaged shard or record is left out with a warning naming it and the file, and the rest loads; a
        shard that loads shorter than its record commits is named in a warning with the cause.
        """
        shards: list[LoadedShard] = []
        records: dict[str, dict] = {}
        self.unrecorded = {}
        if (self.root / TOMBS).is_dir():
            _remove_temporaries(self.root / TOMBS)
        deleted = self.tombstones()
        for ctx_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and p.name != TOMBS):
            if ctx_dir.name in deleted:  # deleted while this folder's worker was down: it goes now
                log.info("context %s was deleted: its files in %s are removed, not loaded", ctx_dir.name, ctx_dir)
                shutil.rmtree(ctx_dir)
                continue
            shard_dirs = sorted(p for p in ctx_dir.iterdir() if p.is_dir() and p.name.isdigit())
            for folder in (ctx_dir, *shard_dirs):
                _remove_temporaries(folder)
            record, why = _load_record(ctx_dir)
            if record:
                records[ctx_dir.name] = record
            else:
                self.unrecorded[ctx_dir.name] = why
            for shard_dir in shard_dirs:
                try:
                    loaded = self._load_shard(ctx_dir.name, int(shard_dir.name), shard_dir)
                except Damaged as exc:
                    log.warning("persisted shard %s of context %s not loaded, its files are damaged: %s",
                                shard_dir.name, ctx_dir.name, exc)
                    continue
                if loaded is not None:
                    shards.append(loaded)
        for s in shards:
            _warn_if_short(s, records.get(s.context_id))
        unverified = sum(s.unverified for s in shards)
        if unverified:
            log.info("%d persisted segments under %s have no digest (written before digests were stored): "
                     "loaded unverified", unverified, self.root)
        return shards, records

    def _load_shard(self, context_id: str, index: int, folder: Path) -> LoadedShard | None:
        """The shard's contiguous segments from key 0, each checked; raises :class:`Damaged` naming the file."""
        found = sorted((*b, p) for p in folder.iterdir() if (b := _segment_bounds(p.name)))
        if not (folder / SHARD).exists():
            if found:
                raise Damaged(f"{folder / SHARD} is missing beside {len(found)} segments")
            log.info("persisted shard %d of context %s has no %s and no keys (a create that was interrupted): "
                     "nothing to load", index, context_id, SHARD)
            return None
        meta = _read_shard_meta(folder / SHARD)
        dims = meta.dims
        parts: list[Segment] = []
        expect = 0
        next_start = None
        for start, stop, path in found:
            if start != expect:
                next_start = start  # a gap: what follows it was never part of a committed prefix
                break
            seg = _read_segment(path, stop - start, meta.dtype)
            dims = dims or seg.dims  # a shard.json without dims: the first segment's are the shard's
            if seg.dims != dims:
                raise Damaged(f"{path}: dims (h_kv, d, d_v) must be the shard's {dims}, got {seg.dims}")
            parts.append(seg)
            expect = stop
        if dims is None:  # written before shards recorded their dims, and no keys: nothing to rebuild it from
            log.info("persisted shard %d of context %s has no keys and no dims in its %s: nothing to load",
                     index, context_id, SHARD)
            return None
        h_kv, d, d_v = dims
        dt = dtype_of(meta.dtype)
        # No keys yet (a context created empty, or a shard planned for appends to come) is a shard all the same,
        # or its context would come back without it.
        k = np.concatenate([p.k for p in parts]) if parts else np.zeros((0, h_kv, d), dt)
        v = np.concatenate([p.v for p in parts]) if parts else np.zeros((0, h_kv, d_v), dt)
        k_pos = np.concatenate([p.k_pos for p in parts]) if parts else np.zeros(0, np.int64)
        return LoadedShard(context_id, index, meta.dtype, meta.reserve, meta.max_capacity, k, v, k_pos,
                           next_start=next_start, unverified=sum(not p.verified for p in parts))


def _remove_temporaries(folder: Path) -> None:
    """Remove the temporaries of interrupted writes (files only: a folder so named is none of ours)."""
    for path in folder.glob(f"*{TMP}"):
        if path.is_file():
            path.unlink()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: JSON, or bytes that are not UTF-8
        raise Damaged(f"{path} must be readable JSON, got {type(exc).__name__}: {exc}") from None


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _read_shard_meta(path: Path) -> ShardMeta:
    raw = _read_json(path)
    if not isinstance(raw, dict) or raw.get("dtype") not in DTYPES or \
            not (_is_count(raw.get("reserve")) and _is_count(raw.get("max_capacity"))):
        raise Damaged(f"{path} must be an object with a dtype of {', '.join(DTYPES)} and counts reserve and "
                      f"max_capacity, got {str(raw)[:200]}")
    dims = raw.get("dims")
    if dims is not None and not (isinstance(dims, list) and len(dims) == 3 and all(_is_count(x) for x in dims)):
        raise Damaged(f"{path}: dims must be three counts (h_kv, d, d_v), got {str(dims)[:100]}")
    return ShardMeta(raw["dtype"], raw["reserve"], raw["max_capacity"], None if dims is None else tuple(dims))


def _read_segment(path: Path, n: int, dtype: str) -> Segment:
    """The segment at ``path``, which its name says holds ``n`` keys of a shard of ``dtype``, checked against
    its digest (when it has one) and against both; raises :class:`Damaged` naming the file and what failed."""
    try:
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise Damaged(f"{path} must be a readable safetensors file, got {type(exc).__name__}: {exc}") from None
    if sorted(tensors) != sorted(TENSORS):
        raise Damaged(f"{path} must hold tensors {', '.join(TENSORS)}, got {', '.join(sorted(tensors)) or 'none'}")
    digest = metadata.get(DIGEST)
    if digest is not None and digest != _digest(tensors, metadata.get("dtype", "")):
        raise Damaged(f"{path}: its bytes do not match its {DIGEST} digest")
    _check_segment(path, tensors, metadata.get("dtype"), n, dtype)
    k, v = (t.view(BFLOAT16) if dtype == "bfloat16" else t for t in (tensors["k"], tensors["v"]))
    return Segment(k, v, tensors["k_pos"], verified=digest is not None)


def _check_segment(path: Path, t: dict[str, np.ndarray], declared: str | None, n: int, dtype: str) -> None:
    """Raise :class:`Damaged` unless the segment's tensors are ``n`` keys of a shard of ``dtype``."""
    stored = _storage_dtype(dtype)
    if declared != dtype or t["k"].dtype != stored or t["v"].dtype != stored or t["k_pos"].dtype != np.int64:
        raise Damaged(f"{path} must hold {dtype} keys ({stored} k and v, int64 k_pos) as its shard does, got "
                      f"{declared} ({t['k'].dtype} k, {t['v'].dtype} v, {t['k_pos'].dtype} k_pos)")
    k, v, k_pos = t["k"].shape, t["v"].shape, t["k_pos"].shape
    if len(k) != 3 or len(v) != 3 or k[0] != n or v[0] != n or k_pos != (n,) or k[1] != v[1]:
        raise Damaged(f"{path} must hold its name's {n} keys as k [n, h_kv, d], v [n, h_kv, d_v], k_pos [n], "
                      f"got k {list(k)}, v {list(v)}, k_pos {list(k_pos)}")


def _record_digest(record: dict) -> str:
    """sha256 of a record's canonical JSON text (keys sorted, no spaces): what :meth:`ShardFiles.save_record`
    stores beside it and a load checks it by."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _load_record(ctx_dir: Path) -> tuple[dict | None, str]:
    """The context's record kept here, or None and why: none stored, a damaged one (a warning names it), or an
    empty one (``{}``: what a restart wrote over a damaged one until 2026-12-04)."""
    path = ctx_dir / RECORD
    if not path.exists():
        return None, f"there is no {path}"
    try:
        raw = _read_json(path)
        if raw == {}:
            return None, f"{path} holds an empty record"
        record = _check_record(path, *_unwrap_record(path, raw))
    except Damaged as exc:
        log.warning("persisted record of context %s not loaded, it is damaged: %s", ctx_dir.name, exc)
        return None, str(exc)
    return record, ""


def _unwrap_record(path: Path, raw: Any) -> tuple[Any, bool]:
    """The record in a ``record.json`` and whether it was verified: ``{"sha256": digest, "record": record}``,
    checked against its digest (one changed byte in it would otherwise read as another committed length: a
    wrong answer), or, written before records had digests (2026-12-06), the bare record, loaded unverified
    (one info line)."""
    if isinstance(raw, dict) and DIGEST in raw:
        if set(raw) != {DIGEST, "record"} or not isinstance(raw["record"], dict):
            raise Damaged(f"{path} must hold exactly {DIGEST} and a record object, got keys {sorted(raw)[:8]}")
        if _record_digest(raw["record"]) != raw[DIGEST]:
            raise Damaged(f"{path}: the record does not match its {DIGEST} digest")
        return raw["record"], True
    log.info("persisted record %s has no digest (written before records had one): loaded unverified", path)
    return raw, False


def _check_record(path: Path, record: Any, verified: bool) -> dict:
    """``record`` if it has the shape a directory rebuild reads (a count ``version``; ``shards``, each with a
    count ``index`` and ``length``), else raise :class:`Damaged`. An unverified record must name both
    (a wrapper whose key names were damaged must not read as a record of no shards); a verified one is
    as it was written."""
    if not verified and not (isinstance(record, dict) and {"version", "shards"} <= set(record)):
        raise Damaged(f"{path} must be a context record with a version and shards, got {str(record)[:200]}")
    shards = record.get("shards", []) if isinstance(record, dict) else None
    ok = isinstance(record, dict) and _is_count(record.get("version", 0)) and isinstance(shards, list) and all(
        isinstance(s, dict) and _is_count(s.get("index")) and _is_count(s.get("length")) for s in shards)
    if not ok:
        raise Damaged(f"{path} must be a context record (an object with a count version and shards each with "
                      f"a count index and length), got {str(record)[:200]}")
    return record


def _warn_if_short(shard: LoadedShard, record: dict | None) -> None:
    """One warning when the shard holds fewer keys than its context's record here commits, naming why: the
    directory will not count this replica (``service.contexts.directory``)."""
    committed = next((s["length"] for s in (record or {}).get("shards", []) if s["index"] == shard.index), 0)
    n = len(shard.k_pos)
    if n >= committed:
        return
    why = (f"its segments stop at key {n}, the next one found starts at key {shard.next_start}"
           if shard.next_start is not None else f"no segment holds the keys from {n} on")
    log.warning("persisted shard %d of context %s loaded with %d keys, fewer than the %d its record (version %s) "
                "commits, so not counted as a replica: %s", shard.index, shard.context_id, n, committed,
                (record or {}).get("version"), why)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype == BFLOAT16 else a
