"""The bounds a deployment sets on what a request may be and how it arrives.

Both are built once from :class:`service.core.settings.ServiceSettings` and passed down:
:class:`Limits` bounds sizes before anything is allocated (docs/API.md section 8), :class:`Pace`
how fast a body must arrive (docs/SECURITY.md). They live here, below ``service.wire``, so that
the settings can build them without importing the formats that check them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from service.core.errors import RequestTimeout


@dataclass(frozen=True)
class Limits:
    """Bounds checked before anything is allocated for a request (built once, from the settings)."""

    max_body_bytes: int = 2 * 2**30  #: a whole binary body
    max_json_body_bytes: int = 64 * 2**20  #: a whole JSON body (parsing costs ~10x its size)
    max_header_bytes: int = 2**20  #: the JSON header of a safetensors body
    max_elements: int = 2**28  #: elements of one tensor
    max_dims: int = 3  #: dims of one tensor (tensors with a rule in TENSOR_RULES have their own rank)
    max_contexts: int = 64  #: context ids in one attention request
    max_context_id_chars: int = 128  #: characters of one context id
    max_shards: int = 1024  #: shards a create cuts a context into (appends open more past its plan)
    max_replicas: int = 8  #: replicas of one context
    max_batch_items: int = 256  #: items of one batch request (``POST /v1/attention/batch``)
    #: ``out`` elements of an answer written as JSON text (about 20 bytes and 0.9 us each here: 2**21
    #: is ~40 MB, within the JSON body limit); larger answers go as safetensors (docs/API.md section 8)
    max_json_answer_elements: int = 2**21

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{f.name} must be an int >= 1, got {value!r}")

    def to_json(self) -> dict[str, int]:
        """Every limit by name (``GET /v1/limits``, docs/API.md section 8)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Limits:
        """The limits a server advertised; names this version does not know are ignored, missing ones default."""
        return cls(**{f.name: doc[f.name] for f in fields(cls) if f.name in doc})


#: The limits used when a caller gives none.
DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Pace:
    """How fast a body must arrive (docs/SECURITY.md).

    All of it within ``timeout_s`` of the request's head; and at every moment ``t``
    seconds after the head, at least ``min_rate * (t - grace_s)`` bytes (``min_rate``
    in bytes/s; 0 turns the rate off), which allows a slow start and pauses but not a
    trickle.
    """

    timeout_s: float
    min_rate: float
    grace_s: float

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not (self.min_rate >= 0 and self.grace_s >= 0):
            raise ValueError(f"min_rate and grace_s must be >= 0, got {self.min_rate!r} and {self.grace_s!r}")

    def deadline(self, started: float, received: int) -> float:
        """When the next bytes must have come, ``received`` bytes having come since ``started``."""
        end = started + self.timeout_s
        if self.min_rate > 0:
            end = min(end, started + self.grace_s + received / self.min_rate)
        return end

    def too_slow(self, received: int, elapsed: float) -> RequestTimeout:
        """The error naming the limit that was missed: the one whose deadline came first for these
        bytes (not read from ``elapsed``, which a timer may stop a hair short of the deadline)."""
        rate_end = self.grace_s + received / self.min_rate if self.min_rate > 0 else math.inf
        if rate_end >= self.timeout_s:
            return RequestTimeout(f"the request body must arrive within {self.timeout_s:g} s, got {received} "
                                  f"bytes in {elapsed:.1f} s")
        return RequestTimeout(f"the request body must arrive at {self.min_rate:g} bytes/s or more after the first "
                              f"{self.grace_s:g} s, got {received} bytes in {elapsed:.1f} s")
