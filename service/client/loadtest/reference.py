"""The float64 answers the sampled requests are checked against, computed chunk by chunk.

Independent of the service's kernel and merge: a plain online softmax in float64
(README, "The math") over the keys a request reads, regenerated from the seed a
chunk at a time (``data.Source``), so a 1M-key context is never held whole. The
sampled requests that read the same keys are computed together: their query rows
are stacked, so one pass over the keys serves them all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from service.client.loadtest.data import GENERATE_KEYS, Segment, Source

#: Query rows of one request the reference computes at most (see Expected.rows).
CHECK_ROWS = 8
#: Bytes of one float64 score tile; bounds the reference's memory whatever the batch of rows.
SCORE_BYTES = 64 * 2**20


@dataclass
class Expected:
    """What one request asked: ``q [n_q, h_q, d]`` at positions ``q_pos [n_q]`` over ``segments`` in order.

    ``rows``: the query rows of the answer to check (all when None). A long prefill is
    checked on a few rows (:data:`CHECK_ROWS`, spread over the chunk, first and last
    included): a float64 reference of every row would cost the client as much as the
    service's work, and a wrong merge or a missed shard shows in every row.
    """

    q: np.ndarray
    q_pos: np.ndarray
    segments: tuple[Segment, ...]
    causal: bool = False
    rows: np.ndarray | None = None

    def checked(self) -> Expected:
        """The same question restricted to its checked rows."""
        if self.rows is None:
            return self
        return Expected(self.q[self.rows], self.q_pos[self.rows], self.segments, self.causal)

    def select(self, out: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The checked rows of an answer ``(out [n_q, h_q, d_v], lse [n_q, h_q])``."""
        return (out, lse) if self.rows is None else (out[self.rows], lse[self.rows])


def check_rows(n_q: int, most: int) -> np.ndarray | None:
    """At most ``most`` of ``n_q`` rows, evenly spread, first and last included; None: all of them."""
    if n_q <= most:
        return None
    return np.unique(np.linspace(0, n_q - 1, most).round().astype(np.int64))


@dataclass
class _State:
    """Online-softmax state of some query rows, float64, per kv head: ``m, l [h_kv, R]``, ``acc [h_kv, R, d_v]``.

    ``m`` is the largest kept score seen (``-inf`` while none is), ``l = sum exp(s - m)``
    and ``acc = sum exp(s - m) v`` over the kept keys seen.
    """

    m: np.ndarray
    l: np.ndarray
    acc: np.ndarray

    @classmethod
    def empty(cls, h_kv: int, rows: int, d_v: int) -> _State:
        return cls(np.full((h_kv, rows), -np.inf), np.zeros((h_kv, rows)), np.zeros((h_kv, rows, d_v)))

    def add(self, m: np.ndarray, l: np.ndarray, acc: np.ndarray) -> None:
        """Merge in the state ``(m, l, acc)`` of more keys (README, "The math": rescale both to the new max)."""
        m_new = np.maximum(self.m, m)
        safe = np.where(np.isfinite(m_new), m_new, 0.0)  # rows with no kept key yet: exp(-inf) = 0 below
        a, b = np.exp(self.m - safe), np.exp(m - safe)
        self.l = self.l * a + l * b
        self.acc = self.acc * a[..., None] + acc * b[..., None]
        self.m = m_new


def answers64(source: Source, asked: Sequence[Expected]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(out [r, h_q, d_v], lse [r, h_q])`` in float64 for the ``r`` checked rows of each request of ``asked``.

    One pass over each distinct segment for all the requests that read it (their rows
    stacked), then each request merges the states of its segments.
    """
    asked = [a.checked() for a in asked]
    s = source.shape
    g = s.h_q // s.h_kv
    states = [_State.empty(s.h_kv, a.q.shape[0] * g, s.d_v) for a in asked]
    readers: dict[Segment, list[int]] = {}
    for i, a in enumerate(asked):
        for seg in a.segments:
            readers.setdefault(seg, []).append(i)
    for seg, idx in readers.items():
        group = [asked[i] for i in idx]
        # [h_kv, R, d]: row r of kv head h is (query row, head h * g + j) of one request, requests in order
        q = np.concatenate([a.q.astype(np.float64) for a in group])  # [N, h_q, d]
        rows = q.reshape(q.shape[0], s.h_kv, g, s.d).transpose(1, 0, 2, 3).reshape(s.h_kv, -1, s.d)  # [h_kv, N*g, d]
        q_pos = np.repeat(np.concatenate([a.q_pos for a in group]).astype(np.int64), g)  # [N*g]
        causal = np.repeat(np.concatenate([np.full(a.q.shape[0], a.causal) for a in group]), g)  # [N*g]
        part = _segment(source, seg, rows, q_pos, causal)
        start = 0
        for i in idx:
            n = states[i].m.shape[1]
            states[i].add(part.m[:, start:start + n], part.l[:, start:start + n], part.acc[:, start:start + n])
            start += n
    answers = []
    for st in states:
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.where(st.l[..., None] > 0, st.acc / st.l[..., None], 0.0)  # [h_kv, n_q*g, d_v]
            lse = np.where(st.l > 0, st.m + np.log(st.l), -np.inf)  # [h_kv, n_q*g]
        out = out.reshape(s.h_kv, -1, g, s.d_v).transpose(1, 0, 2, 3).reshape(-1, s.h_q, s.d_v)  # [n_q, h_q, d_v]
        lse = lse.reshape(s.h_kv, -1, g).transpose(1, 0, 2).reshape(-1, s.h_q)  # [n_q, h_q]
        answers.append((out, lse))
    return answers


def _segment(source: Source, seg: Segment, rows: np.ndarray, q_pos: np.ndarray, causal: np.ndarray) -> _State:
    """The state of ``rows [h_kv, R, d]`` (positions ``q_pos [R]``, ``causal [R]``) over the keys of ``seg``."""
    s = source.shape
    scale = 1.0 / np.sqrt(s.d)
    st = _State.empty(s.h_kv, rows.shape[1], s.d_v)
    # Keys per step: a score tile [h_kv, R, B] of float64 stays within SCORE_BYTES.
    step = max(1, min(GENERATE_KEYS, SCORE_BYTES // (8 * s.h_kv * max(rows.shape[1], 1))))
    for lo, k, v in _steps(source, seg, step):
        k_pos = seg.pos0 + np.arange(lo - seg.lo, lo - seg.lo + k.shape[0])  # [B]
        k64 = k.astype(np.float64).transpose(1, 2, 0)  # [h_kv, d, B]
        v64 = v.astype(np.float64).transpose(1, 0, 2)  # [h_kv, B, d_v]
        sc = np.matmul(rows, k64) * scale  # [h_kv, R, B]
        keep = ~causal[:, None] | (k_pos[None, :] <= q_pos[:, None])  # [R, B]
        sc = np.where(keep[None], sc, -np.inf)
        m = sc.max(axis=2)  # [h_kv, R], -inf where the step kept no key of a row
        safe = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(sc - safe[..., None])  # [h_kv, R, B], 0 where masked
        st.add(m, p.sum(axis=2), np.matmul(p, v64))
    return st


def _steps(source: Source, seg: Segment, step: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(lo, k, v)`` of ``seg``'s keys, ``step`` at a time, each generator block drawn once."""
    for a, kb, vb in source.pieces(seg.stream, seg.lo, seg.hi, GENERATE_KEYS):
        for lo in range(0, kb.shape[0], step):
            yield a + lo, kb[lo:lo + step], vb[lo:lo + step]


def error(got_out: np.ndarray, got_lse: np.ndarray, out64: np.ndarray, lse64: np.ndarray) -> float:
    """The larger of ``max |out - out64| / max(1, max |out64|)`` and the same for ``lse``.

    Shapes must agree, and so must the rows with no key (``lse = -inf``, ``out = 0``).
    A mismatch of shape or of such rows, or any other value that is not finite (a NaN in ``out``
    or ``lse``: it would compare as no error), is an infinite error.
    """
    if got_out.shape != out64.shape or got_lse.shape != lse64.shape:
        return float("inf")
    empty = np.isneginf(lse64)
    if (not np.array_equal(np.isneginf(got_lse), empty) or not np.isfinite(got_out).all()
            or not np.isfinite(got_lse[~empty]).all()):
        return float("inf")
    e_out = float(np.max(np.abs(got_out - out64), initial=0.0)) / max(1.0, float(np.max(np.abs(out64), initial=0.0)))
    kept = ~empty
    e_lse = (float(np.max(np.abs(got_lse[kept] - lse64[kept]), initial=0.0))
             / max(1.0, float(np.max(np.abs(lse64[kept]), initial=0.0))))
    return max(e_out, e_lse)
