"""service.client.options: contexts and window are checked before a client sends anything."""

import asyncio

import numpy as np
import pytest

from service.client.aio import AsyncClient
from service.client.batch import encode_batch
from service.client.options import context_ids, window_bounds
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
