"""Which connections the front end holds (service.core.connections): the idle one longest closes for a
new one at a limit, a new one with none idle is refused, per client and in all."""

from __future__ import annotations

import pytest

from service.core.connections import ConnectionLimits, Connections


class Conn:
    """A connection as the HTTP protocol reports it: closing it tells the counter it is gone."""

    def __init__(self, held: Connections, client: str = "10.0.0.1") -> None:
        self.held, self.client, self.closed = held, client, False

    def close(self) -> None:
        self.closed = True

    def open(self) -> bool:
        return self.held.admit(self, self.client, self.close)


def test_at_the_limit_the_connection_idle_longest_closes_for_a_new_one():
    held = Connections(ConnectionLimits(total=3, per_client=None))
    a, b, c, d = (Conn(held) for _ in range(4))
    assert a.open() and b.open() and c.open()
    held.busy(a)  # in a request: never closed for another
    held.busy(b)
    held.idle(b, b.close)  # answered: idle again, but since after c
    assert d.open()
    assert (a.closed, b.closed, c.closed) == (False, False, True) and held.held == 3


def test_with_none_idle_a_new_connection_is_refused_and_nothing_is_closed():
    held = Connections(ConnectionLimits(total=2, per_client=None))
    a, b = Conn(held), Conn(held)
    assert a.open() and b.open()
    held.busy(a)
    held.busy(b)
    assert not Conn(held).open()
    assert not a.closed and not b.closed and held.held == 2
    held.gone(a)
    held.gone(a)  # reported twice (closed for another, then lost): counted once
    assert Conn(held).open() and held.held == 2


def test_a_client_at_its_own_limit_closes_its_own_idle_connection_not_anothers():
    held = Connections(ConnectionLimits(total=10, per_client=2))
    other = Conn(held, "10.0.0.2")
    first, second, third = Conn(held), Conn(held), Conn(held)
    assert other.open() and first.open() and second.open()
    assert third.open()
    assert first.closed and not other.closed
    held.busy(second)
    held.busy(third)
    assert not Conn(held).open()  # none of its own idle: refused, though another client's is
    assert not other.closed
    assert Conn(held, "10.0.0.3").open()  # another address still has room


def test_refusals_answered_at_once_are_an_eighth_of_the_total():
    held = Connections(ConnectionLimits(total=16, per_client=None))
    assert held.may_answer_refusal() and held.may_answer_refusal()
    assert not held.may_answer_refusal()
    held.refusal_sent()
    assert held.may_answer_refusal()


def test_the_default_total_leaves_half_the_open_file_limit_to_the_rest_of_the_process():
    limits = ConnectionLimits.sized(None, None, open_files=20000)
    assert limits.total == 8888 and limits.total + limits.refusing <= 10000
    assert ConnectionLimits.sized(50, 5, open_files=20000) == ConnectionLimits(total=50, per_client=5)
    with pytest.raises(ValueError, match="total must be an int >= 1, got 0"):
        ConnectionLimits(total=0, per_client=None)
