"""JSON documents with large arrays in them, written a piece at a time.

``json.dumps`` writes a list of floats in C without letting go of the GIL: a JSON
answer of 2**21 numbers held it for about 1.4 s, and writing it in a thread did not
help (the event loop waited for the GIL, and then, at every socket call it made, waited
for it again). So the front end writes JSON answers on the event loop itself, in pieces:
:func:`write_json` gives the same text as ``json.dumps(doc, separators=(",", ":"),
allow_nan=False)``, with each :class:`JsonArray` in the document as nested lists
(non-finite values ``null``: ``values.array_to_json``), one ``json.dumps`` call per
:data:`PIECE_NUMBERS` numbers at most, and awaits ``asyncio.sleep(0)`` between pieces,
so other requests are served between them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.wire.values import array_to_json

#: Numbers per ``json.dumps`` call: about 3.5 ms of writing here (0.9 us a number), the longest
#: the event loop waits for another request while an answer is written.
PIECE_NUMBERS = 4096

_SEP = (",", ":")


@dataclass(frozen=True, eq=False)
class JsonArray:
    """A float32/float64 array to write as nested lists (one flat list with ``flat``)."""

    name: str  #: for the error when it is not such an array
    array: np.ndarray
    flat: bool = False


async def write_json(doc: Any) -> bytes:
    """``doc`` (dicts with string keys, lists, strings, numbers, None and :class:`JsonArray`) as compact
    JSON, letting the event loop run other tasks after each piece of an array."""
    parts: list[str] = []
    for _ in _write(doc, parts):
        await asyncio.sleep(0)
    return b"".join(p.encode() for p in parts)  # one copy of the whole on the loop, not a str and then bytes


def _write(value: Any, parts: list[str]) -> Iterator[None]:
    """Appends ``value``'s text to ``parts``; yields after each piece of an array."""
    if isinstance(value, JsonArray):
        a = value.array
        if not isinstance(a, np.ndarray):
            array_to_json(value.name, a)  # raises its ValueError: not a float32/float64 array
        yield from _write_array(value.name, a.reshape(-1) if value.flat else a, parts)
    elif isinstance(value, dict):
        parts.append("{")
        for i, (key, item) in enumerate(value.items()):
            if not isinstance(key, str):
                raise ValueError(f"JSON object keys must be strings, got {key!r}")
            parts.append(("," if i else "") + json.dumps(key) + ":")
            yield from _write(item, parts)
        parts.append("}")
    elif isinstance(value, (list, tuple)):
        parts.append("[")
        for i, item in enumerate(value):
            if i:
                parts.append(",")
            yield from _write(item, parts)
        parts.append("]")
    else:
        parts.append(json.dumps(value, separators=_SEP, allow_nan=False))


def _write_array(name: str, a: np.ndarray, parts: list[str]) -> Iterator[None]:
    """``a`` as nested lists, each ``json.dumps`` over at most PIECE_NUMBERS numbers."""
    if a.size <= PIECE_NUMBERS or a.ndim == 0:
        parts.append(json.dumps(array_to_json(name, a), separators=_SEP, allow_nan=False))
        yield
        return
    parts.append("[")
    per = PIECE_NUMBERS // (a[0].size or 1)  # whole items along axis 0 per piece (0: an item is too large)
    if per >= 1:
        for i in range(0, a.shape[0], per):
            text = json.dumps(array_to_json(name, a[i:i + per]), separators=_SEP, allow_nan=False)
            parts.append(("," if i else "") + text[1:-1])  # the items, without their list's brackets
            yield
    else:
        for i in range(a.shape[0]):
            if i:
                parts.append(",")
            yield from _write_array(name, a[i], parts)
    parts.append("]")
