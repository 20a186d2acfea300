"""The error model: one exception per kind, one table of codes and statuses, one body format."""

from __future__ import annotations

import json

import pytest
from expect import CONTRACT_STATUS

from service.core import errors, request_id
from service.core.errors import (
    ERRORS,
    MethodNotAllowed,
    Overloaded,
    ServiceError,
    TooManyConnections,
    Unauthorized,
    error_body,
    error_responses,
    render,
)


@pytest.mark.parametrize("cls", list(ERRORS), ids=lambda c: c.__name__)
def test_each_error_carries_the_contract_code_and_status(cls):
    made = {Unauthorized: lambda: cls(), Overloaded: lambda: cls("busy", 1), TooManyConnections: lambda: cls("full", 1),
            MethodNotAllowed: lambda: cls("method must be POST, got PUT", "POST")}
    err = made.get(cls, lambda: cls("x must be y, got z"))()
    assert err.status == CONTRACT_STATUS[err.code]


def test_method_not_allowed_names_the_methods_the_route_takes():
    assert MethodNotAllowed("method must be one of GET, DELETE, got PUT", "GET, DELETE").headers == {
        "Allow": "GET, DELETE"}


def test_the_table_covers_every_code_of_the_contract_and_every_error_class():
    assert sorted(kind.code for kind in ERRORS.values()) == sorted(CONTRACT_STATUS)
    classes = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, ServiceError)}
    assert classes - {ServiceError} == set(ERRORS)


def test_error_body_is_json_with_detail_and_code():
    err = errors.InvalidOption('scale must be a number, got "0.1" ü')
    assert json.loads(error_body(err)) == {"detail": 'scale must be a number, got "0.1" ü', "code": "invalid_option"}
    assert str(err) == err.detail and err.headers == {}


def test_kserve_routes_get_the_protocol_error_key_too():
    err = errors.InvalidTensor("q must be 3-d, got 2")
    status, body, headers = render(err, "/v2/models/attention/infer")
    assert status == 422 and headers == {}
    assert json.loads(body) == {"error": err.detail, "detail": err.detail, "code": "invalid_tensor", "request_id": "-"}
    assert json.loads(render(err, "/v1/attention")[1]) == {"detail": err.detail, "code": "invalid_tensor",
                                                           "request_id": "-"}


def test_render_names_the_current_request_id():
    rid = request_id.assign([(b"x-request-id", b"abc-123")])
    assert json.loads(render(errors.ContextNotFound("id must name an existing context, got 'x'"), "/v1/x")[1])[
        "request_id"] == rid == "abc-123"


@pytest.mark.parametrize("value", [b"", b"a" * 65, b"evil\r\nx: y", b"caf\xc3\xa9", b"a b"])
def test_an_unsafe_client_request_id_is_replaced_by_a_fresh_one(value):
    rid = request_id.assign([(b"x-request-id", value)])
    assert rid != value.decode(errors="replace") and len(rid) == 16 and int(rid, 16) >= 0


RAY_TRACEBACK = (
    "ray::ShardWorker.create_shard() (pid=48213, ip=192.0.2.2, actor_id=6f1c0b3a9e2d4f5a8b7c6d5e01000000, "
    "repr=<workers.actor.ShardWorker object at 0x7f3a>)\n"
    "  File \"/work/main/.venv/lib/python3.11/site-packages/ray/_private/worker.py\", line 912, in main_loop\n"
    "\x1b[36mCapacityError\x1b[0m: shard needs 1048576 bytes")


@pytest.mark.parametrize("detail, kind", [
    (RAY_TRACEBACK, "a traceback"),
    ("Traceback (most recent call last):\n  boom", "a traceback"),
    ("worker died \x1b[31mred\x1b[0m", "a terminal escape"),
    ("could not open /tmp/ray/session_latest/logs", "a file path"),
    ("see /home/user/splitkey/workers/actor.py", "a file path"),
    ("node 10.1.2.3:6379 is gone", "an address"),
    ("worker (pid=4242) died", "a process id"),
    ("actor 6f1c0b3a9e2d4f5a8b7c6d5e01000000 died", "a Ray id"),
    ("actor '6f1c0b3a9e2d4f5a8b7c6d5e01000000' died, got 'x'", "a Ray id"),
    ('{"detail":"actor 6f1c0b3a9e2d4f5a8b7c6d5e01000000 died, got \\"x\\""}', "a Ray id"),
    ("The ActorID is unknown", "a Ray id"),
    ("worker splitkey-worker-1 died: ActorDiedError", "a Ray exception"),
    ("the merge tree lost a node: ObjectLostError", "a Ray exception"),
    ("the cluster must answer, got RaySystemError", "a Ray exception"),
    ("worker splitkey-worker-0's write channel closed: OSError", "a connection error"),
    ("worker w's channel closed: EOFError", "a connection error"),
])
def test_internals_are_found_in_a_detail(detail, kind):
    assert errors.internals(detail) == kind


@pytest.mark.parametrize("detail", [
    "q must be 3-d [n_q, h_q, d], got shape [2, 3]",
    "scale must be a finite number, got 1e400",
    "id must name an existing context, got 'ctx_Zm9vYmFyYmF6cXV4cXV1eA'",
    "window must be [left, right] with each >= 0 or null, got [-1, 0.5]",
    "request body must be at most 67108864 bytes, got Content-Length 67108865",
    "POST /v1/contexts/{id}/append must name the context length as after, got 12",
    # The client's own hex-like values, echoed: not Ray ids.
    "contexts must name existing contexts, got unknown id 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'",
    'scale must be a number, got "111111111111111111111111111111111111111111"',
    'contexts[0] must be an id of 1 to 128 characters, got "cccccccccccccccccccccccccccccccccccccccccccccccccccccc...',
    'window must be [left, right], got "12345678901234567890123456789012345678901234567890,"',
    # ... and unquoted: a number a check computed from the client's, a name the client sent.
    "k has shape [4294967296, 4294967296, 4294967296]: 79228162514264337593543950336 elements, over 2**28",
    "data_offsets must be ints, got 1000000000000000000000000000000 for k",
    "unknown field aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa in the request",
])
def test_a_detail_in_the_services_words_is_kept(detail):
    assert errors.internals(detail) is None
    assert json.loads(render(errors.InvalidOption(detail), "/v1/attention")[1])["detail"] == detail


def test_a_detail_with_internals_is_withheld_and_logged_under_the_request_id(caplog):
    rid = request_id.assign([])
    with caplog.at_level("WARNING", logger="service.core.errors"):
        status, body, _ = render(errors.InsufficientCapacity(RAY_TRACEBACK), "/v2/models/attention/infer")
    doc = json.loads(body)
    assert status == 507 and doc["code"] == "insufficient_capacity" and doc["request_id"] == rid
    assert doc["detail"] == doc["error"] == f"insufficient capacity: the server log has the details under request id {rid}"
    assert errors.internals(body.decode()) is None
    assert rid in caplog.text and "pid=48213" in caplog.text  # the log keeps what the client does not see


@pytest.mark.parametrize("seconds, header", [(0.2, "1"), (1, "1"), (2.5, "3"), (0, "1")])
def test_overloaded_sets_retry_after_in_whole_seconds_rounded_up(seconds, header):
    err = Overloaded("too many requests in flight", seconds)
    assert err.status == 429 and err.headers == {"Retry-After": header}


@pytest.mark.parametrize("bad", [float("inf"), True, "3"])
def test_overloaded_rejects_a_retry_after_that_is_not_a_finite_number(bad):
    with pytest.raises(ValueError, match="retry_after_s must be a finite number"):
        Overloaded("busy", bad)


def test_unauthorized_carries_a_bearer_challenge():
    err = Unauthorized()
    assert err.status == 401 and err.headers["WWW-Authenticate"] == "Bearer"
    assert render(err, "/v1/cluster")[2] == {"WWW-Authenticate": "Bearer"}


def test_error_responses_document_every_code_of_a_status():
    docs = error_responses(422, 503)
    assert docs[422]["description"] == "error: invalid_tensor, invalid_option"
    assert "context_lost" in docs[503]["description"]
    with pytest.raises(ValueError, match="status must be one of"):
        error_responses(418)
