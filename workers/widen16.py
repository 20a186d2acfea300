"""The compiled float16 widening loop of ``workers.widen`` (numba), cached on disk.

Apart from ``workers.widen`` so that only float16 work loads numba, and at module level
so that numba's disk cache finds it again: a loop built inside a function that holds its
intrinsic in a closure gets a new cache key in every process, and each worker compiled it
on its first float16 request (0.7-1.0 s here, and again for read-only inputs).
"""

from __future__ import annotations

from typing import Any

import numba
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


@intrinsic
def half_bits_to_float(typingctx: Any, bits: Any) -> Any:  # pragma: no cover - compiled
    """float32 of the float16 whose bits are ``bits`` (uint16): LLVM's fpext, one instruction with F16C."""
    if bits != types.uint16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@numba.njit(nogil=True, boundscheck=False, cache=True)
def widen16(base: Any, row_stride: int, rows: int, cols: int, out: Any) -> None:  # pragma: no cover - compiled
    """``out [rows * cols]`` float32 of the float16 bits ``base [(rows - 1) * row_stride + cols]`` (uint16),
    both contiguous: row ``i`` is ``base[i * row_stride : i * row_stride + cols]``. Each row is taken as
    a contiguous slice, so that the inner loop vectorises."""
    for i in range(rows):
        src = base[i * row_stride:i * row_stride + cols]
        dst = out[i * cols:(i + 1) * cols]
        for t in range(cols):
            dst[t] = half_bits_to_float(src[t])  # type: ignore[call-arg]  # numba passes typingctx
