"""The checker of the fault soak (``benchmarks/chaos.py``), Jepsen style: a recorded history in, violations out.

Each context's keys are a fixed stream: the keys at positions ``[b*CHUNK, (b+1)*CHUNK)`` are drawn
from ``(seed, context, b)`` alone (:func:`stream`), and its one writer appends them a chunk at a
time with ``after=`` the length it last saw. Whatever failed, and whatever was sent again, the
context's keys are therefore always a *prefix* of its stream, and an answer is the float64
attention of its query over some prefix length ``L`` (:func:`prefix_answers` gives them all).

The history is a list of operations (dicts, one JSONL line each): ``create``, ``append``,
``read``, ``delete``, ``final`` (a read after the faults have stopped) and ``fault``, each with
``t0``/``t1`` (seconds, when it was sent and when it ended) and an ``outcome``: ``ok``
(acknowledged), ``refused`` (an error answer: not stored) or ``unknown`` (no answer: stored or not).

The rules (:func:`check`), per context:

* A read that began at ``t0`` and ended at ``t1`` may reflect any prefix from the length
  *acknowledged* before ``t0`` to the length *sent* (acknowledged or not) by ``t1``: an append
  concurrent with the read may be seen or not. Reflecting a shorter prefix is a **stale read**
  (``stale_read``: an answer that misses an acknowledged append, which the context may still
  hold); a longer one, keys never acknowledged nor sent by then (``unsent``); no prefix at all (a
  hole, a wrong key, a wrong merge) a **wrong answer** (``wrong``).
* After the faults (``final``): the length must be at least every acknowledged length (else a
  **lost acknowledged write**, ``lost_ack``) and at most the keys sent, and the answer that of
  that prefix; a deleted context must be gone (``resurrected`` if it answers).
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: Keys per append; a context's lengths are multiples of it.
CHUNK = 8
H_Q, H_KV, D = 2, 1, 16
#: An answer matches a prefix within these (float32 service against float64).
RTOL, ATOL = 1e-4, 1e-4


def stream(seed: int, ctx: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """``k, v [length, H_KV, D]`` (float32): the first ``length`` keys of context ``ctx``'s stream."""
    if length % CHUNK:
        raise ValueError(f"length must be a multiple of {CHUNK}, got {length}")
    blocks = [_block(seed, ctx, b) for b in range(length // CHUNK)]
    if not blocks:
        return np.zeros((0, H_KV, D), np.float32), np.zeros((0, H_KV, D), np.float32)
    kv = np.concatenate(blocks, axis=1)
    return kv[0], kv[1]


@functools.cache
def _block(seed: int, ctx: int, b: int) -> np.ndarray:
    """``[2, CHUNK, H_KV, D]``: k and v of chunk ``b`` (kept: a soak's checker reads each many times)."""
    return np.random.default_rng([seed, ctx, b]).standard_normal((2, CHUNK, H_KV, D)).astype(np.float32)


def query(seed: int, ctx: int, serial: int) -> np.ndarray:
    """``q [1, H_Q, D]`` (float32) of read ``serial`` on context ``ctx``."""
    return np.random.default_rng([seed, ctx, 1 << 40, serial]).standard_normal((1, H_Q, D)).astype(np.float32)


def prefix_answers(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``out [n+1, H_Q, D]``, ``lse [n+1, H_Q]``: float64 attention of ``q [1, H_Q, D]`` over each prefix
    ``k[:L], v[:L]`` (row ``L``; row 0 is empty: NaN), all at once by running sums."""
    g = H_Q // H_KV
    q64 = q[0].astype(np.float64)  # [H_Q, D]
    k64 = np.repeat(k.astype(np.float64), g, axis=1)  # [n, H_Q, D]
    v64 = np.repeat(v.astype(np.float64), g, axis=1)
    s = np.einsum("hd,nhd->nh", q64, k64) / np.sqrt(D)  # [n, H_Q]
    top = s.max(axis=0, initial=0.0)
    p = np.exp(s - top)
    den = np.cumsum(p, axis=0)  # [n, H_Q]
    num = np.cumsum(p[..., None] * v64, axis=0)  # [n, H_Q, D]
    nan = np.full((1, H_Q), np.nan)
    out = np.concatenate([np.full((1, H_Q, D), np.nan), num / den[..., None]])
    lse = np.concatenate([nan, top + np.log(den)])
    return out, lse


@dataclass
class Violation:
    rule: str  #: stale_read, lost_ack, unsent, wrong, resurrected
    ctx: int
    op: dict[str, Any]
    detail: str


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    reads_checked: int = 0
    appends_acknowledged: int = 0
    finals_checked: int = 0
    unavailable_at_end: list[int] = field(default_factory=list)  #: contexts not readable after the faults

    def count(self, rule: str) -> int:
        return sum(1 for v in self.violations if v.rule == rule)

    @property
    def ok(self) -> bool:
        return not self.violations


class _Context:
    """What the history says of one context: its acknowledged and sent lengths over time."""

    def __init__(self, ops: list[dict[str, Any]]) -> None:
        writes = [op for op in ops if op["op"] in ("create", "append")]
        self.acks = sorted((op["t1"], op["after"] + op["n"]) for op in writes if op["outcome"] == "ok")
        self.sends = sorted((op["t0"], op["after"] + op["n"]) for op in writes)
        self.deleted = any(op["op"] == "delete" and op["outcome"] == "ok" for op in ops)

    def acked_by(self, t: float) -> int:
        return max((n for at, n in self.acks if at <= t), default=0)

    def sent_by(self, t: float) -> int:
        return max((n for at, n in self.sends if at <= t), default=0)

    @property
    def most_sent(self) -> int:
        return max((n for _, n in self.sends), default=0)


def matching_lengths(op: dict[str, Any], seed: int, most: int) -> list[int]:
    """The prefix lengths (multiples of CHUNK, up to ``most``) whose float64 answer ``op``'s answer matches."""
    k, v = stream(seed, op["ctx"], most)
    out64, lse64 = prefix_answers(query(seed, op["ctx"], op["q"]), k, v)
    out, lse = np.asarray(op["out"], np.float64).reshape(H_Q, D), np.asarray(op["lse"], np.float64).reshape(H_Q)
    lengths = np.arange(CHUNK, most + 1, CHUNK)
    close = (np.abs(out - out64[lengths]) <= ATOL + RTOL * np.abs(out64[lengths])).all(axis=(1, 2))
    close &= (np.abs(lse - lse64[lengths]) <= ATOL + RTOL * np.abs(lse64[lengths])).all(axis=1)
    return [int(n) for n in lengths[close]]


def _check_read(op: dict[str, Any], ctx: _Context, seed: int, report: Report) -> None:
    lo, hi = ctx.acked_by(op["t0"]), ctx.sent_by(op["t1"])
    seen = matching_lengths(op, seed, max(ctx.most_sent, hi))
    if any(lo <= n <= hi for n in seen):
        return
    if not seen:
        report.violations.append(Violation("wrong", op["ctx"], op, f"no prefix matches (allowed {lo}..{hi})"))
    elif max(seen) < lo:
        report.violations.append(Violation("stale_read", op["ctx"], op, f"saw {max(seen)} keys, {lo} acknowledged"))
    else:
        report.violations.append(Violation("unsent", op["ctx"], op, f"saw {min(seen)} keys, {hi} sent by then"))


def _check_final(op: dict[str, Any], ctx: _Context, seed: int, report: Report) -> None:
    if ctx.deleted:
        if op["outcome"] == "ok":
            report.violations.append(Violation("resurrected", op["ctx"], op, "a deleted context answered"))
        return
    if op["outcome"] != "ok":
        report.unavailable_at_end.append(op["ctx"])
        return
    report.finals_checked += 1
    acked, length = ctx.acked_by(float("inf")), op["length"]
    if length < acked:
        report.violations.append(Violation("lost_ack", op["ctx"], op, f"holds {length} keys, {acked} acknowledged"))
    elif length > ctx.most_sent:
        report.violations.append(Violation("unsent", op["ctx"], op, f"holds {length} keys, {ctx.most_sent} sent"))
    elif length not in matching_lengths(op, seed, length):
        report.violations.append(Violation("wrong", op["ctx"], op, f"the answer is not that of its {length} keys"))


def check(history: Sequence[dict[str, Any]], seed: int) -> Report:
    """Every rule of the module's docstring over ``history`` (the soak's operations, any order)."""
    report = Report()
    by_ctx: dict[int, list[dict[str, Any]]] = {}
    for op in history:
        if "ctx" in op:
            by_ctx.setdefault(op["ctx"], []).append(op)
    for ops in by_ctx.values():
        ctx = _Context(ops)
        report.appends_acknowledged += sum(1 for op in ops if op["op"] == "append" and op["outcome"] == "ok")
        for op in ops:
            if op["op"] == "read" and op["outcome"] == "ok":
                report.reads_checked += 1
                _check_read(op, ctx, seed, report)
            elif op["op"] == "final":
                _check_final(op, ctx, seed, report)
    return report


@dataclass
class FaultFigures:
    """One fault kind over the soak: injections, the share of requests answered (:func:`answered`: right
    refusals count) from each injection until the next, and seconds from the end of each (a resumed pause, a kill) until every
    context's writer had an append acknowledged again (sent after that end)."""

    kind: str
    injected: int = 0
    requests: int = 0
    answered: int = 0
    recovery_s: list[float] = field(default_factory=list)
    unrecovered: int = 0  #: injections some writer had no acknowledged append after before the next
    errors: Counter[str] = field(default_factory=Counter)  #: what the requests not answered got

    @property
    def availability(self) -> float:
        return self.answered / self.requests if self.requests else 1.0

    def tally(self, ops: Iterable[dict[str, Any]]) -> None:
        """Count requests, those answered (:func:`answered`) and what the others got."""
        for op in ops:
            self.requests += 1
            if answered(op):
                self.answered += 1
            else:
                self.errors[str(op.get("error", ""))[:80]] += 1


def availability(history: Sequence[dict[str, Any]]) -> dict[str, FaultFigures]:
    """Per fault kind, the figures of :class:`FaultFigures`; ``"none"``: requests before the first fault."""
    faults = sorted((op for op in history if op["op"] == "fault" and not op["target"].startswith("not injected")),
                    key=lambda op: op["t0"])
    requests = [op for op in history if op["op"] in ("read", "append")]
    writers = {op["ctx"] for op in requests if op["op"] == "append" and op.get("writer")}
    figures: dict[str, FaultFigures] = {"none": FaultFigures("none")}
    starts = [f["t0"] for f in faults] + [float("inf")]
    history_end = max((op["t1"] for op in requests), default=0.0)
    for i, fault in enumerate(faults):
        fig = figures.setdefault(fault["kind"], FaultFigures(fault["kind"]))
        fig.injected += 1
        fig.tally(op for op in requests if starts[i] <= op["t0"] < starts[i + 1])
        back = [min((op["t1"] for op in requests if op["ctx"] == c and op["op"] == "append"
                     and op["outcome"] == "ok" and op["t0"] >= fault["t1"]), default=float("inf"))
                for c in writers]
        if back and max(back) <= min(starts[i + 1], history_end):
            fig.recovery_s.append(max(back) - fault["t1"])
        else:
            fig.unrecovered += 1
    figures["none"].tally(op for op in requests if op["t0"] < starts[0])
    return figures


@dataclass
class Outside:
    """Requests (reads and appends) to the contexts of two replicas or more that overlap no fault nor the
    ``grace_s`` after its end (a request in flight when a fault hit is the fault's): what the issue's
    ">= 99% answered" target is about (docs/RELIABILITY.md).
    A refusal that is the right answer counts as answered: 404 (a churn context read as it is deleted)
    and 409 (an ``after`` that an earlier, unanswered append of the same writer made wrong)."""

    grace_s: float
    requests: int = 0
    answered: int = 0
    errors: Counter[str] = field(default_factory=Counter)  #: what the requests not answered got

    @property
    def share(self) -> float:
        return self.answered / self.requests if self.requests else 1.0


#: Refusals that answer the request rightly: 404 (a churn context read as it is deleted) and 409 (an
#: ``after`` that an earlier, unanswered append of the same writer made wrong).
RIGHT_REFUSALS = ("404 ", "409 ")


def answered(op: dict[str, Any]) -> bool:
    """Whether a read or an append was answered: ok, or a refusal that is the right answer (RIGHT_REFUSALS)."""
    return op["outcome"] == "ok" or str(op.get("error", "")).startswith(RIGHT_REFUSALS)


def outside_faults(history: Sequence[dict[str, Any]], grace_s: float = 1.0) -> Outside:
    """:class:`Outside` of ``history``: requests to replicated contexts whose ``[t0, t1]`` meets no
    ``[fault t0, fault t1 + grace_s]``."""
    replicated = {op["ctx"] for op in history if op["op"] == "create" and op.get("replicas", 1) >= 2}
    windows = [(op["t0"], op["t1"] + grace_s) for op in history if op["op"] == "fault"
               and not op["target"].startswith("not injected")]
    figures = Outside(grace_s)
    for op in history:
        if op["op"] not in ("read", "append") or op["ctx"] not in replicated:
            continue
        if any(op["t0"] <= hi and lo <= op["t1"] for lo, hi in windows):
            continue
        figures.requests += 1
        if answered(op):
            figures.answered += 1
        else:
            figures.errors[str(op.get("error", ""))[:80]] += 1
    return figures


def read_history(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def write_history(path: Path, ops: Iterable[dict[str, Any]]) -> None:
    with path.open("w") as f:
        for op in ops:
            f.write(json.dumps(op) + "\n")
