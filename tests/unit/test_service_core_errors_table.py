"""The one error table (service.core.errors): every error a client can see, the service's and the
library's typed ones, has one row of code, HTTP status and gRPC status; a library check's error
reaches the client through the real request builder as that row says. No server, no Ray, no mocks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.core import errors, request_id
from service.core.errors import ERRORS, LIBRARY, ServiceError, client_input, library_error, render
from service.wire.json_codec import decode_json_request
from service.wire.request import Decoded, attention_request, context_write
from service.wire.rules import ATTENTION, CONTEXT_CREATE, check_options
from workers import errors as library_errors
from workers.errors import InvalidAttentionOption, InvalidInput
from workers.options import AttentionOptions
from workers.problem import check_alibi, check_heads, check_kv, check_positions, check_q

#: The gRPC status each HTTP status got before the table named them (service/grpc_server.py's
#: STATUS, 2026-12-06), written out: the table must keep every one. A status it lacked was UNKNOWN.
GRPC_BEFORE = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED",
    409: "FAILED_PRECONDITION", 413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT", 422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
    507: "RESOURCE_EXHAUSTED",
}


def subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | subclasses(sub)
    return found


def library_classes() -> set[type]:
    return {c for c in vars(library_errors).values()
            if isinstance(c, type) and issubclass(c, Exception) and c.__module__ == library_errors.__name__}


# -- one row each -----------------------------------------------------------------------------

def test_every_service_error_has_exactly_one_row_and_every_code_one_class():
    assert subclasses(ServiceError) == set(ERRORS)
    codes = [kind.code for kind in ERRORS.values()]
    assert len(codes) == len(set(codes))


def test_every_typed_library_error_has_one_row_answered_by_a_row_of_the_table():
    assert library_classes() == set(LIBRARY) == {InvalidInput, InvalidAttentionOption}
    for answer in LIBRARY.values():
        assert answer in ERRORS
    assert (ERRORS[LIBRARY[InvalidInput]].code, ERRORS[LIBRARY[InvalidInput]].status) == ("invalid_tensor", 422)
    assert (ERRORS[LIBRARY[InvalidAttentionOption]].code,
            ERRORS[LIBRARY[InvalidAttentionOption]].status) == ("invalid_option", 422)


def test_the_library_errors_are_value_errors_so_its_api_is_unchanged():
    for cls in library_classes():
        assert issubclass(cls, ValueError), cls


@pytest.mark.parametrize("cls", list(ERRORS), ids=lambda c: c.__name__)
def test_each_row_keeps_the_grpc_status_its_http_status_had(cls):
    kind = ERRORS[cls]
    assert kind.grpc == GRPC_BEFORE.get(kind.status, "UNKNOWN"), (kind.code, kind.status)


def test_each_rows_grpc_name_is_a_grpc_status_code():
    grpc = pytest.importorskip("grpc")
    members = set(grpc.StatusCode.__members__)
    for cls, kind in ERRORS.items():
        assert kind.grpc in members, (cls.__name__, kind.grpc)
        assert grpc.StatusCode[kind.grpc].name == kind.grpc


def test_an_error_reads_its_row():
    err = errors.ContextLost("a shard of ctx-a must have a live replica, got none")
    assert err.kind is ERRORS[errors.ContextLost]
    assert (err.code, err.status, err.kind.grpc) == ("context_lost", 503, "UNAVAILABLE")


# -- the one mapping --------------------------------------------------------------------------

def test_a_library_error_becomes_its_rows_error_with_the_librarys_message():
    err = library_error(InvalidInput("q must be [n_q, h_q, d], got shape (2,)"))
    assert type(err) is errors.InvalidTensor and err.detail == "q must be [n_q, h_q, d], got shape (2,)"
    err = library_error(InvalidAttentionOption("scale must be a finite number > 0, got -1"))
    assert type(err) is errors.InvalidOption and err.detail == "scale must be a finite number > 0, got -1"


def test_another_value_error_is_no_clients_mistake_and_passes_through():
    assert library_error(ValueError("index step must be 1, got 2")) is None
    with pytest.raises(ValueError, match="index step") as info, client_input():
        raise ValueError("index step must be 1, got 2")
    assert type(info.value) is ValueError  # not turned into a 422: a fault of the service stays a 500
    err = errors.ContextNotFound("id must name an existing context, got 'x'")
    with pytest.raises(errors.ContextNotFound) as found, client_input():
        raise err
    assert found.value is err


def test_client_input_raises_the_service_error_alone():
    with pytest.raises(errors.InvalidTensor) as info, client_input():
        check_q(np.zeros((2, 3), np.float32))
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no library traceback behind it


# -- through the real request builder ---------------------------------------------------------

def tensors(n_q=2, h_q=4, h_kv=2, d=8, d_v=3, n_k=5, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"q": rng.standard_normal((n_q, h_q, d)).astype(dtype),
            "k": rng.standard_normal((n_k, h_kv, d)).astype(dtype),
            "v": rng.standard_normal((n_k, h_kv, d_v)).astype(dtype)}


def answer(err: ServiceError, path: str = "/v1/attention") -> tuple[int, dict]:
    status, body, _ = render(err, path)
    return status, json.loads(body)


def library_message(check, *args) -> str:
    """What the library check says, as the library's callers see it (a ValueError)."""
    with pytest.raises(ValueError) as info:
        check(*args)
    assert type(info.value) is InvalidInput
    return str(info.value)


def bad(name: str) -> tuple[dict[str, np.ndarray], dict, str]:
    """A request whose tensor ``name`` one library check refuses: its tensors, alibi slopes and that
    check's own message."""
    t = tensors()
    if name == "q":
        t["q"] = t["q"][:, :, 0]
        return t, {}, library_message(check_q, t["q"])
    if name == "q dtype":
        t["q"] = t["q"].astype(np.int32)
        return t, {}, library_message(check_q, t["q"])
    if name == "v":
        t["v"] = t["v"][:4]
        return t, {}, library_message(check_kv, t["k"], t["v"])
    if name == "heads":
        t["q"] = np.zeros((2, 3, 8), np.float32)
        return t, {}, library_message(check_heads, 3, 8, check_kv(t["k"], t["v"]))
    if name == "alibi_slopes":
        slopes = np.ones(3)
        return t, {"alibi_slopes": slopes}, library_message(check_alibi, slopes, 4)
    if name == "q_pos":
        t["q_pos"] = np.arange(3, dtype=np.int64)
        return t, {}, library_message(check_positions, "q_pos", t["q_pos"], 2)
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["q", "q dtype", "v", "heads", "alibi_slopes", "q_pos"])
def test_a_library_checks_error_is_a_422_invalid_tensor_naming_the_field(name):
    t, extra, message = bad(name)
    if "alibi_slopes" in extra:
        t["alibi_slopes"] = extra["alibi_slopes"]
    decoded = Decoded(t, check_options({}, ATTENTION, alibi_slopes=t.get("alibi_slopes")))
    rid = request_id.current()  # not assigned here: the id is a context variable other tests read
    with pytest.raises(ServiceError) as info:
        attention_request(decoded)
    field = name.split()[0] if name != "heads" else "h_q"
    assert message.startswith(field), (field, message)
    assert answer(info.value) == (422, {"detail": message, "code": "invalid_tensor", "request_id": rid})
    # the KServe routes say the same, with the protocol's "error"
    assert answer(info.value, "/v2/models/attention/infer") == (
        422, {"error": message, "detail": message, "code": "invalid_tensor", "request_id": rid})
    assert info.value.kind.grpc == "INVALID_ARGUMENT"


def test_a_json_body_the_library_refuses_is_answered_from_the_table():
    body = json.dumps({"q": [[[1.0, 2.0]]], "k": [[[1.0, 0.0, 3.0]]], "v": [[[1.0]]]}).encode()
    with pytest.raises(errors.InvalidTensor) as info:
        attention_request(decode_json_request(body))
    assert info.value.detail == "k must have head dim d = 2 as q, got 3"
    status, doc = answer(info.value)
    assert (status, doc["code"], doc["detail"]) == (422, "invalid_tensor", "k must have head dim d = 2 as q, got 3")


def test_a_context_writes_keys_are_checked_through_the_table():
    t = tensors()
    t["k_pos"] = np.array([0, 1, 2], np.int64)
    with pytest.raises(errors.InvalidTensor) as info:
        context_write(Decoded({"k": t["k"], "v": t["v"], "k_pos": t["k_pos"]}, check_options({}, CONTEXT_CREATE)))
    assert info.value.detail == "k_pos must have shape [5], got (3,)"


def test_an_attention_option_the_library_refuses_is_a_422_invalid_option():
    with pytest.raises(ServiceError) as info:
        check_options({"scale": -1}, ATTENTION)
    assert answer(info.value)[1]["code"] == "invalid_option"
    assert info.value.detail == "scale must be a finite number > 0, got -1"
    with pytest.raises(InvalidAttentionOption, match="scale must be a finite number > 0, got -1"):
        AttentionOptions(scale=-1)
