import warnings

import numpy as np
import pytest

from merge import State, empty, finalize, from_lse, merge


def test_empty_is_minus_inf_zero_zero():
    st = empty(3, 4, 5)
    assert st.m.shape == (3, 4) and st.acc.shape == (3, 4, 5)
    assert np.all(st.m == -np.inf) and np.all(st.l == 0) and np.all(st.acc == 0)
    assert st.dtype == np.float32


def test_finalize_of_empty_gives_zero_out_and_minus_inf_lse_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = finalize(empty(2, 3, 4, dtype=np.float64))
    assert np.all(out == 0) and np.all(lse == -np.inf)
    assert out.dtype == np.float64


def test_from_lse_round_trips_through_finalize(rng):
    out = rng.standard_normal((3, 4, 5))
    lse = rng.standard_normal((3, 4)) * 10
    lse[0, 1] = -np.inf
    out2, lse2 = finalize(from_lse(out, lse))
    np.testing.assert_array_equal(lse2, lse)
    np.testing.assert_allclose(out2[lse2 > -np.inf], out[lse > -np.inf], rtol=1e-15)
    assert np.all(out2[0, 1] == 0)


def test_from_lse_reads_flash_attentions_plus_inf_as_a_row_with_no_key(rng):
    out = rng.standard_normal((2, 3, 4))
    lse = rng.standard_normal((2, 3))
    lse[1, 2] = np.inf  # FlashAttention's lse of a row whose keys were all masked
    out[1, 2] = np.nan  # whatever it wrote there is not read
    st = from_lse(out, lse)
    assert st.m[1, 2] == -np.inf and st.l[1, 2] == 0 and np.all(st.acc[1, 2] == 0)
    # Merged with a state that saw keys for that row, the row is that state's alone.
    other = from_lse(np.ones((2, 3, 4)), np.zeros((2, 3)))
    merged_out, merged_lse = finalize(merge(st, other))
    assert np.all(merged_out[1, 2] == 1) and merged_lse[1, 2] == 0


def test_from_lse_keeps_float32_for_float32_inputs():
    st = from_lse(np.zeros((1, 1, 2), np.float32), np.zeros((1, 1), np.float32))
    assert st.dtype == np.float32


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"m": np.zeros((2,)), "l": np.zeros((2,)), "acc": np.zeros((2, 1))}, "State.m must be"),
        ({"m": np.zeros((2, 3)), "l": np.zeros((2, 2)), "acc": np.zeros((2, 3, 1))}, "State.l must have"),
        ({"m": np.zeros((2, 3)), "l": np.zeros((2, 3)), "acc": np.zeros((2, 4, 1))}, "State.acc must be"),
        ({"m": np.zeros((2, 3), np.float16), "l": np.zeros((2, 3), np.float16), "acc": np.zeros((2, 3, 1), np.float16)},
         "dtype must be float32 or float64"),
        ({"m": np.zeros((2, 3), np.float32), "l": np.zeros((2, 3)), "acc": np.zeros((2, 3, 1))}, "share one dtype"),
    ],
)
def test_state_rejects_inconsistent_arrays(kwargs, match):
    with pytest.raises(ValueError, match=match):
        State(**kwargs)


def test_empty_rejects_negative_sizes_and_bad_dtype():
    with pytest.raises(ValueError, match="n_q must be a non-negative int, got -1"):
        empty(-1, 2, 3)
    with pytest.raises(ValueError, match="dtype must be float32 or float64, got float16"):
        empty(1, 2, 3, dtype=np.float16)


@pytest.mark.parametrize("call, match", [
    (lambda: finalize((1, 2, 3)), "state must be a State, got tuple"),
    (lambda: empty(1, 2, 3, dtype="foo"), "dtype must be float32 or float64, got 'foo'"),
    (lambda: from_lse([[[1.0]]], [[0.0]]), "out must be a numpy or cupy array, got list"),
    (lambda: State([[0.0]], [[0.0]], [[[0.0]]]), "State.m must be a numpy or cupy array, got list"),
    # Python scalars are no arrays either (they passed the module check, then failed on .ndim)
    (lambda: State(1.0, np.zeros((1, 1), np.float32), np.zeros((1, 1, 1), np.float32)),
     "State.m must be a numpy or cupy array, got float"),
    (lambda: State(np.zeros((1, 1), np.float32), 1.0, np.zeros((1, 1, 1), np.float32)),
     "State.l must be a numpy or cupy array, got float"),
    (lambda: from_lse(np.zeros((1, 1, 1), np.float32), 0.0), "lse must be a numpy or cupy array, got float"),
    (lambda: empty(1, 1, 1, xp="numpy"), "xp must be the numpy or cupy module, got 'numpy'"),
    (lambda: empty(1, 1, 1, xp=None), "xp must be the numpy or cupy module, got None"),
])
def test_arguments_of_the_wrong_kind_raise_value_error_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_from_lse_rejects_nan_lse_and_wrong_shapes():
    with pytest.raises(ValueError, match="lse must be a number or \\+-inf for a row with no key, got NaN"):
        from_lse(np.zeros((1, 1, 2)), np.full((1, 1), np.nan))
    with pytest.raises(ValueError, match=r"lse must be \[n_q, h_q\]"):
        from_lse(np.zeros((1, 2, 2)), np.zeros((2, 1)))


def test_from_lse_takes_bfloat16_out_as_other_kernels_return_it():
    import ml_dtypes

    out = np.linspace(-3, 3, 24).reshape(2, 3, 4).astype(ml_dtypes.bfloat16)
    lse = np.array([[0.5, -np.inf, 2.0], [1.0, 3.0, np.inf]], np.float32).astype(ml_dtypes.bfloat16)
    st = from_lse(out, lse)
    assert st.dtype == np.float32
    seen = np.isfinite(lse.astype(np.float32))
    np.testing.assert_array_equal(st.acc[seen], out.astype(np.float32)[seen])
    np.testing.assert_array_equal(st.l, seen.astype(np.float32))
    assert np.all(st.acc[~seen] == 0) and np.all(st.m[~seen] == -np.inf)


def test_a_row_whose_state_overflowed_finalizes_to_nan_never_to_an_empty_row():
    # A score past float32's range makes m = inf and l = NaN. Read as l == 0 it became out NaN,
    # lse -inf ("no key"), which from_lse then turned into a truly empty row.
    st = State(np.array([[np.inf, 1.0, -np.inf]], np.float32), np.array([[np.nan, 2.0, 0.0]], np.float32),
               np.array([[[np.nan], [4.0], [0.0]]], np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the NaN row's arithmetic
        out, lse = finalize(st)
    assert np.isnan(out[0, 0, 0]) and np.isnan(lse[0, 0])
    assert out[0, 1, 0] == 2.0 and lse[0, 1] == np.float32(1.0 + np.log(2.0))
    assert out[0, 2, 0] == 0 and lse[0, 2] == -np.inf
    with pytest.raises(ValueError, match="got NaN"):  # and it cannot pass for an empty row downstream
        from_lse(out, lse)
