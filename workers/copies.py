"""Copies into the resident layout (``workers.layout.StreamingKV``) at memory speed.

An append writes keys ``k [n, h_kv, d]`` into the d-major ``kt [h_kv, d, capacity]``
and values ``v [n, h_kv, d_v]`` into ``[h_kv, capacity, d_v]``. Two things made
that copy the slowest stage of an upload (benchmarks/results/2026-12-01/NOTES.md, "Uploads: where the time went first"):

* NumPy copies arrays of a dtype it knows from a plug-in (bfloat16) element by
  element through the plug-in's functions; as unsigned integers of the same width
  (:func:`as_bits`) the same bytes take NumPy's own strided loops.
* The keys' transpose: NumPy walks ``kt`` row by row and reads ``k`` with a stride
  of ``h_kv * d`` elements (0.85 GB/s here for float16). A loop that numba compiles
  goes tile by tile (:data:`TILE_KEYS` keys by :data:`TILE_DIMS` dimensions): the tile's
  keys are read in order and each of its dimensions is written as one run of keys, so
  every cache line written is filled before it is left (1.9 GB/s for 16-bit keys into a
  128K-key shard, against 0.5 for a loop writing each key down its column); NumPy in
  steps of :data:`TRANSPOSE_KEYS` keys is the fallback where numba is missing.

The values keep their row order (``[n, d_v]`` runs per head) and copy at memory
speed as they are.

A third cost is the memory itself: the first write to a page of a new array traps
to the kernel, and on these VMs (Firecracker, free memory handed back to the host)
faulting in fresh memory runs at about 0.45 GB/s, slower than every copy above.
:func:`prefault` asks the kernel to fault a range in ahead of its writes
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+), which leaves what is stored there
unchanged: a shard allocated for its whole capacity is prefaulted by a background
thread while the upload's next chunks are still on their way (``workers.store``).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from merge import array_module

#: Keys per step of the NumPy fallback of :func:`copy_keys_dmajor`.
TRANSPOSE_KEYS = 128
#: The compiled transpose's tile: keys (a 32-byte run of a key dimension's row at 16 bits) by
#: dimensions. Chosen by measurement (benchmarks/results/2026-12-07/NOTES.md, "Key transpose").
TILE_KEYS, TILE_DIMS = 16, 64
#: Unsigned integers of each itemsize: copies move the bits as these (:func:`as_bits`).
BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


#: madvise advice: fault the range in, writable, keeping its contents (Linux 5.14+).
MADV_POPULATE_WRITE = 23
#: madvise advice: back the range with 4 KiB pages only, never transparent huge pages.
MADV_NOHUGEPAGE = 15
#: madvise advice: give the range's pages back; the next read of them finds zeros.
MADV_DONTNEED = 4
#: Bytes per madvise call of :func:`prefault`: a thread that owns no lock, one step at a time.
PREFAULT_STEP = 64 * 2**20


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def prefault(a: np.ndarray) -> bool:
    """Fault in the whole pages of ``a``'s memory for writing, its contents unchanged (module doc).

    ``a`` may be strided: each contiguous run of its last axis is one range. Returns
    False where the kernel or platform cannot (nothing is done then). Safe while
    other threads read or write ``a``: the kernel only maps pages in.
    """
    madvise = _madvise()
    if madvise is None or a.size == 0:
        return False
    if a.ndim > 1 and not a.flags.c_contiguous:
        return all(prefault(part) for part in a)
    if a.ndim == 1 and a.strides[0] != a.itemsize:
        return False  # not a run of memory; never asked for
    page = mmap.PAGESIZE
    lo = -(-a.ctypes.data // page) * page
    hi = (a.ctypes.data + a.nbytes) // page * page
    for start in range(lo, hi, PREFAULT_STEP):
        if madvise(start, min(PREFAULT_STEP, hi - start), MADV_POPULATE_WRITE) != 0:
            return False  # EINVAL before Linux 5.14: the writes fault the pages in as ever
    return True


def reserve(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An array of ``shape`` whose memory is reserved, not yet held: an anonymous mapping that the
    kernel backs with a 4 KiB page on the first write to it (``workers.layout``, "Pages").

    Untouched memory costs address space only, and huge pages are refused for it
    (``MADV_NOHUGEPAGE``): with them one write would hold 2 MiB. The mapping goes back
    to the system when the array and its views are gone. Off Linux: ``np.empty``.
    """
    dt = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if size == 0 or not sys.platform.startswith("linux"):
        return np.empty(shape, dtype=dt)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
    madvise = _madvise()
    if madvise is not None:
        madvise(ctypes.addressof(ctypes.c_char.from_buffer(region)), size, MADV_NOHUGEPAGE)
    return np.frombuffer(region, dtype=dt).reshape(shape)


def release(a: np.ndarray) -> bool:
    """Give back to the system the whole pages that lie inside ``a``'s memory (a reserved shard's
    tail, ``workers.layout``); what they held reads as zeros afterwards. ``a`` may be strided as for
    :func:`prefault`; a page that ``a`` shares with memory outside it is kept. Returns False where
    the platform cannot (the pages stay held)."""
    madvise = _madvise()
    if madvise is None or a.size == 0:
        return False
    if a.ndim > 1 and not a.flags.c_contiguous:
        done = [release(part) for part in a]  # every part, not up to the first that fails
        return all(done)
    page = mmap.PAGESIZE
    lo = -(-a.ctypes.data // page) * page
    hi = (a.ctypes.data + a.nbytes) // page * page
    return hi <= lo or madvise(lo, hi - lo, MADV_DONTNEED) == 0


def as_bits(a: Any) -> Any:
    """The same memory as unsigned integers of the same width (module doc)."""
    return a.view(BITS[np.dtype(a.dtype).itemsize])


@functools.cache
def compiled_transpose() -> Callable[[np.ndarray, np.ndarray], None] | None:
    """The numba loop ``(dst [h_kv, d, n], k [n, h_kv, d]) -> None`` (unsigned integers of one
    width, any strides), built on first use; None without numba."""
    try:
        import numba
    except ImportError:  # pragma: no cover - exercised where numba has no wheel
        return None

    tj, te = TILE_KEYS, TILE_DIMS  # compile-time constants: LLVM unrolls the tile's loops

    # cache: compiled once per machine into __pycache__, not once per worker process
    @numba.njit(nogil=True, boundscheck=False, cache=True)
    def transpose(dst: Any, k: Any) -> None:  # pragma: no cover - compiled
        n, h_kv, d = k.shape
        n_full = n - n % tj  # keys in whole tiles
        d_full = d - d % te  # dims in whole tiles
        for h in range(h_kv):
            for j0 in range(0, n_full, tj):
                # tile [tj keys, te dims]: read as tj runs of k's rows, written as te runs of tj keys
                for e0 in range(0, d_full, te):
                    for e in range(te):
                        for j in range(tj):
                            dst[h, e0 + e, j0 + j] = k[j0 + j, h, e0 + e]
                for e in range(d_full, d):  # the last dims, fewer than te
                    for j in range(tj):
                        dst[h, e, j0 + j] = k[j0 + j, h, e]
            for j in range(n_full, n):  # the last keys, fewer than tj
                for e in range(d):
                    dst[h, e, j] = k[j, h, e]

    return transpose


def copy_keys_dmajor(dst: Any, k: Any) -> None:
    """``dst [h_kv, d, n] = k [n, h_kv, d]`` transposed, bit for bit (module doc)."""
    if array_module(dst) is not np:  # a GPU copies the transpose at memory speed
        dst[...] = k.transpose(1, 2, 0)
        return
    dst_bits, k_bits = as_bits(dst), as_bits(k).view()
    # Read-only whatever the caller's k: numba compiles a loop per argument type, and a request's keys
    # arrive read-only, a shard's writable; one type is the loop workers.fused.warm() compiles.
    k_bits.flags.writeable = False
    loop = compiled_transpose()
    if loop is not None:
        if k.size:
            loop(dst_bits, k_bits)
        return
    for lo in range(0, int(k.shape[0]), TRANSPOSE_KEYS):
        hi = lo + TRANSPOSE_KEYS
        dst_bits[:, :, lo:hi] = k_bits[lo:hi].transpose(1, 2, 0)  # [h_kv, d, <=TRANSPOSE_KEYS]


def copy_values(dst: Any, v: Any) -> None:
    """``dst [h_kv, n, d_v] = v [n, h_kv, d_v]`` with the heads first, bit for bit."""
    if array_module(dst) is not np:
        dst[...] = v.transpose(1, 0, 2)
        return
    as_bits(dst)[...] = as_bits(v).transpose(1, 0, 2)  # [h_kv, n, d_v]
