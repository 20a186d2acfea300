"""Merging partial states: the rescale-and-add of README "The math", and the tree.

``merge(a, b)`` and ``merge_group(states)`` are the same operation on 2 or k
states: take the common max ``m``, rescale each side by ``exp(m_side - m)`` and add.
``merge_all`` applies ``merge_group`` over a fixed balanced tree of the input
order, so the floating-point result depends only on the inputs and their order,
never on which shard finished first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from merge.state import NO_SCORE, State


def _check_compatible(states: Sequence[State], names: Sequence[str] | None = None) -> None:
    """Every state a State of the first one's shape, dtype and array module; an error names the
    caller's argument (``names[i]``, by default ``states[i]``)."""
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
        if st.dtype != first.dtype:
            raise ValueError(f"{name(i)} must have dtype {first.dtype} as {name(0)}, got {st.dtype}")
        if st.xp is not first.xp:
            raise ValueError(f"{name(i)} must live in {first.xp.__name__} as {name(0)}, got {st.xp.__name__}")


def merge_group(states: Sequence[State]) -> State:
    """Merge k >= 1 states in one step (the node of the merge tree).

    Invariant of the result, for every (query, head): ``m`` is the max over all
    inputs, ``l`` and ``acc`` are the sums of the inputs' ``l`` and ``acc`` each
    rescaled to that common ``m``. Rows empty in every input stay empty
    (m = -inf, l = 0, acc = 0) without a NaN.
    """
    _check_sequence(states)
    if len(states) == 0:
        raise ValueError("states must hold at least one State, got an empty sequence")
    _check_compatible(states)
    if len(states) == 1:
        return states[0]
    xp = states[0].xp
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


def merge(a: State, b: State) -> State:
    """Merge two states: exact for the union of their key sets (README, "The math")."""
    _check_compatible((a, b), ("a", "b"))
    return merge_group((a, b))


def tree_levels(n: int, fanin: int) -> list[list[tuple[int, int]]]:
    """The fixed shape of the merge tree over ``n`` leaves.

    Level 0 groups consecutive leaves in runs of ``fanin``; each later level groups
    the previous level's results the same way, until one remains. Each level is a
    list of ``(start, stop)`` index ranges into the level below. Used by
    ``merge_all`` here and by distributed merges, so both build the same tree.
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


def _check_sequence(states: Any) -> None:
    """``states`` is a list or tuple (of States, checked next): a lone State is a common slip."""
    if not isinstance(states, (list, tuple)):
        raise ValueError(f"states must be a list or tuple of States, got {type(states).__name__}")


def _check_fanin(fanin: int) -> None:
    if isinstance(fanin, bool) or not isinstance(fanin, (int, np.integer)) or fanin < 2:
        raise ValueError(f"fanin must be an int >= 2, got {fanin!r}")


def merge_all(states: Sequence[State], fanin: int = 2) -> State:
    """Merge any number of states over a fixed balanced tree of their order.

    The same states in the same order give a bitwise-identical result.
    """
    _check_fanin(fanin)
    _check_sequence(states)
    level = list(states)
    if not level:
        raise ValueError("states must hold at least one State, got an empty sequence")
    _check_compatible(level)  # every leaf, named by its place in ``states`` (the tree's nodes only merge)
    for lv in tree_levels(len(level), fanin):
        level = [merge_group(level[a:b]) for a, b in lv]
    return merge_group(level)
