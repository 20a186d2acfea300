"""Admission control: request slots and the in-flight body budget (service.core.admission)."""

import pytest

from service.core.admission import Admission
from service.core.errors import Overloaded
from service.core.metrics import Metrics


def admission(max_inflight: int = 2, max_inflight_bytes: int = 100) -> Admission:
    return Admission(max_inflight=max_inflight, max_inflight_bytes=max_inflight_bytes, retry_after_s=1,
                     metrics=Metrics())


def rejected(a: Admission, reason: str) -> float:
    return a.metrics.rejected.labels(reason=reason)._value.get()


def test_slots_are_taken_once_per_ticket_and_given_back_on_release():
    a = admission(max_inflight=2)
    t1, t2, t3 = a.ticket(), a.ticket(), a.ticket()
    t1.admit()
    t1.admit()  # idempotent: one request, one slot
    t2.admit()
    with pytest.raises(Overloaded, match="in-flight requests must be at most 2 at once") as err:
        t3.admit()
    assert err.value.headers["Retry-After"] == "1" and rejected(a, "inflight") == 1
    t1.release()
    t1.release()  # idempotent too
    t3.admit()
    assert a.inflight == 2


def test_body_bytes_are_charged_as_they_arrive_and_refused_past_the_budget():
    a = admission(max_inflight_bytes=100)
    t1, t2 = a.ticket(), a.ticket()
    t1.charge(60)
    t2.charge(40)
    with pytest.raises(Overloaded, match="within 100 bytes, 100 are held, got 41 bytes of this body"):
        t2.charge(1)
    assert a.body_bytes == 100 and rejected(a, "body_bytes") == 1
    t1.release()
    assert a.body_bytes == 40
    t2.charge(60)
    t2.release()
    assert a.body_bytes == 0 and a.metrics.inflight_body_bytes._value.get() == 0


def test_a_declared_length_that_cannot_fit_now_is_refused_before_reading():
    a = admission(max_inflight_bytes=100)
    busy = a.ticket()
    busy.charge(70)
    with pytest.raises(Overloaded, match="got Content-Length 31"):
        a.ticket().expect(31)
    a.ticket().expect(30)  # fits: nothing is charged by expecting
    assert a.body_bytes == 70


def test_declared_but_unsent_bytes_cost_nothing():
    a = admission(max_inflight_bytes=100)
    for _ in range(10):
        a.ticket().expect(100)  # ten clients each declaring the whole budget and sending nothing
    assert a.body_bytes == 0
