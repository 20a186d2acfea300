"""The direct channel's future helpers (workers.channel.then, gather): a cancel goes down to the jobs
(a query whose client went away is not run: workers.batch), and nothing fails on a cancelled future."""

from concurrent.futures import Future

from workers.channel import gather, then


def test_cancelling_a_then_cancels_its_source_and_a_cancelled_source_cancels_the_then():
    source: Future = Future()
    out = then(source, lambda r: r + 1)
    assert out.cancel() and source.cancelled()
    source2: Future = Future()
    out2 = then(source2, lambda r: r + 1)
    assert source2.cancel() and out2.cancelled()
    source3: Future = Future()
    out3 = then(source3, lambda r: r + 1)
    source3.set_result(1)
    assert out3.result(0) == 2 and not out3.cancel()


def test_a_source_taken_before_the_cancel_runs_on_and_its_then_stays_cancelled():
    source: Future = Future()
    assert source.set_running_or_notify_cancel()  # taken by the compute thread
    out = then(source, lambda r: r + 1)
    assert out.cancel() and not source.cancelled()  # too late for the job: it runs
    source.set_result(1)  # and its answer goes nowhere, without an error
    assert out.cancelled()


def test_cancelling_a_gather_cancels_every_job_not_taken():
    parts: list[Future] = [Future() for _ in range(3)]
    assert parts[0].set_running_or_notify_cancel()
    out = gather(parts, lambda results: results)
    assert out.cancel()
    assert [p.cancelled() for p in parts] == [False, True, True]
    parts[0].set_result("late")  # the taken one answers into a cancelled gather: no error
    assert out.cancelled()
