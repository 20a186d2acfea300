"""The error model, limits, options (JSON values and URL query form) and content negotiation."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.codec import (
    ATTENTION,
    CONTEXT_APPEND,
    CONTEXT_CREATE,
    Limits,
    attention_options,
    check_options,
    check_request,
    parse_query_options,
)
from service.errors import STATUS, ApiError, error_body, error_responses, from_value_error, overloaded, unauthorized
from service.negotiation import content_type, request_format, response_format
from workers.options import AttentionOptions


@contextmanager
def api_error(code: str, *fragments: str):
    """Expect an ApiError with ``code`` (and its status) whose detail contains every fragment."""
    with pytest.raises(ApiError) as info:
        yield info
    err = info.value
    assert (err.code, err.status) == (code, STATUS[code]), repr(err)
    for fragment in fragments:
        assert fragment in err.detail, (fragment, err.detail)


# -- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("code, status", [
    ("invalid_body", 400), ("unauthorized", 401), ("context_not_found", 404), ("body_too_large", 413),
    ("unsupported_media_type", 415), ("invalid_tensor", 422), ("invalid_option", 422), ("overloaded", 429),
    ("workers_unavailable", 503), ("context_lost", 503), ("deadline_exceeded", 504),
    ("insufficient_capacity", 507),
])
def test_each_error_code_carries_the_contract_status(code, status):
    assert ApiError(code, "x must be y, got z").status == status


def test_an_unknown_error_code_is_a_programming_error():
    with pytest.raises(ValueError, match="code must be one of"):
        ApiError("teapot", "short and stout")


def test_error_body_is_json_with_detail_and_code():
    err = ApiError("invalid_option", 'scale must be a number, got "0.1" ü')
    assert json.loads(error_body(err)) == {"detail": 'scale must be a number, got "0.1" ü', "code": "invalid_option"}
    assert str(err) == err.detail and err.headers == {}


@pytest.mark.parametrize("seconds, header", [(0.2, "1"), (1, "1"), (2.5, "3"), (0, "1")])
def test_overloaded_sets_retry_after_in_whole_seconds_rounded_up(seconds, header):
    err = overloaded("too many requests in flight", seconds)
    assert err.status == 429 and err.headers == {"Retry-After": header}


@pytest.mark.parametrize("bad", [float("inf"), True, "3"])
def test_overloaded_rejects_a_retry_after_that_is_not_a_finite_number(bad):
    with pytest.raises(ValueError, match="retry_after_s must be a finite number"):
        overloaded("busy", bad)


def test_unauthorized_carries_a_bearer_challenge():
    err = unauthorized()
    assert err.status == 401 and err.headers["WWW-Authenticate"] == "Bearer"


def test_from_value_error_keeps_the_library_message():
    err = from_value_error(ValueError("q must be [n_q, h_q, d], got shape (2,)"))
    assert (err.status, err.code, err.detail) == (422, "invalid_tensor", "q must be [n_q, h_q, d], got shape (2,)")


def test_error_responses_document_every_code_of_a_status():
    docs = error_responses(422, 503)
    assert docs[422]["description"] == "error: invalid_tensor, invalid_option"
    assert "context_lost" in docs[503]["description"]
    with pytest.raises(ValueError, match="status must be one of"):
        error_responses(418)


# -- limits ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_limits_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="max_dims must be an int >= 1"):
        Limits(max_dims=bad)


# -- options from JSON values ------------------------------------------------------------------

def test_check_options_normalises_and_drops_nulls_and_a_zero_softcap():
    opts = check_options({"scale": 1, "causal": False, "window": [3, None], "softcap": 0, "contexts": None},
                         ATTENTION, Limits())
    assert opts == {"scale": 1.0, "causal": False, "window": (3, None)}
    assert type(opts["scale"]) is float


@pytest.mark.parametrize("raw, fragments", [
    ({"scale": True}, ["scale must be a number", "got true"]),
    ({"scale": "0.125"}, ["scale must be a number", 'got "0.125"']),
    ({"scale": 0}, ["scale must be a finite number > 0", "got 0"]),
    ({"scale": float("nan")}, ["scale must be a finite number", "nan"]),
    ({"softcap": -1.0}, ["softcap must be a finite number >= 0"]),
    ({"causal": 0}, ["causal must be true or false", "got 0"]),
    ({"causal": "true"}, ["causal must be true or false", 'got "true"']),
    ({"window": [1.0, None]}, ["window must be [left, right]", "got [1.0, null]"]),
    ({"window": [True, None]}, ["window must be [left, right]"]),
    ({"window": [1]}, ["window must be [left, right]"]),
    ({"window": "128,"}, ["window must be [left, right]"]),
    ({"window": [-1, 0]}, ["window must be [left, right], each null or an int in [0, 2**62]", "got [-1, 0]"]),
    ({"window": [0, 2**63]}, ["window must be [left, right]"]),
    ({"window": [0, 10**4000]}, ["window must be [left, right]", "..."]),
    ({"contexts": "abc"}, ["contexts must be a list of 1 to 64 ids", 'got "abc"']),
    ({"contexts": []}, ["contexts must be a list of 1 to 64 ids"]),
    ({"contexts": ["a", 1]}, ["contexts[1] must be an id", "got 1"]),
    ({"contexts": ["a,b"]}, ["contexts[0] must be an id", 'got "a,b"']),
    ({"contexts": ["x" * 129]}, ["contexts[0] must be an id of 1 to 128 characters"]),
    ({"contexts": ["a", "a"]}, ["contexts must not repeat an id", 'got "a" twice']),
    ({"contexts": [str(i) for i in range(65)]}, ["contexts must be a list of 1 to 64 ids"]),
    ({"replicas": 1}, ["replicas is not an option of attention requests"]),
])
def test_attention_options_are_strictly_typed_and_name_the_field(raw, fragments):
    with api_error("invalid_option", *fragments):
        check_options(raw, ATTENTION, Limits())


@pytest.mark.parametrize("raw, fragments", [
    ({"replicas": 0}, ["replicas must be an int in [1, 64]", "got 0"]),
    ({"replicas": 2.0}, ["replicas must be an int", "got 2.0"]),
    ({"shards": True}, ["shards must be an int", "got true"]),
    ({"shards": "2"}, ["shards must be an int", 'got "2"']),
    ({"shards": 1025}, ["shards must be an int in [1, 1024]", "got 1025"]),
    ({"causal": True}, ["causal is not an option of context requests"]),
])
def test_context_options_are_positive_bounded_ints(raw, fragments):
    with api_error("invalid_option", *fragments):
        check_options(raw, CONTEXT_CREATE, Limits())


def test_an_unknown_option_is_rejected_even_when_null():
    with api_error("invalid_option", "replicas is not an option of append requests"):
        check_options({"replicas": None}, CONTEXT_APPEND, Limits())


def test_attention_options_builds_the_library_options():
    opts = attention_options({"scale": 0.5, "causal": True, "window": (4, None)}, alibi_slopes=[0.5])
    assert isinstance(opts, AttentionOptions)
    assert (opts.scale, opts.causal, opts.window, opts.softcap, opts.right) == (0.5, True, (4, None), None, 0)


# -- options as URL query parameters ---------------------------------------------------------

@pytest.mark.parametrize("params, expected", [
    ({}, {}),
    ({"scale": "0.125"}, {"scale": 0.125}),
    ({"scale": "1e-3"}, {"scale": 0.001}),
    ({"scale": "2"}, {"scale": 2.0}),
    ({"causal": "true"}, {"causal": True}),
    ({"causal": "false"}, {"causal": False}),
    ({"softcap": "30"}, {"softcap": 30.0}),
    ({"softcap": "0"}, {}),
    ({"window": "128,"}, {"window": (128, None)}),
    ({"window": "128,0"}, {"window": (128, 0)}),
    ({"window": ",0"}, {"window": (None, 0)}),
    ({"window": ","}, {"window": (None, None)}),
    ({"contexts": "ID1,ID2"}, {"contexts": ["ID1", "ID2"]}),
    ({"contexts": "ctx_0.a~b-c"}, {"contexts": ["ctx_0.a~b-c"]}),
])
def test_query_options_parse_the_documented_syntax(params, expected):
    assert parse_query_options(params) == expected


@pytest.mark.parametrize("params, fragments", [
    ({"causal": "1"}, ["causal must be true or false", 'got "1"']),
    ({"causal": "0"}, ["causal must be true or false"]),
    ({"causal": "True"}, ["causal must be true or false", 'got "True"']),
    ({"causal": ""}, ["causal must be true or false", 'got ""']),
    ({"scale": "nan"}, ["scale must be a number", 'got "nan"']),
    ({"scale": "inf"}, ["scale must be a number"]),
    ({"scale": "0x10"}, ["scale must be a number"]),
    ({"scale": " 1"}, ["scale must be a number"]),
    ({"scale": "1_000"}, ["scale must be a number"]),
    ({"scale": ".5"}, ["scale must be a number"]),
    ({"scale": ""}, ["scale must be a number"]),
    ({"scale": "1e999"}, ["scale must be a finite number"]),
    ({"scale": "-1"}, ["scale must be a finite number > 0", "got -1.0"]),
    ({"softcap": "-30"}, ["softcap must be a finite number >= 0"]),
    ({"window": "128"}, ["window must be LEFT,RIGHT", 'got "128"']),
    ({"window": "1,2,3"}, ["window must be LEFT,RIGHT"]),
    ({"window": "-1,0"}, ["window must be LEFT,RIGHT", 'got "-1,0"']),
    ({"window": "1.5,"}, ["window must be LEFT,RIGHT"]),
    ({"window": "01,"}, ["window must be LEFT,RIGHT"]),
    ({"window": "a,b"}, ["window must be LEFT,RIGHT"]),
    ({"window": "9" * 22 + ","}, ["window must be LEFT,RIGHT"]),
    ({"window": str(2**63) + ","}, ["window must be [left, right], each null or an int in [0, 2**62]"]),
    ({"contexts": ""}, ["contexts[0] must be an id", 'got ""']),
    ({"contexts": "a,,b"}, ["contexts[1] must be an id"]),
    ({"contexts": "a,a"}, ["contexts must not repeat an id"]),
    ({"contexts": "a b"}, ["contexts[0] must be an id", 'got "a b"']),
    ({"q_pos": "1,2"}, ["query parameters of attention requests must be among", 'got "q_pos"']),
    ({"Causal": "true"}, ['got "Causal"']),
])
def test_query_options_reject_bad_values_naming_parameter_and_value(params, fragments):
    with api_error("invalid_option", *fragments):
        parse_query_options(params)


@pytest.mark.parametrize("params, fragments", [
    ({"replicas": "0"}, ["replicas must be an int >= 1", 'got "0"']),
    ({"replicas": "01"}, ["replicas must be an int >= 1"]),
    ({"replicas": "1.0"}, ["replicas must be an int >= 1"]),
    ({"replicas": "-1"}, ["replicas must be an int >= 1"]),
    ({"shards": "99999999999"}, ["shards must be an int >= 1"]),
    ({"shards": "2000"}, ["shards must be an int in [1, 1024]", "got 2000"]),
    ({"contexts": "a"}, ["query parameters of context requests must be among"]),
])
def test_query_options_of_context_requests_are_bounded_counts(params, fragments):
    with api_error("invalid_option", *fragments):
        parse_query_options(params, CONTEXT_CREATE)


def test_query_options_of_context_requests_parse_counts():
    assert parse_query_options({"replicas": "2", "shards": "16"}, CONTEXT_CREATE) == {"replicas": 2, "shards": 16}


class MultiDict:
    """Stands in for Starlette's QueryParams, which keeps repeated keys in ``multi_items``."""

    def __init__(self, items):
        self.items = items

    def multi_items(self):
        return list(self.items)


@pytest.mark.parametrize("params", [
    [("causal", "true"), ("causal", "false")],
    MultiDict([("causal", "true"), ("causal", "true")]),
])
def test_a_repeated_query_parameter_is_rejected(params):
    with api_error("invalid_option", "causal must be given once"):
        parse_query_options(params)


def test_query_options_accept_a_list_of_pairs():
    assert parse_query_options([("scale", "0.5"), ("window", "2,")]) == {"scale": 0.5, "window": (2, None)}


# -- whole requests --------------------------------------------------------------------------

@pytest.mark.parametrize("names, options, fragments", [
    ({"k", "v"}, {}, ["q is required in attention requests"]),
    ({"q", "k"}, {}, ["v must be given with k, got k alone"]),
    ({"q", "v"}, {"contexts": ["a"]}, ["k must be given with v, got v alone"]),
    ({"q"}, {}, ["k and v must be given when no contexts are"]),
])
def test_attention_requests_need_q_and_keys(names, options, fragments):
    with api_error("invalid_tensor", *fragments):
        check_request(dict.fromkeys(names), options, ATTENTION)


@pytest.mark.parametrize("names, options", [({"q", "k", "v"}, {}), ({"q"}, {"contexts": ["a"]})])
def test_attention_requests_with_inline_keys_or_contexts_pass(names, options):
    check_request(dict.fromkeys(names), options, ATTENTION)


@pytest.mark.parametrize("kind", [CONTEXT_CREATE, CONTEXT_APPEND])
def test_context_requests_need_k_and_v(kind):
    with api_error("invalid_tensor", "v is required"):
        check_request({"k": None}, {}, kind)


# -- content negotiation ---------------------------------------------------------------------

@pytest.mark.parametrize("header, fmt", [
    ("application/json", "json"),
    ("application/json; charset=utf-8", "json"),
    ('Application/JSON; charset="UTF-8"', "json"),
    ("application/octet-stream", "safetensors"),
    ("application/vnd.safetensors", "safetensors"),
    ("application/octet-stream; foo=bar", "safetensors"),
])
def test_request_format_follows_content_type(header, fmt):
    assert request_format(header) == fmt


@pytest.mark.parametrize("header, fragment", [
    (None, "got none"),
    ("", "got none"),
    ("text/plain", 'got "text/plain"'),
    ("application/x-www-form-urlencoded", 'got "application/x-www-form-urlencoded"'),
    ("application/jsonx", 'got "application/jsonx"'),
    ("application/json; charset=latin-1", 'charset must be utf-8, got "latin-1"'),
])
def test_request_format_rejects_other_media_types_with_415(header, fragment):
    with api_error("unsupported_media_type", fragment):
        request_format(header)


@pytest.mark.parametrize("accept, request_fmt, fmt", [
    (None, "json", "json"),
    (None, "safetensors", "safetensors"),
    ("", "safetensors", "safetensors"),
    ("*/*", "safetensors", "safetensors"),
    ("application/*", "json", "json"),
    ("application/json", "safetensors", "json"),
    ("application/octet-stream", "json", "safetensors"),
    ("application/vnd.safetensors", "json", "safetensors"),
    ("application/json;q=0.5, application/octet-stream", "json", "safetensors"),
    ("application/json;q=0.9, application/octet-stream;q=0.9", "safetensors", "safetensors"),
    ("application/json;q=0.9, application/octet-stream;q=0.9", "json", "json"),
    ("application/json;q=0, */*", "json", "safetensors"),
    ("*/*;q=0.1, application/json", "safetensors", "json"),
    ("text/html", "safetensors", "safetensors"),
    ("text/html, application/json;q=0", "safetensors", "safetensors"),
    ("application/json;q=bogus, application/octet-stream;q=0.2", "json", "safetensors"),
    ("application/json;q=7", "safetensors", "safetensors"),
    ("nonsense", "json", "json"),
])
def test_response_format_follows_accept_and_falls_back_to_the_request_format(accept, request_fmt, fmt):
    assert response_format(accept, request_fmt) == fmt


def test_responses_are_labelled_with_the_primary_media_type():
    assert content_type("json") == "application/json"
    assert content_type("safetensors") == "application/octet-stream"


def test_values_too_long_to_print_are_shown_by_type():
    with api_error("invalid_option", "scale must be a number, got a list"):
        check_options({"scale": [10**5000]}, ATTENTION, Limits())


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_an_int_option_beyond_float64_is_422(name):
    with api_error("invalid_option", f"{name} must be a finite number, got 1000"):
        check_options({name: 10**400}, ATTENTION, Limits())


QUERY_NAMES = st.sampled_from(["scale", "causal", "window", "softcap", "contexts", "replicas", "shards", "x"])
QUERY_TEXT = st.text(alphabet="0123456789,.-+eE_ abtrufalsnixNI", max_size=12)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(QUERY_NAMES, QUERY_TEXT), max_size=4), st.sampled_from([ATTENTION, CONTEXT_CREATE]))
def test_random_query_parameters_only_ever_raise_api_error(pairs, kind):
    try:
        parse_query_options(pairs, kind)
    except ApiError as err:
        assert err.code == "invalid_option"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60), st.sampled_from(["json", "safetensors"]))
def test_random_headers_never_break_negotiation(header, request_fmt):
    assert response_format(header, request_fmt) in ("json", "safetensors")
    try:
        request_format(header)
    except ApiError as err:
        assert err.code == "unsupported_media_type"
