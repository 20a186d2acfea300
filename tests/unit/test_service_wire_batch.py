"""service.wire.batch: batch bodies read into items (each checked, or refused alone) and answers written."""

import asyncio
import json

import numpy as np
import pytest
from expect import service_error

from service.client.batch import decode_batch, encode_batch
from service.client.errors import SplitkeyError
from service.core.errors import InvalidBody
from service.wire.batch import (
    AppendThenQuery,
    ItemError,
    decode_binary_batch,
    decode_json_batch,
    encode_binary_batch,
    json_batch,
)
from service.wire.json_text import write_json
from service.wire.request import AttentionRequest
from service.wire.rules import Limits
from service.wire.safetensors import encode_safetensors, to_bytes


def _dumps_json(doc):
    """The text ``write_json`` answers with, at once."""
    return asyncio.run(write_json(doc))


Q = np.ones((2, 4, 8), np.float32)


def body(items):
    return to_bytes(encode_batch(items))


def test_binary_batch_items_carry_their_own_tensors_and_options():
    k = np.zeros((5, 2, 8), np.float32)
    items = decode_binary_batch(body([
        {"q": Q, "contexts": ["a", "b"], "causal": True, "window": (4, None)},
        {"q": Q[:1], "k": k, "v": k[..., :3], "q_pos": np.array([9]), "scale": 0.5, "softcap": 3.0},
    ]))
    first, second = items
    assert isinstance(first, AttentionRequest) and first.contexts == ("a", "b") and first.kv is None
    assert first.options.causal and first.options.window == (4, None)
    assert second.kv.dims.n_k == 5 and second.kv.dims.d_v == 3 and second.options.scale == 0.5
    assert second.q_pos.tolist() == [9] and second.options.softcap == 3.0 and second.contexts == ()


@pytest.mark.parametrize("item, status, code, word", [
    ({"q": Q}, 422, "invalid_tensor", "k and v"),  # neither keys nor contexts
    ({"q": Q, "contexts": ["a"], "causal": "yes"}, 422, "invalid_option", "causal"),
    ({"q": Q, "contexts": ["a"], "window": (-2, 0)}, 422, "invalid_option", "window"),
    ({"q": np.ones((2, 8), np.float32), "contexts": ["a"]}, 422, "invalid_tensor", "q"),
    ({"q": Q, "contexts": ["bad id!"]}, 422, "invalid_option", "contexts[0]"),
    ({"q": Q * np.nan, "contexts": ["a"]}, 422, "invalid_tensor", "finite"),
])
def test_a_bad_item_is_refused_alone_naming_the_item_and_field(item, status, code, word):
    # The bad item second, encoded by hand: the client's own encoding would refuse or convert it.
    tensors = {"0.q": Q, "1.q": np.asarray(item["q"])}
    opts = [{"contexts": ["a"]}, {n: (list(x) if isinstance(x, tuple) else x) for n, x in item.items() if n != "q"}]
    good, bad = decode_binary_batch(to_bytes(encode_safetensors(tensors, {"items": json.dumps(opts)})))
    assert isinstance(good, AttentionRequest)
    assert isinstance(bad, ItemError) and (bad.status, bad.code) == (status, code), bad
    assert bad.detail.startswith("items[1]: ") and word in bad.detail


@pytest.mark.parametrize("make, code, word", [
    (lambda: to_bytes(encode_safetensors({"0.q": Q})), "invalid_body", "__metadata__"),
    (lambda: to_bytes(encode_safetensors({"0.q": Q}, {"items": "[}"})), "invalid_body", "items"),
    (lambda: to_bytes(encode_safetensors({"0.q": Q}, {"items": "3"})), "invalid_option", "items"),
    (lambda: to_bytes(encode_safetensors({"0.q": Q}, {"items": json.dumps([{}] * 5)})), "invalid_option", "1 to 4"),
    (lambda: to_bytes(encode_safetensors({"0.q": Q, "2.q": Q}, {"items": "[{}, {}]"})), "invalid_tensor", "2.q"),
    (lambda: to_bytes(encode_safetensors({"0.out": Q}, {"items": "[{}]"})), "invalid_tensor", "0.out"),
    (lambda: to_bytes(encode_safetensors({"00.q": Q}, {"items": "[{}]"})), "invalid_tensor", "00.q"),
    (lambda: body([{"q": Q, "contexts": ["a"]}])[:-1], "invalid_body", ""),
    (lambda: to_bytes(encode_safetensors({"0.q": Q}, {"items": "[3]"})), "invalid_body", "items\"][0]"),
])
def test_a_body_that_is_not_a_batch_is_refused_whole(make, code, word):
    with service_error(code, word):
        decode_binary_batch(make(), Limits(max_batch_items=4))


def test_json_batch_items_and_errors():
    items = decode_json_batch(json.dumps({"items": [
        {"q": Q.tolist(), "contexts": ["a"], "dtype": "float16"},
        {"q": Q.tolist(), "k": [[[1.0] * 8] * 2], "v": [[[1.0] * 8] * 2], "wrong": 1},
    ]}).encode())
    assert isinstance(items[0], AttentionRequest) and items[0].q.dtype == np.float16
    assert isinstance(items[1], ItemError) and "wrong" in items[1].detail and items[1].detail.startswith("items[1]")
    for doc, code in (({"items": []}, "invalid_option"), ({"items": {}}, "invalid_option"),
                      ({"items": [], "x": 1}, "invalid_body"), ([], "invalid_body"),
                      ({"items": [{}, [1, 2]]}, "invalid_body")):
        with service_error(code):
            decode_json_batch(json.dumps(doc).encode())


def test_answers_round_trip_through_the_client_and_json():
    out, lse = np.full((1, 4, 3), 0.5, np.float32), np.array([[1.0, -np.inf, 2.0, 3.0]], np.float32)
    answers = [(out, lse), ItemError(404, "context_not_found", "items[1]: gone")]
    got = decode_batch(to_bytes(encode_binary_batch(answers)), 2)
    assert np.array_equal(got[0][0], out) and np.array_equal(got[0][1], lse)
    assert isinstance(got[1], SplitkeyError) and (got[1].status, got[1].code) == (404, "context_not_found")
    doc = json.loads(_dumps_json(json_batch(answers)))
    assert doc["items"][0]["lse"] == [[1.0, None, 2.0, 3.0]]
    assert doc["items"][1] == {"error": {"status": 404, "code": "context_not_found", "detail": "items[1]: gone"}}


def test_an_item_tensor_of_the_wrong_rank_or_kind_is_refused_alone_as_a_single_body_would_be():
    opts = json.dumps([{"contexts": ["a"]}, {"contexts": ["a"]}, {"contexts": ["a"]}])
    tensors = {"0.q": Q, "1.q": Q.astype(np.int32), "2.q": Q, "2.q_pos": np.array([1.0, 2.0])}
    good, wrong_kind, wrong_pos = decode_binary_batch(to_bytes(encode_safetensors(tensors, {"items": opts})))
    assert isinstance(good, AttentionRequest)
    assert wrong_kind.code == "invalid_tensor" and "1.q dtype must be F16" in wrong_kind.detail
    assert wrong_pos.code == "invalid_tensor" and "2.q_pos dtype must be I32 or I64" in wrong_pos.detail


def raw_safetensors(entries, metadata):
    """A body with hand-written header entries ``name: (dtype, shape, nbytes)``, the data zero bytes."""
    header, offset = {"__metadata__": metadata}, 0
    for name, (dtype, shape, nbytes) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + bytes(offset)


@pytest.mark.parametrize("entry, status, word", [
    # a safetensors dtype the service does not take: the tensor's own choices, as a single body's 422 names them
    (("I16", [2], 4), 422, "1.q_pos dtype must be I32 or I64, got \"I16\""),
    (("U8", [2, 4, 8], 64), 422, "1.q dtype must be F16, BF16, F32 or F64, got \"U8\""),
    (("F32", [1, 2, 4, 8], 256), 422, "1.q must be [n_q, h_q, d] (3 dims), got shape [1, 2, 4, 8]"),
])
def test_an_item_tensor_the_service_does_not_take_is_refused_alone(entry, status, word):
    name = "1.q_pos" if entry[0] == "I16" else "1.q"
    entries = {"0.q": ("F32", [2, 4, 8], 256), **({"1.q": ("F32", [2, 4, 8], 256)} if name != "1.q" else {}),
               name: entry, "2.q": ("F32", [2, 4, 8], 256)}
    opts = json.dumps([{"contexts": ["a"]}] * 3)
    first, bad, last = decode_binary_batch(raw_safetensors(entries, {"items": opts}))
    assert isinstance(first, AttentionRequest) and isinstance(last, AttentionRequest)
    assert isinstance(bad, ItemError) and bad.status == status and bad.detail.startswith("items[1]: ")
    assert word in bad.detail, bad.detail


def test_an_item_tensor_over_the_element_limit_is_refused_alone_and_a_broken_frame_is_the_bodys():
    limits = Limits(max_elements=100)
    opts = json.dumps([{"contexts": ["a"]}] * 2)
    small, big = decode_binary_batch(raw_safetensors({"0.q": ("F32", [1, 4, 8], 128), "1.q": ("F32", [1, 4, 32], 512)},
                                                     {"items": opts}), limits)
    assert isinstance(small, AttentionRequest)
    assert isinstance(big, ItemError) and (big.status, big.code) == (413, "body_too_large")
    assert "1.q must have at most 100 elements, got 128" in big.detail
    # The refused tensor's bytes still belong to the body's framing: a gap after it is the whole body's error.
    broken = raw_safetensors({"0.q": ("U8", [4], 4), "1.q": ("F32", [1, 4, 8], 128)}, {"items": opts})
    text_len = int.from_bytes(broken[:8], "little")
    header = json.loads(broken[8:8 + text_len])
    header["0.q"]["data_offsets"] = [0, 2]  # leaves bytes [2, 4) to no tensor
    text = json.dumps(header).encode()
    with pytest.raises(InvalidBody, match="must belong to a tensor"):
        decode_binary_batch(len(text).to_bytes(8, "little") + text + bytes(132))


def test_the_clients_refuse_a_causal_that_is_not_a_bool():
    from service.client.sync import _query

    with pytest.raises(ValueError, match=r"items\[1\] causal must be a bool, got 'false'"):
        encode_batch([{"q": Q, "contexts": ["a"]}, {"q": Q, "contexts": ["a"], "causal": "false"}])
    with pytest.raises(ValueError, match="causal must be a bool, got 0"):
        _query({"causal": 0})
    assert _query({"causal": np.bool_(False)}) == "causal=false"


def test_items_written_as_a_json_array_not_a_string_are_refused_saying_metadata_values_are_strings():
    body = raw_safetensors({"0.q": ("F32", [2, 4, 8], 256)}, {"items": [{"contexts": ["a"]}]})
    with service_error("invalid_body") as err:
        decode_binary_batch(body)
    assert '"items": a string of JSON text' in err.value.detail and "metadata values are strings" in err.value.detail


def test_an_items_append_travels_in_both_forms_with_its_options():
    k = np.zeros((3, 2, 8), np.float32)
    item = {"q": Q[:1], "contexts": ["a"], "append": {"k": k, "v": k[..., :4], "k_pos": np.array([7, 8, 9]),
                                                      "after": 7, "upload": "u-1"}}
    json_item = {"q": Q[:1].tolist(), "contexts": ["a"], "dtype": "float16",
                 "append": {"k": k.tolist(), "v": k[..., :4].tolist(), "after": 7, "upload": "u-1"}}
    [binary] = decode_binary_batch(body([item]))
    [text] = decode_json_batch(json.dumps({"items": [json_item]}).encode())
    for got in (binary, text):
        assert isinstance(got, AppendThenQuery) and got.context_id == "a" and got.req.n_q == 1
        assert got.write.after == 7 and got.write.upload == "u-1" and got.write.kv.dims.n_k == 3
    assert binary.write.kv.k_pos.tolist() == [7, 8, 9] and text.write.kv.k.dtype == np.float16  # the item's dtype


@pytest.mark.parametrize("item, word", [
    ({"q": Q, "contexts": ["a", "b"], "append": {"k": Q, "v": Q}}, "contexts must name the one context"),
    ({"q": Q, "append": {"k": Q, "v": Q}}, "contexts must name the one context"),  # not "k and v must be given"
    ({"q": Q, "contexts": ["a"], "append": {"k": Q}}, "v is required in append requests"),
    ({"q": Q, "contexts": ["a"], "append": {"k": Q, "v": Q, "after": -1}}, "after"),
])
def test_an_append_that_is_not_one_is_refused_alone(item, word):
    first, second = decode_binary_batch(body([item, {"q": Q, "contexts": ["a"]}]))
    assert isinstance(first, ItemError) and first.status == 422 and word in first.detail
    assert first.detail.startswith("items[0]: ") and isinstance(second, AttentionRequest)
    if "contexts must name" in word:  # the same in JSON, with the code API.md section 10 names
        as_json = {n: ({f: x.tolist() for f, x in a.items()} if n == "append" else a.tolist() if n == "q" else a)
                   for n, a in item.items()}
        [refused] = decode_json_batch(json.dumps({"items": [as_json]}).encode())
        assert isinstance(refused, ItemError) and (refused.status, refused.code) == (422, "invalid_option")
        assert word in refused.detail
