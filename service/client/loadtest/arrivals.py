"""When requests are sent: closed loops (a fixed number of clients) and open loops (a rate).

Both take ``request(client, i, due) -> R``, which sends request ``i`` and measures it
from ``due`` (a ``time.perf_counter()`` value), and return what the requests returned
in completion order with the point's wall time. One :class:`~service.client.Client`
per thread (a client holds one connection). Both stop at ``max_requests`` or
``max_seconds``, whichever comes first, or when ``stop`` is set (Ctrl-C).

Open loop (docs/LOADTEST.md, "Arrivals"): arrival gaps are drawn from a gamma
distribution of shape ``burstiness`` and mean ``1 / rate`` (shape 1: a Poisson
process; below 1: burstier; above: more regular), as ``vllm bench serve`` does. A
request's latency counts from its arrival time, also when all ``max_inflight``
senders were busy and it waited for one, so a saturated service is not hidden by a
load generator that slows down with it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from service.client.sync import Client

R = TypeVar("R")
#: ``request(client, index, due)``: send request ``index``; its record.
Request = Callable[[Client, int, float], R]
#: ``on_done(record)``: called once per finished request (from the sending thread).
OnDone = Callable[[R], None]


class _Clients(Generic[R]):
    """One client per thread, all closed at the end."""

    def __init__(self, make_client: Callable[[], Client]) -> None:
        self.make_client = make_client
        self.local = threading.local()
        self.all: list[Client] = []
        self.lock = threading.Lock()

    def get(self) -> Client:
        client = getattr(self.local, "client", None)
        if client is None:
            client = self.local.client = self.make_client()
            with self.lock:
                self.all.append(client)
        return client

    def close(self) -> None:
        for c in self.all:
            c.close()


def closed_loop(make_client: Callable[[], Client], request: Request[R], concurrency: int, max_requests: int,
                max_seconds: float, *, first: int = 0, stop: threading.Event | None = None,
                on_done: OnDone[R] | None = None) -> tuple[list[R], float]:
    """``concurrency`` clients, each sending its next request when its last one is answered.

    Requests are numbered ``first, first + 1, ...``.
    """
    if type(concurrency) is not int or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    stop = stop or threading.Event()
    records: list[R] = []
    lock = threading.Lock()
    issued = [0]
    t0 = time.perf_counter()
    deadline = t0 + max_seconds

    def worker() -> None:
        client = make_client()
        try:
            while True:
                with lock:
                    if issued[0] >= max_requests or time.perf_counter() > deadline or stop.is_set():
                        return
                    i = first + issued[0]
                    issued[0] += 1
                rec = request(client, i, time.perf_counter())
                with lock:
                    records.append(rec)
                if on_done is not None:
                    on_done(rec)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, daemon=True, name=f"loadtest-{n}") for n in range(concurrency)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:
        stop.set()  # Ctrl-C in join: the senders stop after their request in flight
        raise
    return records, time.perf_counter() - t0


def gaps(rate: float, burstiness: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival gaps in seconds: gamma of shape ``burstiness``, mean ``1 / rate``."""
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be > 0, got rate={rate!r}, burstiness={burstiness!r}")
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)


def open_loop(make_client: Callable[[], Client], request: Request[R], rate: float, burstiness: float,
              max_requests: int, max_seconds: float, *, max_inflight: int = 256, first: int = 0,
              rng: np.random.Generator | None = None, stop: threading.Event | None = None,
              on_done: OnDone[R] | None = None) -> tuple[list[R], float]:
    """Requests arrive at ``rate`` per second (gamma gaps of shape ``burstiness``), whatever the answers do."""
    stop = stop or threading.Event()
    rng = rng if rng is not None else np.random.default_rng()
    arrivals = np.cumsum(gaps(rate, burstiness, max_requests, rng))  # seconds after t0
    clients: _Clients[R] = _Clients(make_client)
    records: list[R] = []
    lock = threading.Lock()

    def send(i: int, due: float) -> None:
        rec = request(clients.get(), i, due)
        with lock:
            records.append(rec)
        if on_done is not None:
            on_done(rec)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="loadtest")
    t0 = time.perf_counter()
    futures = []
    try:
        for n, at in enumerate(arrivals):
            if at > max_seconds or stop.is_set():
                break
            wait = t0 + at - time.perf_counter()
            if wait > 0 and stop.wait(wait):
                break
            futures.append(pool.submit(send, first + n, t0 + at))
        for f in futures:
            f.result()
    except BaseException:
        stop.set()  # Ctrl-C: arrivals not yet sent are dropped, those in flight finish
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        clients.close()
    return records, time.perf_counter() - t0
