"""How values are written on the wire: dtype codes and raw bytes, JSON text and JSON numbers.

* Binary: safetensors and the Open Inference Protocol name the same six dtypes with
  different codes (``BF16`` / ``BF16``, ``F32`` / ``FP32``, ``I64`` / ``INT64``): one
  table, :data:`WIRE_DTYPES`. Bytes are little-endian, C order; a bfloat16 travels as
  its 16 bits and decodes to ``ml_dtypes.bfloat16`` (the numpy dtypes are those of
  ``workers.dtypes``).
* JSON, shared by the JSON bodies and the Open Inference Protocol: :func:`load_json`
  (strict: UTF-8, no repeated keys; 400 on failure), :func:`numbers_to_array` (the
  leaves of a JSON tensor to an array of the wanted dtype, refusing bools, strings,
  values that overflow the dtype and non-finite values, naming the element) and
  :func:`array_to_json` (non-finite values as ``null``: JSON has no infinities, and an
  ``lse`` of -inf marks a fully masked row).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core.errors import InvalidBody, InvalidTensor
from service.wire.rules import show
from workers.dtypes import BFLOAT16, DTYPES, FLOAT32, FLOAT64, bfloat16_from_bits

# -- binary: dtype codes and raw bytes -------------------------------------------------------

@dataclass(frozen=True)
class WireDtype:
    """One dtype on the wire."""

    value: np.dtype  #: the dtype of the decoded array
    bits: np.dtype  #: the little-endian dtype of its bytes (bfloat16: its uint16 bits)
    safetensors: str  #: safetensors code
    kserve: str  #: Open Inference Protocol datatype
    write_rank: int  #: order of the reference safetensors writer (it writes the highest first)
    integer: bool  #: positions (int32, int64) rather than values


#: The table, in the reference safetensors writer's dtype order.
WIRE_DTYPES: tuple[WireDtype, ...] = (
    WireDtype(DTYPES["float16"], np.dtype("<f2"), "F16", "FP16", 0, False),
    WireDtype(DTYPES["bfloat16"], np.dtype("<u2"), "BF16", "BF16", 1, False),
    WireDtype(np.dtype(np.int32), np.dtype("<i4"), "I32", "INT32", 2, True),
    WireDtype(DTYPES["float32"], np.dtype("<f4"), "F32", "FP32", 3, False),
    WireDtype(DTYPES["float64"], np.dtype("<f8"), "F64", "FP64", 4, False),
    WireDtype(np.dtype(np.int64), np.dtype("<i8"), "I64", "INT64", 5, True),
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
    a = np.frombuffer(buf, dtype=wire.bits, count=math.prod(shape), offset=offset)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    a = a.reshape(shape)
    return bfloat16_from_bits(a) if wire.value == BFLOAT16 else a


def array_bytes(a: np.ndarray, wire: WireDtype) -> np.ndarray:
    """The little-endian bytes of ``a`` as a flat uint8 array (no copy when already contiguous and LE)."""
    raw = a.view(np.uint16) if wire.value == BFLOAT16 else a
    return np.ascontiguousarray(raw, dtype=wire.bits).reshape(-1).view(np.uint8)


# -- JSON text and numbers ------------------------------------------------------------------

def load_json(data: bytes | bytearray | memoryview, what: str) -> Any:
    """Parse UTF-8 JSON, rejecting duplicate object keys; 400 ``invalid_body`` if unparseable.

    NaN and Infinity literals parse to floats here; the field checks reject them by name.
    """
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in items:
            if key in obj:
                raise InvalidBody(f"{what} must not repeat a key, got {show(key)} twice")
            obj[key] = value
        return obj

    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidBody(f"{what} must be UTF-8, got byte 0x{data[e.start]:02x} at {e.start}") from None
    try:
        return json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        raise InvalidBody(f"{what} must be valid JSON, got {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise InvalidBody(f"{what} must be valid JSON, got lists or objects nested too deeply") from None
    except ValueError:
        # Valid JSON, but an integer literal longer than CPython converts (its guard against quadratic
        # parsing): no field takes one (positions and sizes are int64, 19 digits; values float64, 309).
        # The literal is found in the text (the first run of digits past the limit), not in the message.
        limit = sys.get_int_max_str_digits()
        long = next((len(m.group()) for m in re.finditer(r"\d+", text) if len(m.group()) > limit), None)
        got = f"one of {long} digits" if long is not None else "a longer one"
        raise InvalidBody(f"{what} must hold integers of at most {limit} digits (no field "
                          f"takes more than 309), got {got}") from None


def _first(items: Sequence[Any], bad: Callable[[Any], bool]) -> int:
    return next(i for i, x in enumerate(items) if bad(x))


def _beyond_float64(x: Any) -> bool:
    try:
        float(x)
    except OverflowError:
        return True
    return False


def numbers_to_array(leaves: list[Any], shape: Sequence[int], dtype: np.dtype, *, integer: bool,
                     where: Callable[[int], str], label: str) -> np.ndarray:
    """``leaves`` (C order) as an array of ``dtype`` and ``shape``; 422 naming element ``where(i)``.

    ``integer``: only ints are taken (else ints and floats, never bools); ``label``
    names ``dtype`` in messages (``"float16"``, ``"FP16"``).
    """
    if integer:
        if not set(map(type, leaves)) <= {int}:
            i = _first(leaves, lambda x: type(x) is not int)
            raise InvalidTensor(f"{where(i)} must be an int, got {show(leaves[i])}")
        try:
            return np.array(leaves, dtype=dtype).reshape(shape)
        except OverflowError:
            info = np.iinfo(dtype)
            i = _first(leaves, lambda x: not info.min <= x <= info.max)
            raise InvalidTensor(f"{where(i)} must fit in {label}, got {show(leaves[i])}") from None
    if not set(map(type, leaves)) <= {int, float}:
        i = _first(leaves, lambda x: type(x) not in (int, float))
        raise InvalidTensor(f"{where(i)} must be a number, got {show(leaves[i])}")
    try:
        wide = np.array(leaves, dtype=np.float64)
    except OverflowError:  # an int literal beyond float64
        i = _first(leaves, _beyond_float64)
        raise InvalidTensor(f"{where(i)} must be a finite {label} number, got {show(leaves[i])}") from None
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, by element
        cast = wide.astype(dtype)
    finite = np.isfinite(cast)
    if not finite.all():
        i = int(np.argmin(finite))
        raise InvalidTensor(f"{where(i)} must be a finite {label} number, got {show(leaves[i])}")
    return cast.reshape(shape)


def array_to_json(name: str, a: Any, *, flat: bool = False) -> list:
    """Nested lists of a float32/float64 array (one flat list with ``flat``); non-finite values are ``None``."""
    if not isinstance(a, np.ndarray) or a.dtype not in (FLOAT32, FLOAT64):
        got = getattr(a, "dtype", type(a).__name__)
        raise ValueError(f"{name} must be a float32 or float64 numpy array, got {got}")
    if flat:
        a = a.reshape(-1)
    finite = np.isfinite(a)
    if finite.all():
        return a.tolist()
    obj = a.astype(object)
    obj[~finite] = None
    return obj.tolist()
