"""Progress on stderr: an upload's percent and GB/s, and a live line per point of the sweep.

On a terminal a line rewrites itself; otherwise (a log file, CI) a line is written
every tenth of an upload and every :data:`LOG_EVERY_S` seconds of a point.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

#: Seconds between live lines on a terminal, and when writing to a file.
TTY_EVERY_S, LOG_EVERY_S = 0.5, 10.0


class UploadProgress:
    """``progress(done, total)`` of an upload: ``label``, percent, keys and GB/s.

    An upload done in one chunk writes nothing. When it is done, ``done`` (if given) gets its record:
    ``label``, ``keys``, ``gb`` (of K+V), ``seconds`` and ``gb_per_s`` (results.json's ``uploads``).
    """

    def __init__(self, key_bytes: int, stream: TextIO | None = None, label: str = "upload",
                 done: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.key_bytes = key_bytes
        self.label = label
        self.done = done
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.calls = 0
        self.tenths = 0  # tenths written so far (not on a terminal)

    def __call__(self, done: int, total: int) -> None:
        self.calls += 1
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        if done >= total and self.done is not None:  # once: the record goes, the callback is dropped
            record, self.done = self.done, None
            gb = total * self.key_bytes / 1e9
            record({"label": self.label.removeprefix("upload "), "keys": total, "gb": gb, "seconds": seconds,
                    "gb_per_s": gb / seconds})
        if self.calls == 1 and done >= total:
            return
        line = (f"{self.label} {100 * done / total:5.1f}%  {done}/{total} keys  "
                f"{done * self.key_bytes / seconds / 1e9:.2f} GB/s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
        elif 10 * done // total > self.tenths:
            self.tenths = 10 * done // total
            self.stream.write(line + "\n")
        self.stream.flush()


class LiveLine:
    """The running count of one point: ``label: N done, F failed, R req/s, p50 X ms``."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.every = TTY_EVERY_S if self.tty else LOG_EVERY_S
        self.t0 = self.last = time.perf_counter()
        self.done = self.failed = 0
        self.written = (-1, -1)  # (done, failed) of the last line written
        self.latencies: list[float] = []
        self.lock = threading.Lock()

    def add(self, ok: bool, latency_s: float) -> None:
        with self.lock:
            if ok:
                self.done += 1
                self.latencies.append(latency_s)
            else:
                self.failed += 1
            now = time.perf_counter()
            if now - self.last >= self.every:
                self.last = now
                self._write(final=False)

    def close(self) -> None:
        with self.lock:
            self._write(final=True)

    def _write(self, final: bool) -> None:
        if not self.tty and final and self.written == (self.done, self.failed):
            return  # the last line says it already
        self.written = (self.done, self.failed)
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        p50 = sorted(self.latencies)[len(self.latencies) // 2] * 1000 if self.latencies else float("nan")
        line = (f"{self.label}: {self.done} done, {self.failed} failed, {self.done / seconds:.1f} req/s, "
                f"p50 {p50:.1f} ms, {seconds:.0f} s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
