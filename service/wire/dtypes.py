"""The dtypes that travel on the wire: one table of their codes in each format, and raw bytes.

safetensors and the Open Inference Protocol name the same six dtypes with
different codes (``BF16`` / ``BF16``, ``F32`` / ``FP32``, ``I64`` / ``INT64``).
Bytes are little-endian, C order; a bfloat16 travels as its 16 bits and decodes
to ``ml_dtypes.bfloat16`` (the numpy dtypes are those of ``workers.dtypes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.dtypes import BFLOAT16, DTYPES, bfloat16_from_bits


@dataclass(frozen=True)
class WireDtype:
    """One dtype on the wire."""

    value: np.dtype  #: the dtype of the decoded array
    bits: np.dtype  #: the little-endian dtype of its bytes (bfloat16: its uint16 bits)
    safetensors: str  #: safetensors code
    kserve: str  #: Open Inference Protocol datatype
    write_rank: int  #: order of the reference safetensors writer (it writes the highest first)

    @property
    def integer(self) -> bool:
        return self.value.kind in "iu"


#: The table, in the reference safetensors writer's dtype order.
WIRE_DTYPES: tuple[WireDtype, ...] = (
    WireDtype(DTYPES["float16"], np.dtype("<f2"), "F16", "FP16", 0),
    WireDtype(DTYPES["bfloat16"], np.dtype("<u2"), "BF16", "BF16", 1),
    WireDtype(np.dtype(np.int32), np.dtype("<i4"), "I32", "INT32", 2),
    WireDtype(DTYPES["float32"], np.dtype("<f4"), "F32", "FP32", 3),
    WireDtype(DTYPES["float64"], np.dtype("<f8"), "F64", "FP64", 4),
    WireDtype(np.dtype(np.int64), np.dtype("<i8"), "I64", "INT64", 5),
)
SAFETENSORS: Mapping[str, WireDtype] = {w.safetensors: w for w in WIRE_DTYPES}
KSERVE: Mapping[str, WireDtype] = {w.kserve: w for w in WIRE_DTYPES}
_BY_VALUE = {w.value: w for w in WIRE_DTYPES}
NAMES = "float16, bfloat16, float32, float64, int32 or int64"


def wire_of(name: str, a: Any) -> WireDtype:
    """The wire dtype of array ``a`` (any byte order), or raise naming it."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    wire = _BY_VALUE.get(a.dtype.newbyteorder("="))
    if wire is None:
        raise ValueError(f"{name} dtype must be {NAMES}, got {a.dtype}")
    return wire


def from_bytes(buf: Any, wire: WireDtype, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """The array of ``shape`` at ``offset`` of ``buf``: a zero-copy view (on little-endian hosts)."""
    a = np.frombuffer(buf, dtype=wire.bits, count=int(np.prod(shape, dtype=np.int64)), offset=offset)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    a = a.reshape(shape)
    return bfloat16_from_bits(a) if wire.value == BFLOAT16 else a


def array_bytes(a: np.ndarray, wire: WireDtype) -> np.ndarray:
    """The little-endian bytes of ``a`` as a flat uint8 array (no copy when already contiguous and LE)."""
    raw = a.view(np.uint16) if wire.value == BFLOAT16 else a
    return np.ascontiguousarray(raw, dtype=wire.bits).reshape(-1).view(np.uint8)
