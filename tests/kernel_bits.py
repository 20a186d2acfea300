"""What the micro-kernel tests share: the key dtypes, float32's epsilon, and an array as the
compiled kernels read it (16-bit formats as their bits, as ``workers.fused`` hands them in)."""

from __future__ import annotations

import numpy as np

from workers import BFLOAT16

EPS32 = float(np.finfo(np.float32).eps)
DTYPES = {"float32": np.float32, "bfloat16": BFLOAT16, "float16": np.float16}


def bits(a: np.ndarray) -> np.ndarray:
    """``a`` as the kernels read it: bfloat16 as uint16, float16 as int16, float32 as is."""
    if a.dtype == BFLOAT16:
        return a.view(np.uint16)
    if a.dtype == np.float16:
        return a.view(np.int16)
    return a
