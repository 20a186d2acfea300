"""The compute thread of a shard worker: what waits together on the same shards runs together."""

from __future__ import annotations

import math
import threading
import time

import pytest

from workers import cutoff
from workers.batch import Batcher


class Gate:
    """A run function whose first batch waits until released, recording every batch it runs."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.started = threading.Event()
        self.batches: list[list] = []

    def run(self, payloads):
        self.batches.append(list(payloads))
        if len(self.batches) == 1:
            self.started.set()
            assert self.open.wait(30)
        if any(p == "boom" for p in payloads):
            raise ValueError("payload must not be boom, got boom")
        return [f"done {p}" for p in payloads]


def queued(batcher: Batcher, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(batcher._queue) < n:
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_jobs_waiting_together_with_one_key_run_as_one_batch_in_arrival_order():
    gate = Gate()
    b = Batcher(gate.run)
    first = b.submit("first", key="a")
    assert gate.started.wait(10)  # an idle batcher starts a job at once: no timer
    later = [b.submit(p, key=k) for p, k in [("a1", "a"), ("b1", "b"), ("a2", "a"), ("x", None), ("a3", "a")]]
    queued(b, 5)
    gate.open.set()
    assert first.result(10) == "done first"
    assert [f.result(10) for f in later] == ["done a1", "done b1", "done a2", "done x", "done a3"]
    assert gate.batches == [["first"], ["a1", "a2", "a3"], ["b1"], ["x"]]


def test_a_batch_holds_at_most_max_rows():
    gate = Gate()
    b = Batcher(gate.run, max_rows=5)
    b.submit("first", key="k")
    assert gate.started.wait(10)
    futures = [b.submit(f"r{i}", key="k", rows=2) for i in range(5)]
    queued(b, 5)
    gate.open.set()
    [f.result(10) for f in futures]
    assert gate.batches[1:] == [["r0", "r1"], ["r2", "r3"], ["r4"]]


def test_a_failing_job_fails_alone_and_its_batch_mates_still_answer():
    gate = Gate()
    b = Batcher(gate.run)
    b.submit("first", key="k")
    assert gate.started.wait(10)
    ok1, bad, ok2 = (b.submit(p, key="k") for p in ("one", "boom", "two"))
    queued(b, 3)
    gate.open.set()
    assert ok1.result(10) == "done one" and ok2.result(10) == "done two"
    with pytest.raises(ValueError, match="payload must not be boom"):
        bad.result(10)


def test_only_jobs_the_oldest_admits_join_its_batch():
    gate = Gate()
    b = Batcher(gate.run, joins=lambda first, job: first[0] == job[0])  # same first letter
    b.submit("go", key="k")
    assert gate.started.wait(10)
    futures = [b.submit(p, key="k") for p in ("ab", "xy", "ac", "xz")]
    queued(b, 4)
    gate.open.set()
    [f.result(10) for f in futures]
    assert gate.batches[1:] == [["ab", "ac"], ["xy", "xz"]]


def test_run_here_runs_a_job_in_the_calling_thread_when_the_batcher_is_idle():
    threads = []

    def run(payloads):
        threads.append(threading.current_thread().name)
        if payloads == ["boom"]:
            raise ValueError("payload must not be boom, got boom")
        return [f"done {p}" for p in payloads]

    b = Batcher(run, name="the-compute-thread")
    done = b.run_here("x", key="a")
    assert done is not None and done.done() and done.result() == "done x"
    assert threads == [threading.current_thread().name] and b.batches == 1
    failed = b.run_here("boom")
    assert failed is not None and isinstance(failed.exception(), ValueError)
    assert b.submit("y").result(10) == "done y" and threads[-1] == "the-compute-thread"


def test_run_here_declines_while_a_batch_runs_or_jobs_wait_and_nothing_is_lost():
    gate = Gate()
    b = Batcher(gate.run)
    first = b.submit("first", key="a")
    assert gate.started.wait(10)
    assert b.run_here("while running", key="a") is None  # a batch runs: not run, not queued
    waiting = b.submit("a1", key="a")
    gate.open.set()
    assert first.result(10) == "done first" and waiting.result(10) == "done a1"
    assert gate.batches == [["first"], ["a1"]]


def test_jobs_queued_while_run_here_runs_wait_for_it_then_batch_on_the_compute_thread():
    gate = Gate()
    b = Batcher(gate.run)
    here: list = []
    runner = threading.Thread(target=lambda: here.append(b.run_here("here", key="a")))
    runner.start()
    assert gate.started.wait(10)  # run_here's job holds the batcher
    later = [b.submit(p, key="a") for p in ("a1", "a2")]
    queued(b, 2)
    time.sleep(0.05)
    assert gate.batches == [["here"]]  # the compute thread did not start beside it
    gate.open.set()
    runner.join(10)
    assert here[0].result() == "done here" and [f.result(10) for f in later] == ["done a1", "done a2"]
    assert gate.batches == [["here"], ["a1", "a2"]]


def test_max_rows_must_be_positive():
    with pytest.raises(ValueError, match="max_rows must be >= 1, got 0"):
        Batcher(lambda p: p, max_rows=0)


class Late(Exception):
    pass


def test_jobs_whose_deadline_passed_before_the_compute_thread_took_them_are_not_run_and_fail_expired():
    gate = Gate()
    b = Batcher(gate.run, expired=Late)
    b.submit("first", key="a")
    assert gate.started.wait(10)
    past, later = time.monotonic(), time.monotonic() + 3600  # past: out by the time the thread takes it
    futures = {p: b.submit(p, key=k, deadline=d) for p, k, d in [
        ("late a", "a", past), ("a1", "a", later), ("late x", None, past), ("late b", "b", past),
        ("a2", "a", math.inf), ("late a again", "a", past)]}
    queued(b, 6)
    gate.open.set()
    assert futures["a1"].result(10) == "done a1" and futures["a2"].result(10) == "done a2"
    for p in ("late a", "late x", "late b", "late a again"):
        with pytest.raises(Late, match="deadline passed .* before this work could start: not computed"):
            futures[p].result(10)
    assert gate.batches == [["first"], ["a1", "a2"]]  # the late ones never reached run()
    assert b.expired == 4 and b.batches == 2


def test_run_here_does_not_run_a_job_whose_deadline_passed_on_its_way():
    ran = []
    b = Batcher(lambda payloads: ran.extend(payloads) or [f"done {p}" for p in payloads], expired=Late)
    done = b.run_here("late", deadline=time.monotonic())
    assert done is not None and isinstance(done.exception(), Late)
    assert b.run_here("in time", deadline=time.monotonic() + 3600).result() == "done in time"
    assert ran == ["in time"] and b.expired == 1 and b.batches == 1


def blocks(payloads):
    """A kernel of many blocks of keys: it looks at its deadline before each (``workers.cutoff``)."""
    for _ in range(500):
        cutoff.check()
        time.sleep(0.01)
    return [f"done {p}" for p in payloads]


def test_a_batch_running_past_the_latest_deadline_of_its_jobs_stops_at_its_next_block_and_fails_expired():
    b = Batcher(blocks, expired=Late)
    t0 = time.monotonic()
    cut = [b.submit(p, key="a", deadline=t0 + 0.2) for p in ("x", "y")]
    for f in cut:
        with pytest.raises(Late, match="between two blocks of keys: not finished"):
            f.result(10)
    assert time.monotonic() - t0 < 2.0  # not the 5 s the whole run takes
    assert b.expired == 2
    cutoff.check()  # outside a batch: no deadline


# -- through a shard worker -------------------------------------------------------------------




def test_jobs_cancelled_while_they_wait_are_not_run_and_a_taken_job_cannot_be_cancelled():
    """A query whose client went away is cancelled by its front end (workers.channel's cancel op): not
    run if it still waits, counted ``cancelled``; the others, its batch mates too, run as before."""
    gate = Gate()
    b = Batcher(gate.run)
    first = b.submit("first", key="a")
    assert gate.started.wait(10)
    assert not first.cancel()  # taken: running, no longer cancellable
    futures = {p: b.submit(p, key=k) for p, k in [("gone", None), ("a1", "a"), ("gone a", "a"), ("a2", "a")]}
    queued(b, 4)
    assert futures["gone"].cancel() and futures["gone a"].cancel()
    gate.open.set()
    assert first.result(10) == "done first"
    assert futures["a1"].result(10) == "done a1" and futures["a2"].result(10) == "done a2"
    assert futures["gone"].cancelled() and futures["gone a"].cancelled()
    assert gate.batches == [["first"], ["a1", "a2"]]  # the cancelled ones never reached run()
    assert b.cancelled == 2 and b.expired == 0 and b.batches == 2


def test_a_job_cancelled_after_its_deadline_passed_fails_nobody():
    gate = Gate()
    b = Batcher(gate.run, expired=Late)
    b.submit("first", key="a")
    assert gate.started.wait(10)
    late = b.submit("late", key="a", deadline=time.monotonic())
    queued(b, 1)
    assert late.cancel()
    gate.open.set()  # the compute thread drops it as expired, and must not fail on its cancelled future
    assert b.submit("after", key="b").result(10) == "done after"
    assert late.cancelled() and b.expired == 1
