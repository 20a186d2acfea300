"""Closed and open loops: bounded by requests and time, numbered, measured from arrival, stoppable."""

import threading
import time

import numpy as np
import pytest

from service.client import Client
from service.client.loadtest.arrivals import closed_loop, gaps, open_loop


def nowhere() -> Client:
    return Client("http://127.0.0.1:9")  # never connects: the requests below send nothing


def test_a_closed_loop_keeps_concurrency_requests_in_flight_and_stops_at_the_request_bound():
    active, most = [0], [0]
    lock = threading.Lock()

    def request(client, i, due):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.01)
        with lock:
            active[0] -= 1
        return i

    done, wall = closed_loop(nowhere, request, 4, 40, 30.0, first=100)
    assert sorted(done) == list(range(100, 140)) and most[0] == 4
    assert 40 * 0.01 / 4 <= wall < 5


def test_a_closed_loop_stops_at_its_duration():
    done, wall = closed_loop(nowhere, lambda c, i, due: time.sleep(0.02), 2, 10**6, 0.3)
    assert 0.3 <= wall < 2 and 10 <= len(done) <= 40


def test_a_stop_event_ends_a_loop_early():
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    done, wall = closed_loop(nowhere, lambda c, i, due: time.sleep(0.01), 2, 10**6, 30.0, stop=stop)
    assert wall < 5 and done


@pytest.mark.parametrize("shape", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_the_rate_and_the_burstiness_asked(shape):
    g = gaps(50.0, shape, 200_000, np.random.default_rng(1))
    assert g.mean() == pytest.approx(1 / 50, rel=0.02)
    assert g.std() / g.mean() == pytest.approx(1 / np.sqrt(shape), rel=0.03)  # gamma: CV = 1 / sqrt(shape)
    with pytest.raises(ValueError, match="rate and burstiness must be > 0"):
        gaps(0, 1, 1, np.random.default_rng())


def test_an_open_loop_sends_at_its_rate_whatever_the_answers_take_and_counts_from_arrival():
    def slow(client, i, due):
        time.sleep(0.2)  # far slower than the 40/s arrivals: they overlap
        return i, time.perf_counter() - due

    done, wall = open_loop(nowhere, slow, 40.0, 1.0, 20, 30.0, rng=np.random.default_rng(3))
    assert sorted(i for i, _ in done) == list(range(20))
    assert wall < 0.5 + 20 / 40 * 3  # not 20 x 0.2 s: requests do not wait for each other
    assert min(lat for _, lat in done) >= 0.2


def test_an_open_loop_at_its_inflight_bound_counts_the_wait_in_the_latency():
    def slow(client, i, due):
        time.sleep(0.1)
        return time.perf_counter() - due

    done, _ = open_loop(nowhere, slow, 200.0, 1.0, 10, 30.0, max_inflight=1, rng=np.random.default_rng(4))
    assert max(done) >= 0.5  # the last waited for nine others: that is in its latency


def test_an_open_loop_stops_at_its_duration():
    done, wall = open_loop(nowhere, lambda c, i, due: i, 20.0, 1.0, 10**4, 0.5, rng=np.random.default_rng(5))
    assert 2 <= len(done) <= 30 and wall < 3
