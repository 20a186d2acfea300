"""The ``Server-Timing`` header of an answer as stage durations (docs/SERVICE.md, "Server-Timing")."""

from __future__ import annotations

import contextlib


def parse_server_timing(header: str | None) -> dict[str, float]:
    """``"parse;dur=1.5, total;dur=2"`` -> ``{"parse": 0.0015, "total": 0.002}`` (seconds).

    Entries without a ``dur`` or with one that is not a number are left out.
    """
    stages: dict[str, float] = {}
    for part in (header or "").split(","):
        name, _, params = part.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if name and key == "dur":
                with contextlib.suppress(ValueError):
                    stages[name] = float(value) / 1000
    return stages
