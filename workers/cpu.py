"""The CPU backend: the blockwise kernel over numpy arrays, split over threads.

The plan (``workers.plan``) cuts the call into work items; each streams its key
range through ``workers.blockwise.stream``; key-split parts of one tile merge in
key order, so the result does not depend on which thread finished first.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from merge import State, empty, merge_group
from workers.blockwise import TileInputs, stream
from workers.masking import TileBounds
from workers.options import KernelOptions
from workers.plan import make_plan
from workers.problem import Problem
from workers.rows import prepare_rows, rows_to_state


def run_cpu(q: Any, kv: Any, problem: Problem, kopts: KernelOptions) -> State:
    """The state of ``q`` over a key/value source (``NaturalKV`` or ``StreamingView``) of numpy arrays."""
    p = problem
    xp = np
    if p.n_q == 0 or p.n_k == 0:
        return empty(p.n_q, p.h_q, p.d_v, dtype=p.acc_dtype)
    q_rows, q_pos_rows, slopes_rows = prepare_rows(q, p, xp)  # [h_kv, n_rows, d], [n_rows], [h_kv, n_rows]
    n_rows = p.n_q * p.group
    plan = make_plan(n_rows, p.h_kv, p.n_k, p.d, p.d_v, p.acc_dtype.itemsize, kopts)

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
        return stream(tile, kv, kv.k_pos, it.k0, it.k1, it.h0, it.h1, plan.block_size, p.acc_dtype, xp)

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
        # A [hb, rows] part is a State of "n_q" = hb and "h_q" = rows for the merge algebra.
        st = merge_group([State(*results[i]) for i in group])
        m[it.h0:it.h1, it.r0:it.r1] = st.m
        l[it.h0:it.h1, it.r0:it.r1] = st.l
        acc[it.h0:it.h1, it.r0:it.r1] = st.acc
    return rows_to_state(m, l, acc, p, xp)
