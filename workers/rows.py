"""The kernel's row space, shared by the CPU and GPU backends.

Both backends work per kv head ``h`` on the ``n_q * g`` rows (query ``i``, group
member ``j``) that read it, row ``i * g + j``: query head ``h * g + j``.
:func:`prepare_rows` moves q into that space (scaled once), :func:`rows_to_state`
moves a state back to the contract's ``[n_q, h_q, ...]``.
"""

from __future__ import annotations

from typing import Any

from merge import State
from workers.problem import Problem


def prepare_rows(q: Any, problem: Problem, xp: Any) -> tuple[Any, Any, Any]:
    """q in the kernel's row space, scaled; positions and slopes per row.

    Returns ``q_rows [h_kv, n_q*g, d]``, ``q_pos_rows [n_q*g]``, ``slopes_rows [h_kv, n_q*g]`` or None.
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
    acc = acc.reshape(p.h_kv, p.n_q, g, p.d_v).transpose(1, 0, 2, 3).reshape(p.n_q, p.h_q, p.d_v)  # [n_q, h_q, d_v]
    return State(m=xp.ascontiguousarray(m), l=xp.ascontiguousarray(l), acc=xp.ascontiguousarray(acc))
