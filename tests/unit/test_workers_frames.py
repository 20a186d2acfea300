"""The direct channel's frames (workers.frames): exact round trips, bounded and refused input."""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest

from merge import State
from workers import frames
from workers.dtypes import BFLOAT16
from workers.options import AttentionOptions
from workers.problem import Arange
from workers.store import ShardMissing
from workers.tasks import ComputeStatus, ShardQuery, ShardRead, carry


def roundtrip(buffers) -> tuple[dict, list[np.ndarray]]:
    data = b"".join(bytes(b) for b in buffers)
    header_len, body_len = frames.sizes(data[:frames.PREFIX.size])
    head = data[frames.PREFIX.size:frames.PREFIX.size + header_len]
    body = bytearray(data[frames.PREFIX.size + header_len:])
    assert len(body) == body_len
    return frames.decode(head, body)


OPTIONS = [
    AttentionOptions(),
    AttentionOptions(scale=0.1234567890123, causal=True),
    AttentionOptions(window=(3, None), softcap=30.0),
    AttentionOptions(window=(None, 0), alibi_slopes=np.array([0.5, 0.25, 0.125, 1 / 3])),
    AttentionOptions(causal=True, window=(7, 2), softcap=2.5, alibi_slopes=np.array([1e-3, 2.0, 0.1, 0.7],
                                                                                       dtype=np.float32)),
]


@pytest.mark.parametrize("options", OPTIONS, ids=range(len(OPTIONS)))
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64], ids=str)
@pytest.mark.parametrize("arange", [False, True])
def test_query_frame_round_trips_every_option_and_dtype_exactly(rng, options, dtype, arange):
    q = rng.standard_normal((3, 4, 8)).astype(dtype)
    q_pos = Arange(100, 3) if arange else np.array([5, -2, 2**62], dtype=np.int64)
    reads = (ShardRead("ctx_a", 0, 17, 3), ShardRead("ctx_b", 2, 0, 0))
    buffers = frames.query_frame(7, carry(q), ShardQuery(q_pos, options), reads, 4)
    header, arrays = roundtrip(buffers)
    assert header["id"] == 7 and header["op"] == "resident"
    got_q, got_query, got_reads, fanin = frames.parse_query(header, arrays)
    assert got_q.dtype == np.dtype(dtype) and got_q.tobytes() == q.tobytes()
    assert got_reads == reads and fanin == 4
    if arange:
        assert got_query.q_pos == q_pos
    else:
        assert got_query.q_pos.dtype == np.int64 and np.array_equal(got_query.q_pos, q_pos)
    o = got_query.options
    assert (o.scale, o.causal, o.window, o.softcap) == (options.scale, options.causal, options.window, options.softcap)
    if options.alibi_slopes is None:
        assert o.alibi_slopes is None
    else:
        assert o.alibi_slopes.dtype == options.alibi_slopes.dtype
        assert o.alibi_slopes.tobytes() == options.alibi_slopes.tobytes()


def test_the_query_frame_carries_every_attention_option():
    # A new option must be added to frames.query_frame and parse_query, or it would be dropped on the way
    # (the fields derived from them, not passed in, are derived again on arrival).
    assert [f.name for f in dataclasses.fields(AttentionOptions) if f.init] == ["scale", "causal", "window",
                                                                                  "softcap", "alibi_slopes"]


def test_with_budget_keeps_every_other_field_of_the_query():
    # ShardQuery.with_budget builds the copy field by field, and the frames carry each field: a new
    # field must be added to both.
    assert [f.name for f in dataclasses.fields(ShardQuery)] == ["q_pos", "options", "budget_s", "trace"]
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    query = ShardQuery(np.array([3]), AttentionOptions(causal=True), 1.0, trace)
    got = query.with_budget(0.5)
    assert (got.q_pos, got.options, got.budget_s, got.trace, query.budget_s) == \
        (query.q_pos, query.options, 0.5, trace, 1.0)


@pytest.mark.parametrize("trace", [None, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"])
def test_the_query_frame_carries_the_requests_traceparent(trace):
    q = np.zeros((1, 2, 4), np.float32)
    query = ShardQuery(np.array([3], np.int64), AttentionOptions(), 2.0, trace)
    header, arrays = roundtrip(frames.query_frame(1, q, query, (), 2))
    assert frames.parse_query(header, arrays)[1].trace == trace


@pytest.mark.parametrize("trace", [7, "x" * 200])
def test_a_query_frame_with_a_trace_that_is_no_traceparent_is_refused(trace):
    q = np.zeros((1, 2, 4), np.float32)
    header, arrays = roundtrip(frames.query_frame(1, q, ShardQuery(np.array([3], np.int64), AttentionOptions()), (), 2))
    with pytest.raises(frames.FrameError, match="trace must be"):
        frames.parse_query({**header, "trace": trace}, arrays)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_state_frame_round_trips_bitwise_with_minus_inf_rows(rng, dtype):
    m = rng.standard_normal((2, 3)).astype(dtype)
    m[0, 1] = -np.inf
    l = np.abs(rng.standard_normal((2, 3))).astype(dtype)
    l[0, 1] = 0
    acc = rng.standard_normal((2, 3, 5)).astype(dtype)
    status = ComputeStatus("w-1", 0.25, 123, batch=3)
    got_status, st = frames.parse_state(*roundtrip(frames.state_frame(9, status, State(m=m, l=l, acc=acc))))
    assert got_status == status
    for a, b in ((st.m, m), (st.l, l), (st.acc, acc)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    st.acc[0, 0, 0] = 1.0  # decoded from a bytearray: writable, as the merge may need


def test_error_frame_names_the_exception_type_and_message():
    header, arrays = roundtrip(frames.error_frame(4, ShardMissing("shard 2 of ctx_x is not here")))
    err = frames.parse_error(header)
    assert header["id"] == 4 and arrays == []
    assert (err.kind, err.message) == ("ShardMissing", "shard 2 of ctx_x is not here")


def frame(header: dict, body: bytes = b"") -> tuple[bytes, bytes]:
    return json.dumps(header).encode(), body


@pytest.mark.parametrize("header, body, message", [
    ({"arrays": [{"dtype": "object", "shape": [1]}]}, b"\0" * 8, "dtype must be one of"),
    ({"arrays": [{"dtype": "float32", "shape": [-1]}]}, b"", "shape must be"),
    ({"arrays": [{"dtype": "float32", "shape": [1, 1, 1, 1, 1]}]}, b"\0" * 4, "at most 4"),
    ({"arrays": [{"dtype": "float32", "shape": [4]}]}, b"\0" * 8, "must hold the arrays"),
    ({"arrays": [{"dtype": "float32", "shape": [1]}]}, b"\0" * 8, "exactly the arrays"),
    ({"arrays": [{"dtype": "float32", "shape": "4"}]}, b"", "shape must be"),
    # 2**78 elements: a product that wraps around in int64 (to 0) must still be refused
    ({"arrays": [{"dtype": "float32", "shape": [2**26, 2**26, 2**26]}]}, b"", "must hold the arrays"),
    ({"arrays": {"dtype": "float32"}}, b"", "arrays is a list"),
])
def test_decode_refuses_arrays_the_body_does_not_hold_exactly(header, body, message):
    with pytest.raises(frames.FrameError, match=message):
        frames.decode(*frame(header, body))


def test_decode_refuses_a_header_that_is_not_a_json_object():
    with pytest.raises(frames.FrameError, match="must be JSON"):
        frames.decode(b"\xff{", b"")
    with pytest.raises(frames.FrameError, match="must be an object"):
        frames.decode(b"[1, 2]", b"")


@pytest.mark.parametrize("header_len, body_len", [(0, 0), (frames.MAX_HEADER_BYTES + 1, 0),
                                                  (10, frames.MAX_BODY_BYTES + 1), (10, 2**63)])
def test_sizes_are_bounded_before_anything_is_read(header_len, body_len):
    with pytest.raises(frames.FrameError):
        frames.sizes(struct.pack("<IQ", header_len, body_len))


def test_a_frame_over_the_bounds_is_refused_when_encoded():
    with pytest.raises(frames.FrameError, match="must fit"):
        frames.encode({"op": "x"}, [np.zeros(frames.MAX_BODY_BYTES // 8 + 1)])
    with pytest.raises(frames.FrameError, match="dtype"):
        frames.encode({"op": "x"}, [np.zeros(3, dtype=np.complex64)])


@pytest.mark.parametrize("broken", [
    lambda h, a: ({k: v for k, v in h.items() if k != "reads"}, a),
    lambda h, a: ({**h, "reads": [["c", 0, 5]]}, a),
    lambda h, a: ({**h, "options": {**h["options"], "window": [1]}}, a),
    lambda h, a: ({**h, "options": {**h["options"], "scale": -1.0}}, a),
    lambda h, a: (h, a[:1]),  # q_pos missing
    lambda h, a: (h, [a[0][0], a[1]]),  # q of 2 dimensions
    lambda h, a: (h, [a[0], a[1][:1]]),  # q_pos shorter than n_q
])
def test_parse_query_refuses_a_malformed_request_naming_what_it_needs(rng, broken):
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    header, arrays = roundtrip(frames.query_frame(1, q, ShardQuery(np.array([3, 4]), AttentionOptions()),
                                                  (ShardRead("c", 0, 5, 1),), 2))
    with pytest.raises(ValueError):
        frames.parse_query(*broken(header, arrays))


@pytest.mark.parametrize("budget", [None, 0.0, 0.1234567890123, 7, 86400.5])
def test_a_query_s_budget_round_trips_in_its_frame_and_in_a_many_frame(rng, budget):
    from workers.tasks import ResidentQuery

    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    query = ShardQuery(np.array([3, 4]), AttentionOptions(), budget_s=budget)
    reads = (ShardRead("c", 0, 5, 1),)
    _, got, _, _ = frames.parse_query(*roundtrip(frames.query_frame(1, q, query, reads, 2)))
    many = frames.parse_many(*roundtrip(frames.many_frame(2, [ResidentQuery(q, query, reads),
                                                             ResidentQuery(q, query.with_budget(None), reads)])))
    assert got.budget_s == budget and many[0].query.budget_s == budget and many[1].query.budget_s is None
    assert budget is None or type(got.budget_s) is float


def test_a_query_frame_without_a_budget_has_no_deadline(rng):
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    header, arrays = roundtrip(frames.query_frame(1, q, ShardQuery(np.array([3]), AttentionOptions(), 1.0),
                                                  (ShardRead("c", 0, 5, 1),), 2))
    del header["budget"]  # a front end of an earlier release
    assert frames.parse_query(header, arrays)[1].budget_s is None


@pytest.mark.parametrize("budget", [-1.0, -1e-9, float("nan"), float("inf"), "1.0", True, [1.0], {"s": 1}])
def test_a_budget_that_is_not_null_or_a_finite_number_of_seconds_is_a_frame_error(rng, budget):
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    header, arrays = roundtrip(frames.query_frame(1, q, ShardQuery(np.array([3]), AttentionOptions()),
                                                  (ShardRead("c", 0, 5, 1),), 2))
    bad = {**header, "budget": budget}
    with pytest.raises(frames.FrameError, match="budget must be null or a finite number of seconds >= 0"):
        frames.parse_query(bad, arrays)
    with pytest.raises(frames.FrameError, match="budget must be"):  # as the JSON a peer sent (NaN included)
        frames.parse_query(frames.decode(json.dumps(bad).encode(), b"".join(a.tobytes() for a in arrays))[0], arrays)
    with pytest.raises(frames.FrameError, match="budget must be"):
        frames.parse_many({"id": 1, "op": "many", "items": [bad]}, arrays)


def test_many_frame_round_trips_items_of_different_shapes_options_and_dtypes(rng):
    from workers.tasks import ResidentQuery

    items = [ResidentQuery(carry(rng.standard_normal((1 + i, 4, 8)).astype(dt)),
                           ShardQuery(Arange(10, 1 + i) if i % 2 else np.arange(1 + i), opts),
                           (ShardRead(f"c{i}", i, 5 + i, i),) * (1 + i % 2))
             for i, (dt, opts) in enumerate(zip([np.float32, BFLOAT16, np.float16, np.float64, np.float32], OPTIONS))]
    header, arrays = roundtrip(frames.many_frame(3, items))
    got = frames.parse_many(header, arrays)
    assert header["op"] == "many" and len(got) == len(items)
    for a, b in zip(got, items):
        want_q = b.q.array() if hasattr(b.q, "array") else b.q
        assert a.q.dtype == want_q.dtype and a.q.tobytes() == want_q.tobytes() and a.reads == b.reads
        assert a.query.options.window == b.query.options.window and a.query.options.causal == b.query.options.causal
        if isinstance(b.query.q_pos, Arange):
            assert a.query.q_pos == b.query.q_pos
        else:
            assert np.array_equal(a.query.q_pos, b.query.q_pos)


def test_many_reply_keeps_each_item_s_states_or_error_in_place(rng):
    def state(n_q: int) -> State:
        return State(m=rng.standard_normal((n_q, 2)), l=np.ones((n_q, 2)), acc=rng.standard_normal((n_q, 2, 3)))

    results = [(ComputeStatus("w", 0.5, 10, 2), [state(1), state(1)]), ShardMissing("shard 3 is gone"),
               (ComputeStatus("w", 0.5, 10, 2), [state(2)])]
    got = frames.parse_many_reply(*roundtrip(frames.many_reply(8, results)))
    assert isinstance(got[1], frames.RemoteError) and got[1].kind == "ShardMissing"
    for i in (0, 2):
        assert got[i][0] == results[i][0]
        assert [s.acc.tobytes() for s in got[i][1]] == [s.acc.tobytes() for s in results[i][1]]


@pytest.mark.parametrize("items", [[], "x", None])
def test_a_many_request_needs_a_non_empty_list_of_items(items):
    with pytest.raises(frames.FrameError, match="non-empty list"):
        frames.parse_many({"id": 1, "op": "many", "items": items}, [])


# -- notes of committed records over the channel --------------------------------------------------------

def test_a_note_and_a_done_reply_carry_their_json():
    record = {"id": "c", "version": 4, "shards": [{"index": 0, "length": 3, "workers": ["w0"]}], "writer": "f-1"}
    header, arrays = roundtrip(frames.note_frame(2, "c", record))
    assert frames.parse_note(header, arrays) == ("c", record)
    with pytest.raises(frames.FrameError, match="a note must carry"):
        frames.parse_note({**header, "record": [1]}, arrays)
    header, _ = roundtrip(frames.done_frame(3, {"length": 4}))
    assert header["id"] == 3 and frames.parse_done(header) == {"length": 4}
    with pytest.raises(frames.FrameError, match="done or error"):
        frames.parse_done({"op": "state"})
