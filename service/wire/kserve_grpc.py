"""The Open Inference Protocol over gRPC (KServe v2 ``GRPCInferenceService``): protobuf <-> the HTTP form.

A ``ModelInferRequest`` is translated into exactly the body the HTTP route takes with
the binary tensor extension (a JSON header, then every input's raw bytes), and read by
``service.wire.kserve.decode_infer_request``: one set of rules, limits and error
messages for both transports (docs/KSERVE.md, "gRPC"). Inputs travel in
``raw_input_contents`` (what ``tritonclient.grpc`` sends); typed ``contents`` are
refused (422), outputs always go back raw, in ``raw_output_contents``.

The messages are the ``inference`` package's, as generated for ``tritonclient.grpc``
(``service_pb2``); only their fields are used here, so this module takes any object
with those fields and imports no gRPC code.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from service.core.errors import BodyTooLarge, InvalidBody, InvalidOption, InvalidTensor
from service.wire.kserve import MODEL_NAME, MODEL_VERSION, RequestedOutput
from service.wire.rules import DEFAULT_LIMITS, Limits, show
from service.wire.values import KSERVE, array_bytes, wire_of

#: The typed ``contents`` fields of an input tensor; splitkey takes raw bytes only.
_TYPED_CONTENTS = ("bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents",
                   "fp32_contents", "fp64_contents", "bytes_contents")


def _parameter(where: str, name: str, p: Any) -> Any:
    """One ``InferParameter`` as the JSON value the HTTP form would carry."""
    kind = p.WhichOneof("parameter_choice")
    if kind is None:
        raise InvalidOption(f"{where} parameter {name} must have a value, got none")
    return getattr(p, kind)


def served(model_name: str, model_version: str) -> bool:
    """Whether a request names the model served: ``attention``, version empty (the latest) or ``1``."""
    return model_name == MODEL_NAME and model_version in ("", MODEL_VERSION)


def not_served(model_name: str, model_version: str) -> str:
    """What a request naming another model or version is told (gRPC NOT_FOUND, as HTTP's 404 for its path)."""
    return (f"model_name must be {MODEL_NAME} and model_version empty or {MODEL_VERSION}, got "
            f"{show(model_name)} version {show(model_version)}")


def infer_body(req: Any, limits: Limits = DEFAULT_LIMITS) -> tuple[bytes, int]:
    """``(body, header length)`` of the HTTP binary-extension form of a ``ModelInferRequest`` of the
    model served (the caller checked :func:`served`)."""
    for i, spec in enumerate(req.inputs):  # before the count: typed contents leave raw_input_contents empty
        typed = next((f for f in _TYPED_CONTENTS if len(getattr(spec.contents, f))), None)
        if typed is not None:
            raise InvalidTensor(f"inputs[{i}] ({spec.name}) must travel in raw_input_contents, got {typed}")
    raw = list(req.raw_input_contents)
    if len(raw) != len(req.inputs):
        raise InvalidBody(f"raw_input_contents must hold one entry per input ({len(req.inputs)}), got {len(raw)}")
    inputs = []
    for i, (spec, data) in enumerate(zip(req.inputs, raw)):
        # Checked here, in the words of gRPC's fields: the HTTP decoder would name binary_data_size,
        # which a gRPC client never sets. Other datatypes and shapes are the decoder's to refuse.
        wire = KSERVE.get(spec.datatype)
        if wire is not None and all(n >= 0 for n in spec.shape):
            nbytes = math.prod(spec.shape) * wire.bits.itemsize
            if len(data) != nbytes:
                raise InvalidBody(f"raw_input_contents[{i}] ({spec.name}) must be prod(shape) * itemsize = {nbytes} "
                                  f"bytes for shape {list(spec.shape)} {spec.datatype}, got {len(data)} bytes")
        entry: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape),
                                 "parameters": {"binary_data_size": len(data)}}
        for name, p in spec.parameters.items():
            if name != "binary_data_size":
                entry["parameters"][name] = _parameter(f"inputs[{i}]", name, p)
        inputs.append(entry)
    header: dict[str, Any] = {"inputs": inputs}
    if req.id:
        header["id"] = req.id
    params = {name: _parameter("request", name, p) for name, p in req.parameters.items()}
    params.pop("binary_data_output", None)  # gRPC outputs are always raw
    if params:
        header["parameters"] = params
    if len(req.outputs):
        header["outputs"] = [_output(i, o) for i, o in enumerate(req.outputs)]
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > limits.max_json_body_bytes:  # 413, as the HTTP route's JSON part over its limit
        raise BodyTooLarge(f"the JSON part must be at most {limits.max_json_body_bytes} bytes, got {len(text)} "
                           "(the request's header with its parameters)")
    return text + b"".join(raw), len(text)


def _output(i: int, o: Any) -> dict[str, Any]:
    """A requested output as the HTTP form has it, its parameters included: the decoder refuses the
    ones splitkey does not serve (``classification``, shared memory) as it does over HTTP."""
    entry: dict[str, Any] = {"name": o.name}
    params = {name: _parameter(f"outputs[{i}]", name, p) for name, p in o.parameters.items()}
    params.pop("binary_data", None)  # gRPC outputs are always raw
    if params:
        entry["parameters"] = params
    return entry


def infer_response(response_type: Any, request_id: str | None, results: dict[str, np.ndarray],
                   outputs: tuple[RequestedOutput, ...]) -> Any:
    """A ``ModelInferResponse`` (of ``response_type``) with each requested output's raw bytes."""
    resp = response_type(model_name=MODEL_NAME, model_version=MODEL_VERSION, id=request_id or "")
    for o in outputs:
        a = results[o.name]
        wire = wire_of(o.name, a)
        out = resp.outputs.add()
        out.name, out.datatype = o.name, wire.kserve
        out.shape.extend(a.shape)
        resp.raw_output_contents.append(array_bytes(a, wire).tobytes())
    return resp
