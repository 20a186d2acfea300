"""The library API: partial states over one shard of keys, and whole attention in-process.

Backend-neutral: numpy arrays run on the CPU backend (``workers.cpu``); cupy
arrays on the GPU backend (``workers.gpu``, the only package that imports cupy).
The math is in README, "The math"; the loop and its invariant are in
``workers.blockwise``. Every entry point validates its inputs through
``workers.problem`` before any work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from merge import NO_SCORE, State, finalize, merge_all, merge_group
from workers.cpu import run_cpu_many
from workers.layout import NaturalKV, ShardView, StreamingView
from workers.masking import sees_a_key
from workers.options import AttentionOptions, GpuKernels, KernelOptions, gpu_kernels_of, is_int
from workers.problem import Problem, build_problem, check_arrays, check_problem


def _typed(options: Any, kernel: Any) -> None:
    """The typed functions take their options as the dataclasses, never None or a dict."""
    if not isinstance(options, AttentionOptions):
        raise ValueError(f"options must be an AttentionOptions, got {type(options).__name__}")
    if not isinstance(kernel, KernelOptions):
        raise ValueError(f"kernel must be a KernelOptions, got {type(kernel).__name__}")


def _run(q: Any, kv: NaturalKV | StreamingView, problem: Problem, kernel: KernelOptions) -> State:
    """The state of a checked problem on the backend of ``q``'s array module."""
    return _run_many([(q, problem)], kv, kernel)[0]


def _run_many(parts: Sequence[tuple[Any, Problem]], kv: NaturalKV | StreamingView,
              kernel: KernelOptions) -> list[State]:
    """The states of checked problems over the same keys, on the backend of the queries' array module."""
    if isinstance(parts[0][0], np.ndarray):
        states = run_cpu_many(parts, kv, kernel)
    else:
        from workers.gpu.backend import run_gpu_many  # cupy is imported only for cupy inputs

        states = run_gpu_many(parts, kv, kernel)
    return [_overflow_marked(st, problem) for st, (_, problem) in zip(states, parts, strict=True)]


def _overflow_marked(state: State, problem: Problem) -> State:
    """``state`` with every row that sees a key but got no finite score marked as overflowed.

    Scores are finite for finite inputs unless they pass the accumulation dtype's range; one that
    overflows towards -inf weighs nothing, but a row whose *every* visible key overflowed so would
    read as a row that saw no key (``m = -inf``, ``l = 0``): a wrong answer. Such a row gets ``m`` =
    the dtype's lowest finite value with ``l = 0``: beside any finite score in a merge it still
    weighs nothing, and ``finalize`` makes it NaN (docs/API.md section 4, "Overflow").
    """
    unseen = state.m == NO_SCORE  # [n_q, h_q]: no finite score, by the mask or by overflow
    if not bool(unseen.any()):
        return state
    over = unseen & sees_a_key(problem.q_pos, problem.k_pos, problem.options)[:, None]  # [n_q, h_q]
    if not bool(over.any()):
        return state
    return State(m=state.xp.where(over, np.finfo(state.m.dtype).min, state.m), l=state.l, acc=state.acc)


def partial_attention(q: Any, k: Any, v: Any, *, scale: float | None = None, causal: bool = False,
                      q_pos: Any = None, k_pos: Any = None, window: Any = None, softcap: float | None = None,
                      alibi_slopes: Any = None, block_size: int | None = None, threads: int = 1,
                      gpu_kernels: GpuKernels | str = GpuKernels.GENERIC) -> State:
    """The partial state of ``q [n_q, h_q, d]`` over ``k [n_k, h_kv, d]``, ``v [n_k, h_kv, d_v]``.

    Options as in docs/API.md section 3. ``block_size`` (keys per block) and
    ``threads`` change how the keys are walked, not the math. On a shard of a
    longer sequence pass that shard's ``k_pos`` and the queries' ``q_pos``: the
    defaults align the queries with the end of *these* keys.
    """
    options = AttentionOptions(scale=scale, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes)
    kernel = KernelOptions(block_size=block_size, threads=threads, gpu_kernels=gpu_kernels_of(gpu_kernels))
    return partial_attention_shard(q, k, v, q_pos=q_pos, k_pos=k_pos, options=options, kernel=kernel)


def partial_attention_shard(q: Any, k: Any, v: Any, *, q_pos: Any, k_pos: Any, options: AttentionOptions,
                            kernel: KernelOptions) -> State:
    """:func:`partial_attention` with typed options: what a shard worker runs on an inline shard."""
    _typed(options, kernel)
    problem = check_problem(q, k, v, q_pos, k_pos, options)
    return _run(q, NaturalKV(k, v, problem.k_pos), problem, kernel)


def partial_attention_resident(q: Any, view: StreamingView | ShardView, *, q_pos: Any, options: AttentionOptions,
                               kernel: KernelOptions) -> State:
    """Partial state over keys held in the streaming layout (resident contexts).

    ``q_pos`` is required: a resident shard does not know where the queries are.
    """
    return partial_attention_resident_many([(q, q_pos, options)], view, kernel=kernel)[0]


def partial_attention_resident_many(queries: Sequence[tuple[Any, Any, AttentionOptions]],
                                    view: StreamingView | ShardView, *, kernel: KernelOptions) -> list[State]:
    """:func:`partial_attention_resident` for several ``(q, q_pos, options)`` over the same keys.

    Decode-shaped queries of one shape share one pass over the keys (``workers.plan.batchable``);
    each state is bitwise what the query alone would give. Options may differ between queries.
    A :class:`ShardView` (a resident shard's body and tail) runs each part and merges each
    query's states in key order.
    """
    if isinstance(view, ShardView):
        pieces = [p for p in view.parts if p.dims.n_k] or list(view.parts[:1])
        if len(pieces) == 1:
            return partial_attention_resident_many(queries, pieces[0], kernel=kernel)
        per_part = [partial_attention_resident_many(queries, p, kernel=kernel) for p in pieces]
        return [merge_group([states[i] for states in per_part]) for i in range(len(queries))]
    if not isinstance(view, StreamingView):
        raise ValueError(f"view must be a workers.StreamingView (StreamingKV.snapshot()) or a ShardView, got "
                         f"{type(view).__name__}")
    if isinstance(queries, (str, bytes)) or not isinstance(queries, Sequence) or not queries:
        raise ValueError(f"queries must be a non-empty sequence of (q, q_pos, options), got {type(queries).__name__}"
                         f"{' of none' if isinstance(queries, Sequence) and not queries else ''}")
    parts = []
    for i, query in enumerate(queries):
        if not isinstance(query, tuple) or len(query) != 3:
            raise ValueError(f"queries[{i}] must be a tuple (q, q_pos, options), got {type(query).__name__}")
        q, q_pos, options = query
        _typed(options, kernel)
        if q_pos is None:
            raise ValueError("q_pos must be given for resident keys, got None")
        xp = check_arrays(q=q, kt=view.kt, v=view.v)
        parts.append((q, build_problem(q, view.dims, (view.kt.dtype, view.v.dtype), q_pos, view.k_pos, options, xp)))
    return _run_many(parts, view, kernel)


def attention(q: Any, k: Any, v: Any, *, shards: int = 1, scale: float | None = None, causal: bool = False,
              q_pos: Any = None, k_pos: Any = None, window: Any = None, softcap: float | None = None,
              alibi_slopes: Any = None, block_size: int | None = None, threads: int = 1,
              fanin: int = 2) -> tuple[Any, Any]:
    """Exact attention ``(out [n_q, h_q, d_v], lse [n_q, h_q])`` by splitting the keys in-process.

    The keys are cut into ``shards`` contiguous ranges (sizes differ by at most
    one; a range may be empty), each gives a partial state, and ``merge_all``
    combines them over its fixed tree. Same options as :func:`partial_attention`.
    """
    if not is_int(shards) or shards < 1:
        raise ValueError(f"shards must be an int >= 1, got {shards!r}")
    options = AttentionOptions(scale=scale, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes)
    kernel = KernelOptions(block_size=block_size, threads=threads)
    problem = check_problem(q, k, v, q_pos, k_pos, options)
    bounds = [problem.n_k * i // shards for i in range(shards + 1)]
    states = [partial_attention_shard(q, k[a:b], v[a:b], q_pos=problem.q_pos, k_pos=problem.k_pos[a:b],
                                      options=options, kernel=kernel)
              for a, b in zip(bounds[:-1], bounds[1:])]
    return finalize(merge_all(states, fanin=fanin))
