"""Exact widening of a block of 16-bit keys or values to the accumulation dtype, at memory speed.

The kernels compute in float32 (float64 when an input is float64): a 16-bit block
is widened once per BLAS call, into bounded scratch (``workers.layout``). bfloat16
widens fast through ``ml_dtypes`` (the bits shifted up 16). NumPy's own float16 cast
is a scalar loop (about 0.9 GB/s here, seven times slower than bfloat16), so float16
is widened by a loop that numba compiles to the CPU's conversion instruction
(LLVM ``fpext half to float``: ``vcvtph2ps`` with F16C): an IEEE conversion, exact
for every float16, subnormals, infinities and NaNs included.

Where numba is missing, the same result comes from bit arithmetic in NumPy (slower,
exact as well):

    f32 bits = (h & 0x7fff) << 13 | (h & 0x8000) << 16       the f16 fields in f32 places
    value    = f32(bits) * 2**112                           re-bias the exponent (15 -> 127)

(a power-of-two multiply is exact and turns f16 subnormals into the right normal
float32; exponent 31, infinities and NaNs, gets the float32 exponent 255 first).
tests/unit/test_workers_widen.py checks both against ``astype`` on all 65,536 float16s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from workers.dtypes import FLOAT16, FLOAT32

#: 2**112: float16's exponent bias (15) taken to float32's (127), for the NumPy fallback.
REBIAS = np.float32(2.0**112)


@functools.cache
def compiled_widen16() -> Callable[[np.ndarray, int, int, int, np.ndarray], None] | None:
    """The numba loop ``(base, row_stride, rows, cols, out) -> None`` over rows of float16 bits
    (see :func:`as_rows`; ``workers.widen16``), loaded on first use; None without numba.

    Imported lazily: only float16 work pays for loading numba. :func:`float16_to_float32` hands it
    read-only bits always: numba compiles a loop per argument type, and a request's keys arrive
    read-only, a shard's writable.
    """
    try:  # numba is a dependency; the NumPy arithmetic below is the fallback, not the usual path
        from workers.widen16 import widen16
    except ImportError:  # pragma: no cover - exercised where numba has no wheel
        return None
    return widen16


def load_widen16() -> bool:
    """Compile, or load from numba's disk cache, the float16 loop now (a worker's start, ``splitkey
    warm``), so that no request waits for it; False without numba."""
    if compiled_widen16() is None:
        return False
    float16_to_float32(np.zeros(8, dtype=FLOAT16))  # the one argument type every call uses
    return True

def as_rows(bits: np.ndarray) -> tuple[np.ndarray, int, int, int] | None:
    """``(base, row_stride, rows, cols)``: ``bits`` (non-empty, uint16) as rows of contiguous elements
    one ``row_stride`` apart, read through ``base``, a contiguous view of the span they cover; None
    when no such view exists (then the caller copies).

    A key block of the streaming layout, ``kt [hb, d, B]`` with a row stride of the capacity,
    is ``hb * d`` rows of ``B``; a value block ``v [hb, B, d_v]`` is ``hb`` rows of ``B * d_v``.
    Reading in place saves the gather copy that used to precede the widening loop.
    """
    item = bits.itemsize
    for split in range(bits.ndim):  # the fewest rows first: split 0 is one contiguous row
        rows_n = int(np.prod(bits.shape[:split], dtype=np.int64))
        cols = int(np.prod(bits.shape[split:], dtype=np.int64))
        try:
            r = bits.reshape(rows_n, cols, copy=False)  # [rows, cols], a view or nothing
        except ValueError:
            continue
        if r.strides[1] != item and cols > 1:
            continue
        row_stride = r.strides[0] // item if rows_n > 1 else cols
        if row_stride < 0 or r.strides[0] % item:
            continue
        span = (rows_n - 1) * row_stride + cols
        base = np.lib.stride_tricks.as_strided(r, shape=(span,), strides=(item,))  # [span], in bounds of bits
        return base, row_stride, rows_n, cols
    return None


def _bits_numpy(h: np.ndarray, out_bits: np.ndarray) -> None:
    """``out_bits [...]`` uint32: the float32 bits of ``h`` (uint16 float16 bits) before the re-bias."""
    np.copyto(out_bits, h)
    sign = out_bits & np.uint32(0x8000)
    special = (out_bits & np.uint32(0x7C00)) == np.uint32(0x7C00)  # inf or NaN
    np.bitwise_and(out_bits, np.uint32(0x7FFF), out=out_bits)
    np.left_shift(out_bits, np.uint32(13), out=out_bits)
    np.left_shift(sign, np.uint32(16), out=sign)
    np.bitwise_or(out_bits, sign, out=out_bits)
    np.bitwise_or(out_bits, np.uint32(0x7F800000), out=out_bits, where=special)


def float16_to_float32(x: np.ndarray) -> np.ndarray:
    """A new contiguous float32 array equal to ``x.astype(np.float32)`` (``x`` float16, any strides)."""
    if np.dtype(x.dtype) != FLOAT16:
        raise ValueError(f"x must have dtype float16, got {x.dtype}")
    out = np.empty(x.shape, dtype=FLOAT32)
    bits = x.view(np.uint16)
    loop = compiled_widen16()
    if loop is not None:
        if x.size:
            rows = as_rows(bits)
            if rows is None:  # no uniform row stride: gather first (copying 2-byte rows runs at memory speed)
                flat = np.ascontiguousarray(bits).reshape(-1)  # [n], one row
                rows = (flat, flat.size, 1, flat.size)
            base, row_stride, n_rows, cols = rows
            base = base.view()
            base.flags.writeable = False  # one argument type whoever calls (compiled_widen16)
            loop(base, row_stride, n_rows, cols, out.reshape(-1))
        return out
    _bits_numpy(bits, out.view(np.uint32))
    with np.errstate(invalid="ignore"):  # signalling NaNs stay NaNs, quietly
        out *= REBIAS
    return out


def widen(x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype``: itself when it already is, float16 -> float32 through the fast path, else ``astype``."""
    if x.dtype == dtype:
        return x
    if isinstance(x, np.ndarray) and np.dtype(x.dtype) == FLOAT16 and np.dtype(dtype) == FLOAT32:
        return float16_to_float32(x)
    return x.astype(dtype)
