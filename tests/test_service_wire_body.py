import asyncio

import pytest

from service.errors import ServiceError
from service.wire.body import declared_length, read_into_buffer


async def chunks(*parts):
    for p in parts:
        yield p


def run(coro):
    return asyncio.run(coro)


def test_body_with_content_length_is_read_into_one_buffer():
    view = run(read_into_buffer(chunks(b"abc", b"", b"defg"), 7, 100))
    assert bytes(view) == b"abcdefg"


def test_body_longer_or_shorter_than_its_content_length_is_400():
    with pytest.raises(ServiceError) as err:
        run(read_into_buffer(chunks(b"abcdef"), 5, 100))
    assert err.value.code == "invalid_body"
    with pytest.raises(ServiceError, match="got 3"):
        run(read_into_buffer(chunks(b"abc"), 5, 100))


def test_chunked_body_grows_and_is_refused_past_the_limit():
    assert bytes(run(read_into_buffer(chunks(b"x" * (3 << 20), b"y"), None, 4 << 20))) == b"x" * (3 << 20) + b"y"
    with pytest.raises(ServiceError) as err:
        run(read_into_buffer(chunks(b"x" * 60, b"y" * 60), None, 100))
    assert err.value.status == 413 and "chunked" in err.value.detail


def test_declared_length_is_checked_against_the_limit_before_reading():
    assert declared_length(None, 10) is None
    assert declared_length("10", 10) == 10
    with pytest.raises(ServiceError) as err:
        declared_length("11", 10)
    assert err.value.status == 413 and "Content-Length 11" in err.value.detail
    with pytest.raises(ServiceError) as err:
        declared_length("-1", 10)
    assert err.value.status == 400
