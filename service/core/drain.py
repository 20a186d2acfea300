"""Graceful shutdown (docs/SERVICE.md, "Stopping it"): SIGTERM or SIGINT drains, then stops.

``ray.init`` replaces the signal handlers uvicorn installed with its own, which kill
Ray's processes and exit at once (in-flight requests then got 500s). The lifespan
keeps uvicorn's handlers and, once Ray is up, installs :meth:`Drain.on_signal`:

1. ``/readyz`` answers 503 and every new request on a work route answers 503
   ``shutting_down`` (with ``Connection: close``): load balancers stop sending.
2. Requests in flight run to their end, for at most ``shutdown_grace_s`` (default 30 s);
   the ones still running then are cancelled and answered 503 ``shutting_down`` in the
   JSON error format.
3. Then the server stops (``splitkey serve`` tells uvicorn to exit; an app served some
   other way gets the handler the signal had before): ``splitkey serve`` first quiets the
   listener (:attr:`Drain.quiet`, service.core.listener: no new handshakes, the accept backlog
   taken and answered, so that closing it resets no connection), then uvicorn closes it and
   the connections (each with a lingering close, service.http_protocol) and runs the lifespan's end, which stops the workers and the embedded Ray.
   ``splitkey serve`` exits 0. A second signal during the drain skips what is left of
   the grace period; one after it (uvicorn waiting for answers in progress, such as a
   context write, which is never cut) stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

#: The signals that drain.
SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: How often the drain looks at what is still in flight.
POLL_S = 0.05
#: How long cancelled requests get to send their 503 before uvicorn closes their connections.
CUT_WAIT_S = 5.0

Handler = Callable[[int, Any], Any]


class Drain:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.draining = False
        self.cutting = False  # the grace period is over: cancelled requests answer 503
        self.inflight: set[asyncio.Task] = set()
        self._then: dict[int, Handler] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._skip = asyncio.Event()
        #: How to stop the server once drained (``splitkey serve`` sets uvicorn's ``should_exit``, so
        #: that the process exits 0); None: call the handler the signal had before (uvicorn's own,
        #: which exits by re-raising the signal).
        self.stop: Callable[[], None] | None = None
        #: How to stop at once, once :attr:`stop` was called and a signal comes again (``splitkey
        #: serve`` sets uvicorn's ``force_exit``: it then waits no more for answers in progress,
        #: such as a context write whose worker hangs, ``service.routes.common.to_completion``).
        self.force: Callable[[], None] | None = None
        self._stopped = False
        self._kept: int | None = None  #: a signal that came while Ray started (:meth:`kept`)
        #: What to await before :attr:`stop` (``splitkey serve``: stop taking connections and answer
        #: the ones the kernel accepted, service.core.listener.quiet); None: nothing.
        self.quiet: Callable[[], Awaitable[None]] | None = None

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """While Ray starts (``ray.init`` blocks the event loop): SIGTERM and SIGINT are noted, not acted
        on, and :meth:`install` then drains at once. Acted on in the middle of Ray's start, a signal
        ended the process with a traceback (status 3), its Ray session and agents left behind."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        for s in SIGNALS:
            signal.signal(s, self._keep)
        yield

    def _keep(self, signum: int, frame: Any) -> None:
        if self._kept is None:
            self._kept = signum
            log.warning("signal %d while the cluster starts: the server stops as soon as it has started", signum)

    def saved_handlers(self) -> dict[int, Any]:
        """The current handlers of :data:`SIGNALS` (uvicorn's, before ``ray.init`` replaces them)."""
        return {s: signal.getsignal(s) for s in SIGNALS}

    def install(self, then: dict[int, Any]) -> bool:
        """Drain on SIGTERM and SIGINT, then call ``then[signum]`` (uvicorn's handler); False when not
        on the main thread (an app served by a test client: signals are not ours to take there)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._then = {s: h for s, h in then.items() if callable(h)}
        self._loop = asyncio.get_running_loop()
        for s in SIGNALS:
            signal.signal(s, self.on_signal)
        if self._kept is not None:  # a signal came while Ray started (kept): drain now, nothing is in flight
            self.on_signal(self._kept, None)
        return True

    def on_signal(self, signum: int, frame: Any) -> None:
        """The signal handler (main thread): start the drain, or cut it short on a second signal."""
        if self._loop is None:
            return
        if self.draining:
            self._loop.call_soon_threadsafe(self._skip.set)
            if self._stopped and self.force is not None:
                log.warning("signal %d again: stopping now, without waiting for the answers in progress", signum)
                self._loop.call_soon_threadsafe(self.force)
            return
        self.draining = True
        log.warning("signal %d: draining %d request(s) for up to %g s", signum, len(self.inflight), self.grace_s)
        self._loop.call_soon_threadsafe(self._start, signum)

    def _start(self, signum: int) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drain(signum))

    async def _drain(self, signum: int) -> None:
        deadline = time.monotonic() + self.grace_s
        while self.inflight and time.monotonic() < deadline and not self._skip.is_set():
            await asyncio.sleep(POLL_S)
        if self.inflight:
            self.cutting = True
            log.warning("grace period over: %d request(s) still running are cut: a query is answered 503 "
                        "shutting_down, a context write runs to its end and answers what it did", len(self.inflight))
            for task in list(self.inflight):
                task.cancel()
            stop = time.monotonic() + CUT_WAIT_S
            while self.inflight and time.monotonic() < stop:
                await asyncio.sleep(POLL_S)
        if self.quiet is not None:
            await self.quiet()
        handler = self._then.get(signum) or self._then.get(signal.SIGTERM)
        self._stopped = True
        if self.stop is not None:
            self.stop()
        elif handler is not None:
            handler(signum, None)
        else:  # nobody to hand over to: the signal's default action, now that nothing is in flight
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def cut_detail(self) -> str:
        """Why the requests still in flight are cut, for their 503's detail: the grace period ended,
        or a second signal cut the drain short."""
        if self._skip.is_set():
            return "the request must finish before the server stops, got cut by a second signal during the drain"
        return f"the request must finish within the {self.grace_s:g} s shutdown grace period, got cut"

    def track(self) -> asyncio.Task | None:
        """Count the calling request as in flight (until :meth:`done`)."""
        task = asyncio.current_task()
        if task is not None:
            self.inflight.add(task)
        return task

    def done(self, task: asyncio.Task | None) -> None:
        if task is not None:
            self.inflight.discard(task)
