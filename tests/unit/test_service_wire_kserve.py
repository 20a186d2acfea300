"""The KServe v2 codec without a server: request headers, binary sections, parameters, responses."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from expect import given_options
from expect import raised as api_error

from service.wire.json_text import write_json
from service.wire.kserve import (
    RequestedOutput,
    decode_infer_request,
    infer_response,
    response_body,
    header_length,
    model_metadata,
)
from service.wire.rules import Limits
from workers.dtypes import BFLOAT16


def _dumps_json(doc):
    """The text ``write_json`` answers with, at once."""
    return asyncio.run(write_json(doc))


Q = np.arange(12, dtype=np.float32).reshape(1, 3, 4) / 8
K = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 16
V = np.arange(12, dtype=np.float32).reshape(2, 3, 2) / 4

#: The protocol's datatype names, written out (the codec's own table is not used to test itself).
WIRE = {np.dtype(np.float16): "FP16", BFLOAT16: "BF16", np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64",
        np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}


def json_input(name, a, datatype=None, data=None):
    a = np.asarray(a)
    return {"name": name, "shape": list(a.shape), "datatype": datatype or WIRE[a.dtype],
            "data": a.reshape(-1).tolist() if data is None else data}


def binary_request(tensors, **fields):
    """A body with every tensor binary, and its header length (as tritonclient builds it)."""
    inputs = [{"name": n, "shape": list(a.shape), "datatype": WIRE[a.dtype],
               "parameters": {"binary_data_size": a.nbytes}} for n, a in tensors.items()]
    header = json.dumps({"inputs": inputs, **fields}).encode()
    return header + b"".join(a.tobytes() for a in tensors.values()), len(header)


def decode_json(inputs, **fields):
    return decode_infer_request(json.dumps({"inputs": inputs, **fields}).encode(), None)


# -- valid requests --------------------------------------------------------------------------

def test_json_inputs_decode_to_their_datatypes_with_defaults():
    req = decode_json([json_input("q", Q), json_input("k", K), json_input("v", V)], id="r1")
    assert req.id == "r1" and given_options(req.decoded.options) == {} and req.timeout_s is None
    np.testing.assert_array_equal(req.decoded.tensors["q"], Q)
    assert req.decoded.tensors["k"].dtype == np.float32 and req.decoded.tensors["v"].shape == (2, 3, 2)
    assert req.outputs == (RequestedOutput("out", False), RequestedOutput("lse", False))


def test_nested_json_data_is_accepted_when_it_has_the_declared_shape():
    req = decode_json([json_input("q", Q, data=Q.tolist()), json_input("k", K), json_input("v", V)])
    np.testing.assert_array_equal(req.decoded.tensors["q"], Q)


def test_json_bfloat16_and_float16_and_int32_positions_are_cast():
    q = Q.astype(BFLOAT16)
    req = decode_json([json_input("q", q.astype(np.float32), datatype="BF16"), json_input("k", K.astype(np.float16)),
                       json_input("v", V), json_input("q_pos", np.array([5], dtype=np.int32))])
    assert req.decoded.tensors["q"].dtype == BFLOAT16 and req.decoded.tensors["k"].dtype == np.float16
    assert req.decoded.tensors["q_pos"].dtype == np.int32 and req.decoded.tensors["q_pos"].tolist() == [5]
    np.testing.assert_array_equal(req.decoded.tensors["q"], q)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64], ids=lambda t: np.dtype(t).name)
def test_binary_inputs_are_zero_copy_views_of_the_body(dtype):
    tensors = {"q": Q.astype(dtype), "k": K.astype(dtype), "v": V.astype(dtype),
               "k_pos": np.array([3, 9], dtype=np.int64)}
    body, n = binary_request(tensors)
    buf = bytearray(body)
    req = decode_infer_request(buf, n)
    for name, a in tensors.items():
        assert req.decoded.tensors[name].dtype == a.dtype
        np.testing.assert_array_equal(req.decoded.tensors[name], a)
    assert not req.decoded.tensors["q"].flags.owndata
    buf[n] ^= 0xFF  # the first byte of q: the view sees it
    assert req.decoded.tensors["q"].tobytes() != tensors["q"].tobytes()


def test_binary_and_json_inputs_mix_in_one_request():
    header = json.dumps({"inputs": [json_input("q", Q), {"name": "k", "shape": [2, 3, 4], "datatype": "FP32",
                                                         "parameters": {"binary_data_size": K.nbytes}},
                                    json_input("v", V)]}).encode()
    req = decode_infer_request(header + K.tobytes(), len(header))
    np.testing.assert_array_equal(req.decoded.tensors["k"], K)


def test_parameters_become_the_attention_options():
    req = decode_json([json_input("q", Q), json_input("k", K), json_input("v", V)],
                      parameters={"scale": 0.5, "causal": True, "softcap": 30, "window": "128,",
                                  "binary_data_output": True, "timeout": 2_500_000, "priority": 1})
    assert given_options(req.decoded.options) == {"scale": 0.5, "causal": True, "softcap": 30.0, "window": (128, None)}
    assert req.timeout_s == 2.5
    assert req.outputs == (RequestedOutput("out", True), RequestedOutput("lse", True))


def test_contexts_parameter_lets_q_come_alone():
    req = decode_json([json_input("q", Q)], parameters={"contexts": "ctx-a,ctx-b"})
    assert req.decoded.options.contexts == ("ctx-a", "ctx-b") and set(req.decoded.tensors) == {"q"}


def test_requested_outputs_keep_their_order_and_binary_flags():
    req = decode_json([json_input("q", Q), json_input("k", K), json_input("v", V)],
                      outputs=[{"name": "lse", "parameters": {"binary_data": True}}, {"name": "out"}],
                      parameters={"binary_data_output": False})
    assert req.outputs == (RequestedOutput("lse", True), RequestedOutput("out", False))


# -- invalid requests ------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("inputs", "code", "fragment"),
    [
        ([json_input("q", Q), json_input("x", K)], "invalid_tensor", "x"),
        ([json_input("q", Q, datatype="INT8")], "invalid_tensor", "q datatype must be FP16, BF16, FP32, FP64"),
        ([json_input("q_pos", np.array([1.0]))], "invalid_tensor", "q_pos datatype must be INT32, INT64"),
        ([{**json_input("q", Q), "shape": [12]}], "invalid_tensor", "q must be [n_q, h_q, d] (3 dims)"),
        ([{**json_input("q", Q), "shape": [1, 3, 5]}], "invalid_tensor", "got 12 values"),
        ([json_input("q", Q, data=[True] * 12)], "invalid_tensor", "q data[0] must be a number, got true"),
        ([json_input("q", Q, data=["1"] * 12)], "invalid_tensor", "q data[0] must be a number"),
        ([json_input("q", Q, data=[[1.0] * 6, [1.0] * 5 + [[1.0]]])], "invalid_tensor", "ragged"),
        ([json_input("q", Q, data=[[1.0] * 4] * 3)], "invalid_tensor", "nested lists of shape [3, 4]"),
        ([json_input("q", Q, data=[1e300] * 12)], "invalid_tensor", "finite FP32"),
        ([json_input("q", Q, data=[70000.0] * 12, datatype="FP16")], "invalid_tensor", "finite FP16"),
        ([json_input("q_pos", np.array([2**40]), datatype="INT32")], "invalid_tensor", "fit in INT32"),
        ([json_input("q_pos", np.array([1]), data=[1.0])], "invalid_tensor", "q_pos data[0] must be an int"),
        ([json_input("q", Q), json_input("q", Q)], "invalid_tensor", "repeat"),
        ([json_input("k", K), json_input("v", V)], "invalid_tensor", "q is required"),
        ([json_input("q", Q), json_input("k", K)], "invalid_tensor", "v must be given with k"),
        ([{**json_input("q", Q), "parameters": {"shared_memory_region": "r"}}], "invalid_option", "shared memory"),
        ([{"name": "q", "shape": [1, 3, 4], "datatype": "FP32"}], "invalid_body", "got neither"),
        ([{"name": "q", "shape": "1,3,4", "datatype": "FP32", "data": []}], "invalid_body", "shape must be a list"),
        ("q", "invalid_body", "inputs must be a list"),
    ],
    ids=["unknown-name", "bad-datatype", "float-positions", "wrong-rank", "count-mismatch", "bools", "strings",
         "ragged", "partly-nested", "overflow-fp32", "overflow-fp16", "int32-range", "float-ints", "repeated",
         "no-q", "k-without-v", "shared-memory", "no-data", "shape-string", "inputs-not-list"],
)
def test_bad_inputs_name_the_field(inputs, code, fragment):
    err = api_error(decode_json, inputs)
    assert err.code == code and fragment in err.detail


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        ({"temperature": 1.0}, "got \"temperature\""),
        ({"causal": "true"}, "causal must be true or false"),
        ({"scale": True}, "scale must be a number"),
        ({"scale": None}, "scale must not be null"),
        ({"window": [128, None]}, "window must be a string LEFT,RIGHT"),
        ({"window": "128"}, "window must be LEFT,RIGHT"),
        ({"contexts": "a,,b"}, "contexts[1]"),
        ({"binary_data_output": 1}, "binary_data_output must be true or false"),
        ({"timeout": -1}, "timeout must be an int from 0 to"),
        ({"sequence_id": 3}, "got \"sequence_id\""),
    ],
    ids=["unknown", "causal-string", "scale-bool", "scale-null", "window-list", "window-one-side", "empty-id",
         "binary-flag", "timeout", "sequence"],
)
def test_bad_parameters_are_invalid_options(parameters, fragment):
    err = api_error(decode_json, [json_input("q", Q), json_input("k", K), json_input("v", V)], parameters=parameters)
    assert err.code == "invalid_option" and fragment in err.detail


@pytest.mark.parametrize(
    ("outputs", "fragment"),
    [([{"name": "attn"}], "outputs[0].name must be among lse, out"),
     ([{"name": "out"}, {"name": "out"}], "repeat"),
     ([{"name": "out", "parameters": {"classification": 3}}], "no classification"),
     ([{"name": "out", "parameters": {"binary_data": "yes"}}], "binary_data must be true or false")],
    ids=["unknown", "repeated", "classification", "binary-flag"],
)
def test_bad_outputs_are_invalid_options(outputs, fragment):
    err = api_error(decode_json, [json_input("q", Q), json_input("k", K), json_input("v", V)], outputs=outputs)
    assert err.code == "invalid_option" and fragment in err.detail


def test_binary_size_must_match_the_shape_before_anything_is_read():
    body, n = binary_request({"q": Q, "k": K, "v": V})
    doc = json.loads(body[:n])
    doc["inputs"][1]["parameters"]["binary_data_size"] = K.nbytes - 4
    header = json.dumps(doc).encode()
    err = api_error(decode_infer_request, header + body[n:], len(header))
    assert err.code == "invalid_body" and "k parameters.binary_data_size must be prod(shape) * itemsize = 96" in err.detail


@pytest.mark.parametrize("cut", [-4, 4], ids=["short", "trailing"])
def test_binary_section_must_hold_exactly_the_declared_bytes(cut):
    body, n = binary_request({"q": Q, "k": K, "v": V})
    body = body[:cut] if cut < 0 else body + b"\0" * cut
    err = api_error(decode_infer_request, body, n)
    assert err.code == "invalid_body" and "sum of binary_data_size" in err.detail


def test_header_length_is_checked_against_the_body():
    assert header_length(None, 10) is None and header_length("10", 10) == 10
    for value in ("11", "-1", "1e3", " 5", "٣"):
        assert api_error(header_length, value, 10).code == "invalid_body"


def test_oversized_tensors_are_refused_from_their_shape_alone():
    header = json.dumps({"inputs": [{"name": "q", "shape": [2**20, 2**10, 2**10], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 2**42}}]}).encode()
    err = api_error(decode_infer_request, header, len(header), Limits(max_elements=2**20))
    assert err.code == "body_too_large" and "at most 1048576 elements" in err.detail


def test_unparseable_header_and_unknown_keys_are_invalid_body():
    assert api_error(decode_infer_request, b"{", None).code == "invalid_body"
    assert api_error(decode_infer_request, b'{"inputs": [], "model": 1}', None).code == "invalid_body"
    assert api_error(decode_infer_request, b'{"inputs": [], "id": 7}', None).code == "invalid_body"
    assert api_error(decode_infer_request, b'[1]', None).code == "invalid_body"


# -- responses -------------------------------------------------------------------------------

def test_json_response_writes_negative_infinity_as_null():
    out = np.ones((2, 1, 3), dtype=np.float32)
    lse = np.array([[-np.inf], [0.5]], dtype=np.float32)
    doc, raw = infer_response("r", {"out": out, "lse": lse},
                              (RequestedOutput("out", False), RequestedOutput("lse", False)))
    body, n = response_body(_dumps_json(doc), raw)
    assert n is None and not raw
    doc = json.loads(body)
    assert doc["model_name"] == "attention" and doc["model_version"] == "1" and doc["id"] == "r"
    assert doc["outputs"][0] == {"name": "out", "datatype": "FP32", "shape": [2, 1, 3], "data": [1.0] * 6}
    assert doc["outputs"][1] == {"name": "lse", "datatype": "FP32", "shape": [2, 1], "data": [None, 0.5]}


def test_binary_response_keeps_negative_infinity_and_orders_data_as_the_outputs():
    out = np.arange(6, dtype=np.float64).reshape(2, 1, 3)
    lse = np.array([[-np.inf], [0.5]])
    doc, raw = infer_response(None, {"out": out, "lse": lse},
                              (RequestedOutput("lse", True), RequestedOutput("out", True)))
    body, n = response_body(_dumps_json(doc), raw)
    doc = json.loads(body[:n])
    assert "id" not in doc
    assert [(o["name"], o["datatype"], o["parameters"]["binary_data_size"]) for o in doc["outputs"]] == \
        [("lse", "FP64", 16), ("out", "FP64", 48)]
    np.testing.assert_array_equal(np.frombuffer(body[n:n + 16], "<f8"), [-np.inf, 0.5])
    np.testing.assert_array_equal(np.frombuffer(body[n + 16:], "<f8"), np.arange(6))


def test_model_metadata_lists_every_tensor_with_variable_dims():
    meta = model_metadata()
    assert meta["name"] == "attention" and meta["versions"] == ["1"] and meta["platform"] == "splitkey"
    assert [(t["name"], t["shape"]) for t in meta["inputs"]][:3] == [("q", [-1] * 3), ("k", [-1] * 3), ("v", [-1] * 3)]
    assert {t["name"]: t["datatype"] for t in meta["inputs"]}["k_pos"] == "INT64"
    assert [t["name"] for t in meta["outputs"]] == ["out", "lse"]


def _grpc_request(**parameters):
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name="attention")
    q = req.inputs.add()
    q.name, q.datatype = "q", "FP32"
    q.shape.extend([1, 1, 2])
    req.raw_input_contents.append(np.ones((1, 1, 2), np.float32).tobytes())
    for name, value in parameters.items():
        req.parameters[name].string_param = value
    return req


def test_grpc_form_carries_output_parameters_for_the_decoder_to_judge():
    from service.wire.kserve import decode_infer_request
    from service.wire.kserve_grpc import infer_body

    req = _grpc_request(contexts="ctx_a")
    out = req.outputs.add()
    out.name = "out"
    out.parameters["classification"].int64_param = 2
    body, header_len = infer_body(req)
    assert json.loads(body[:header_len])["outputs"] == [{"name": "out", "parameters": {"classification": 2}}]
    err = api_error(decode_infer_request, body, header_len)
    assert err.code == "invalid_option" and "no classification or shared memory" in err.detail


def test_grpc_form_with_a_json_part_over_its_limit_is_413_as_over_http():
    from service.wire.kserve_grpc import infer_body

    limits = Limits(max_body_bytes=4096, max_json_body_bytes=1024)
    err = api_error(infer_body, _grpc_request(contexts="c" * 2000), limits)
    assert err.code == "body_too_large" and "the JSON part must be at most 1024 bytes" in err.detail


def test_grpc_raw_contents_that_do_not_fit_the_shape_are_named_as_grpc_fields():
    from service.wire.kserve_grpc import infer_body

    req = _grpc_request()
    req.inputs[0].shape[:] = [1, 1, 3]  # 12 bytes of FP32; 8 sent
    err = api_error(infer_body, req)
    assert err.code == "invalid_body" and "binary_data_size" not in err.detail, err.detail
    assert err.detail == ("raw_input_contents[0] (q) must be prod(shape) * itemsize = 12 bytes for shape [1, 1, 3] FP32, "
                          "got 8 bytes"), err.detail
