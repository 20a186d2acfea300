"""The query options whose Python spelling a client turns into the wire's: ``contexts`` and ``window``.

Checked before anything is sent, so that a mistake is a ``ValueError`` naming the argument and
what it got (docs/SERVICE.md, "Python client"), never a server error about something else: a
string given as ``contexts`` would otherwise go out as one id per letter.
"""

from __future__ import annotations

from collections.abc import Sequence
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
