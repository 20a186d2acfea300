"""Keys, values and queries drawn from a seed, piece by piece, so nothing is held twice.

Every tensor of a load test is a function of ``(seed, stream, index)``: a key range
``[lo, hi)`` of stream ``s`` is the same numbers whether it is drawn for the upload,
for an inline request or for the reference, and a context of 1M keys is never held
whole (docs/LOADTEST.md, "Verified answers"). Keys are drawn in blocks of
:data:`GENERATE_KEYS`: block ``b`` of a stream comes from its own generator, so any
range costs only the blocks it touches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from service.client.loadtest.config import Shape
from workers.dtypes import DTYPES

#: Keys per generator block (a range touches ceil(len / GENERATE_KEYS) + 1 blocks at most).
GENERATE_KEYS = 16384
#: Keys per block of the short streams (chat turns, from TURN_STREAM on): a turn of a few
#: keys must not draw 16K of them inside its measured latency.
TURN_BLOCK_KEYS = 256
#: Stream numbers: contexts and inline keys use 0 .. 2**20, queries and turns above.
QUERY_STREAM = 2**40
TURN_STREAM = 2**41


@dataclass(frozen=True)
class Segment:
    """Keys ``[lo, hi)`` of ``stream``, at positions ``pos0 + (0 .. hi - lo)``: what a request reads."""

    stream: int
    lo: int
    hi: int
    pos0: int

    @property
    def n(self) -> int:
        return self.hi - self.lo


class Source:
    """The numbers of one sweep: ``Source(seed, shape)``."""

    def __init__(self, seed: int, shape: Shape) -> None:
        self.seed = int(seed)
        self.shape = shape
        self.dtype = DTYPES[shape.dtype]

    @staticmethod
    def block_keys(stream: int) -> int:
        """Keys per generator block of ``stream``."""
        return TURN_BLOCK_KEYS if stream >= TURN_STREAM else GENERATE_KEYS

    def _block(self, stream: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``b`` of ``stream``: ``(k [G, h_kv, d], v [G, h_kv, d_v])`` in the sweep's dtype."""
        s = self.shape
        size = self.block_keys(stream)
        rng = np.random.default_rng([self.seed, stream, b])
        k = rng.standard_normal((size, s.h_kv, s.d), dtype=np.float32).astype(self.dtype)
        v = rng.standard_normal((size, s.h_kv, s.d_v), dtype=np.float32).astype(self.dtype)
        return k, v

    def kv(self, stream: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """``(k [hi - lo, h_kv, d], v [hi - lo, h_kv, d_v])``: keys ``[lo, hi)`` of ``stream``."""
        if not 0 <= lo <= hi:
            raise ValueError(f"key range must satisfy 0 <= lo <= hi, got [{lo}, {hi})")
        s = self.shape
        k = np.empty((hi - lo, s.h_kv, s.d), self.dtype)
        v = np.empty((hi - lo, s.h_kv, s.d_v), self.dtype)
        size = self.block_keys(stream)
        for b in range(lo // size, -(-hi // size)):
            a, z = max(lo, b * size), min(hi, (b + 1) * size)
            kb, vb = self._block(stream, b)
            k[a - lo:z - lo] = kb[a - b * size:z - b * size]
            v[a - lo:z - lo] = vb[a - b * size:z - b * size]
        return k, v

    def pieces(self, stream: int, lo: int, hi: int, size: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """``(start, k, v)`` of keys ``[lo, hi)`` in pieces of at most ``size`` keys.

        Pieces end at multiples of ``size``, so that with ``size`` a multiple of
        :data:`GENERATE_KEYS` each generator block is drawn once.
        """
        if type(size) is not int or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        a = lo
        while a < hi:
            z = min(hi, (a // size + 1) * size)
            k, v = self.kv(stream, a, z)
            yield a, k, v
            a = z

    def query(self, stream: int, n_q: int) -> np.ndarray:
        """``q [n_q, h_q, d]`` number ``stream`` (request index or a derived number)."""
        s = self.shape
        rng = np.random.default_rng([self.seed, QUERY_STREAM + stream])
        return rng.standard_normal((n_q, s.h_q, s.d), dtype=np.float32).astype(self.dtype)
