"""A write's lease on a context: short, renewed while the write runs, bounded in all (issue 50).

Until 2026-12-07 a lease lasted 60 s: a front end killed while holding one (SIGKILL in the fault
soak) kept every other front end's writes to that context waiting for a minute. Now it lasts
``LEASE_TTL_S`` and its holder renews it while it works, up to ``LEASE_MAX_S``.
"""

import asyncio
import time

from faulty_pool import kv, started, write

from service.contexts import service as contexts_service
from service.core.metrics import Timings

TTL_S, RENEW_S, MAX_S = 0.3, 0.1, 1.0


def short_leases(monkeypatch):
    monkeypatch.setattr(contexts_service, "LEASE_TTL_S", TTL_S)
    monkeypatch.setattr(contexts_service, "LEASE_RENEW_S", RENEW_S)
    monkeypatch.setattr(contexts_service, "LEASE_MAX_S", MAX_S)


def test_a_renewal_never_takes_back_a_lease_released_or_lapsed():
    async def main():
        pool, directory, _ = await started(2)
        try:
            assert await directory.acquire("c1", "a", TTL_S)
            assert await directory.renew("c1", "a", TTL_S)
            await directory.release("c1", "a")
            assert not await directory.renew("c1", "a", TTL_S)  # a renewal late for its release
            assert await directory.acquire("c1", "b", TTL_S)
            assert not await directory.renew("c1", "a", TTL_S)  # nor another holder's
            await asyncio.sleep(TTL_S + 0.05)
            assert not await directory.renew("c1", "b", TTL_S)  # lapsed: taken again only by acquire
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_write_longer_than_the_lease_keeps_it_by_renewing_up_to_its_bound(monkeypatch, rng):
    short_leases(monkeypatch)

    async def main():
        pool, directory, contexts = await started(2)
        try:
            ctx = (await contexts.create(write(*kv(rng, 10)), Timings()))["id"]
            async with contexts._lease(ctx, Timings()):
                await asyncio.sleep(3 * TTL_S)  # renewed meanwhile: still this write's
                assert not await directory.acquire(ctx, "another front end", TTL_S)
                await asyncio.sleep(MAX_S)  # past the bound: renewals stopped, the lease lapsed
                assert await directory.acquire(ctx, "another front end", TTL_S)
                await directory.release(ctx, "another front end")
            async with contexts._lease(ctx, Timings()):  # released: taken again at once
                pass
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_lease_whose_holder_died_lets_the_next_write_in_after_the_ttl(monkeypatch, rng):
    short_leases(monkeypatch)

    async def main():
        pool, directory, contexts = await started(2)
        try:
            k, v = kv(rng, 12)
            ctx = (await contexts.create(write(k[:10], v[:10]), Timings()))["id"]
            assert await directory.acquire(ctx, "a front end killed while writing", TTL_S)  # never renewed
            began = time.monotonic()
            desc = await asyncio.wait_for(contexts.append(ctx, write(k[10:], v[10:], after=10), Timings()), 10)
            took = time.monotonic() - began
            assert desc["length"] == 12 and 0.5 * TTL_S <= took < TTL_S + 1.0, (desc, took)
        finally:
            pool.shutdown()

    asyncio.run(main())


def test_a_release_the_stopping_server_cannot_make_leaves_the_writes_own_outcome(monkeypatch, rng):
    """A second signal stops the server while a write is in flight; the lifespan has left Ray,
    so the release raises ShuttingDown (service.contexts.directory). A write that was cut ends
    with its own cancel (nothing logged as a crash); one that finished is answered 503."""
    import pytest

    from service.core.errors import ShuttingDown

    async def main():
        pool, directory, contexts = await started(2)
        try:
            cut, done = [(await contexts.create(write(*kv(rng, 10)), Timings()))["id"] for _ in range(2)]

            async def gone(*_args):
                raise ShuttingDown("the server is stopping")

            monkeypatch.setattr(directory, "release", gone)
            with pytest.raises(asyncio.CancelledError):
                async with contexts._lease(cut, Timings()):
                    raise asyncio.CancelledError
            with pytest.raises(ShuttingDown):  # (another context: cut's lease is left to expire)
                async with contexts._lease(done, Timings()):
                    pass
        finally:
            pool.shutdown()

    asyncio.run(main())
