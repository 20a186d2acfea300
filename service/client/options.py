"""What a client turns from its Python spelling into the wire's: ``contexts``, ``window``, and positions.

Checked before anything is sent, so that a mistake is a ``ValueError`` naming the argument and
what it got (docs/SERVICE.md, "Python client"), never a server error about something else: a
string given as ``contexts`` would otherwise go out as one id per letter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def context_ids(value: Any, name: str = "contexts") -> list[str]:
    """``value`` as the list of context ids it must be: a sequence of strings, not a string."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of context ids, got {value!r:.80}"
                         + (f" (a string: pass [{value!r:.60}])" if isinstance(value, str) else ""))
    ids = list(value)
    for i, one in enumerate(ids):
        if not isinstance(one, str):
            raise ValueError(f"{name}[{i}] must be a context id (a string), got {one!r:.80}")
    return ids


def window_bounds(value: Any, name: str = "window") -> tuple[int | None, int | None]:
    """``value`` as ``(left, right)``: two bounds, each None (unbounded) or an integer."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{name} must be (left, right), each None or an int >= 0, got {value!r:.80}")
    bounds = []
    for b in value:
        if b is not None and (isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer))):
            raise ValueError(f"{name} must be (left, right), each None or an int >= 0, got {value!r:.80}")
        bounds.append(None if b is None else int(b))
    return bounds[0], bounds[1]


#: Position dtypes the wire carries as they are; any other integer dtype is sent as int64.
WIRE_POSITIONS = (np.dtype(np.int32), np.dtype(np.int64))


def wire_tensors(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``tensors`` (None ones left out) as arrays to send: positions (``q_pos``, ``k_pos``, and a batch's
    ``ITEM.q_pos``...) of any integer dtype (docs/API.md section 2), widened to int64 where the wire has
    no such dtype; a position array that is not of integers, or a value past int64, is a ValueError."""
    out = {}
    for name, value in tensors.items():
        if value is None:
            continue
        a = np.asarray(value)
        if name.endswith(("q_pos", "k_pos")) and a.dtype.newbyteorder("=") not in WIRE_POSITIONS:
            if a.dtype.kind not in "iu":
                raise ValueError(f"{name} must be an array of integers, got dtype {a.dtype}")
            if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
                raise ValueError(f"{name} must hold positions below 2**63, got {int(a.max())}")
            a = a.astype(np.int64)
        out[name] = a
    return out

