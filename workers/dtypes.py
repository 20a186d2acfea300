"""Input dtypes and the accumulation dtype (CONTRACT section 2).

NumPy has no bfloat16; ``ml_dtypes.bfloat16`` supplies one. A bfloat16 is the top
16 bits of a float32, so raw bits (``uint16``) convert by a shift, see
:func:`bfloat16_from_bits`.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT16 = np.dtype(np.float16)
FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)

#: Input dtypes accepted for q, k and v.
INPUT_DTYPES = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)
INPUT_DTYPE_NAMES = "float16, bfloat16, float32 or float64"


def check_input_dtype(name: str, dtype: Any) -> np.dtype:
    """Return ``dtype`` as a numpy dtype, or raise naming the argument."""
    dt = np.dtype(dtype)
    if dt not in INPUT_DTYPES:
        raise ValueError(f"{name} must have dtype {INPUT_DTYPE_NAMES}, got {dt}")
    return dt


def accumulation_dtype(*dtypes: Any) -> np.dtype:
    """float64 when any input is float64, float32 otherwise."""
    return FLOAT64 if any(np.dtype(d) == FLOAT64 for d in dtypes) else FLOAT32


def bfloat16_from_bits(bits: Any) -> Any:
    """View raw bfloat16 bits (``uint16``) as an ``ml_dtypes.bfloat16`` array (no copy)."""
    if np.dtype(bits.dtype) != np.dtype(np.uint16):
        raise ValueError(f"bits must have dtype uint16, got {bits.dtype}")
    return bits.view(BFLOAT16)


def bfloat16_to_float32(x: Any) -> np.ndarray:
    """Exact widening of bfloat16 (or its uint16 bits) to float32: the bits shifted up 16."""
    u16 = x.view(np.uint16)
    return (u16.astype(np.uint32) << 16).view(np.float32)
