"""Closing the listening socket without resetting the connections the kernel accepted for it.

Closing a listening socket resets (RST) every connection in its accept backlog: connections
whose handshake the kernel completed and whose request may already be sent, but which the
server had not yet accepted. Their clients cannot tell whether the request ran. A drain
(service.core.drain) therefore quiets the socket before ``splitkey serve`` closes it:

1. new handshakes stop: a socket filter drops incoming SYNs (Linux; elsewhere this step is
   skipped). A client whose SYN is dropped sends it again about a second later, to a closed
   port by then, and gets "connection refused": it knows its request was never sent.
2. the event loop accepts what is in the backlog, and each accepted connection's request is
   answered (503 ``shutting_down``, the drain's answer) for :data:`SETTLE_S`.
3. only then is the socket closed, with an empty backlog.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import select
import socket
import sys
import time

log = logging.getLogger(__name__)

#: ``SO_ATTACH_FILTER`` (Linux, asm-generic/socket.h).
SO_ATTACH_FILTER = 26
#: A classic BPF program over the TCP header (a TCP socket's filter sees it at offset 0): drop a
#: segment with SYN set, keep every other whole. (code, jt, jf, k) per instruction.
DROP_SYN = (
    (0x30, 0, 0, 13),  # ldb [13]: the TCP flags byte
    (0x45, 0, 1, 0x02),  # jset #SYN: next (drop), else skip one (keep)
    (0x06, 0, 0, 0),  # ret #0: drop
    (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1: keep the whole segment
)
#: How often the backlog is looked at, and for how long it must stay empty.
POLL_S = 0.02
#: How long accepted connections get to send their request and read its answer once the backlog
#: is empty (on loopback and in a data centre a request follows its handshake within milliseconds).
SETTLE_S = 0.2
#: The most the whole quieting takes (a client that keeps a connection open without sending is
#: closed by the server's stop, as every idle connection is).
LIMIT_S = 2.0


class _Instruction(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Instruction))]


def refuse_new_connections(sock: socket.socket) -> bool:
    """Drop the SYNs that reach ``sock`` from now on (the connections already made are kept);
    False where the platform has no socket filters (the close may then reset the backlog)."""
    if not sys.platform.startswith("linux"):
        return False
    code = (_Instruction * len(DROP_SYN))(*(_Instruction(*i) for i in DROP_SYN))
    program = _Program(len(DROP_SYN), ctypes.cast(code, ctypes.POINTER(_Instruction)))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(program))  # the kernel copies the program
    except OSError as exc:
        log.warning("cannot stop new connections before closing the listener (%s): the close may reset some", exc)
        return False
    return True


def _backlog_waits(sock: socket.socket) -> bool:
    """Whether a connection waits in ``sock``'s accept backlog (the listener is readable)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


async def quiet(sock: socket.socket, *, settle_s: float = SETTLE_S, limit_s: float = LIMIT_S) -> None:
    """Stop new connections to ``sock`` and return once the event loop has accepted its backlog
    and given those connections ``settle_s`` to be answered (``limit_s`` at most); the caller then
    closes it."""
    if sock.fileno() < 0 or not refuse_new_connections(sock):
        return
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # stopped before it listened: no backlog
        return
    stop = time.monotonic() + limit_s
    empty_since = time.monotonic()
    while time.monotonic() < stop:
        if _backlog_waits(sock):
            empty_since = time.monotonic()
        elif time.monotonic() - empty_since >= settle_s:
            return
        await asyncio.sleep(POLL_S)
    log.warning("the listener's backlog did not empty within %g s: the close may reset some connections", limit_s)
