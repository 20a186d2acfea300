"""The request deadline reaches the workers: work whose request was answered 504 is not computed
afterwards, so an overloaded worker does not spend its time on answers nobody waits for
(docs/SERVICE.md, "Deadlines")."""

from __future__ import annotations

import asyncio
import re
import time


import pytest

from service.core import deadline
from service.client.retry import timeout_text
from service.core.errors import DeadlineExceeded, InvalidOption
from service.routes.common import query_deadline
from service.wire.rules import timeout_header


def test_within_gives_its_work_and_the_tasks_and_threads_it_starts_the_seconds_left():
    async def main() -> tuple:
        async def left() -> float | None:
            return deadline.budget()

        async def work() -> tuple:
            return deadline.budget(), await asyncio.gather(left(), left()), await asyncio.to_thread(deadline.budget)

        assert deadline.budget() is None  # outside a request: internal work has no deadline
        got = await deadline.within(work(), 30.0)
        assert deadline.budget() is None
        return got

    here, gathered, threaded = asyncio.run(main())
    assert 0 < threaded <= min(gathered) and max(gathered) <= here <= 30.0
    with deadline.running(0.0):
        assert deadline.budget() == 0.0  # past it: nothing left, never negative


@pytest.mark.parametrize(("what", "detail"), [(None, "within 0.0123 s"),
                                             ("its X-Request-Timeout of 0.5 s", "within its X-Request-Timeout of 0.5 s")])
def test_a_deadline_passed_names_the_limit_that_set_it_or_its_seconds_rounded(what, detail):
    with pytest.raises(DeadlineExceeded) as info:
        asyncio.run(deadline.within(asyncio.sleep(5), 0.012345, what))
    assert str(info.value) == f"the request must finish {detail}, got longer"


@pytest.mark.parametrize(("text", "seconds"), [("0.25", 0.25), ("2", 2.0), ("1e-3", 0.001), ("120.000", 120.0)])
def test_a_timeout_header_is_read_as_seconds(text, seconds):
    assert timeout_header(text) == seconds
    assert timeout_header(None) is None  # no header: the server's --request-timeout alone


@pytest.mark.parametrize("text", ["0", "-1", "0.000", "inf", "nan", "1e999", " 1", "1s", "", "0x10", "1_0", "+1"])
def test_a_timeout_header_that_is_not_seconds_above_zero_is_refused_naming_it(text):
    with pytest.raises(InvalidOption, match=rf"X-Request-Timeout must be a number of seconds > 0, got \"{re.escape(text)}\""):
        timeout_header(text)


def test_the_clients_send_the_time_left_rounded_up_to_whole_milliseconds_and_at_least_one():
    for left, text in ((0.25, "0.250"), (0.2501, "0.251"), (1e-6, "0.001"), (-0.5, "0.001"), (30.0, "30.000")):
        assert timeout_text(left) == text
        assert timeout_header(text) >= max(left, 1e-3)  # what the server reads: never before the client


def test_the_header_shortens_the_server_deadline_never_lengthens_it_and_counts_from_the_request_start():
    now = time.perf_counter()
    assert query_deadline(120.0, None, now) == 120.0
    assert 0.4 < query_deadline(120.0, 0.5, now) <= 0.5
    assert query_deadline(0.3, 10.0, now) == 0.3
    assert 0.5 < query_deadline(120.0, 2.0, now - 1.0) <= 1.0  # a second already spent reading the body
    with pytest.raises(DeadlineExceeded, match="X-Request-Timeout of 0.5 s"):
        query_deadline(120.0, 0.5, now - 1.0)


