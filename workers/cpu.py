"""The CPU backend: the blockwise kernel over numpy arrays, split over threads, batched over requests.

The plan (``workers.plan``) cuts the call into work items; each streams its key
range through ``workers.blockwise.stream``; key-split parts of one tile merge in
key order, so the result does not depend on which thread finished first.

With ``KernelOptions.cpu_kernels = "fused"``, decode and prefill over resident keys run on
the numba kernel of ``workers.fused`` instead (``workers.fused.choose`` says which).

Several problems over the same keys (requests that reached a worker together,
``workers.batch``) run as one call when :func:`workers.plan.batchable`: every
work item streams its keys once through one tile per request. Each request's
plan, tiles and BLAS calls are those it has alone, so its state is bitwise what
it gives alone (``workers.blockwise.stream``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from merge import State, empty, merge_group
from workers.blockwise import TileInputs, stream
from workers.fused import CpuPath, choose, try_fused
from workers.masking import TileBounds
from workers.options import KernelOptions
from workers.plan import Plan, WorkItem, batchable, make_plan
from workers.problem import Problem
from workers.rows import prepare_rows, rows_to_state


def run_cpu(q: Any, kv: Any, problem: Problem, kopts: KernelOptions) -> State:
    """The state of ``q`` over a key/value source (``NaturalKV`` or ``StreamingView``) of numpy arrays."""
    return run_cpu_many([(q, problem)], kv, kopts)[0]


def run_cpu_many(parts: Sequence[tuple[Any, Problem]], kv: Any, kopts: KernelOptions) -> list[State]:
    """The state of each ``(q, problem)`` over the same keys; one pass over them when :func:`batchable`."""
    problems = [p for _, p in parts]
    if len(parts) > 1 and not batchable(problems):
        return [run_cpu(q, kv, p, kopts) for q, p in parts]
    p0 = problems[0]
    if p0.n_q == 0 or p0.n_k == 0:
        return [empty(p.n_q, p.h_q, p.d_v, dtype=p.acc_dtype) for p in problems]
    if choose(problems, kv, kopts) is CpuPath.FUSED:
        states = try_fused(parts, kv, kopts)  # None: the compiled path failed (logged), NumPy answers
        if states is not None:
            return states
    n_rows = p0.n_q * p0.group  # of each request (batchable: all equal)
    plan = make_plan(n_rows, p0.h_kv, p0.n_k, p0.d, p0.d_v, p0.acc_dtype.itemsize, kopts)
    # Bound the batch's score tiles ([h_kv, n_rows, block] per request): more requests take more passes.
    per_pass = max(1, kopts.batch_scratch_bytes // (p0.h_kv * n_rows * plan.block_size * p0.acc_dtype.itemsize))
    if len(parts) > per_pass:
        return [st for i in range(0, len(parts), per_pass) for st in run_cpu_many(parts[i:i + per_pass], kv, kopts)]
    # Per request: q_rows [h_kv, n_rows, d], q_pos_rows [n_rows], slopes_rows [h_kv, n_rows] or None
    rows = [prepare_rows(q, p, np) for q, p in parts]

    def run_item(it: WorkItem) -> list[tuple[Any, Any, Any]]:
        tiles = []
        for (q_rows, q_pos_rows, slopes_rows), p in zip(rows, problems):
            qp = q_pos_rows[it.r0:it.r1]
            tiles.append(TileInputs(
                q=q_rows[it.h0:it.h1, it.r0:it.r1],
                q_pos=qp,
                slopes=None if slopes_rows is None else slopes_rows[it.h0:it.h1, it.r0:it.r1],
                softcap=p.options.softcap,
                bounds=TileBounds.of(int(qp.min()), int(qp.max()), p.options),
                options=p.options,
            ))
        return stream(tiles, kv, kv.k_pos, it.k0, it.k1, it.h0, it.h1, plan.block_size, p0.acc_dtype, np)

    if kopts.threads > 1 and len(plan.items) > 1:
        contexts = [contextvars.copy_context() for _ in plan.items]  # the batch's deadline (workers.cutoff)
        with ThreadPoolExecutor(min(kopts.threads, len(plan.items))) as pool:
            results = list(pool.map(lambda c, it: c.run(run_item, it), contexts, plan.items))
    else:
        results = [run_item(it) for it in plan.items]
    return [_assemble(plan, [res[i] for res in results], p) for i, p in enumerate(problems)]


def _assemble(plan: Plan, parts: list[tuple[Any, Any, Any]], p: Problem) -> State:
    """One request's state from its (m, l, acc) of every work item: key-split parts merged in key order."""
    n_rows = p.n_q * p.group
    m = np.empty((p.h_kv, n_rows), dtype=p.acc_dtype)
    l = np.empty((p.h_kv, n_rows), dtype=p.acc_dtype)
    acc = np.empty((p.h_kv, n_rows, p.d_v), dtype=p.acc_dtype)
    for group in plan.groups:
        it = plan.items[group[0]]
        # A [hb, rows] part is a State of "n_q" = hb and "h_q" = rows for the merge algebra.
        st = merge_group([State(*parts[i]) for i in group])
        m[it.h0:it.h1, it.r0:it.r1] = st.m
        l[it.h0:it.h1, it.r0:it.r1] = st.l
        acc[it.h0:it.h1, it.r0:it.r1] = st.acc
    return rows_to_state(m, l, acc, p, np)
