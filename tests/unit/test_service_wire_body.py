import asyncio

import pytest

from service.core.errors import ServiceError
from service.wire.body import ClientClosed, Pace, declared_length, paced, read_into_buffer


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


def test_charge_sees_every_chunk_before_it_is_kept_and_may_refuse_it():
    seen = []
    assert bytes(run(read_into_buffer(chunks(b"ab", b"cde"), 5, 100, seen.append))) == b"abcde" and seen == [2, 3]

    def refuse_past_three(n):
        if sum(seen) + n > 3:
            raise ServiceError("budget spent")
        seen.append(n)

    seen.clear()
    with pytest.raises(ServiceError, match="budget spent"):
        run(read_into_buffer(chunks(b"ab", b"cd"), None, 100, refuse_past_three))
    assert seen == [2]


class Clock:
    """A clock the test moves: ``paced`` reads it, the fake ``receive`` advances it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def receiver(clock: Clock, messages):
    """An ASGI ``receive`` whose ``(delay_s, message)`` pairs arrive ``delay_s`` after the previous one;
    a delay past the waiting deadline is a message that never comes (the wait is cut first)."""
    it = iter(messages)

    async def receive():
        delay, message = next(it)
        await asyncio.sleep(min(delay, 0.05) if delay < 1e6 else 3600)
        clock.now += delay
        return message

    return receive


def body(data: bytes, more: bool = True) -> dict:
    return {"type": "http.request", "body": data, "more_body": more}


async def collect(receive, pace, clock):
    return [c async for c in paced(receive, pace, clock)]


def test_pace_deadline_allows_the_grace_then_requires_the_rate_and_never_passes_the_timeout():
    pace = Pace(timeout_s=60, min_rate=1000, grace_s=5)
    assert pace.deadline(0, 0) == 5 and pace.deadline(0, 10_000) == 15
    assert pace.deadline(0, 10**9) == 60  # fast enough for ever: the timeout still holds
    assert Pace(timeout_s=60, min_rate=0, grace_s=5).deadline(0, 0) == 60  # no rate: the timeout alone


@pytest.mark.parametrize("bad", [{"timeout_s": 0, "min_rate": 1, "grace_s": 1},
                                 {"timeout_s": 1, "min_rate": -1, "grace_s": 1},
                                 {"timeout_s": 1, "min_rate": 1, "grace_s": -1}])
def test_pace_refuses_impossible_settings(bad):
    with pytest.raises(ValueError, match="must be"):
        Pace(**bad)


@pytest.mark.parametrize("received, elapsed, limit", [
    (15933, 7.99, "must arrive within 8 s"),  # cut by the timeout, the timer a hair early
    (15933, 8.0, "must arrive within 8 s"),
    (100, 2.1, "must arrive at 1000 bytes/s or more after the first 2 s"),  # the rate's deadline came first
])
def test_a_body_too_slow_names_the_limit_whose_deadline_came_first(received, elapsed, limit):
    assert limit in Pace(timeout_s=8, min_rate=1000, grace_s=2).too_slow(received, elapsed).detail


def test_a_body_at_the_pace_is_read_whole():
    clock = Clock()
    pace = Pace(timeout_s=60, min_rate=100, grace_s=1)
    receive = receiver(clock, [(0.5, body(b"a" * 100)), (1.0, body(b"b" * 100)), (0.1, body(b"c", more=False))])
    assert run(collect(receive, pace, clock)) == [b"a" * 100, b"b" * 100, b"c"]


def test_a_trickling_body_is_cut_with_408_once_the_grace_is_spent():
    clock = Clock()
    pace = Pace(timeout_s=60, min_rate=1000, grace_s=0.05)
    receive = receiver(clock, [(0.01, body(b"x")), (1e9, body(b"y"))])
    with pytest.raises(ServiceError) as err:
        run(collect(receive, pace, clock))
    assert err.value.status == 408 and err.value.code == "request_timeout"
    assert "1000 bytes/s" in err.value.detail and err.value.headers["Connection"] == "close"


def test_a_body_past_its_deadline_is_cut_with_408_even_at_a_good_rate():
    clock = Clock()
    pace = Pace(timeout_s=2, min_rate=1, grace_s=1)
    receive = receiver(clock, [(1.5, body(b"x" * 10_000)), (1.0, body(b"y" * 10_000))])
    with pytest.raises(ServiceError, match="within 2 s") as err:
        run(collect(receive, pace, clock))
    assert err.value.status == 408


def test_a_client_that_goes_away_mid_body_is_client_closed():
    clock = Clock()
    receive = receiver(clock, [(0.01, body(b"x")), (0.01, {"type": "http.disconnect"})])
    with pytest.raises(ClientClosed):
        run(collect(receive, Pace(timeout_s=60, min_rate=0, grace_s=0), clock))
