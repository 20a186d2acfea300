"""The one table of input dtypes, and the accumulation dtype (docs/API.md section 2).

Every layer names dtypes through :data:`DTYPES` (``"bfloat16"`` <-> ``np.dtype``):
the JSON ``dtype`` field, context records, the worker's store, the load generator.
Wire formats add their own codes for the same dtypes in ``service/wire/dtypes.py``.

NumPy has no bfloat16; ``ml_dtypes.bfloat16`` supplies one. A bfloat16 is the top
16 bits of a float32, so raw bits (``uint16``) convert by a shift, see
:func:`bfloat16_from_bits`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from workers.errors import InvalidInput

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT16 = np.dtype(np.float16)
FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)

#: Input dtypes accepted for q, k and v, by their public names, narrowest first.
DTYPES: Mapping[str, np.dtype] = {"float16": FLOAT16, "bfloat16": BFLOAT16, "float32": FLOAT32, "float64": FLOAT64}
INPUT_DTYPE_NAMES = "float16, bfloat16, float32 or float64"
_NAMES = {dt: name for name, dt in DTYPES.items()}


def _input_dtype(dtype: Any) -> np.dtype | None:
    """``dtype`` as one of the input dtypes, or None. ``None`` is no dtype (``np.dtype(None)`` is float64)."""
    try:
        dt = None if dtype is None else np.dtype(dtype)
    except TypeError:
        return None
    return dt if dt in _NAMES else None


def _shown(dtype: Any) -> str:
    """A refused dtype as messages quote it: its numpy name where it has one, else its repr."""
    try:
        return str(np.dtype(dtype)) if dtype is not None else "None"
    except TypeError:
        return repr(dtype)


def dtype_name(dtype: Any) -> str:
    """The public name of an input dtype (``"bfloat16"``), or raise naming it."""
    dt = _input_dtype(dtype)
    if dt is None:
        raise ValueError(f"dtype must be {INPUT_DTYPE_NAMES}, got {_shown(dtype)}")
    return _NAMES[dt]


def dtype_of(name: str) -> np.dtype:
    """The numpy dtype of a public dtype name, or raise naming it."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def check_input_dtype(name: str, dtype: Any) -> np.dtype:
    """Return ``dtype`` as a numpy dtype, or raise naming the argument."""
    dt = _input_dtype(dtype)
    if dt is None:
        raise InvalidInput(f"{name} must have dtype {INPUT_DTYPE_NAMES}, got {_shown(dtype)}")
    return dt


def accumulation_dtype(*dtypes: Any) -> np.dtype:
    """float64 when any input is float64, float32 otherwise."""
    return FLOAT64 if any(np.dtype(d) == FLOAT64 for d in dtypes) else FLOAT32


def bfloat16_from_bits(bits: Any) -> Any:
    """View raw bfloat16 bits (``uint16``) as an ``ml_dtypes.bfloat16`` array (no copy)."""
    if np.dtype(bits.dtype) != np.dtype(np.uint16):
        raise ValueError(f"bits must have dtype uint16, got {bits.dtype}")
    return bits.view(BFLOAT16)

