"""Content negotiation: Content-Type picks the decoder, Accept the encoder."""

from __future__ import annotations

import pytest
from expect import service_error
from hypothesis import given, settings
from hypothesis import strategies as st

from service.core.errors import ServiceError
from service.wire.negotiation import (
    MEMO_ACCEPT_CHARS,
    _negotiate_memo,
    content_type,
    request_format,
    response_format,
)

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
    with service_error("unsupported_media_type", fragment):
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


@pytest.mark.parametrize("request_fmt", ["json", "safetensors"])
def test_an_accept_negotiated_once_answers_each_request_format_on_its_own(request_fmt):
    accept = "application/json;q=0.5, application/octet-stream;q=0.5"  # a tie: the request's format
    assert response_format(accept, "json") == "json"
    assert response_format(accept, "safetensors") == "safetensors"
    assert response_format(accept, request_fmt) == request_fmt  # again, from the memo


def test_a_long_accept_is_negotiated_every_time_and_not_remembered():
    accept = "text/html;q=0.9, " * (MEMO_ACCEPT_CHARS // 17) + "application/json"
    assert len(accept) > MEMO_ACCEPT_CHARS
    misses = _negotiate_memo.cache_info().misses
    assert response_format(accept, "safetensors") == "json"
    assert response_format(accept, "safetensors") == "json"
    assert _negotiate_memo.cache_info().misses == misses


def test_responses_are_labelled_with_the_primary_media_type():
    assert content_type("json") == "application/json"
    assert content_type("safetensors") == "application/octet-stream"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60), st.sampled_from(["json", "safetensors"]))
def test_random_headers_never_break_negotiation(header, request_fmt):
    assert response_format(header, request_fmt) in ("json", "safetensors")
    try:
        request_format(header)
    except ServiceError as err:
        assert err.code == "unsupported_media_type"
