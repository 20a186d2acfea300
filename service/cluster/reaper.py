"""The embedded Ray follows its front end: a small watcher process that ends what it leaves behind.

After a SIGKILL of ``splitkey serve`` most of its embedded Ray ends at once, but Ray's
dashboard and runtime-env agents linger for about 60 s (they report the raylet's death
to a GCS that is gone, and wait for it). ``splitkey serve`` therefore starts this
watcher next to its embedded Ray (``service.cluster.connect``): it notes the front end's
descendants every :data:`POLL_S` and, when the front end's end closes the pipe it holds,
sends them SIGTERM, then SIGKILL to what is still there :data:`KILL_AFTER_S` later. Each
process is known by its pid and start time, so a reused pid is never touched. Linux only
(it reads ``/proc``); elsewhere it is not started.

    python -m service.cluster.reaper PARENT_PID     (stdin: the pipe the front end holds)
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from pathlib import Path

#: Seconds between looks at the front end's descendants.
POLL_S = 0.5
#: Seconds between SIGTERM and SIGKILL for what the front end left behind.
KILL_AFTER_S = 1.0

Proc = tuple[int, str]  # (pid, start time in clock ticks since boot)


def _stat(pid: int) -> tuple[int, str] | None:
    """``(parent pid, start time)`` of a live process, None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    if fields[0] == "Z":
        return None
    return int(fields[1]), fields[19]


def descendants(root: int) -> set[Proc]:
    """Every live process below ``root``, as ``(pid, start time)``."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry))
                started[int(entry)] = st[1]
    found: set[Proc] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child in started and (child, started[child]) not in found:
                found.add((child, started[child]))
                todo.append(child)
    return found


def _signal_all(procs: set[Proc], signum: int) -> set[Proc]:
    """Send ``signum`` to the processes still alive as themselves; the ones it reached."""
    reached = set()
    for pid, start in procs:
        st = _stat(pid)
        if st is not None and st[1] == start:
            try:
                os.kill(pid, signum)
                reached.add((pid, start))
            except OSError:
                pass
    return reached


def watch(parent: int, pipe: int) -> None:
    """Until ``pipe`` reads EOF (the parent ended), note ``parent``'s descendants; then end them."""
    me = os.getpid()
    seen: set[Proc] = set()
    while True:
        seen |= {p for p in descendants(parent) if p[0] != me}
        ready, _, _ = select.select([pipe], [], [], POLL_S)
        if ready and not os.read(pipe, 4096):
            break
        if _stat(parent) is None:
            break
    left = _signal_all(seen, signal.SIGTERM)
    if left:
        time.sleep(KILL_AFTER_S)
        _signal_all(left, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m service.cluster.reaper PARENT_PID", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C for the front end is not for this watcher
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nor a SIGTERM sent to the whole group: it ends after them
    watch(int(argv[0]), sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
