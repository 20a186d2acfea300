"""The error model: one exception per kind, one table of codes and statuses, one body format."""

from __future__ import annotations

import json

import pytest
from expect import CONTRACT_STATUS

from service import errors
from service.errors import ERRORS, Overloaded, ServiceError, Unauthorized, error_body, error_responses, render


@pytest.mark.parametrize("cls", list(ERRORS), ids=lambda c: c.__name__)
def test_each_error_carries_the_contract_code_and_status(cls):
    err = cls("x must be y, got z") if cls not in (Unauthorized, Overloaded) else (
        cls() if cls is Unauthorized else cls("busy", 1))
    assert err.status == CONTRACT_STATUS[err.code]


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
    assert json.loads(body) == {"error": err.detail, "detail": err.detail, "code": "invalid_tensor"}
    assert json.loads(render(err, "/v1/attention")[1]) == {"detail": err.detail, "code": "invalid_tensor"}


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
