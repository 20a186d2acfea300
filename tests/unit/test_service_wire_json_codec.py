"""JSON bodies and results: strict fields, rectangular tensors, non-finite values, the OpenAPI models."""

from __future__ import annotations

import asyncio
import json

import ml_dtypes
import numpy as np
import pydantic
import pytest
from expect import given_options
from expect import service_error as api_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.core.errors import ServiceError
from service.wire.json_codec import (
    AttentionRequestModel,
    AttentionResult,
    ContextAppendRequestModel,
    ContextCreateRequestModel,
    decode_json_request,
    json_result,
)
from service.wire.json_text import write_json
from service.wire.rules import ATTENTION, CONTEXT_APPEND, CONTEXT_CREATE, Limits


def _dumps_json(doc):
    """The text ``write_json`` answers with, at once."""
    return asyncio.run(write_json(doc))


Q = [[[1, 2.5], [0.5, -1]]]  # [1, 2, 2]
K = [[[1, 0]], [[0, 1]], [[-1, 0.25]]]  # [3, 1, 2]
V = [[[1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]]  # [3, 1, 3]


def encode(out, lse):
    """A result's JSON text, as the routes write it (``json_text``)."""
    return _dumps_json(json_result(out, lse))


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def attention(**fields) -> bytes:
    return body(**{"q": Q, "k": K, "v": V, **fields})


def decode(text: bytes, **kwargs) -> tuple[dict, dict]:
    """The tensors of a body and the options it gave (changed from the defaults)."""
    decoded = decode_json_request(text, **kwargs)
    return dict(decoded.tensors), given_options(decoded.options)


# -- valid bodies ----------------------------------------------------------------------------

def test_an_attention_body_decodes_to_float32_tensors_by_default():
    tensors, options = decode(attention(q_pos=[2], k_pos=[0, 1, 2], alibi_slopes=[0.5, 1],
                                                     scale=0.5, causal=True, window=[1, None], softcap=30))
    assert {n: (a.dtype.name, a.shape) for n, a in tensors.items()} == {
        "q": ("float32", (1, 2, 2)), "k": ("float32", (3, 1, 2)), "v": ("float32", (3, 1, 3)),
        "q_pos": ("int64", (1,)), "k_pos": ("int64", (3,)), "alibi_slopes": ("float64", (2,))}
    assert np.array_equal(tensors["q"], np.array(Q, np.float32))
    assert options == {"scale": 0.5, "causal": True, "window": (1, None), "softcap": 30.0}


@pytest.mark.parametrize("name, dtype", [("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16),
                                         ("float32", np.float32), ("float64", np.float64)])
def test_dtype_is_what_q_k_and_v_are_cast_to(name, dtype):
    q = [[[0.1, 1 / 3]]]
    tensors, _ = decode(attention(q=q, dtype=name))
    assert all(tensors[n].dtype == dtype for n in "qkv")
    assert tensors["q"].tobytes() == np.array(q, np.float64).astype(dtype).tobytes()


def test_null_means_not_given():
    tensors, options = decode(attention(q_pos=None, dtype=None, causal=None, contexts=None))
    assert set(tensors) == {"q", "k", "v"} and tensors["q"].dtype == np.float32 and options == {}


def test_contexts_stand_in_for_inline_keys():
    tensors, options = decode(body(q=Q, contexts=["ctx-1", "ctx_2"]))
    assert set(tensors) == {"q"} and options == {"contexts": ("ctx-1", "ctx_2")}


def test_context_create_and_append_bodies_decode():
    tensors, options = decode(body(k=K, v=V, k_pos=[5, 6, 7], replicas=2, shards=3), kind=CONTEXT_CREATE)
    assert set(tensors) == {"k", "v", "k_pos"} and options == {"replicas": 2, "shards": 3}
    tensors, options = decode(body(k=K, v=V, dtype="float16"), kind=CONTEXT_APPEND)
    assert tensors["k"].dtype == np.float16 and options == {}


def test_an_empty_position_list_is_a_zero_length_tensor():
    tensors, _ = decode(attention(q=[[[1.0]]], k=[[[1.0]]], v=[[[1.0]]], k_pos=[0], q_pos=[0]))
    assert tensors["q_pos"].shape == (1,)
    tensors, _ = decode(body(k=K, v=V, k_pos=[0, 1, 2]), kind=CONTEXT_APPEND)
    assert tensors["k_pos"].dtype == np.int64


# -- field names and types -------------------------------------------------------------------

@pytest.mark.parametrize("kind, fields, code, fragment", [
    (ATTENTION, {"foo": 1}, "invalid_option", 'foo is not a field of attention requests'),
    (ATTENTION, {"Causal": True}, "invalid_option", 'got "Causal"'),
    (ATTENTION, {"replicas": 2}, "invalid_option", "replicas is not a field of attention requests"),
    (CONTEXT_CREATE, {"q": Q}, "invalid_tensor", "q is not a field of context requests"),
    (CONTEXT_CREATE, {"causal": True}, "invalid_option", "causal is not a field of context requests"),
    (CONTEXT_APPEND, {"shards": 2}, "invalid_option", "shards is not a field of append requests"),
])
def test_an_unknown_field_is_422_naming_it(kind, fields, code, fragment):
    with api_error(code, fragment):
        decode_json_request(body(k=K, v=V, **fields), kind=kind)


@pytest.mark.parametrize("fields, fragment", [
    ({"causal": 0}, "causal must be true or false, got 0"),
    ({"causal": "true"}, 'causal must be true or false, got "true"'),
    ({"scale": False}, "scale must be a number, got false"),
    ({"scale": "0.125"}, 'scale must be a number, got "0.125"'),
    ({"softcap": [30]}, "softcap must be a number, got [30]"),
    ({"window": [128.0, None]}, "window must be [left, right], each null or an int in [0, 2**62], got [128.0, null]"),
    ({"window": {"left": 1}}, "window must be [left, right]"),
    ({"contexts": "ctx"}, 'contexts must be a list of 1 to 64 ids, got "ctx"'),
    ({"dtype": "int8"}, 'dtype must be one of float16, bfloat16, float32, float64, got "int8"'),
    ({"dtype": 32}, "dtype must be one of float16, bfloat16, float32, float64, got 32"),
])
def test_options_are_strict_json_types(fields, fragment):
    with api_error("invalid_option", fragment):
        decode_json_request(attention(**fields))


@pytest.mark.parametrize("text, fragment", [
    (b'{"q": [[[1]]], "k": [[[1]]], "v": [[[1]]], "scale": NaN}', "scale must be a finite number"),
    (b'{"q": [[[1]]], "k": [[[1]]], "v": [[[1]]], "softcap": Infinity}', "softcap must be a finite number"),
    (b'{"q": [[[1]]], "k": [[[1]]], "v": [[[1]]], "scale": 1e999}', "scale must be a finite number"),
])
def test_non_finite_option_literals_are_422_naming_the_option(text, fragment):
    with api_error("invalid_option", fragment):
        decode_json_request(text)


# -- tensors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, fragment", [
    ({"q": [[[1, 2]], [[3]]]}, "q must be rectangular: q[1][0] must have length 2 like q[0][0], got length 1"),
    ({"q": [[[1, 2], [3, 4]], [[5, 6]]]}, "q must be rectangular: q[1] must have length 2 like q[0], got length 1"),
    ({"k": [[[1, 0]], [[0, 1]], [[1]]]}, "k[2][0] must have length 2 like k[0][0], got length 1"),
    ({"q": [[[1, True]]]}, "q[0][0][1] must be a number, got true"),
    ({"q": [[[1, "2"]]]}, 'q[0][0][1] must be a number, got "2"'),
    ({"q": [[[1, None]]]}, "q[0][0][1] must be a number, got null"),
    ({"q": [[[1, [2]]]]}, "q[0][0][1] must be a number, got [2]"),
    ({"v": [[[1]], [[2]], [[{"x": 1}]]]}, 'v[2][0][0] must be a number, got {"x": 1}'),
    ({"q": [[1, 2]]}, "q[0][0] must be a list (q is [n_q, h_q, d]), got 1"),
    ({"q": [1, 2]}, "q[0] must be a list (q is [n_q, h_q, d]), got 1"),
    ({"q": [[[1], 2]]}, "q[0][1] must be a list"),
    ({"q": "abc"}, 'q must be a nested list of numbers [n_q, h_q, d], got "abc"'),
    ({"q": 1.5}, "q must be a nested list of numbers [n_q, h_q, d], got 1.5"),
    ({"q": []}, "q must not be empty (q is [n_q, h_q, d]; JSON cannot give the shape of an empty tensor"),
    ({"q": [[]]}, "q[0] must not be empty"),
    ({"q_pos": [1.0]}, "q_pos[0] must be an int, got 1.0"),
    ({"q_pos": [True]}, "q_pos[0] must be an int, got true"),
    ({"k_pos": [0, 1, 2**63]}, f"k_pos[2] must fit in int64, got {2**63}"),
    ({"k_pos": [[0]]}, "k_pos[0] must be an int, got [0]"),
    ({"alibi_slopes": [0.5, "1"]}, 'alibi_slopes[1] must be a number, got "1"'),
    ({"q": [[[1, 70000]]], "dtype": "float16"}, "q[0][0][1] must be a finite float16 number, got 70000"),
    ({"q": [[[1e39]]], "dtype": "bfloat16"}, "q[0][0][0] must be a finite bfloat16 number, got 1e+39"),
    ({"q": [[[1e300]]]}, "q[0][0][0] must be a finite float32 number, got 1e+300"),
    ({"q": [[[10**400]]], "dtype": "float64"}, "q[0][0][0] must be a finite float64 number, got 1000000000"),
])
def test_a_bad_tensor_is_422_naming_the_tensor_and_where(fields, fragment):
    with api_error("invalid_tensor", fragment):
        decode_json_request(attention(**fields))


@pytest.mark.parametrize("literal, shown", [(b"NaN", "NaN"), (b"Infinity", "Infinity"), (b"-Infinity", "-Infinity"),
                                            (b"1e400", "Infinity")])
def test_non_finite_tensor_values_are_422_naming_the_element(literal, shown):
    text = b'{"q": [[[0.5, ' + literal + b']]], "contexts": ["c"]}'
    with api_error("invalid_tensor", f"q[0][0][1] must be a finite float32 number, got {shown}"):
        decode_json_request(text)
    with api_error("invalid_tensor", "alibi_slopes[0] must be a finite float64 number"):
        decode_json_request(b'{"q": [[[1]]], "contexts": ["c"], "alibi_slopes": [' + literal + b"]}")


@pytest.mark.parametrize("fields, fragment", [
    ({}, "q is required in attention requests"),
    ({"q": Q, "k": K}, "v must be given with k, got k alone"),
    ({"q": Q}, "k and v must be given when no contexts are, got neither"),
    ({"q": None, "k": K, "v": V}, "q is required"),
])
def test_a_missing_tensor_is_422_naming_it(fields, fragment):
    with api_error("invalid_tensor", fragment):
        decode_json_request(body(**fields))


def test_tensor_sizes_are_bounded_before_arrays_are_built():
    with api_error("body_too_large", "k must have at most 5 elements, got 6"):
        decode_json_request(attention(), Limits(max_elements=5))
    with api_error("body_too_large", "JSON body must be at most 64 bytes"):
        decode_json_request(attention(), Limits(max_json_body_bytes=64))


# -- unparseable bodies ----------------------------------------------------------------------

@pytest.mark.parametrize("text, fragment", [
    (b"", "JSON body must be valid JSON, got Expecting value at line 1 column 1"),
    (b'{"q": [[[1]]]', "JSON body must be valid JSON"),
    (b"{'q': 1}", "JSON body must be valid JSON"),
    (b'{"q": 1, "q": 2}', 'JSON body must not repeat a key, got "q" twice'),
    (b'{"q": [[[1]]], "k": {"a": 1, "a": 2}}', 'must not repeat a key, got "a" twice'),
    (b"\xef\xbb\xbf{}", "JSON body must be valid JSON"),
    (b'{"q": "\xff"}', "JSON body must be UTF-8, got byte 0xff at 7"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    # Valid JSON, longer than CPython converts: said so, in the service's words, not as invalid JSON.
    (b'{"scale": ' + b"9" * 5000 + b"}", "JSON body must hold integers of at most 4300 digits (no field takes more "
                                          "than 309), got one of 5000 digits"),
    (b'{"q_pos": [-' + b"1" * 4301 + b"]}", "got one of 4301 digits"),
    (b"[]", "JSON body must be an object, got []"),
    (b'"q"', 'JSON body must be an object, got "q"'),
])
def test_an_unparseable_body_is_400(text, fragment):
    with api_error("invalid_body", fragment):
        decode_json_request(text)


# -- fuzzing ---------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers() | st.floats() | st.text(max_size=5)
    | st.sampled_from([10**400, -(10**400), 2**63, 70000, 1e39]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=30,
)
FIELDS = sorted(ATTENTION.tensors | ATTENTION.options | CONTEXT_CREATE.options | {"dtype", "x"})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6), st.sampled_from(
    [ATTENTION, CONTEXT_CREATE, CONTEXT_APPEND]))
def test_random_json_bodies_only_ever_raise_service_errors(fields, kind):
    try:
        decode_json_request(json.dumps(fields).encode(), kind=kind)
    except ServiceError as err:
        assert err.status in (400, 413, 422)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_as_json_only_ever_raise_service_errors(text):
    try:
        decode_json_request(text)
    except ServiceError as err:
        assert err.status in (400, 422)


# -- results ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_results_round_trip_exactly_through_json(dtype, rng):
    out = rng.standard_normal((3, 4, 5)).astype(dtype)
    lse = rng.standard_normal((3, 4)).astype(dtype)
    doc = json.loads(encode(out, lse))
    assert np.array_equal(np.array(doc["out"], dtype), out) and np.array_equal(np.array(doc["lse"], dtype), lse)


def test_a_fully_masked_row_has_lse_null():
    out = np.zeros((2, 1, 2), np.float32)
    lse = np.array([[-np.inf], [0.5]], np.float32)
    assert json.loads(encode(out, lse)) == {"out": [[[0.0, 0.0]], [[0.0, 0.0]]], "lse": [[None], [0.5]]}


def test_other_non_finite_results_are_null_rather_than_invalid_json():
    out = np.array([[[np.nan, np.inf, 1.0]]])
    text = encode(out, np.array([[np.inf]]))
    assert json.loads(text) == {"out": [[[None, None, 1.0]]], "lse": [[None]]}


@pytest.mark.parametrize("out, lse, message", [
    (np.zeros((1, 1, 1), np.float16), np.zeros((1, 1), np.float32), "out must be a float32 or float64"),
    (np.zeros((1, 1, 1), np.float32), np.zeros((1, 1), np.int64), "lse must be a float32 or float64"),
    (np.zeros((1, 2, 1), np.float32), np.zeros((1, 1), np.float32), "out and lse must be"),
])
def test_encode_json_result_rejects_arrays_of_the_wrong_kind(out, lse, message):
    with pytest.raises(ValueError, match=message):
        encode(out, lse)


# -- OpenAPI models --------------------------------------------------------------------------

@pytest.mark.parametrize("model, kind", [(AttentionRequestModel, ATTENTION), (ContextCreateRequestModel, CONTEXT_CREATE),
                                         (ContextAppendRequestModel, CONTEXT_APPEND)])
def test_the_openapi_models_describe_exactly_the_fields_the_decoder_takes(model, kind):
    assert set(model.model_fields) == kind.tensors | kind.options | {"dtype"}
    required = {name for name, f in model.model_fields.items() if f.is_required()}
    assert required == set(kind.required)
    assert model.model_json_schema()["additionalProperties"] is False


@pytest.mark.parametrize("text", [
    attention(), attention(causal=True, window=[4, None], dtype="bfloat16"), body(q=Q, contexts=["a"]),
])
def test_the_models_accept_what_the_decoder_accepts(text):
    decode_json_request(text)
    AttentionRequestModel.model_validate_json(text)


@pytest.mark.parametrize("fields", [{"causal": 0}, {"scale": "0.5"}, {"scale": True}, {"window": "1,"},
                                    {"foo": 1}, {"dtype": "int8"}, {"q_pos": [1.0]}])
def test_the_models_reject_what_the_decoder_rejects(fields):
    text = attention(**fields)
    with pytest.raises(ServiceError):
        decode_json_request(text)
    with pytest.raises(pydantic.ValidationError):
        AttentionRequestModel.model_validate_json(text)


def test_the_result_model_reads_an_encoded_result():
    text = encode(np.ones((1, 1, 2), np.float32), np.array([[-np.inf]], np.float32))
    result = AttentionResult.model_validate_json(text)
    assert result.out == [[[1.0, 1.0]]] and result.lse == [[None]]
