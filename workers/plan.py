"""How one partial-attention call is cut into work items (pure, no arrays).

The kernel works in a head-major row space: for kv head ``h`` the query rows are
the ``n_q * g`` pairs (query i, group member j), row ``i * g + j``, all reading
kv head ``h``. A work item is a batch of kv heads ``[h0, h1)``, a tile of rows
``[r0, r1)`` and a key range ``[k0, k1)``; the kernel streams its key range in
blocks of ``block_size`` keys.

* Few rows (decode): one item spans all kv heads, so each block is one batched
  GEMM over heads, and the keys are split into ranges when there are threads to
  feed (split-K, as in Flash-Decoding). Split ranges are merged in key order.
* Many rows (prefill): one kv head per item, rows tiled, each item over all keys.

The score tile of an item, ``[h1-h0, r1-r0, block_size]`` plus its temporaries,
and the copies of one BLAS call (``CALL_KEYS`` keys, when a layout must cast),
stay within ``KernelOptions.scratch_bytes`` whatever ``n_k`` is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.options import KernelOptions
from workers.problem import Problem

#: Up to this many rows per kv head, a call is decode-shaped (heads batched).
DECODE_ROWS = 32
#: Row tile of prefill-shaped calls.
PREFILL_ROW_TILE = 1024
#: Block sizes chosen from the budget are multiples of this and within the bounds.
BLOCK_GRANULE = 64
MIN_BLOCK, MAX_BLOCK = 64, 8192
#: Score tile temporaries per element: scores, a mask or bias operand, slack
#: (the GPU path's budget, ``workers.gpu``).
TILE_TEMPS = 3
#: The CPU budget counts a tile as 1.5 tiles: the kernel builds the ALiBi and
#: mask operands a few rows at a time within half a tile
#: (``blockwise.operand_rows``). Prefill (1024 rows) streams ~4% faster with
#: the 1280-key blocks this allows than with the 640-key ones of 3 tiles.
CPU_TILE_HALVES = 3
#: Keys per BLAS call of the CPU kernel when a layout must cast: a block's two
#: products are cut into calls, and the cast copies of one call's keys and
#: values are the only block-sized scratch besides the score tile. Layouts that
#: hand out views pick their own call length (``layout.*.VIEW_CALL_KEYS``).
#: Large blocks mean fewer softmax steps: decode over resident keys streams
#: about 10% faster with 8192-key blocks than with 1024-key ones.
CALL_KEYS = 256


@dataclass(frozen=True)
class WorkItem:
    h0: int
    h1: int
    r0: int
    r1: int
    k0: int
    k1: int


@dataclass(frozen=True)
class Plan:
    block_size: int
    items: tuple[WorkItem, ...]
    #: Items that share (heads, rows) and split the keys, listed in key order;
    #: each group is merged into one state in this order.
    groups: tuple[tuple[int, ...], ...]


def choose_block(hb: int, rows: int, d: int, d_v: int, itemsize: int, kopts: KernelOptions) -> int:
    """Keys per block so that the tile and one call's copies fit the scratch budget."""
    if kopts.block_size is not None:
        return kopts.block_size
    copies = hb * (d + d_v) * itemsize * CALL_KEYS  # one call's cast keys and values, at most
    per_key = hb * rows * itemsize * CPU_TILE_HALVES // 2  # the score tile and its operands
    b = max(kopts.scratch_bytes - copies, 0) // max(per_key, 1)
    b = (b // BLOCK_GRANULE) * BLOCK_GRANULE
    return int(min(MAX_BLOCK, max(MIN_BLOCK, b)))


def make_plan(n_rows: int, h_kv: int, n_k: int, d: int, d_v: int, itemsize: int, kopts: KernelOptions) -> Plan:
    """Cut ``h_kv`` heads x ``n_rows`` rows x ``n_k`` keys into work items."""
    if n_rows <= DECODE_ROWS:
        head_batches = [(0, h_kv)]
        row_tiles = [(0, n_rows)]
    else:
        head_batches = [(h, h + 1) for h in range(h_kv)]
        row_tiles = [(r, min(r + PREFILL_ROW_TILE, n_rows)) for r in range(0, n_rows, PREFILL_ROW_TILE)]
    hb = head_batches[0][1] - head_batches[0][0]
    rt = row_tiles[0][1] - row_tiles[0][0]
    block = choose_block(hb, rt, d, d_v, itemsize, kopts)
    tiles = [(h, r) for h in head_batches for r in row_tiles]
    n_blocks = -(-n_k // block)
    # Split the keys only when the tiles alone cannot feed the threads.
    splits = 1
    if len(tiles) < kopts.threads:
        splits = max(1, min(-(-kopts.threads // len(tiles)), n_blocks))
    per_split = -(-n_blocks // splits) * block if n_k else 0
    items: list[WorkItem] = []
    groups: list[tuple[int, ...]] = []
    for (h0, h1), (r0, r1) in tiles:
        members = []
        for s in range(splits):
            k0 = min(s * per_split, n_k)
            k1 = min(k0 + per_split, n_k) if s < splits - 1 else n_k
            members.append(len(items))
            items.append(WorkItem(h0, h1, r0, r1, k0, k1))
        groups.append(tuple(members))
    return Plan(block_size=block, items=tuple(items), groups=tuple(groups))


def batchable(problems: Sequence[Problem]) -> bool:
    """Whether the problems can share one pass over their keys, one tile each (``workers.blockwise.stream``).

    Decode-shaped (a pass is worth sharing while reading the keys costs more than
    the arithmetic), of one shape and accumulation dtype: the rows per kv head,
    ``n_q * g``, set the plan, the block size and the BLAS calls, so equal rows give
    every problem the plan it has alone. Options (scale, masks, softcap, ALiBi) and
    positions are per tile and may differ.
    """
    first = problems[0]

    def key(p: Problem) -> tuple:
        return p.n_k, p.h_kv, p.d, p.d_v, p.n_q * p.group, p.acc_dtype

    return first.n_q * first.group <= DECODE_ROWS and all(key(p) == key(first) for p in problems)
