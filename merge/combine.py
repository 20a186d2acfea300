"""Merging partial states: the rescale-and-add of README "The math", and the tree.

``merge(a, b)`` and ``merge_group(states)`` are the same operation on 2 or k
states: take the common max ``m``, rescale each side by ``exp(m_side - m)`` and add.
``merge_all`` applies that operation over a fixed balanced tree of the input
order (``tree_levels``), so the floating-point result depends only on the inputs
and their order, never on which shard finished first.

The public functions check their arguments once (``_checked``); the tree's inner
nodes then only combine (``_combine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from merge.state import NO_SCORE, State, array_module


def _checked(states: Any, names: Sequence[str] | None = None) -> Sequence[State]:
    """``states``, a non-empty list or tuple of States of the first one's shape, dtype and array
    module (a lone State is a common slip); an error names the caller's argument (``names[i]``, by
    default ``states[i]``)."""
    if not isinstance(states, (list, tuple)):
        raise ValueError(f"states must be a list or tuple of States, got {type(states).__name__}")
    if not states:
        raise ValueError("states must hold at least one State, got an empty sequence")

    def name(i: int) -> str:
        return names[i] if names is not None else f"states[{i}]"
    first = states[0]
    if not isinstance(first, State):
        raise ValueError(f"{name(0)} must be a State, got {type(first).__name__}")
    for i, st in enumerate(states[1:], start=1):
        if not isinstance(st, State):
            raise ValueError(f"{name(i)} must be a State, got {type(st).__name__}")
        if st.acc.shape != first.acc.shape:
            raise ValueError(f"{name(i)} must have shape [n_q, h_q, d_v] = {tuple(first.acc.shape)} as {name(0)}, "
                             f"got {tuple(st.acc.shape)}")
        if st.m.dtype != first.m.dtype:
            raise ValueError(f"{name(i)} must have dtype {first.m.dtype} as {name(0)}, got {st.m.dtype}")
        if type(st.m) is not type(first.m):
            raise ValueError(f"{name(i)} must live in {array_module(first.m).__name__} as {name(0)}, "
                             f"got {array_module(st.m).__name__}")
    return states


def _combine(states: Sequence[State]) -> State:
    """Merge k >= 1 checked states in one step (a node of the merge tree).

    Invariant of the result, for every (query, head): ``m`` is the max over all
    inputs, ``l`` and ``acc`` are the sums of the inputs' ``l`` and ``acc`` each
    rescaled to that common ``m``. Rows empty in every input stay empty
    (m = -inf, l = 0, acc = 0) without a NaN.
    """
    if len(states) == 1:
        return states[0]
    xp = array_module(states[0].m)
    m = states[0].m
    for st in states[1:]:
        m = xp.maximum(m, st.m)
    # Guard: where every input is empty, m = -inf and (m_side - m) would be
    # -inf - -inf = NaN. Measuring against 0 there instead makes each factor
    # exp(-inf - 0) = 0, so empty rows stay exactly empty.
    m_ref = xp.where(m == NO_SCORE, 0, m)
    l = None
    acc = None
    for st in states:
        # factor = exp(m_side - m): 1 for the side holding the max, 0 for an empty side.
        factor = xp.exp(st.m - m_ref)  # [n_q, h_q]
        l_i = st.l * factor
        acc_i = st.acc * factor[..., None]  # [n_q, h_q, d_v]
        l = l_i if l is None else l + l_i
        acc = acc_i if acc is None else acc + acc_i
    return State(m=m, l=l, acc=acc)


def merge_group(states: Sequence[State]) -> State:
    """Merge k >= 1 states in one step (the node of the merge tree; see ``_combine``)."""
    return _combine(_checked(states))


def merge(a: State, b: State) -> State:
    """Merge two states: exact for the union of their key sets (README, "The math")."""
    return _combine(_checked((a, b), ("a", "b")))


def _check_fanin(fanin: int) -> None:
    if isinstance(fanin, bool) or not isinstance(fanin, (int, np.integer)) or fanin < 2:
        raise ValueError(f"fanin must be an int >= 2, got {fanin!r}")


def tree_levels(n: int, fanin: int) -> list[list[tuple[int, int]]]:
    """The fixed shape of the merge tree over ``n`` leaves.

    Level 0 groups consecutive leaves in runs of ``fanin``; each later level groups
    the previous level's results the same way, until one remains. Each level is a
    list of ``(start, stop)`` index ranges into the level below. ``merge_all`` walks
    the same tree, and distributed merges build it from here.
    """
    _check_fanin(fanin)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    levels = []
    width = n
    while width > 1:
        level = [(i, min(i + fanin, width)) for i in range(0, width, fanin)]
        levels.append(level)
        width = len(level)
    return levels


def merge_all(states: Sequence[State], fanin: int = 2) -> State:
    """Merge any number of states over a fixed balanced tree of their order.

    The same states in the same order give a bitwise-identical result. Every leaf is
    checked, named by its place in ``states``; the tree's nodes only combine. Each level
    groups consecutive results in runs of ``fanin``: the tree of ``tree_levels``.
    """
    _check_fanin(fanin)
    level = list(_checked(states))
    while len(level) > 1:
        level = [_combine(level[i:i + fanin]) for i in range(0, len(level), fanin)]
    return level[0]
