"""The fault soak's checker (benchmarks/chaos_check.py) on hand-made histories: each rule catches what it is for."""

import numpy as np
from benchloader import benchmark_package_module

chaos = benchmark_package_module("chaos_check")
SEED = 7
CTX = 0
FIRST = 8 * chaos.CHUNK


def created(t1: float = 1.0) -> dict:
    return {"op": "create", "ctx": CTX, "after": 0, "n": FIRST, "t0": 0.0, "t1": t1, "outcome": "ok"}


def append(after: int, t0: float, t1: float, outcome: str = "ok") -> dict:
    return {"op": "append", "ctx": CTX, "after": after, "n": chaos.CHUNK, "t0": t0, "t1": t1, "outcome": outcome,
            "writer": True}


def answer(keys: int, serial: int = 0, **extra) -> dict:
    """A read's op whose answer is the float64 attention over the first ``keys`` keys."""
    k, v = chaos.stream(SEED, CTX, keys)
    out, lse = chaos.prefix_answers(chaos.query(SEED, CTX, serial), k, v)
    return {"ctx": CTX, "q": serial, "outcome": "ok", "out": out[keys].tolist(), "lse": lse[keys].tolist(), **extra}


def read(length: int, t0: float, t1: float, serial: int = 0) -> dict:
    return answer(length, serial, op="read", t0=t0, t1=t1)


def final(length: int, t0: float = 100.0) -> dict:
    return answer(length, 99, op="final", t0=t0, t1=t0 + 0.1, length=length)


def rules(history: list[dict]) -> list[str]:
    return [v.rule for v in chaos.check(history, SEED).violations]


def test_prefix_answers_match_a_materialised_float64_softmax():
    k, v = chaos.stream(SEED, CTX, 3 * chaos.CHUNK)
    q = chaos.query(SEED, CTX, 0)
    out, lse = chaos.prefix_answers(q, k, v)
    n = 2 * chaos.CHUNK
    s = np.einsum("hd,nd->hn", q[0].astype(np.float64), k[:n, 0].astype(np.float64)) / np.sqrt(chaos.D)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    want = p @ v[:n, 0].astype(np.float64) / p.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out[n], want, rtol=1e-12)
    np.testing.assert_allclose(lse[n], s.max(axis=1) + np.log(p.sum(axis=1)), rtol=1e-12)


def test_a_clean_history_has_no_violation():
    history = [created(), append(FIRST, 2.0, 3.0), read(FIRST + chaos.CHUNK, 4.0, 5.0), final(FIRST + chaos.CHUNK)]
    report = chaos.check(history, SEED)
    assert report.ok and report.reads_checked == 1 and report.finals_checked == 1


def test_a_read_concurrent_with_an_append_may_see_it_or_not():
    concurrent = append(FIRST, 2.0, 4.0)
    assert rules([created(), concurrent, read(FIRST + chaos.CHUNK, 3.0, 3.5)]) == []
    assert rules([created(), concurrent, read(FIRST, 3.0, 3.5)]) == []


def test_a_read_may_see_an_append_that_got_no_answer():
    assert rules([created(), append(FIRST, 2.0, 4.0, "unknown"), read(FIRST + chaos.CHUNK, 5.0, 6.0)]) == []


def test_a_read_missing_an_acknowledged_append_is_a_stale_read():
    assert rules([created(), append(FIRST, 2.0, 3.0), read(FIRST, 4.0, 5.0)]) == ["stale_read"]


def test_a_final_length_short_of_what_was_acknowledged_is_a_lost_ack():
    assert rules([created(), append(FIRST, 2.0, 3.0), final(FIRST)]) == ["lost_ack"]


def test_an_answer_from_keys_not_yet_sent_is_caught():
    # The second chunk is sent only after the read ended: the read cannot have seen it.
    history = [created(), append(FIRST, 2.0, 3.0), append(FIRST + chaos.CHUNK, 9.0, 10.0),
               read(FIRST + 2 * chaos.CHUNK, 4.0, 5.0)]
    assert rules(history) == ["unsent"]


def test_a_wrong_answer_is_caught():
    op = read(FIRST, 2.0, 3.0)
    op["out"][0][0] += 1e-2
    assert rules([created(), op]) == ["wrong"]


def test_an_answer_over_a_prefix_with_a_hole_is_wrong():
    k, v = chaos.stream(SEED, CTX, FIRST + chaos.CHUNK)
    holed = np.concatenate([np.arange(FIRST - chaos.CHUNK), np.arange(FIRST, FIRST + chaos.CHUNK)])
    out, lse = chaos.prefix_answers(chaos.query(SEED, CTX, 0), k[holed], v[holed])
    op = {"op": "read", "ctx": CTX, "q": 0, "t0": 4.0, "t1": 5.0, "outcome": "ok",
          "out": out[FIRST].tolist(), "lse": lse[FIRST].tolist()}
    assert rules([created(), append(FIRST, 2.0, 3.0), op]) == ["wrong"]


def test_a_deleted_context_that_answers_at_the_end_is_resurrected():
    deleted = {"op": "delete", "ctx": CTX, "t0": 2.0, "t1": 3.0, "outcome": "ok"}
    assert rules([created(), deleted, final(FIRST)]) == ["resurrected"]


def test_a_final_look_retried_is_judged_by_its_last_look_only():
    failed = {"op": "final_retry", "ctx": CTX, "t0": 99.0, "t1": 99.5, "outcome": "refused", "error": "503 x"}
    report = chaos.check([created(), failed, final(FIRST)], SEED)
    assert report.ok and report.unavailable_at_end == [] and report.finals_checked == 1
    last_failed = {**failed, "op": "final", "t0": 100.0}
    assert chaos.check([created(), failed, last_failed], SEED).unavailable_at_end == [CTX]


def test_availability_counts_answers_and_recovery_per_fault_kind():
    fault = {"op": "fault", "kind": "worker_kill", "t0": 10.0, "t1": 10.5, "target": "pid 1"}
    history = [created(), append(FIRST, 2.0, 3.0), fault, append(FIRST + 8, 11.0, 12.0, "refused"),
               append(FIRST + 8, 12.0, 14.0)]
    figures = chaos.availability(history)
    kill = figures["worker_kill"]
    assert (kill.injected, kill.requests, kill.answered, kill.recovery_s) == (1, 2, 1, [3.5])
    assert (figures["none"].requests, figures["none"].answered) == (1, 1)


def test_availability_per_fault_counts_right_refusals_as_answers_and_names_every_other_error():
    """Until 2026-12-07 a 404 of a churn context counted as unanswered here (answered in the replicated
    figure), and the requests before the first fault listed no errors."""
    fault = {"op": "fault", "kind": "worker_kill", "t0": 10.0, "t1": 10.5, "target": "pid 1"}
    history = [created(),
               {**append(FIRST, 2.0, 3.0, "refused"), "error": "503 workers_unavailable: x"},  # before the fault
               {**read(FIRST, 4.0, 4.5), "outcome": "refused", "error": "404 context_not_found"},  # right
               fault,
               {**read(FIRST, 11.0, 11.5), "outcome": "refused", "error": "404 context_not_found"},
               {**append(FIRST, 12.0, 13.0, "refused"), "error": "503 context_lost"}]
    figures = chaos.availability(history)
    none, kill = figures["none"], figures["worker_kill"]
    assert (none.requests, none.answered, dict(none.errors)) == (2, 1, {"503 workers_unavailable: x": 1})
    assert (kill.requests, kill.answered, dict(kill.errors)) == (2, 1, {"503 context_lost": 1})


def test_replicated_availability_leaves_out_each_fault_and_the_second_after_it():
    replicated = {**created(), "replicas": 2}
    single = {**created(), "ctx": 1, "replicas": 1}
    fault = {"op": "fault", "kind": "worker_pause", "t0": 10.0, "t1": 14.0, "target": "pid 1 for 4.0 s"}
    failed = {"op": "not injected", "kind": "worker_kill", "t0": 20.0, "t1": 20.0, "target": "not injected: x"}
    history = [replicated, single, fault, {**failed, "op": "fault"},
               append(FIRST, 2.0, 3.0),  # before: answered
               append(FIRST + 8, 12.0, 13.0, "refused"),  # during the pause: left out
               append(FIRST + 8, 9.0, 10.5, "refused"),  # in flight when it began: the fault's, left out
               append(FIRST + 8, 14.9, 15.5, "refused"),  # within the second after it: left out
               {**append(FIRST + 8, 15.2, 15.6, "refused"), "error": "503 workers_unavailable"},  # counted, lost
               {**append(FIRST + 8, 16.0, 16.5, "refused"), "error": "409 length_mismatch"},  # a right refusal
               {**append(FIRST + 8, 20.5, 21.0, "refused"), "error": "503 x"},  # a fault not injected: no window
               {**read(FIRST, 17.0, 17.5), "ctx": 1, "outcome": "refused"}]  # one replica: not counted
    out = chaos.outside_faults(history)
    assert (out.requests, out.answered) == (4, 2) and out.errors == {"503 workers_unavailable": 1, "503 x": 1}
    assert abs(out.share - 0.5) < 1e-12
