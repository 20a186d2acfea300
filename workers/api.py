"""The library API: ``partial_attention`` (one shard -> State) and ``attention``.

Backend-neutral: numpy arrays run on the CPU kernel here; cupy arrays are sent
to ``workers.gpu`` (the only module that imports cupy). The math is in README,
"The math"; the loop and its invariant are in ``workers.blockwise``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from merge import State, array_module, empty, finalize, merge_all, merge_group
from workers.blockwise import TileInputs, stream
from workers.layout import NaturalKV, StreamingView
from workers.masking import TileBounds
from workers.options import AttentionOptions, KernelOptions, Problem, check_problem
from workers.plan import make_plan


def _host(x: Any) -> Any:
    """A numpy copy/view of a small index array (cupy: one device-to-host copy)."""
    return x.get() if hasattr(x, "get") else x


def prepare_rows(q: Any, problem: Problem, xp: Any) -> tuple[Any, Any, Any]:
    """q in the kernel's row space, scaled; positions and slopes per row.

    Returns ``q_rows [h_kv, n_q*g, d]``, ``q_pos_rows [n_q*g]``, ``slopes_rows [h_kv, n_q*g]`` or None.
    Row ``i*g + j`` of kv head ``h`` is query ``i``, query head ``h*g + j``.
    """
    p, opts = problem, problem.options
    g = p.group
    factor = p.scale if opts.softcap is None else p.scale / opts.softcap
    q_rows = q.reshape(p.n_q, p.h_kv, g, p.d).transpose(1, 0, 2, 3)  # [h_kv, n_q, g, d]
    q_rows = q_rows.astype(p.acc_dtype).reshape(p.h_kv, p.n_q * g, p.d)  # [h_kv, n_q*g, d]
    q_rows *= factor
    q_pos_rows = xp.repeat(p.q_pos, g)  # [n_q*g]
    slopes_rows = None
    if opts.alibi_slopes is not None:
        sl = xp.asarray(opts.alibi_slopes, dtype=p.acc_dtype).reshape(p.h_kv, 1, g)  # [h_kv, 1, g]
        slopes_rows = xp.broadcast_to(sl, (p.h_kv, p.n_q, g)).reshape(p.h_kv, p.n_q * g)  # [h_kv, n_q*g]
    return q_rows, q_pos_rows, slopes_rows


def rows_to_state(m: Any, l: Any, acc: Any, problem: Problem, xp: Any) -> State:
    """Kernel row space ``[h_kv, n_q*g, ...]`` back to the contract's ``[n_q, h_q, ...]``."""
    p = problem
    g = p.group
    m = m.reshape(p.h_kv, p.n_q, g).transpose(1, 0, 2).reshape(p.n_q, p.h_q)  # [n_q, h_q]
    l = l.reshape(p.h_kv, p.n_q, g).transpose(1, 0, 2).reshape(p.n_q, p.h_q)
    acc = acc.reshape(p.h_kv, p.n_q, g, p.d_v).transpose(1, 0, 2, 3).reshape(p.n_q, p.h_q, p.d_v)
    return State(m=xp.ascontiguousarray(m), l=xp.ascontiguousarray(l), acc=xp.ascontiguousarray(acc))


def run_cpu(q: Any, kv: Any, problem: Problem, kopts: KernelOptions) -> State:
    """Run the blockwise kernel over a key/value source on numpy arrays."""
    p = problem
    xp = np
    if p.n_q == 0 or p.n_k == 0:
        return empty(p.n_q, p.h_q, p.d_v, dtype=p.acc_dtype)
    q_rows, q_pos_rows, slopes_rows = prepare_rows(q, p, xp)
    n_rows = p.n_q * p.group
    plan = make_plan(n_rows, p.h_kv, p.n_k, p.d, p.d_v, p.acc_dtype.itemsize, kopts)
    k_pos_host = kv.k_pos

    def run_item(i: int) -> tuple[Any, Any, Any]:
        it = plan.items[i]
        qp = q_pos_rows[it.r0:it.r1]
        tile = TileInputs(
            q=q_rows[it.h0:it.h1, it.r0:it.r1],
            q_pos=qp,
            slopes=None if slopes_rows is None else slopes_rows[it.h0:it.h1, it.r0:it.r1],
            softcap=p.options.softcap,
            bounds=TileBounds.of(int(qp.min()), int(qp.max()), p.options),
            options=p.options,
        )
        return stream(tile, kv, k_pos_host, it.k0, it.k1, it.h0, it.h1, plan.block_size, p.acc_dtype, xp)

    if kopts.threads > 1 and len(plan.items) > 1:
        with ThreadPoolExecutor(min(kopts.threads, len(plan.items))) as pool:
            results = list(pool.map(run_item, range(len(plan.items))))
    else:
        results = [run_item(i) for i in range(len(plan.items))]

    m = np.empty((p.h_kv, n_rows), dtype=p.acc_dtype)
    l = np.empty((p.h_kv, n_rows), dtype=p.acc_dtype)
    acc = np.empty((p.h_kv, n_rows, p.d_v), dtype=p.acc_dtype)
    for group in plan.groups:
        it = plan.items[group[0]]
        # Key-split parts of one tile merge in key order, so the result does not
        # depend on which thread finished first. A [hb, rows] part is a State of
        # "n_q" = hb and "h_q" = rows for the merge algebra.
        parts = [State(*results[i]) for i in group]
        st = merge_group(parts)
        m[it.h0:it.h1, it.r0:it.r1] = st.m
        l[it.h0:it.h1, it.r0:it.r1] = st.l
        acc[it.h0:it.h1, it.r0:it.r1] = st.acc
    return rows_to_state(m, l, acc, p, xp)


def _options(scale: Any, causal: Any, window: Any, softcap: Any, alibi_slopes: Any) -> AttentionOptions:
    return AttentionOptions(scale=scale, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes)


def partial_attention(q: Any, k: Any, v: Any, *, scale: float | None = None, causal: bool = False,
                      q_pos: Any = None, k_pos: Any = None, window: Any = None, softcap: float | None = None,
                      alibi_slopes: Any = None, block_size: int | None = None, threads: int = 1,
                      gpu_kernels: str = "generic") -> State:
    """The partial state of ``q [n_q, h_q, d]`` over ``k [n_k, h_kv, d]``, ``v [n_k, h_kv, d_v]``.

    Options as in CONTRACT section 3. ``block_size`` (keys per block) and
    ``threads`` change how the keys are walked, not the math. On a shard of a
    longer sequence pass that shard's ``k_pos`` and the queries' ``q_pos``: the
    defaults align the queries with the end of *these* keys.
    """
    opts = _options(scale, causal, window, softcap, alibi_slopes)
    problem = check_problem(q, k, v, q_pos, k_pos, opts)
    kopts = KernelOptions(block_size=block_size, threads=threads, gpu_kernels=gpu_kernels)
    if not isinstance(q, np.ndarray):
        from workers import gpu

        return gpu.partial_attention_gpu(q, k, v, problem, kopts, kernels=kopts.gpu_kernels)
    return run_cpu(q, NaturalKV(k, v, problem.k_pos), problem, kopts)


def partial_attention_resident(q: Any, view: StreamingView, *, q_pos: Any, options: AttentionOptions,
                               kernel: KernelOptions) -> State:
    """Partial state over keys held in the streaming layout (resident contexts).

    ``q_pos`` is required: a resident shard does not know where the queries are.
    """
    if q_pos is None:
        raise ValueError("q_pos must be given for resident keys, got None")
    h_kv, d, n_k = (int(s) for s in view.kt.shape)
    xp_is_np = isinstance(view.kt, np.ndarray)
    # Shape checks reuse the inline ones on zero-copy stand-ins of the right shape.
    k_probe = _probe(view.kt, (n_k, h_kv, d))
    v_probe = _probe(view.v, (n_k, h_kv, int(view.v.shape[2])))
    problem = check_problem(q, k_probe, v_probe, q_pos, view.k_pos, options)
    if not xp_is_np:
        from workers import gpu

        return gpu.partial_attention_resident_gpu(q, view, problem, kernel, kernels=kernel.gpu_kernels)
    return run_cpu(q, view, problem, kernel)


def _probe(like: Any, shape: tuple[int, ...]) -> Any:
    """A zero-stride array of ``shape`` and ``like``'s dtype/module (no allocation)."""
    xp = array_module(like)
    return xp.broadcast_to(xp.zeros((), dtype=like.dtype), shape)


def attention(q: Any, k: Any, v: Any, *, shards: int = 1, scale: float | None = None, causal: bool = False,
              q_pos: Any = None, k_pos: Any = None, window: Any = None, softcap: float | None = None,
              alibi_slopes: Any = None, block_size: int | None = None, threads: int = 1,
              fanin: int = 2) -> tuple[Any, Any]:
    """Exact attention ``(out [n_q, h_q, d_v], lse [n_q, h_q])`` by splitting the keys in-process.

    The keys are cut into ``shards`` contiguous ranges (sizes differ by at most
    one; a range may be empty), each gives a partial state, and ``merge_all``
    combines them over its fixed tree. Same options as :func:`partial_attention`.
    """
    if isinstance(shards, bool) or not isinstance(shards, (int, np.integer)) or shards < 1:
        raise ValueError(f"shards must be an int >= 1, got {shards!r}")
    opts = _options(scale, causal, window, softcap, alibi_slopes)
    problem = check_problem(q, k, v, q_pos, k_pos, opts)
    n_k = problem.n_k
    bounds = [n_k * i // shards for i in range(shards + 1)]
    states = [
        partial_attention(q, k[a:b], v[a:b], scale=problem.scale, causal=causal, q_pos=problem.q_pos,
                          k_pos=problem.k_pos[a:b], window=window, softcap=softcap,
                          alibi_slopes=alibi_slopes, block_size=block_size, threads=threads)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return finalize(merge_all(states, fanin=fanin))
