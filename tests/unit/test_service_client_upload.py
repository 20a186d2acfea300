"""Uploads of any size: chunk sizing and retry decisions (pure), then chunked creates and appends
against real servers: exactness, planned shards, limits, a chunk that fails midway, retries."""

import datetime
import http.client

import numpy as np
import pytest

from service.client import SplitkeyError, UploadError
from service.client.errors import retry_after_seconds
from service.client.retry import BACKOFF_S, MAX_BACKOFF_S
from service.client.upload import (
    HEADER_ROOM,
    Upload,
    chunk_bounds,
    chunk_keys,
    retry_delay,
)
from service.wire.rules import Limits
from workers import BFLOAT16


# -- chunk sizing and retry decisions (pure) ---------------------------------------------------

def test_chunks_fill_the_body_limit_less_the_header_room():
    k, v = np.zeros((10, 2, 16), np.float32), np.zeros((10, 2, 8), np.float32)  # 192 bytes a key
    assert chunk_keys(Limits(max_body_bytes=HEADER_ROOM + 192 * 100 + 191), k, v) == 100
    pos = np.arange(10)  # 8 more bytes a key
    assert chunk_keys(Limits(max_body_bytes=HEADER_ROOM + 200 * 100), k, v, pos) == 100
    half = k.astype(BFLOAT16), v.astype(BFLOAT16)  # 96 bytes a key
    assert chunk_keys(Limits(max_body_bytes=HEADER_ROOM + 96 * 100), *half) == 100


def test_chunks_keep_each_tensor_under_the_element_limit():
    k, v = np.zeros((1, 8, 128), np.float32), np.zeros((1, 8, 64), np.float32)
    assert chunk_keys(Limits(max_elements=8 * 128 * 7 + 5), k, v, requested=1000) == 7


def test_chunks_default_to_the_target_bytes_and_the_caller_may_ask_for_fewer_or_more():
    k, v = np.zeros((1, 8, 128), np.float32), np.zeros((1, 8, 128), np.float32)  # 8 KiB a key
    assert chunk_keys(Limits(), k, v) == 16 * 2**20 // 8192  # the default target: 16 MiB of k and v
    assert chunk_keys(Limits(), k, v, target_bytes=8192 * 3) == 3
    assert chunk_keys(Limits(), k, v, requested=5) == 5
    # A request past what the server takes is capped at the limit; at least one key goes.
    assert chunk_keys(Limits(max_body_bytes=HEADER_ROOM + 8192 * 4), k, v, requested=10**6) == 4
    assert chunk_keys(Limits(max_body_bytes=1024), k, v) == 1


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "8"])
def test_chunk_keys_must_be_a_positive_int(bad):
    k = np.zeros((1, 1, 1), np.float32)
    with pytest.raises(ValueError, match="chunk_keys must be an int >= 1"):
        chunk_keys(Limits(), k, k, requested=bad)


def test_chunk_bounds_cover_the_keys_in_order_with_one_empty_chunk_for_none():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    assert chunk_bounds(3, 4) == [(0, 3)]
    assert chunk_bounds(0, 4) == [(0, 0)]


def test_retry_delays_back_off_honour_retry_after_and_refuse_what_a_retry_cannot_fix():
    busy = SplitkeyError(503, "workers_unavailable", "no worker")
    assert [retry_delay(busy, a) for a in range(6)] == [BACKOFF_S * 2**a for a in range(4)] + [MAX_BACKOFF_S] * 2
    assert retry_delay(SplitkeyError(429, "overloaded", "busy", retry_after=3.0), 0) == 3.0
    assert retry_delay(SplitkeyError(504, "deadline_exceeded", "late"), 1) == 2 * BACKOFF_S
    for status, code in ((400, "invalid_body"), (404, "context_not_found"), (409, "length_mismatch"),
                         (413, "body_too_large"), (422, "invalid_tensor"), (507, "insufficient_capacity")):
        assert retry_delay(SplitkeyError(status, code, "x"), 0) is None
    # A lost connection: at once the first time (an idle keep-alive connection), then backing off.
    assert retry_delay(http.client.RemoteDisconnected("closed"), 0) == 0.0
    assert retry_delay(ConnectionResetError(), 1) == 2 * BACKOFF_S
    assert retry_delay(TimeoutError(), 2) == 4 * BACKOFF_S
    assert retry_delay(ValueError("a bug"), 0) is None


def test_an_upload_error_says_what_is_stored():
    upload = Upload(total=300)
    upload.context_id = "ctx_a"  # as a create learns it from its first chunk's answer
    upload.commit(100)
    err = upload.stopped(SplitkeyError(507, "insufficient_capacity", "the context does not fit"))
    assert isinstance(err, SplitkeyError)
    assert (err.context_id, err.committed, err.total) == ("ctx_a", 100, 300)
    assert (err.status, err.code, err.detail) == (507, "insufficient_capacity", "the context does not fit")
    assert str(err) == ("upload stopped with 100 of 300 keys committed (keys [0, 100) are stored in context "
                        "ctx_a): 507 insufficient_capacity: the context does not fit")
    with pytest.raises(ValueError, match="retries must be an int >= 0, got -1"):
        Upload(total=5, retries=-1)
    lost = Upload(total=5).stopped(ConnectionResetError("reset by peer"))
    assert (lost.context_id, lost.committed, lost.status, lost.code) == (None, 0, 0, "")
    assert "no context was created" in str(lost) and "ConnectionResetError: reset by peer" in lost.detail
    assert str(lost) == ("upload stopped with 0 of 5 keys committed (no context was created): the connection "
                         "failed: ConnectionResetError: reset by peer")  # no "0 :" of an answer that never came


# -- against the shared server (64 MiB bodies, context_shard_keys 256, two workers) -------------


# -- against a small server: 256 KiB bodies, 1 MiB per worker, one request in flight -------------

BODY = 256 * 2**10


@pytest.mark.parametrize("value, seconds", [
    ("3", 3.0), (" 0 ", 0.0), ("1.5", 1.5),
    ("Fri, 04 Dec 2026 10:00:30 GMT", 30.0),  # an HTTP-date, 30 s after "now" below
    ("Fri, 04 Dec 2026 09:00:00 GMT", 0.0),  # a date past: retry at once
    ("-1", None), ("nan", None), ("soon", None), ("", None), (None, None),
])
def test_retry_after_reads_delay_seconds_and_http_dates(value, seconds):
    now = datetime.datetime(2026, 12, 4, 10, 0, 0, tzinfo=datetime.timezone.utc).timestamp()
    assert retry_after_seconds(value, now=now) == seconds


def test_an_append_that_stopped_says_how_many_keys_it_appended_and_carries_the_request_id():
    upload = Upload(total=8, context_id="ctx_a")
    upload.commit(3)
    err = upload.stopped(SplitkeyError(503, "workers_unavailable", "try again", request_id="r-1"))
    assert "the first 3 were appended to context ctx_a" in str(err) and err.request_id == "r-1"
    assert "none was appended" in str(Upload(total=8, context_id="ctx_a").stopped(ConnectionResetError()))
    assert "keys [0, 3) are stored" in str(UploadError("ctx_b", 3, 8, 0, "", "x"))  # a create's


def test_a_plain_append_whose_answer_was_lost_says_its_keys_may_be_stored_not_that_none_were():
    """An append sent once (no ``after``) whose connection failed after it went out may be stored;
    saying "none was appended" made the documented resume store its keys twice."""
    from service.client.upload import may_have_arrived

    lost = Upload(total=1, context_id="ctx_a").stopped(ConnectionResetError(), unknown=1)
    assert (lost.committed, lost.unknown) == (0, 1)
    assert "none was appended" not in str(lost) and "the next 1 may have been too" in str(lost)
    create = Upload(total=4).stopped(TimeoutError(), unknown=4)
    assert "no context was created, or one was" in str(create)
    assert may_have_arrived(ConnectionResetError()) and may_have_arrived(TimeoutError())
    refused = ConnectionError("could not connect")
    refused.__cause__ = ConnectionRefusedError()
    assert not may_have_arrived(ConnectionRefusedError()) and not may_have_arrived(refused)  # never sent
    assert not may_have_arrived(SplitkeyError(503, "workers_unavailable", "x"))  # an answer says what it did
    assert Upload(total=8, context_id="ctx_a").stopped(ConnectionResetError()).unknown == 0

