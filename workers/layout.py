"""Where the keys and values live, and how the kernel reads one block of them.

The kernel streams blocks of ``B`` keys for a batch of kv heads and wants

* keys d-major:  ``kt [hb, d, B]`` so scores are ``q_tile @ kt`` (a wide GEMM), and
* values key-major: ``v [hb, B, d_v]`` so the update is ``p @ v``,

both in the accumulation dtype. Two sources provide that:

* :class:`NaturalKV` wraps the contract's ``k [n_k, h_kv, d]``, ``v [n_k, h_kv, d_v]``
  (inline requests) and hands out strided views of one block (BLAS reads the
  keys as a transposed operand), casting other dtypes one block at a time into
  bounded scratch, so nothing of size ``n_k`` is allocated;
* :class:`StreamingKV` holds keys already d-major (resident contexts), with a
  padded row stride (a power-of-two stride makes the ``d`` rows of a block
  collide in the same cache sets), and grows by appending.

Both are array-module neutral (numpy or cupy).

Pages
-----
A resident shard (:class:`ShardKV`) keeps the keys it was created with in a body of
arrays allocated for them, and the keys appended past those in a tail. On the CPU the
tail is a :class:`StreamingKV` that reserves the address space of every key the shard
may grow to at once and holds memory only where keys were written: the kernel backs
the reservation with a 4 KiB page on the first write to it (``workers.copies.reserve``),
so the MMU's page table is the tail's block table. Appends never move or copy what is
stored, a tail grows one page at a time and a dropped shard gives its pages back at once. What a shard holds is counted exactly
(:func:`held_bytes`): per row of d-major keys, of values and of positions, the
pages its written keys span. A row's keys start a cache line past a page (the
padded stride), so a row spans at most two pages more than its keys fill, and
:func:`page_keys` keys (8 KiB of every row) are the page a tail holds beyond its
data at most: **held <= data + one page** (1024 float64, 2048 float32, 4096
16-bit keys). A body holds its keys as tightly as rows padded off powers of two
allow (:func:`padded_capacity`): a short shard, whose rows are a page or two long,
would pay up to a page per row for the straddle if it were paged. The page is the system's, per row: the d-major layout keeps each
(head, dim) row apart so that the kernel reads it as one long run of keys. A truncated tail stays held
until the shard is dropped (the next append writes it again). Arrays on a GPU are
allocated, not reserved: they grow geometrically and count what they allocated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from merge import array_module
from workers.copies import as_bits, copy_keys_dmajor, copy_values, release, reserve
from workers.dtypes import check_input_dtype
from workers.plan import CALL_KEYS, DECODE_ROWS
from workers.problem import KVDims, as_array, check_arrays, check_kv, check_positions
from workers.widen import widen

#: Capacity granule of StreamingKV, in keys.
CAPACITY_GRANULE = 256
#: Bytes of a memory page and of a cache line (x86-64), for the row stride (:func:`padded_capacity`).
PAGE_BYTES, LINE_BYTES = 4096, 64


def bytes_per_key(h_kv: int, d: int, d_v: int, dtype: Any) -> int:
    """Bytes one resident key takes: its key and value rows in ``dtype`` and an int64 position."""
    return h_kv * (d + d_v) * np.dtype(dtype).itemsize + 8


def page_keys(itemsize: int) -> int:
    """Keys of a page (module doc, "Pages"): 8 KiB of every row of a shard."""
    return 2 * PAGE_BYTES // itemsize


def held_bytes(h_kv: int, d: int, d_v: int, dtype: Any, capacity: int, keys: int) -> int:
    """Bytes a reserved shard of ``capacity`` (padded) keys holds once its first ``keys`` are written:
    the 4 KiB pages of its three mappings (d-major keys, values, positions) that those keys touch."""
    if keys <= 0:
        return 0
    item = np.dtype(dtype).itemsize
    return (spanned(h_kv * d, capacity * item, keys * item) + spanned(h_kv, capacity * d_v * item, keys * d_v * item)
            + spanned(1, 0, keys * 8))


def spanned(rows: int, row_bytes: int, used: int) -> int:
    """Bytes of the pages of a page-aligned mapping that the first ``used`` bytes of each of its
    ``rows`` (``row_bytes`` apart) touch, each page counted once."""
    if used <= 0:
        return 0
    if rows > 1 and row_bytes < used + PAGE_BYTES:
        return _spanned_rows(rows, row_bytes, used)  # rows may share pages: count the union
    # No two rows share a page: row r spans q + 1 pages, one more where its offset in its first page
    # (periodic in r) is at least PAGE_BYTES - rem. Counted from the sorted offsets: every append asks.
    q, rem = divmod(used - 1, PAGE_BYTES)
    offsets = _row_offsets(rows, row_bytes % PAGE_BYTES)
    return (rows * (q + 1) + rows - int(np.searchsorted(offsets, PAGE_BYTES - rem))) * PAGE_BYTES


@functools.lru_cache(maxsize=64)
def _row_offsets(rows: int, step: int) -> np.ndarray:
    """Each row's offset in its first page, sorted."""
    return np.sort(np.arange(rows, dtype=np.int64) * step % PAGE_BYTES)


def _spanned_rows(rows: int, row_bytes: int, used: int) -> int:
    """:func:`spanned` row by row, for rows close enough to share pages."""
    start = np.arange(rows, dtype=np.int64) * row_bytes
    first, last = start // PAGE_BYTES, (start + used - 1) // PAGE_BYTES
    after = np.concatenate([[-1], last[:-1]]) + 1  # a page the row before touched is not counted again
    return int(np.maximum(last - np.maximum(first, after) + 1, 0).sum()) * PAGE_BYTES


def padded_capacity(n: int, itemsize: int) -> int:
    """Capacity for ``n`` keys of ``itemsize``-byte elements: the row stride of the d-major keys.

    A BLAS call reads a run of keys from each of ``d`` rows ``capacity`` elements
    apart. Rows a power of two apart land in the same cache sets and, a megabyte or
    more apart, in the same TLB sets, and the score product ran at 35 GFLOP/s instead
    of 88 (measured: ``[8, 4, 128] @ [8, 128, 1024]``, rows 1 MiB + 64 B apart against
    1 MiB + 16 KiB + 64 B). So a row longer than a page spans an odd number of whole
    pages plus one cache line; a shorter one is rounded to the granule plus a line.
    """
    keys = -(-max(n, 1) // CAPACITY_GRANULE) * CAPACITY_GRANULE
    if keys * itemsize < PAGE_BYTES:
        return keys + LINE_BYTES // itemsize
    pages = -(-keys * itemsize // PAGE_BYTES)
    pages += 1 - pages % 2  # odd
    return (pages * PAGE_BYTES + LINE_BYTES) // itemsize


@dataclass(frozen=True, eq=False)
class NaturalKV:
    """Keys and values in the contract layout, read block by block."""

    k: Any  # [n_k, h_kv, d]
    v: Any  # [n_k, h_kv, d_v]
    k_pos: Any  # [n_k] int64 array or options.Arange

    @property
    def n_k(self) -> int:
        return int(self.k.shape[0])

    #: Keys per CPU BLAS call over views for decode-shaped tiles (see
    #: :meth:`call_keys`). A head's rows are ``h_kv * d`` elements apart (4 KiB
    #: at 8 x 128 float32), so a long run of them falls into few cache sets,
    #: which the unpacked small-``m`` GEMM re-reads: at 8 x 128, 4 rows, 256-key
    #: calls read 14 GB/s where 1024-key calls read 10. Tall tiles (prefill) are
    #: packed by BLAS and take the whole block.
    VIEW_CALL_KEYS = 256

    def call_keys(self, acc_dtype: Any, rows: int) -> int | None:
        """Keys per BLAS call on the CPU for a tile of ``rows``; None: the whole block.

        ``CALL_KEYS`` when blocks are cast copies (bounded scratch), else
        ``VIEW_CALL_KEYS`` for decode-shaped tiles.
        """
        if self.k.dtype != acc_dtype or self.v.dtype != acc_dtype:
            return CALL_KEYS
        return self.VIEW_CALL_KEYS if rows <= DECODE_ROWS else None

    def keys(self, start: int, stop: int, h0: int, h1: int, acc_dtype: Any) -> Any:
        """``kt [hb, d, B]`` for keys ``[start, stop)`` and kv heads ``[h0, h1)``: a strided view, or a cast copy."""
        k = self.k[start:stop, h0:h1]  # [B, hb, d]
        # No transposing copy: each head's [B, d] rows have unit stride in d, so
        # BLAS reads kt as a transposed operand (a copy that transposes costs
        # more than the matmul it feeds). Other dtypes are cast block by block,
        # contiguously, into bounded scratch.
        return widen(k, acc_dtype).transpose(1, 2, 0)  # [hb, d, B]

    def values(self, start: int, stop: int, h0: int, h1: int, acc_dtype: Any) -> Any:
        """``v [hb, B, d_v]`` for keys ``[start, stop)`` and kv heads ``[h0, h1)``."""
        v = self.v[start:stop, h0:h1]  # [B, hb, d_v]
        return widen(v, acc_dtype).transpose(1, 0, 2)  # [hb, B, d_v]

    def block(self, start: int, stop: int, h0: int, h1: int, acc_dtype: Any) -> tuple[Any, Any]:
        """``(kt [hb, d, B], v [hb, B, d_v])`` for keys ``[start, stop)`` and kv heads ``[h0, h1)``."""
        return self.keys(start, stop, h0, h1, acc_dtype), self.values(start, stop, h0, h1, acc_dtype)


class StreamingKV:
    """Keys d-major and values head-major, in the stored dtype, growing by append.

    Readers take a :meth:`snapshot`; :meth:`append` writes past the published
    length first and publishes the new length last (or swaps in new arrays when
    it must grow), so a reader sees the sequence before or after an append,
    never a half-written one.
    """

    def __init__(self, h_kv: int, d: int, d_v: int, dtype: Any, xp: Any = np, capacity: int = 0,
                 max_capacity: int | None = None) -> None:
        """``capacity`` keys allocated now; with ``max_capacity`` on the CPU, address space reserved for
        that many keys instead, held page by page as keys are written (module doc, "Pages"), and
        ``capacity`` keys counted as held from the start (a reservation the budget is charged for)."""
        for name, n in (("h_kv", h_kv), ("d", d), ("d_v", d_v)):
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        for name, n in (("capacity", capacity), ("max_capacity", 0 if max_capacity is None else max_capacity)):
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
                raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        self.h_kv, self.d, self.d_v = int(h_kv), int(d), int(d_v)
        self.dtype = check_input_dtype("dtype", dtype)
        self.xp = xp
        self.n_k = 0
        #: Reserved address space, held page by page (CPU only); else allocated in full.
        self.paged = max_capacity is not None and xp is np
        #: Keys charged from the start (a reservation), and the most written since (or truncated to).
        self.reserved = int(capacity) if self.paged else 0
        self.high_water = 0
        self._held = (-1, 0)  # (keys, bytes) of the last count of held_bytes
        if self.paged:
            cap = padded_capacity(max(int(capacity), int(max_capacity)), self.dtype.itemsize)  # type: ignore[arg-type]
            self._kt, self._v, self._pos = (reserve((h_kv, d, cap), self.dtype), reserve((h_kv, cap, d_v), self.dtype),
                                            reserve((cap,), np.int64))
            return
        cap = padded_capacity(capacity, self.dtype.itemsize)
        self._kt = xp.empty((h_kv, d, cap), dtype=self.dtype)  # [h_kv, d, cap]
        self._v = xp.empty((h_kv, cap, d_v), dtype=self.dtype)  # [h_kv, cap, d_v]
        self._pos = xp.empty((cap,), dtype=xp.int64)

    @classmethod
    def from_arrays(cls, k: Any, v: Any, k_pos: Any) -> StreamingKV:
        """Copy ``k [n_k, h_kv, d]``, ``v [n_k, h_kv, d_v]`` into the streaming layout (checked as
        :meth:`append` checks them)."""
        xp = check_arrays(k=k, v=v)
        dims = check_kv(k, v)
        kv = cls(dims.h_kv, dims.d, dims.d_v, k.dtype, xp=xp, capacity=dims.n_k)
        kv.append(k, v, k_pos)
        return kv

    @property
    def capacity(self) -> int:
        return int(self._pos.shape[0])

    def regions(self, start: int, stop: int) -> tuple[Any, Any, Any]:
        """Where keys ``[start, stop)`` of the capacity live: views of the keys, values and positions."""
        return self._kt[:, :, start:stop], self._v[:, start:stop], self._pos[start:stop]

    @property
    def nbytes(self) -> int:
        """Bytes held: the pages written so far when paged (module doc, "Pages"), else the allocation."""
        return self.held_after(0)

    def held_after(self, n: int) -> int:
        """Bytes held once ``n`` more keys are appended (after growing, if they do not fit)."""
        if self.paged and self.n_k + n <= self.capacity:
            keys = max(self.reserved, self.high_water, self.n_k + n)
            if self._held[0] != keys:  # one count per length: the store sums every shard's on each write
                self._held = (keys, held_bytes(self.h_kv, self.d, self.d_v, self.dtype, self.capacity, keys))
            return self._held[1]
        cap = self.growth(n) if n else self.capacity
        return cap * (self.h_kv * (self.d + self.d_v) * self.dtype.itemsize + 8)

    def bytes_per_key(self) -> int:
        return bytes_per_key(self.h_kv, self.d, self.d_v, self.dtype)

    def growth(self, n: int, max_capacity: int | None = None) -> int:
        """Capacity after appending ``n`` keys (unchanged if they fit)."""
        new = self.n_k + n
        if new <= self.capacity:
            return self.capacity
        want = max(new, 2 * self.capacity)
        if max_capacity is not None:
            want = max(new, min(want, max_capacity))
        return padded_capacity(want, self.dtype.itemsize)

    def truncate(self, n: int) -> None:
        """Forget keys past the first ``n`` (undo of an append that did not commit).

        A paged shard gives back the pages only those keys held (above its reservation), so that an
        undone write leaves the shard holding what it held before; nobody reads past the committed
        length, which is at most ``n``.
        """
        if not 0 <= n <= self.n_k:
            raise ValueError(f"n must be in [0, {self.n_k}], got {n}")
        self.n_k = n
        keep = max(n, self.reserved)
        if self.paged and self.high_water > keep:
            # Up to a page past the tail: the page holding the tail's last key lies inside that span.
            stop = min(self.capacity, self.high_water + page_keys(self.dtype.itemsize))
            for region in self.regions(keep, stop):
                release(region)
            self.high_water = keep

    def append(self, k: Any, v: Any, k_pos: Any, max_capacity: int | None = None) -> None:
        """Add keys ``k [n, h_kv, d]``, values ``v [n, h_kv, d_v]`` in the stored dtype, at integer
        positions ``k_pos [n]`` (an array or an ``Arange``, within the position range), or raise
        naming the argument; nothing is written then."""
        check_arrays(k=k, v=v)
        n = int(k.shape[0]) if k.ndim else 0
        if k.ndim != 3 or tuple(k.shape[1:]) != (self.h_kv, self.d):
            raise ValueError(f"k must be [n, {self.h_kv}, {self.d}], got {tuple(k.shape)}")
        if tuple(v.shape) != (n, self.h_kv, self.d_v):
            raise ValueError(f"v must be [{n}, {self.h_kv}, {self.d_v}], got {tuple(v.shape)}")
        k_pos = check_positions("k_pos", k_pos, n, self.xp)  # integers of the range, [n]
        if np.dtype(k.dtype) != self.dtype or np.dtype(v.dtype) != self.dtype:
            raise ValueError(f"k and v must have the stored dtype {self.dtype}, got {k.dtype} and {v.dtype}")
        old, new = self.n_k, self.n_k + n
        kt, vv, pos = self._kt, self._v, self._pos
        if new > self.capacity:
            # Grow geometrically into fresh arrays; readers holding the old ones keep them.
            cap = self.growth(n, max_capacity)
            xp = self.xp
            kt = xp.empty((self.h_kv, self.d, cap), dtype=self.dtype)
            vv = xp.empty((self.h_kv, cap, self.d_v), dtype=self.dtype)
            pos = xp.empty((cap,), dtype=xp.int64)
            as_bits(kt)[:, :, :old] = as_bits(self._kt)[:, :, :old]
            as_bits(vv)[:, :old] = as_bits(self._v)[:, :old]
            pos[:old] = self._pos[:old]
        copy_keys_dmajor(kt[:, :, old:new], k)  # [h_kv, d, n]
        copy_values(vv[:, old:new], v)  # [h_kv, n, d_v]
        pos[old:new] = as_array(k_pos, self.xp)
        if kt is not self._kt:
            self.paged = False  # grown past its reservation into allocated arrays
        self._kt, self._v, self._pos = kt, vv, pos
        self.high_water = max(self.high_water, new)
        self.n_k = new  # publish last

    def snapshot(self, length: int | None = None) -> StreamingView:
        """A read-only view of the first ``length`` keys (None: all ``n_k``; never more) as they are now."""
        n = self.n_k if length is None else min(length, self.n_k)
        return StreamingView(kt=self._kt[:, :, :n], v=self._v[:, :n], k_pos=self._pos[:n])


@dataclass(frozen=True, eq=False)
class StreamingView:
    """A fixed-length view of a :class:`StreamingKV`, read block by block."""

    kt: Any  # [h_kv, d, n_k] (row stride = capacity)
    v: Any  # [h_kv, n_k, d_v]
    k_pos: Any  # [n_k]
    #: The shape of the keys and values, from ``kt`` and ``v`` (derived and checked here, once).
    dims: KVDims = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The kernels index v and k_pos by kt's extents (the fused one without bounds checks): a view
        # built by hand whose parts disagree would read past them.
        for name in ("kt", "v", "k_pos"):
            if not hasattr(getattr(self, name), "shape"):
                raise ValueError(f"StreamingView.{name} must be an array, got {type(getattr(self, name)).__name__}")
        if self.kt.ndim != 3 or self.v.ndim != 3 or self.k_pos.ndim != 1:
            raise ValueError(f"StreamingView must hold kt [h_kv, d, n_k], v [h_kv, n_k, d_v] and k_pos [n_k], got "
                             f"shapes {tuple(self.kt.shape)}, {tuple(self.v.shape)} and {tuple(self.k_pos.shape)}")
        h_kv, d, n_k = self.kt.shape
        if tuple(self.v.shape[:2]) != (h_kv, n_k) or self.k_pos.shape[0] != n_k:
            raise ValueError(f"StreamingView.v must be [h_kv, n_k, d_v] and k_pos [n_k] with [h_kv, n_k] = "
                             f"{[int(h_kv), int(n_k)]} from kt, got shapes {tuple(self.v.shape)} and "
                             f"{tuple(self.k_pos.shape)}")
        object.__setattr__(self, "dims", KVDims(n_k=int(n_k), h_kv=int(h_kv), d=int(d), d_v=int(self.v.shape[2])))

    @property
    def n_k(self) -> int:
        return self.dims.n_k

    #: Keys per CPU BLAS call over views (see :meth:`call_keys`): the value
    #: product of a decode tile streams best with about a thousand keys per call.
    VIEW_CALL_KEYS = 1024

    def call_keys(self, acc_dtype: Any, rows: int) -> int | None:
        """Keys per BLAS call on the CPU for a tile of ``rows``; None: the whole block.

        ``CALL_KEYS`` when blocks are cast copies (bounded scratch), else ``VIEW_CALL_KEYS``.
        """
        if self.kt.dtype != acc_dtype or self.v.dtype != acc_dtype:
            return CALL_KEYS
        return self.VIEW_CALL_KEYS

    def keys(self, start: int, stop: int, h0: int, h1: int, acc_dtype: Any) -> Any:
        """``kt [hb, d, B]``: a view when no cast is needed."""
        kt = self.kt[h0:h1, :, start:stop]  # [hb, d, B]
        return widen(kt, acc_dtype)

    def values(self, start: int, stop: int, h0: int, h1: int, acc_dtype: Any) -> Any:
        """``v [hb, B, d_v]``: a view when no cast is needed."""
        v = self.v[h0:h1, start:stop]  # [hb, B, d_v]
        return widen(v, acc_dtype)

    def block(self, start: int, stop: int, h0: int, h1: int, acc_dtype: Any) -> tuple[Any, Any]:
        """``(kt [hb, d, B], v [hb, B, d_v])`` for keys ``[start, stop)`` and kv heads ``[h0, h1)``."""
        return self.keys(start, stop, h0, h1, acc_dtype), self.values(start, stop, h0, h1, acc_dtype)


@dataclass(frozen=True, eq=False)
class ShardView:
    """The first keys of a :class:`ShardKV`: its parts in key order (the body's, then the tail's), each a
    :class:`StreamingView`; the kernel runs each and merges their states (``workers.api``)."""

    parts: tuple[StreamingView, ...]

    @property
    def n_k(self) -> int:
        return sum(p.n_k for p in self.parts)

    @property
    def k_pos(self) -> Any:
        """The keys' positions ``[n_k]``, in key order (a copy when there is a tail)."""
        if len(self.parts) == 1:
            return self.parts[0].k_pos
        xp = array_module(self.parts[0].k_pos)
        return xp.concatenate([p.k_pos for p in self.parts])


class ShardKV:
    """A resident shard: a body of arrays sized when it is created, and a tail for the keys appended past it.

    The body holds the keys a create writes and the reservation it asks for (a planned context's
    capacity): allocated for exactly that, rows padded as :func:`padded_capacity` says, as tight as
    a shard that never grows. Keys appended past it go to the tail, which on the CPU reserves
    address space for the rest of the shard's ``reach`` and holds it page by page (module doc,
    "Pages"): no append copies what is stored, and the tail holds at most one page beyond its keys.
    On a GPU there is no tail: the body grows geometrically (:meth:`StreamingKV.append`).

    Invariant: the tail holds keys only while the body is full, so key ``j`` of the shard is key
    ``j`` of the body, or key ``j - body.n_k`` of the tail.
    """

    def __init__(self, h_kv: int, d: int, d_v: int, dtype: Any, xp: Any = np, capacity: int = 0,
                 reach: int = 0) -> None:
        self.body = StreamingKV(h_kv, d, d_v, dtype, xp=xp, capacity=capacity)
        self.reach = max(int(reach), self.body.capacity)
        self.tail: StreamingKV | None = None

    h_kv = property(lambda self: self.body.h_kv)
    d = property(lambda self: self.body.d)
    d_v = property(lambda self: self.body.d_v)
    dtype = property(lambda self: self.body.dtype)

    @property
    def n_k(self) -> int:
        return self.body.n_k + (self.tail.n_k if self.tail is not None else 0)

    @property
    def nbytes(self) -> int:
        """Bytes held: the body's arrays, and the tail's pages."""
        return self.body.nbytes + (self.tail.nbytes if self.tail is not None else 0)

    def bytes_per_key(self) -> int:
        return self.body.bytes_per_key()

    def _split(self, n: int) -> tuple[int, int]:
        """How ``n`` appended keys divide: ``(into the body, into the tail)``."""
        if self.body.xp is not np:
            return n, 0  # a GPU body grows
        room = self.body.capacity - self.body.n_k if self.tail is None or self.tail.n_k == 0 else 0
        return min(n, room), n - min(n, room)

    def held_after(self, n: int) -> int:
        """Bytes held once ``n`` more keys are appended."""
        body, tail = self._split(n)
        held = self.body.held_after(body)
        if tail:
            held += self.tail.held_after(tail) if self.tail is not None else held_bytes(
                self.h_kv, self.d, self.d_v, self.dtype, self._tail_capacity(tail), tail)
        elif self.tail is not None:
            held += self.tail.nbytes
        return held

    def _tail_capacity(self, n: int) -> int:
        return padded_capacity(max(self.reach - self.body.capacity, n), self.dtype.itemsize)

    def append(self, k: Any, v: Any, k_pos: Any) -> None:
        """Add keys ``k [n, h_kv, d]``, values ``v [n, h_kv, d_v]`` at ``k_pos [n]`` (as
        :meth:`StreamingKV.append` checks them); the body first, while it has room."""
        body, tail = self._split(int(k.shape[0]) if k.ndim else 0)
        if not tail:
            self.body.append(k, v, k_pos, max_capacity=self.reach)
            return
        check_arrays(k=k, v=v)
        k_pos = check_positions("k_pos", k_pos, int(k.shape[0]), self.body.xp)
        if self.tail is None:
            self.tail = StreamingKV(self.h_kv, self.d, self.d_v, self.dtype, xp=self.body.xp,
                                    max_capacity=max(self.reach - self.body.capacity, tail))
        # The tail checks the whole write before the body takes its part: a refused write changes neither.
        self.tail.append(k[body:], v[body:], k_pos[body:])
        if body:
            self.body.append(k[:body], v[:body], k_pos[:body])

    def truncate(self, n: int) -> None:
        """Forget keys past the first ``n`` (an undone append); the tail gives its pages back."""
        if not 0 <= n <= self.n_k:
            raise ValueError(f"n must be in [0, {self.n_k}], got {n}")
        if self.tail is not None:
            self.tail.truncate(max(n - self.body.n_k, 0))
        self.body.truncate(min(n, self.body.n_k))

    def snapshot(self, length: int) -> ShardView:
        """A read-only view of the first ``length`` keys (at most :attr:`n_k`)."""
        body = self.body.snapshot(length)
        if length > body.dims.n_k and self.tail is not None:
            return ShardView((body, self.tail.snapshot(length - body.dims.n_k)))
        return ShardView((body,))
