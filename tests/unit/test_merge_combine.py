import re
import warnings

import numpy as np
import pytest
from reference import reference

from merge import State, empty, finalize, merge, merge_all, merge_group, tree_levels
from workers import partial_attention


def scores_state(scores, values, block):
    """The state of one query over scalar keys: score s_j = q . k_j with q = 1, scale 1."""
    s = np.asarray(scores, dtype=np.float64)
    vals = np.asarray(values, dtype=np.float64)
    q = np.ones((1, 1, 1))
    return partial_attention(q, s.reshape(-1, 1, 1), vals.reshape(-1, 1, 1), scale=1.0, block_size=block)


def test_seed_example_four_scores_two_blocks_gives_28_9847():
    a = scores_state([1, 3], [10, 20], block=2)
    b = scores_state([5, 2], [30, 40], block=2)
    # After the first block: m = 3, l = 1.1353, acc = 21.3534 (the seed's carried numbers).
    assert a.m[0, 0] == 3
    assert a.l[0, 0] == pytest.approx(1.1353, abs=1e-4)
    assert a.acc[0, 0, 0] == pytest.approx(21.3534, abs=1e-4)
    out, _ = finalize(merge(a, b))
    assert out[0, 0, 0] == pytest.approx(28.9847, abs=1e-4)
    one, _ = finalize(scores_state([1, 3, 5, 2], [10, 20, 30, 40], block=1))
    assert one[0, 0, 0] == pytest.approx(28.98474626, abs=1e-8)


def test_seed_example_five_scores_gives_l_1_5713_and_39_95():
    st = scores_state([1, 3, 2, 5, 4], [10, 20, 30, 40, 50], block=2)
    assert st.m[0, 0] == 5
    assert st.l[0, 0] == pytest.approx(1.5713, abs=1e-4)
    out, _ = finalize(st)
    assert out[0, 0, 0] == pytest.approx(39.95, abs=5e-3)


def random_state(rng, n_q=3, h_q=4, d_v=5, empty_rows=0.2, dtype=np.float64):
    m = rng.standard_normal((n_q, h_q)) * 20
    l = rng.uniform(0.5, 10, (n_q, h_q))
    acc = rng.standard_normal((n_q, h_q, d_v)) * l[..., None]
    hole = rng.random((n_q, h_q)) < empty_rows
    m[hole], l[hole], acc[hole] = -np.inf, 0, 0
    return State(m.astype(dtype), l.astype(dtype), acc.astype(dtype))


def assert_states_close(a, b, rtol=1e-12):
    oa, la = finalize(a)
    ob, lb = finalize(b)
    np.testing.assert_array_equal(np.isneginf(la), np.isneginf(lb))
    np.testing.assert_allclose(oa, ob, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(la[np.isfinite(la)], lb[np.isfinite(lb)], rtol=rtol)


def test_merge_is_commutative(rng):
    a, b = random_state(rng), random_state(rng)
    assert_states_close(merge(a, b), merge(b, a))


def test_merge_is_associative_up_to_rounding(rng):
    a, b, c = random_state(rng), random_state(rng), random_state(rng)
    assert_states_close(merge(merge(a, b), c), merge(a, merge(b, c)))


def test_merge_with_empty_shard_is_identity(rng):
    a = random_state(rng)
    e = empty(3, 4, 5, dtype=np.float64)
    for st in (merge(a, e), merge(e, a)):
        np.testing.assert_array_equal(st.m, a.m)
        np.testing.assert_array_equal(st.l, a.l)
        np.testing.assert_array_equal(st.acc, a.acc)


def test_merge_of_two_empty_states_is_empty_without_nan_or_warning():
    e = empty(2, 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st = merge(e, e)
        out, lse = finalize(st)
    assert np.all(st.m == -np.inf) and np.all(st.l == 0) and np.all(st.acc == 0)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_merge_matches_reference_over_split_keys(rng):
    q = rng.standard_normal((4, 6, 8))
    k = rng.standard_normal((50, 3, 8))
    v = rng.standard_normal((50, 3, 7))
    kp = np.arange(50)
    qp = np.arange(46, 50)
    parts = [partial_attention(q, k[a:b], v[a:b], q_pos=qp, k_pos=kp[a:b]) for a, b in ((0, 17), (17, 17), (17, 50))]
    out, lse = finalize(merge_all(parts, fanin=3))
    ref_out, ref_lse = reference(q, k, v)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)


@pytest.mark.parametrize("fanin", [2, 3, 4, 8])
def test_merge_all_is_bitwise_deterministic_for_the_same_order(rng, fanin):
    states = [random_state(rng, dtype=np.float32) for _ in range(11)]
    first = merge_all(states, fanin=fanin)
    again = merge_all(list(states), fanin=fanin)
    for name in ("m", "l", "acc"):
        assert getattr(first, name).tobytes() == getattr(again, name).tobytes()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9, 17])
def test_merge_all_equals_sequential_merge_up_to_rounding(rng, n):
    states = [random_state(rng) for _ in range(n)]
    seq = states[0]
    for st in states[1:]:
        seq = merge(seq, st)
    assert_states_close(merge_all(states), seq)


def test_tree_levels_are_balanced_groups_of_the_input_order():
    assert tree_levels(5, 2) == [[(0, 2), (2, 4), (4, 5)], [(0, 2), (2, 3)], [(0, 2)]]
    assert tree_levels(1, 2) == []
    assert tree_levels(9, 3) == [[(0, 3), (3, 6), (6, 9)], [(0, 3)]]


def test_float32_scores_in_the_hundreds_stay_finite():
    # exp(300) overflows float32 (max about exp(88.7)); the stable rescale never forms it.
    a = State(np.full((1, 1), 300, np.float32), np.ones((1, 1), np.float32), np.full((1, 1, 2), 5, np.float32))
    b = State(np.full((1, 1), 500, np.float32), np.ones((1, 1), np.float32), np.full((1, 1, 2), 7, np.float32))
    out, lse = finalize(merge(a, b))
    assert np.all(np.isfinite(out)) and np.isfinite(lse).all()
    assert out[0, 0, 0] == pytest.approx(7.0)
    assert lse[0, 0] == pytest.approx(500.0)


def test_merge_rejects_mismatched_states_naming_the_callers_argument():
    with pytest.raises(ValueError, match=r"b must have shape \[n_q, h_q, d_v\] = \(1, 2, 3\) as a, got \(1, 2, 4\)"):
        merge(empty(1, 2, 3), empty(1, 2, 4))
    with pytest.raises(ValueError, match="b must have dtype float32 as a, got float64"):
        merge(empty(1, 2, 3), empty(1, 2, 3, dtype=np.float64))
    with pytest.raises(ValueError, match="a must be a State, got str"):
        merge("x", empty(1, 2, 3))
    a, b = empty(2, 2, 3), empty(3, 2, 3)
    # merge_all names the leaf by its place in the caller's list, not by its place in a tree node.
    for states, fanin, word in (([a, a, a, b], 2, r"states\[3\] must have shape"),
                                ([a, a, b, b], 2, r"states\[2\] must have shape"),
                                ([a] * 5 + [b], 3, r"states\[5\] must have shape"),
                                ([a, a, "x", a], 2, r"states\[2\] must be a State, got str")):
        with pytest.raises(ValueError, match=word):
            merge_all(states, fanin=fanin)
    with pytest.raises(ValueError, match="b must be a State"):
        merge(empty(1, 2, 3), "x")
    with pytest.raises(ValueError, match="at least one State"):
        merge_all([])
    with pytest.raises(ValueError, match="fanin must be an int >= 2, got 1"):
        merge_all([empty(1, 1, 1)], fanin=1)


@pytest.mark.parametrize("call, match", [
    (lambda st: merge_all(st), "states must be a list or tuple of States, got State"),
    (lambda st: merge_all(None), "states must be a list or tuple of States, got NoneType"),
    (lambda st: merge_group(st), "states must be a list or tuple of States, got State"),
    (lambda st: tree_levels(2.5, 2), "n must be an int >= 1, got 2.5"),
    (lambda st: tree_levels(True, 2), "n must be an int >= 1, got True"),
    (lambda st: tree_levels("3", 2), "n must be an int >= 1, got '3'"),
])
def test_arguments_of_the_wrong_kind_raise_value_error_naming_them(call, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        call(empty(1, 1, 1))
