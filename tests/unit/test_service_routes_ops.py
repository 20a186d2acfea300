"""Readiness follows what can be served (issue 50, finding 3): a front end with a worker left is ready and
says what was lost beside it, on /readyz and on the KServe probes."""

import asyncio
import types

import httpx

from service.app import create_app
from service.cluster.local import LocalPool
from service.core.settings import ServiceSettings


def test_a_front_end_that_lost_one_of_two_workers_stays_ready_and_says_it_is_degraded():
    async def main():
        settings = ServiceSettings(workers=2)
        app = create_app(settings)
        pool = await LocalPool.start(settings, workers=2)
        stats = types.SimpleNamespace(lost_shards=0)
        # The routes read the pool and the repair loop's counts off the runtime; the lifespan (Ray) is not run.
        app.state.splitkey.runtime = types.SimpleNamespace(pool=pool, repair=types.SimpleNamespace(stats=stats))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
                r = await c.get("/readyz")
                assert r.status_code == 200 and r.json() == {"ready": True, "workers": 2, "alive": 2,
                                                             "degraded": False, "lost_shards": 0}
                pool.stop(1)
                stats.lost_shards = 3
                for _ in range(5):  # counted dead within a few pings (service.cluster.surface.missed_ping)
                    r = await c.get("/readyz")
                    if r.json()["alive"] == 1:
                        break
                assert r.status_code == 200 and r.json() == {"ready": True, "workers": 2, "alive": 1,
                                                             "degraded": True, "lost_shards": 3}
                assert (await c.get("/v2/health/ready")).status_code == 200
                pool.stop(0)
                for _ in range(5):
                    r = await c.get("/readyz")
                    if r.json()["alive"] == 0:
                        break
                assert r.status_code == 503 and not r.json()["ready"]
                assert (await c.get("/v2/health/ready")).status_code == 503
        finally:
            pool.shutdown()

    asyncio.run(main())
