"""The Open Inference Protocol (KServe v2) for the ``attention`` model: pure decode and encode.

See docs/KSERVE.md. A request is a JSON header ``{"id"?, "inputs", "outputs"?,
"parameters"?}``, optionally followed (binary tensor extension) by the raw
little-endian bytes of every input whose ``parameters.binary_data_size`` is set, in
input order; ``Inference-Header-Content-Length`` says where the JSON ends.

Errors follow the rest of the service (``service.core.errors``): a request that breaks
the protocol's structure (not JSON, ``inputs`` not a list, a binary section that
does not add up) is 400 ``invalid_body``; a well-formed one with a wrong tensor
(unknown name, datatype, rank, element count, value) is 422 ``invalid_tensor``; a
wrong option or parameter is 422 ``invalid_option``; sizes over
:class:`service.wire.rules.Limits` are 413 ``body_too_large``. Every size is checked
against the body and the shape before any array is built; binary tensors are
zero-copy views of the body. Error bodies carry the protocol's ``error`` key as
well as the contract's ``detail`` and ``code`` (``service.core.errors.render``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from service.core import VERSION
from service.core.errors import BodyTooLarge, InvalidBody, InvalidOption, InvalidTensor
from service.wire.request import Decoded
from service.wire.rules import (
    ATTENTION,
    DEFAULT_LIMITS,
    TENSOR_RULES,
    Limits,
    RequestOptions,
    check_extent,
    check_options,
    check_present,
    query_value,
    show,
    sorted_names,
)
from service.wire.json_text import JsonArray
from service.wire.values import KSERVE, array_bytes, from_bytes, load_json, numbers_to_array, wire_of

MODEL_NAME = "attention"
MODEL_VERSION = "1"
PLATFORM = "splitkey"
#: The protocol's extensions served, over HTTP and gRPC alike (docs/KSERVE.md).
EXTENSIONS = ("binary_tensor_data",)


def server_metadata() -> dict[str, Any]:
    """The server's metadata (``GET /v2``, gRPC ``ServerMetadata``): name, release and extensions."""
    return {"name": PLATFORM, "version": VERSION, "extensions": list(EXTENSIONS)}

FLOAT_DATATYPES = ("FP16", "BF16", "FP32", "FP64")
INT_DATATYPES = ("INT32", "INT64")

#: The outputs of the model, with their layouts.
OUTPUTS: Mapping[str, str] = {"out": "[n_q, h_q, d_v]", "lse": "[n_q, h_q]"}
#: Request parameters that belong to the protocol rather than to attention.
#: ``binary_data_output`` sets the default output format, ``timeout`` (microseconds)
#: can shorten the deadline, ``priority`` is accepted and ignored.
PROTOCOL_PARAMETERS = frozenset({"binary_data_output", "timeout", "priority"})
#: The largest ``timeout`` taken (a year in microseconds); a deadline only shortens
#: ``--request-timeout`` anyway, and larger ints need not convert to a float.
MAX_TIMEOUT_US = 365 * 24 * 3600 * 10**6
#: Request parameters given as strings in the query-string syntax (``window=LEFT,RIGHT``, ``contexts=ID1,ID2``).
_STRING_OPTIONS = frozenset({"window", "contexts"})
_REQUEST_KEYS = frozenset({"id", "inputs", "outputs", "parameters"})
_INPUT_KEYS = frozenset({"name", "shape", "datatype", "data", "parameters"})
_OUTPUT_KEYS = frozenset({"name", "parameters"})
MAX_ID_CHARS = 256


@dataclass(frozen=True)
class RequestedOutput:
    """One output of the response, and whether its data travels as binary."""

    name: str
    binary: bool


@dataclass(frozen=True, eq=False)
class InferRequest:
    """A decoded request: the attention tensors and options, and what the protocol adds."""

    id: str | None
    decoded: Decoded  #: tensors (numpy, views of the body for binary inputs) and checked options
    outputs: tuple[RequestedOutput, ...]
    timeout_s: float | None  #: the client's ``timeout`` parameter, in seconds (None: not given)


@dataclass(frozen=True)
class _Input:
    name: str
    datatype: str
    shape: tuple[int, ...]
    binary_size: int | None
    data: Any

    @property
    def count(self) -> int:
        return math.prod(self.shape)


# -- the header ------------------------------------------------------------------------------

def header_length(value: str | None, body_len: int) -> int | None:
    """The ``Inference-Header-Content-Length`` as an int (None if absent), within the body."""
    if value is None:
        return None
    if not value.isdigit() or not value.isascii():
        raise InvalidBody(f"Inference-Header-Content-Length must be a non-negative integer, got {show(value)}")
    n = int(value)
    if n > body_len:
        raise InvalidBody(f"Inference-Header-Content-Length must be at most the body length {body_len}, got {n}")
    return n


def _only_parameter(where: str, params: Any, key: str, why: str) -> Any:
    """The value of ``key``, the one parameter a tensor entry may carry (None when absent)."""
    if type(params) is not dict:
        raise InvalidBody(f"{where} parameters must be an object, got {show(params)}")
    for other in params:
        if other != key:
            raise InvalidOption(f"{where} parameters must be among {key} ({why}), got {show(other)}")
    return params.get(key)


def _check_input(i: int, entry: Any, limits: Limits) -> _Input:
    where = f"inputs[{i}]"
    if type(entry) is not dict:
        raise InvalidBody(f"{where} must be an object with name, shape, datatype, got {show(entry)}")
    for key in entry:
        if key not in _INPUT_KEYS:
            raise InvalidBody(f"{where} keys must be among {sorted_names(_INPUT_KEYS)}, got {show(key)}")
    name, shape, datatype = entry.get("name"), entry.get("shape"), entry.get("datatype")
    if type(name) is not str:
        raise InvalidBody(f"{where}.name must be a string, got {show(name)}")
    if name not in TENSOR_RULES:
        raise InvalidTensor(f"{where}.name must be among {sorted_names(TENSOR_RULES)}, got {show(name)}")
    if type(shape) is not list or any(type(s) is not int or s < 0 for s in shape):
        raise InvalidBody(f"{name} shape must be a list of ints >= 0, got {show(shape)}")
    if type(datatype) is not str:
        raise InvalidBody(f"{name} datatype must be a string, got {show(datatype)}")
    rule = TENSOR_RULES[name]
    wanted = INT_DATATYPES if rule.kind == "int" else FLOAT_DATATYPES
    if datatype not in wanted:
        raise InvalidTensor(f"{name} datatype must be {', '.join(wanted)}, got {show(datatype)}")
    if len(shape) != rule.rank:
        raise InvalidTensor(f"{name} must be {rule.layout} ({rule.rank} dims), got shape {show(shape)}")
    count = check_extent(name, shape, limits)
    size = _only_parameter(name, entry.get("parameters", {}), "binary_data_size", "shared memory is not supported")
    if size is not None and (type(size) is not int or size < 0):
        raise InvalidBody(f"{name} parameters.binary_data_size must be an int >= 0, got {show(size)}")
    has_data = "data" in entry
    if has_data == (size is not None):
        raise InvalidBody(f"{name} must have exactly one of data and parameters.binary_data_size, got "
                   + ("both" if has_data else "neither"))
    if size is not None:
        nbytes = count * KSERVE[datatype].bits.itemsize
        if size != nbytes:
            raise InvalidBody(f"{name} parameters.binary_data_size must be prod(shape) * itemsize = {nbytes} bytes for "
                       f"shape {shape} {datatype}, got {size}")
    return _Input(name, datatype, tuple(shape), size, entry.get("data"))


def _outputs(value: Any, default_binary: bool) -> tuple[RequestedOutput, ...]:
    if value is None or value == []:
        return tuple(RequestedOutput(name, default_binary) for name in OUTPUTS)
    if type(value) is not list:
        raise InvalidBody(f"outputs must be a list of objects, got {show(value)}")
    seen: list[RequestedOutput] = []
    for i, entry in enumerate(value):
        if type(entry) is not dict or "name" not in entry or any(k not in _OUTPUT_KEYS for k in entry):
            raise InvalidBody(f"outputs[{i}] must be an object with name and optional parameters, got {show(entry)}")
        name = entry["name"]
        if type(name) is not str or name not in OUTPUTS:
            raise InvalidOption(f"outputs[{i}].name must be among {sorted_names(OUTPUTS)}, got {show(name)}")
        if any(o.name == name for o in seen):
            raise InvalidOption(f"outputs must not repeat a name, got {show(name)} twice")
        binary = _only_parameter(f"{name} output", entry.get("parameters", {}), "binary_data",
                                 "no classification or shared memory")
        if binary is None:
            binary = default_binary
        if type(binary) is not bool:
            raise InvalidOption(f"{name} parameters.binary_data must be true or false, got {show(binary)}")
        seen.append(RequestedOutput(name, binary))
    return tuple(seen)


def _parameters(value: Any, limits: Limits, alibi_slopes: Any) -> tuple[RequestOptions, bool, float | None]:
    """``(options, binary_data_output, timeout_s)`` of the request ``parameters``."""
    if value is None:
        value = {}
    if type(value) is not dict:
        raise InvalidBody(f"parameters must be an object, got {show(value)}")
    allowed = ATTENTION.options | PROTOCOL_PARAMETERS
    raw: dict[str, Any] = {}
    for name, v in value.items():
        if name not in allowed:
            raise InvalidOption(f"parameters must be among {sorted_names(allowed)}, got {show(name)}")
        if name in ATTENTION.options and v is None:
            raise InvalidOption(f"parameters.{name} must not be null (leave it out for the default)")
        if name in _STRING_OPTIONS:
            if type(v) is not str:
                syntax = "LEFT,RIGHT" if name == "window" else "ID1,ID2"
                raise InvalidOption(f"{name} must be a string {syntax}, got {show(v)}")
            raw[name] = query_value(name, v)
        elif name in ATTENTION.options:
            raw[name] = v
    binary = value.get("binary_data_output", False)
    if type(binary) is not bool:
        raise InvalidOption(f"binary_data_output must be true or false, got {show(binary)}")
    timeout = value.get("timeout")
    if timeout is not None and (type(timeout) is not int or not 0 <= timeout <= MAX_TIMEOUT_US):
        raise InvalidOption(f"timeout must be an int from 0 to {MAX_TIMEOUT_US} (microseconds), got {show(timeout)}")
    priority = value.get("priority")
    if priority is not None and (type(priority) is not int or priority < 0):
        raise InvalidOption(f"priority must be an int >= 0, got {show(priority)}")
    timeout_s = timeout / 1e6 if timeout else None
    return check_options(raw, ATTENTION, limits, alibi_slopes), binary, timeout_s


# -- tensors ---------------------------------------------------------------------------------

def _flatten(name: str, data: Any, shape: tuple[int, ...]) -> list[Any]:
    """The leaves of ``data``: a flat row-major list, or nested lists of exactly ``shape``."""
    wanted = f"a flat list of prod(shape) = {math.prod(shape)} values or nested lists of shape {list(shape)}"
    if type(data) is not list:
        raise InvalidTensor(f"{name} data must be {wanted}, got {show(data)}")
    level, nested = [data], []
    while level and type(level[0]) is list:
        kinds = set(map(type, level))
        lengths = set(map(len, level))
        if kinds != {list} or len(lengths) != 1:
            raise InvalidTensor(f"{name} data must be {wanted}, got ragged or mixed nested lists")
        nested.append(lengths.pop())
        level = list(chain.from_iterable(level))
        if not nested[-1]:
            break
    if list in set(map(type, level)):
        raise InvalidTensor(f"{name} data must be {wanted}, got ragged or mixed nested lists")
    if len(nested) > 1 and tuple(nested) != shape and not (nested[-1] == 0 and tuple(nested) == shape[:len(nested)]):
        raise InvalidTensor(f"{name} data must be {wanted}, got nested lists of shape {nested}")
    if len(level) != math.prod(shape):
        raise InvalidTensor(f"{name} data must be {wanted}, got {len(level)} values")
    return level


def _from_json(spec: _Input) -> np.ndarray:
    leaves = _flatten(spec.name, spec.data, spec.shape)
    wire = KSERVE[spec.datatype]
    return numbers_to_array(leaves, spec.shape, wire.value, integer=wire.integer,
                            where=lambda i: f"{spec.name} data[{i}]", label=spec.datatype)


def decode_infer_request(body: bytes | bytearray | memoryview, header_len: int | None,
                         limits: Limits = DEFAULT_LIMITS) -> InferRequest:
    """Decode an infer request: the whole ``body`` is JSON when ``header_len`` is None."""
    mv = memoryview(body).cast("B")
    if len(mv) > limits.max_body_bytes:
        raise BodyTooLarge(f"body must be at most {limits.max_body_bytes} bytes, got {len(mv)}")
    n = len(mv) if header_len is None else header_len
    if n > len(mv):
        raise InvalidBody(f"Inference-Header-Content-Length must be at most the body length {len(mv)}, got {n}")
    if n > limits.max_json_body_bytes:
        raise BodyTooLarge(f"the JSON part must be at most {limits.max_json_body_bytes} bytes, "
                       f"got {n}; send large tensors as binary data")
    obj = load_json(mv[:n], "inference request header")
    if type(obj) is not dict:
        raise InvalidBody(f"inference request header must be a JSON object, got {show(obj)}")
    for key in obj:
        if key not in _REQUEST_KEYS:
            raise InvalidBody(f"inference request keys must be among {sorted_names(_REQUEST_KEYS)}, got {show(key)}")
    request_id = obj.get("id")
    if request_id is not None and (type(request_id) is not str or len(request_id) > MAX_ID_CHARS):
        raise InvalidBody(f"id must be a string of at most {MAX_ID_CHARS} characters, got {show(request_id)}")
    inputs = obj.get("inputs")
    if type(inputs) is not list:
        raise InvalidBody(f"inputs must be a list of tensors, got {show(inputs)}")
    specs = [_check_input(i, entry, limits) for i, entry in enumerate(inputs)]
    names = [s.name for s in specs]
    for name in names:
        if names.count(name) > 1:
            raise InvalidTensor(f"inputs must not repeat a name, got {name} twice")
    binary_total = sum(s.binary_size for s in specs if s.binary_size is not None)
    if binary_total != len(mv) - n:
        raise InvalidBody(f"binary data after the {n}-byte header must be the sum of binary_data_size = {binary_total} "
                   f"bytes, got {len(mv) - n}")
    tensors: dict[str, np.ndarray] = {}
    offset = n
    for spec in specs:
        if spec.binary_size is None:
            tensors[spec.name] = _from_json(spec)
        else:
            tensors[spec.name] = from_bytes(mv, KSERVE[spec.datatype], spec.shape, offset)
            offset += spec.binary_size
    options, binary_output, timeout_s = _parameters(obj.get("parameters"), limits, tensors.get("alibi_slopes"))
    outputs = _outputs(obj.get("outputs"), binary_output)
    check_present(tensors, options.contexts, ATTENTION)
    return InferRequest(request_id, Decoded(tensors, options), outputs, timeout_s)


# -- the response ----------------------------------------------------------------------------

def infer_response(request_id: str | None, results: Mapping[str, np.ndarray],
                   outputs: tuple[RequestedOutput, ...]) -> tuple[dict[str, Any], list[memoryview]]:
    """A response's JSON document (``json_text.write_json`` writes it) and its binary outputs in order:
    the body is the document's text, then those bytes (:func:`response_body`)."""
    doc: dict[str, Any] = {"model_name": MODEL_NAME, "model_version": MODEL_VERSION}
    if request_id is not None:
        doc["id"] = request_id
    entries, raw = [], []
    for o in outputs:
        a = results[o.name]
        if a.dtype.kind != "f" or a.dtype.itemsize < 4:
            raise ValueError(f"outputs must be float32 or float64, got {a.dtype}")
        wire = wire_of(o.name, a)
        entry: dict[str, Any] = {"name": o.name, "datatype": wire.kserve, "shape": list(a.shape)}
        if o.binary:
            data = array_bytes(a, wire)
            entry["parameters"] = {"binary_data_size": int(data.nbytes)}
            raw.append(data.data)
        else:
            entry["data"] = JsonArray(o.name, a, flat=True)
        entries.append(entry)
    doc["outputs"] = entries
    return doc, raw


def response_body(header: bytes, raw: Sequence[memoryview]) -> tuple[bytes, int | None]:
    """The body of a response whose document was written as ``header``, and the header's length for
    ``Inference-Header-Content-Length`` (None when no output is binary: the whole body is JSON)."""
    return header + b"".join(raw), (len(header) if raw else None)


# -- metadata --------------------------------------------------------------------------------

def model_metadata() -> dict[str, Any]:
    """The model metadata response: every dim is variable (-1); inputs but q are optional."""
    def tensor(name: str, datatype: str, rank: int) -> dict[str, Any]:
        return {"name": name, "datatype": datatype, "shape": [-1] * rank}

    inputs = [tensor(name, "INT64" if rule.kind == "int" else "FP32", rule.rank)
              for name, rule in TENSOR_RULES.items()]
    outputs = [tensor("out", "FP32", 3), tensor("lse", "FP32", 2)]
    return {"name": MODEL_NAME, "versions": [MODEL_VERSION], "platform": PLATFORM, "inputs": inputs,
            "outputs": outputs}
