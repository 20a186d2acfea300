"""One attention request, from validated arrays to ``(out, lse)``.

Keys of a request are, in this order: the keys of each named context (in the
order named), then the inline keys. Default positions follow the contract over
that union: inline keys without ``k_pos`` continue after the last context
position (from 0 with no context), and queries without ``q_pos`` are the last
``n_q`` positions (bottom-right alignment).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.errors import ApiError
from service.orchestrator import Job, Orchestrator, Timings, inline_shard_count, shard_bounds
from service.settings import ServiceSettings
from workers.options import Arange, AttentionOptions, check_positions, check_problem

#: Elements checked for finiteness at a time (bounds the temporary bool array).
FINITE_CHUNK = 1 << 20

#: Fields whose errors are about options (422 invalid_option) rather than tensors.
OPTION_FIELDS = ("scale", "causal", "window", "softcap", "alibi_slopes", "contexts", "shards", "replicas")


def invalid(exc: ValueError) -> ApiError:
    """A library ValueError as a 422 with the contract's code for its field."""
    msg = str(exc)
    code = "invalid_option" if msg.startswith(OPTION_FIELDS) else "invalid_tensor"
    return ApiError(code, msg)


def check_finite(name: str, x: np.ndarray) -> None:
    """Refuse NaN and infinities in a tensor (checked in chunks, no full-size temporary)."""
    flat = x.reshape(-1)
    for start in range(0, flat.shape[0], FINITE_CHUNK):
        if not np.isfinite(flat[start:start + FINITE_CHUNK]).all():
            raise ApiError("invalid_tensor", f"{name} must be finite, got NaN or infinity")


#: Above this many bytes in all, the finiteness check runs in a thread, not on the event loop.
FINITE_INLINE_BYTES = 4 * 2**20


async def check_all_finite(tensors: dict[str, Any]) -> None:
    """:func:`check_finite` over every float tensor given (None entries are skipped).

    A pass over a GiB takes ~0.1 s: large bodies are checked off the event loop so
    other requests keep being read meanwhile.
    """
    present = {n: a for n, a in tensors.items() if a is not None and np.dtype(a.dtype).kind == "f"}

    def run() -> None:
        for name, arr in present.items():
            check_finite(name, arr)

    if sum(a.nbytes for a in present.values()) > FINITE_INLINE_BYTES:
        await asyncio.to_thread(run)
    else:
        run()


@dataclass
class AttentionCall:
    """A parsed request: tensors as numpy arrays (views of the body), options, contexts."""

    q: np.ndarray
    k: np.ndarray | None = None
    v: np.ndarray | None = None
    q_pos: np.ndarray | None = None
    k_pos: np.ndarray | None = None
    options: AttentionOptions = field(default_factory=AttentionOptions)
    contexts: list[str] = field(default_factory=list)

    def options_dict(self) -> dict[str, Any]:
        o = self.options
        return {"scale": o.scale, "causal": o.causal, "window": o.window, "softcap": o.softcap,
                "alibi_slopes": o.alibi_slopes}


def build_options(fields: dict[str, Any]) -> AttentionOptions:
    try:
        return AttentionOptions(**fields)
    except ValueError as exc:
        raise ApiError("invalid_option", str(exc)) from exc


class AttentionService:
    def __init__(self, settings: ServiceSettings, orchestrator: Orchestrator, contexts: Any = None) -> None:
        self.settings = settings
        self.orch = orchestrator
        self.contexts = contexts  # service.contexts.ContextService, or None before it exists

    async def attention(self, call: AttentionCall, timings: Timings) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        if (call.k is None) != (call.v is None):
            raise ApiError("invalid_tensor", f"k and v must be sent together, got only {'k' if call.v is None else 'v'}")
        if call.k is None and not call.contexts:
            raise ApiError("invalid_tensor", "k and v must be given when no contexts are named, got neither")
        await check_all_finite({name: getattr(call, name) for name in ("q", "k", "v")})
        # 1. The contexts named, resolved to their committed shards (404 if unknown).
        resolved = None
        next_pos = 0
        if call.contexts:
            if self.contexts is None:
                raise ApiError("invalid_option", "contexts must be empty on this server, got some")
            resolved = await self.contexts.resolve(call.contexts)
            next_pos = resolved.next_pos
        # 2. Positions over the union: inline keys continue after the contexts.
        n_k = 0 if call.k is None else int(call.k.shape[0])
        k_pos = call.k_pos if call.k_pos is not None else Arange(next_pos, n_k)
        q_pos = call.q_pos if call.q_pos is not None else self._default_q_pos(call, k_pos, next_pos)
        # 3. Validate everything before any work is scattered.
        try:
            if call.k is not None:
                problem = check_problem(call.q, call.k, call.v, q_pos, k_pos, call.options)
                q_pos, k_pos = problem.q_pos, problem.k_pos
                if resolved is not None:
                    resolved.check_inline(problem)
            else:
                q_pos = check_positions("q_pos", q_pos, int(call.q.shape[0]), np)
            if resolved is not None:
                resolved.check_query(call.q, call.options)
        except ValueError as exc:
            raise invalid(exc) from exc
        # 4. Scatter: q and each inline shard go into the object store once.
        opts = call.options_dict()
        bounds: list[tuple[int, int]] = []
        if call.k is not None:
            shards = inline_shard_count(n_k, self.orch.pool.size, self.settings.shards, self.settings.min_shard_keys)
            bounds = shard_bounds(n_k, shards)
        parts = [a for lo, hi in bounds for a in (call.k[lo:hi], call.v[lo:hi])]
        q_ref, *refs = await self.orch.put(call.q, *parts)
        jobs: list[Job] = []
        if resolved is not None:
            jobs += resolved.jobs(q_ref, q_pos, opts, self.settings.merge_fanin)
        for i, (lo, hi) in enumerate(bounds):
            jobs.append(Job("partial", (q_ref, refs[2 * i], refs[2 * i + 1], q_pos, k_pos[lo:hi], opts), None,
                            f"inline shard {i}"))
        timings.add("scatter", time.perf_counter() - t0)
        n_q, h_q = int(call.q.shape[0]), int(call.q.shape[1])
        d_v = int(call.v.shape[2]) if call.v is not None else resolved.dims[2]
        wide = any(a is not None and a.dtype == np.float64 for a in (call.q, call.k, call.v)) or (
            resolved is not None and any(r["dtype"] == "float64" for r in resolved.records))
        state_nbytes = n_q * h_q * (d_v + 2) * (8 if wide else 4)
        return await self.orch.run(jobs, timings, state_nbytes)

    @staticmethod
    def _default_q_pos(call: AttentionCall, k_pos: Any, next_pos: int) -> np.ndarray:
        """The last ``n_q`` positions: ``arange(end - n_q, end)``, ``end`` one past the last key."""
        n_q = int(call.q.shape[0])
        if isinstance(k_pos, Arange):
            end = k_pos.start + k_pos.n
        else:
            kp = np.asarray(k_pos)
            if kp.ndim != 1 or np.dtype(kp.dtype).kind not in "iu":
                raise ApiError("invalid_tensor", f"k_pos must be a 1-d integer tensor, got shape {list(kp.shape)} dtype {kp.dtype}")
            end = max(int(kp.max()) + 1 if kp.size else 0, next_pos)
        return np.arange(end - n_q, end, dtype=np.int64)
