"""service.client.options: contexts and window are checked before a client sends anything."""

import asyncio

import numpy as np
import pytest

from service.client.aio import AsyncClient
from service.client.batch import encode_batch
from service.client.options import context_ids, window_bounds, wire_tensors
from service.client.sync import Client

Q = np.zeros((1, 1, 4), np.float32)
#: Nothing listens there: every mistake below is refused before a connection is tried.
NOWHERE = "http://127.0.0.1:9"


def test_context_ids_take_any_sequence_of_strings():
    assert context_ids(["ctx_a", "ctx_b"]) == ["ctx_a", "ctx_b"]
    assert context_ids(("ctx_a",)) == ["ctx_a"] and context_ids([]) == []


@pytest.mark.parametrize(("value", "match"), [
    ("ctx_abc", r"contexts must be a list of context ids, got 'ctx_abc' \(a string: pass \['ctx_abc'\]\)"),
    (b"ctx", "contexts must be a list of context ids, got b'ctx'"),
    ({"ctx_a"}, "contexts must be a list of context ids, got {'ctx_a'}"),
    (["ctx_a", 7], r"contexts\[1\] must be a context id \(a string\), got 7"),
])
def test_a_string_or_other_non_list_of_ids_is_refused_naming_contexts(value, match):
    with pytest.raises(ValueError, match=match):
        context_ids(value)


def test_window_bounds_are_none_or_integers():
    assert window_bounds((3, None)) == (3, None) and window_bounds([None, np.int64(5)]) == (None, 5)


@pytest.mark.parametrize("value", [(10,), (1, 2, 3), "ab", (1.5, None), (True, None), 4])
def test_a_window_that_is_not_two_integer_bounds_is_refused_naming_window(value):
    with pytest.raises(ValueError, match=r"window must be \(left, right\), each None or an int >= 0, got "):
        window_bounds(value)


def test_every_client_refuses_a_string_as_contexts_before_sending():
    with Client(NOWHERE) as c:
        with pytest.raises(ValueError, match="contexts must be a list of context ids, got 'ctx_abc'"):
            c.attention(Q, contexts="ctx_abc")
        with pytest.raises(ValueError, match=r"window must be \(left, right\)"):
            c.attention(Q, contexts=["ctx_abc"], window=(10,))

    async def run() -> None:
        async with AsyncClient(NOWHERE) as c:
            with pytest.raises(ValueError, match="contexts must be a list of context ids, got 'ctx_abc'"):
                await c.attention(Q, contexts="ctx_abc")

    asyncio.run(run())
    with pytest.raises(ValueError, match=r"items\[1\] contexts must be a list of context ids, got 'ctx_abc'"):
        encode_batch([{"q": Q, "contexts": ["ctx_a"]}, {"q": Q, "contexts": "ctx_abc"}])
    with pytest.raises(ValueError, match=r"items\[0\] window must be \(left, right\)"):
        encode_batch([{"q": Q, "window": (1,)}])


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                                   np.dtype(">i8")])
def test_positions_of_any_integer_dtype_go_out_as_a_wire_integer_with_their_values(dtype):
    """API.md section 2: positions are any integer dtype; the wire carries int32 and int64."""
    from service.wire.safetensors import encode_safetensors

    pos = np.array([0, 5, 100], dtype)
    sent = wire_tensors({"q_pos": pos, "k_pos": None, "0.append.k_pos": pos, "q": np.ones((3, 1, 2), np.float16)})
    assert set(sent) == {"q_pos", "0.append.k_pos", "q"} and sent["q"].dtype == np.float16
    for name in ("q_pos", "0.append.k_pos"):
        assert sent[name].dtype.newbyteorder("=") in (np.int32, np.int64) and sent[name].tolist() == [0, 5, 100]
    encode_safetensors(sent)  # the wire takes them (an int16 array was refused there before)


def test_positions_that_are_not_integers_or_pass_int64_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="q_pos must be an array of integers, got dtype float32"):
        wire_tensors({"q_pos": np.array([1.0], np.float32)})
    with pytest.raises(ValueError, match=r"3\.k_pos must hold positions below 2\*\*63"):
        wire_tensors({"3.k_pos": np.array([2**63], np.uint64)})
