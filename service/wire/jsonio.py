"""JSON text and JSON numbers, shared by the JSON bodies and the Open Inference Protocol.

* :func:`load_json`: strict parsing (UTF-8, no repeated keys), 400 on failure;
* :func:`numbers_to_array`: the leaves of a JSON tensor to a numpy array of the
  wanted dtype, refusing bools, strings, values that overflow the dtype and
  non-finite values, naming the element;
* :func:`array_to_json`: a float array to JSON lists, non-finite values as
  ``null`` (JSON has no infinities: an ``lse`` of -inf, a fully masked row).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from service.errors import InvalidBody, InvalidTensor
from service.wire.rules import show
from workers.dtypes import FLOAT32, FLOAT64


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
    except ValueError as e:  # e.g. an integer literal with thousands of digits
        raise InvalidBody(f"{what} must be valid JSON, got {e}") from None


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
