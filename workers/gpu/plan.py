"""How the fused GPU kernels cut one shard's work (pure Python: no cupy, no arrays).

The fused path (``workers.gpu.backend``, kernels in ``workers/gpu/kernels/attention.cu``,
design in docs/GPU.md) runs one thread block per (key chunk, kv head, row tile):

* rows: the kernel row space of ``workers.rows.prepare_rows`` (row ``i * g + j``
  of kv head ``h`` is query ``i``, query head ``h * g + j``), cut into tiles of
  ``rows_per_block`` rows;
* keys: the shard's ``n_k`` keys cut into ``n_chunks`` contiguous chunks of
  ``chunk_keys`` keys (the last one shorter), each a whole number of
  ``KEY_TILE``-key tiles, which the block streams in order;
* combine: the chunk states of one (head, row) are merged in chunk order, as
  ``merge.merge_group(states)`` does (common max, then sums in that order).

Few rows (decode) use the split-K decode kernel and many chunks, so that the
device has enough blocks; many rows (prefill) use the tiled prefill kernel,
whose row tiles alone usually fill the device (then one chunk).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

#: Threads per block and keys per tile; must match attention.cu.
THREADS = 128
KEY_TILE = 64
#: Row tiles of the decode kernel (the smallest that holds every row is used).
DECODE_ROWS = (2, 4, 8, 16, 32)
#: Row tile of the prefill kernel (4 warps x 16 rows of mma).
PREFILL_ROWS = 64
#: Resident blocks per multiprocessor the split aims at (several hide memory latency).
BLOCKS_PER_SM = 4
#: A chunk streams at least this many tiles unless the whole shard is shorter.
MIN_CHUNK_TILES = 4


def _check_count(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class FusedPlan:
    """Launch shape of one fused call: grid ``(n_chunks, h_kv, row_tiles)``, ``THREADS`` threads."""

    kernel: str  # "decode" or "prefill"
    rows_per_block: int
    row_tiles: int
    h_kv: int
    n_k: int
    chunk_keys: int  # a multiple of KEY_TILE
    n_chunks: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.n_chunks, self.h_kv, self.row_tiles)

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """Key ranges ``[k0, k1)`` of the chunks, in key order: also the combine order."""
        return tuple((c * self.chunk_keys, min((c + 1) * self.chunk_keys, self.n_k)) for c in range(self.n_chunks))


def rows_per_block(n_rows: int) -> tuple[str, int]:
    """The kernel and its row tile for ``n_rows`` rows per kv head."""
    for rows in DECODE_ROWS:
        if n_rows <= rows:
            return "decode", rows
    return "prefill", PREFILL_ROWS


def make_fused_plan(n_rows: int, h_kv: int, n_k: int, sm_count: int, chunk_keys: int | None = None) -> FusedPlan:
    """Cut ``h_kv`` heads x ``n_rows`` rows x ``n_k`` keys into thread blocks.

    ``chunk_keys`` forces the keys per chunk (rounded up to whole tiles); by
    default the keys are split until ``sm_count * BLOCKS_PER_SM`` blocks exist
    or chunks would fall under ``MIN_CHUNK_TILES`` tiles.
    """
    n_rows = _check_count("n_rows", n_rows, 1)
    h_kv = _check_count("h_kv", h_kv, 1)
    n_k = _check_count("n_k (an empty shard needs no kernel)", n_k, 1)
    sm_count = _check_count("sm_count", sm_count, 1)
    kernel, rows = rows_per_block(n_rows)
    row_tiles = -(-n_rows // rows)
    tiles = -(-n_k // KEY_TILE)
    if chunk_keys is None:
        blocks = h_kv * row_tiles
        splits = max(1, -(-sm_count * BLOCKS_PER_SM // blocks))
        splits = min(splits, max(1, tiles // MIN_CHUNK_TILES))
        chunk_tiles = -(-tiles // splits)
    else:
        chunk_tiles = -(-_check_count("chunk_keys", chunk_keys, 1) // KEY_TILE)
    chunk = chunk_tiles * KEY_TILE
    return FusedPlan(kernel=kernel, rows_per_block=rows, row_tiles=row_tiles, h_kv=h_kv, n_k=n_k,
                     chunk_keys=chunk, n_chunks=-(-n_k // chunk))
