"""What a load test runs: the sweep's typed configuration, checked once (docs/LOADTEST.md).

A sweep is the product of workloads (``modes``), context lengths (``n_k``) and
arrival points (closed-loop ``concurrency`` levels, then open-loop ``rates``). Every
point is bounded by ``duration_s`` and ``requests``; nothing here does I/O.
"""

from __future__ import annotations

import math
import operator
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.dtypes import DTYPES

#: The workloads (docs/LOADTEST.md, "Workloads").
MODES = ("decode", "inline", "prefill", "shared-prefix", "multi-turn")
#: Largest |out - reference| / max(1, max |reference|) a verified answer may have by default.
#: The service accumulates in float32 (error of order 1e-6 here); a merge that misses one of
#: two shards of a 1M-key context moves an answer by about 1e-3 (random keys), and its
#: log-sum-exp by log 2, which is checked with the same bound.
TOLERANCE = 1e-4
#: Comparisons ``--fail-on`` accepts, longest first so that ``>=`` is not read as ``>``.
COMPARATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
}
SIZE_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str, name: str) -> int:
    """``"64K"`` -> 65536, ``"1M"`` -> 1048576, ``"4096"`` -> 4096 (binary suffixes K, M, G)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)\s*", text)
    if not m:
        raise ValueError(f"{name} must be a count such as 4096, 64K or 1M, got {text!r}")
    return int(m.group(1)) * SIZE_SUFFIXES[m.group(2).upper()]


def parse_list(text: str, name: str, item: Callable[[str, str], float]) -> list:
    """A comma-separated list of ``item``s (empty entries ignored)."""
    return [item(x, name) for x in text.split(",") if x.strip()]


def parse_key_count(text: str, name: str) -> int:
    """One entry of ``--n-k``: a size (:func:`parse_size`) of at least one key, named as given."""
    n = parse_size(text, name)
    if n < 1:
        raise ValueError(f"{name} must list key counts >= 1, got {text.strip()!r}")
    return n


def parse_rate(text: str, name: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"{name} must list request rates per second, got {text!r}") from None
    if not (math.isfinite(rate) and rate > 0):  # named here with the text given, not the parsed list
        raise ValueError(f"{name} must list request rates > 0 per second, got {text.strip()!r}")
    return rate


#: Metrics that have a value only when the run has an SLO (``slo_ms``).
SLO_METRICS = ("slo_ms", "goodput_per_s", "slo_attainment")


@dataclass(frozen=True)
class FailOn:
    """A threshold that fails the run when any point's ``metric`` compares true: ``latency_p99_ms>500``."""

    metric: str
    op: str
    value: float

    @classmethod
    def parse(cls, text: str) -> FailOn:
        for op in COMPARATORS:
            name, sep, value = text.partition(op)
            if sep:
                try:
                    return cls(name.strip(), op, float(value))
                except ValueError:
                    break
        raise ValueError(f"--fail-on must be METRIC<op>NUMBER with <op> one of > >= < <=, such as latency_p99_ms>500, "
                         f"got {text!r}")

    def violated(self, value: float) -> bool:
        return COMPARATORS[self.op](value, self.value)

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


@dataclass(frozen=True)
class Shape:
    """Heads, head sizes and dtype of every tensor the load test sends (axis names of docs/API.md)."""

    h_q: int = 32
    h_kv: int = 8
    d: int = 128
    d_v: int = 128
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("h_q", "h_kv", "d", "d_v"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.h_q % self.h_kv:
            raise ValueError(f"h_q must be a multiple of h_kv, got h_q={self.h_q}, h_kv={self.h_kv}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(sorted(DTYPES))}, got {self.dtype!r}")

    @property
    def key_bytes(self) -> int:
        """Bytes of K+V per key."""
        return (self.d + self.d_v) * self.h_kv * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class SweepConfig:
    """One sweep. Counts are keys or requests; times are seconds; ``None`` means "not set"."""

    url: str
    api_key: str | None = None
    modes: tuple[str, ...] = ("decode",)
    n_k: tuple[int, ...] = (65536,)
    concurrency: tuple[int, ...] = (1, 4, 16)
    rates: tuple[float, ...] = ()
    burstiness: float = 1.0
    duration_s: float = 30.0
    requests: int = 200
    warmup: int = 2
    shape: Shape = field(default_factory=Shape)
    n_q: int = 1
    prefill_n_q: int = 256
    groups: int = 4
    suffix_keys: int = 4096
    turn_keys: int = 16
    conversations: int = 8
    replicas: int = 1
    max_inflight: int = 256
    verify_every: int = 10
    tolerance: float = TOLERANCE
    slo_ms: float | None = None
    fail_on: tuple[FailOn, ...] = ()
    seed: int = 0
    chunk_keys: int | None = None
    per_request: bool = False

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url) if isinstance(self.url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://HOST[:PORT], got {self.url!r}")
        if not self.modes or any(m not in MODES for m in self.modes) or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must list {', '.join(MODES)}, each once, got {','.join(self.modes)!r}")
        if type(self.seed) is not int or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not self.n_k or any(type(n) is not int or n < 1 for n in self.n_k):
            raise ValueError(f"n_k must list key counts >= 1, got {self.n_k!r}")
        if any(type(c) is not int or c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must list ints >= 1, got {self.concurrency!r}")
        if any(not (math.isfinite(r) and r > 0) for r in self.rates):
            raise ValueError(f"rates must list request rates > 0 per second, got {self.rates!r}")
        if not self.concurrency and not self.rates:
            raise ValueError("concurrency or rates must name at least one point, got neither")
        positive_ints = ("requests", "n_q", "prefill_n_q", "groups", "suffix_keys", "turn_keys", "conversations",
                         "replicas", "max_inflight", "verify_every")
        for name in positive_ints:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if type(self.warmup) is not int or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        for name in ("duration_s", "burstiness", "tolerance"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.slo_ms is not None and not (math.isfinite(self.slo_ms) and self.slo_ms > 0):
            raise ValueError(f"slo_ms must be a number > 0, got {self.slo_ms!r}")
        for rule in self.fail_on:
            if rule.metric in SLO_METRICS and self.slo_ms is None:
                raise ValueError(f"fail_on {rule} must come with an SLO (--slo-ms), got none: without one "
                                 f"{rule.metric} has no value")
        if self.chunk_keys is not None and (type(self.chunk_keys) is not int or self.chunk_keys < 1):
            raise ValueError(f"chunk_keys must be an int >= 1, got {self.chunk_keys!r}")

    def points(self) -> list[tuple[str, float]]:
        """The arrival points of one (mode, n_k): ``("concurrency", c)`` for each level, then ``("rate", r)``."""
        return [("concurrency", float(c)) for c in self.concurrency] + [("rate", r) for r in self.rates]
