"""Seeded keys and the float64 answers the load test checks against."""

import numpy as np
import pytest
from reference import reference

from service.client.loadtest import data
from service.client.loadtest.config import Shape
from service.client.loadtest.data import Segment, Source
from service.client.loadtest.reference import Expected, answers64, error
from workers import BFLOAT16


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(data, "GENERATE_KEYS", 16)
    from service.client.loadtest import reference as ref

    monkeypatch.setattr(ref, "GENERATE_KEYS", 16)


def test_a_key_range_is_the_same_numbers_however_it_is_cut(small_blocks):
    src = Source(7, Shape(h_q=4, h_kv=2, d=8, d_v=4, dtype="bfloat16"))
    k, v = src.kv(3, 0, 100)
    assert k.shape == (100, 2, 8) and v.shape == (100, 2, 4) and k.dtype == BFLOAT16
    for lo, hi in [(0, 1), (5, 37), (16, 32), (99, 100), (40, 40)]:
        kk, vv = src.kv(3, lo, hi)
        assert kk.tobytes() == k[lo:hi].tobytes() and vv.tobytes() == v[lo:hi].tobytes()
    pieces = list(src.pieces(3, 5, 100, 32))
    assert [a for a, _, _ in pieces] == [5, 32, 64, 96]  # pieces end on multiples of the size
    assert np.concatenate([p[1] for p in pieces]).tobytes() == k[5:].tobytes()
    assert not np.array_equal(src.kv(4, 0, 100)[0], k)  # another stream, other numbers
    assert np.array_equal(Source(7, src.shape).query(5, 3), src.query(5, 3))
    with pytest.raises(ValueError, match=r"key range must satisfy 0 <= lo <= hi, got \[5, 4\)"):
        src.kv(0, 5, 4)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_the_chunked_float64_answer_equals_a_materialised_one(small_blocks, dtype):
    shape = Shape(h_q=6, h_kv=2, d=8, d_v=5, dtype=dtype)
    src = Source(1, shape)
    segs = (Segment(0, 0, 70, 0), Segment(9, 3, 40, 70), Segment(11, 0, 5, 107))  # 112 keys at positions 0..111
    k = np.concatenate([src.kv(s.stream, s.lo, s.hi)[0] for s in segs])
    v = np.concatenate([src.kv(s.stream, s.lo, s.hi)[1] for s in segs])
    k_pos = np.concatenate([s.pos0 + np.arange(s.n) for s in segs])
    asked = [Expected(src.query(0, 3), np.array([0, 50, 200]), segs, causal=True),  # row 0 sees one key
             Expected(src.query(1, 2), np.array([111, 111]), segs),
             Expected(src.query(2, 1), np.array([-5]), segs, causal=True)]  # sees no key: lse -inf, out 0
    got = answers64(src, asked)
    for a, (out, lse) in zip(asked, got):
        want_out, want_lse = reference(a.q, k, v, causal=a.causal, q_pos=a.q_pos, k_pos=k_pos)
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
        np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-12)
    assert np.isneginf(got[2][1]).all() and not got[2][0].any()
    # One request at a time gives the same as all together (they share the segments' passes).
    for a, (out, lse) in zip(asked, got):
        alone = answers64(src, [a])[0]
        np.testing.assert_allclose(alone[0], out, rtol=1e-13, atol=1e-15)


def test_requests_over_different_segments_share_the_common_ones(small_blocks):
    src = Source(2, Shape(h_q=2, h_kv=1, d=4, d_v=4))
    base = Segment(0, 0, 50, 0)
    one = Expected(src.query(0, 1), np.array([60]), (base, Segment(5, 0, 10, 50)))
    two = Expected(src.query(1, 1), np.array([55]), (base, Segment(6, 0, 5, 50)))
    for a, (out, _lse) in zip([one, two], answers64(src, [one, two])):
        ks, vs = zip(*(src.kv(s.stream, s.lo, s.hi) for s in a.segments))
        want, _ = reference(a.q, np.concatenate(ks), np.concatenate(vs))
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_the_error_is_relative_and_catches_shapes_and_empty_rows():
    out = np.full((1, 2, 3), 4.0)
    lse = np.array([[10.0, -np.inf]])
    assert error(out, lse, out, lse) == 0.0
    assert error(out + 1e-3, lse, out, lse) == pytest.approx(1e-3 / 4)
    assert error(out, lse + np.array([[0.5, 0]]), out, lse) == pytest.approx(0.5 / 10)
    assert error(out[:, :1], lse[:, :1], out, lse) == float("inf")  # a missing head
    assert error(out, np.array([[10.0, 3.0]]), out, lse) == float("inf")  # a row that should be empty
    assert error(out * np.nan, lse, out, lse) == float("inf")
    for bad in (np.nan, np.inf):  # an lse that is not finite where the reference's is
        assert error(out, np.array([[bad, -np.inf]]), out, lse) == float("inf"), bad
    assert error(out, np.array([[np.nan, np.nan]]), out, lse) == float("inf")


def test_turn_streams_draw_small_blocks_and_cut_the_same():
    src = Source(3, Shape(h_q=2, h_kv=1, d=4, d_v=4))
    stream = data.TURN_STREAM + 5
    assert src.block_keys(stream) == data.TURN_BLOCK_KEYS and src.block_keys(0) == data.GENERATE_KEYS
    k, v = src.kv(stream, 0, 600)
    for lo, hi in [(0, 16), (250, 260), (256, 600)]:
        kk, vv = src.kv(stream, lo, hi)
        assert kk.tobytes() == k[lo:hi].tobytes() and vv.tobytes() == v[lo:hi].tobytes()
