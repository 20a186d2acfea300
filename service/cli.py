"""The ``splitkey`` command: ``serve``, ``warm`` and ``loadtest``."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pydantic import ValidationError

from service import cli_settings
from service.core import logs

if TYPE_CHECKING:
    import uvicorn


def _serve(args: argparse.Namespace) -> int:
    import uvicorn  # imported here to keep `splitkey --help` fast

    from service.app import create_app
    from service.core import listener
    from service.core.connections import Connections, open_files_limit
    from service.core.settings import ServiceSettings
    from service.http_protocol import JsonErrorsProtocol

    try:
        settings = ServiceSettings(**cli_settings.layered(args, os.environ))
        settings.api_key()  # fail now, not at the first request, if the key file is unreadable
        warning = settings.check_exposure(args.insecure)
    except ValidationError as exc:
        print(f"splitkey serve: {cli_settings.explain(exc)}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"splitkey serve: {exc}", file=sys.stderr)
        return 2
    try:
        sock = listen(settings.host, settings.port)
    except OSError as exc:
        print(f"splitkey serve: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    # The other ports are tried now, so that one in use fails before Ray starts; the gRPC server and
    # service.metrics_listener bind them later.
    for other_host, other_port, flag in ((settings.host, settings.grpc_port, "--grpc-port"),
                                         (settings.metrics_host, settings.metrics_port, "--metrics-port")):
        if not other_port:
            continue
        try:
            listen(other_host, other_port).close()
        except OSError as exc:
            sock.close()
            print(f"splitkey serve: cannot listen on {other_host}:{other_port} ({flag}): {exc.strerror or exc}",
                  file=sys.stderr)
            return 1
    logs.configure(settings.log_format, settings.log_level)
    log = logging.getLogger("splitkey")
    if warning:
        log.warning(warning)
    for line in cli_settings.misspelt(os.environ):
        log.warning(line)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    log.info("splitkey starting on %s (the port is bound; it answers once the workers are up)", url)
    open_files = open_files_limit()
    connections = Connections(settings.connection_limits(open_files))
    log.info("at most %d connections at once (%s per client address; open-file limit %d)",
             connections.limits.total, connections.limits.per_client or "no bound", open_files)
    app = create_app(settings)
    state = app.state.splitkey

    def ready() -> None:
        pool = state.runtime.pool if state.runtime is not None else None
        log.info("splitkey ready on %s: %s", url, f"{pool.size} {pool.device} workers" if pool else "no workers")

    # log_config=None: uvicorn's own loggers go through the handler configured above (its format, its level).
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", log_config=None,
                            access_log=False, timeout_keep_alive=30,
                            http=JsonErrorsProtocol.configured(
                                admission=app.state.splitkey.admission,
                                check_s=settings.body_grace_s, min_rate=settings.min_body_rate,
                                head_timeout_s=settings.body_timeout_s,
                                connections=connections, retry_after_s=settings.retry_after_s))
    server = ready_server(ready)(config)

    def stop() -> None:  # after the drain (service.core.drain): exit without re-raising the signal, status 0
        server.should_exit = True

    def force() -> None:  # a signal after the drain: uvicorn waits no more for answers in progress
        server.force_exit = True

    # Before uvicorn closes the listener, which would reset the connections in its backlog.
    app.state.splitkey.drain.quiet = lambda: listener.quiet(sock)
    app.state.splitkey.drain.stop = stop
    app.state.splitkey.drain.force = force
    logging.getLogger("uvicorn.error").addFilter(lambda record: state.startup_error is None)  # one line, below
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn's answer to a failed start-up
        if state.startup_error is None:
            raise
    if state.startup_error is not None:
        print(f"splitkey serve: the start failed: {state.startup_error}", file=sys.stderr)
        return 1
    if getattr(server, "taken", None) is not None:  # ReadyServer's: its port was taken while it started
        print(f"splitkey serve: cannot listen on {settings.host}:{port}: Address already in use (another process "
              f"listened on it while this one started)", file=sys.stderr)
        return 1
    if server.started:
        log.info("splitkey stopped")
    return 0 if server.started else 1


def ready_server(on_ready: Callable[[], None]) -> type[uvicorn.Server]:
    """``uvicorn.Server`` that calls ``on_ready`` once its sockets listen: the lifespan (Ray, the workers)
    has started and connections are answered, not refused."""
    import uvicorn

    class ReadyServer(uvicorn.Server):
        #: The listening socket whose port another process took while this one started (None: all listen).
        taken: socket.socket | None = None

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            self.taken = next((sock for sock in sockets or () if not listening(sock)), None)
            if self.taken is not None:
                self.should_exit = True  # the lifespan's end runs (Ray stops), then serve() says why: status 1
            elif self.started and not self.should_exit:  # not when a signal came while it started
                on_ready()

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)
            if self.force_exit:  # uvicorn skips the lifespan's end then; cancelled later, it logged a
                await self.lifespan.shutdown()  # traceback and left Ray under the writes still running

    return ReadyServer


def listening(sock: socket.socket) -> bool:
    """Whether ``sock`` listens. A bound socket's ``listen`` can fail once the lifespan is done: with
    SO_REUSEADDR (which a restart needs) another process may bind the same port meanwhile and listen
    first, and the server then served nothing while it said it was ready."""
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:  # the event loop gave up the socket when its listen failed
        return False


def listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before the cluster starts (port 0: any free one).

    Binding first fails fast on a port in use, and keeps the port from the ephemeral ports
    that Ray and the workers' channels (docs/SERVICE.md, "The direct channel") bind while
    the lifespan starts them; uvicorn listens on it once the lifespan is done.
    """
    host = host.strip("[]")  # "[::1]" as in a URL
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may reuse TIME_WAIT
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock  # not inheritable (Python's default): Ray's processes started later must not hold it


def _loadtest(args: argparse.Namespace) -> int:
    from service.client.loadtest.cli import main as loadtest_main

    return loadtest_main(args)


def _warm(args: argparse.Namespace) -> int:
    from workers.fused import WARM_DTYPES, available, warm
    from workers.widen import load_widen16

    load_widen16()  # the NumPy kernel's float16 loop, into the same cache
    took = warm(threads=args.threads)
    if not available() or set(took) != set(WARM_DTYPES):
        print("splitkey warm: the fused CPU kernel cannot be compiled here (see the log above): workers serve "
              "on the NumPy kernel", file=sys.stderr)
        return 1
    print("splitkey warm: fused CPU kernel ready in numba's disk cache (" +
          ", ".join(f"{name} {sec:.1f} s" for name, sec in took.items()) + ")")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitkey", description="Exact split-key attention service.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the HTTP service (embedded Ray unless --ray-address)",
                       description="Start the HTTP service: an embedded local Ray on loopback, or joined to a "
                                   "cluster with --ray-address. Every setting is also read from its SPLITKEY_* "
                                   "environment variable and from a --config file; a flag given wins over the "
                                   "variable, the variable over the file. docs/API.md section 9 has the table.")
    s.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without --api-key-file (anyone who reaches it can use it)")
    s.add_argument("--config", metavar="FILE",
                   help="a TOML file of settings, keyed by their names (max_inflight or max-inflight); a flag or "
                        "a SPLITKEY_* variable wins over it (docs/SERVICE.md, 'A config file')")
    cli_settings.add_arguments(s)
    s.set_defaults(func=_serve)
    w = sub.add_parser("warm", help="compile the fused CPU kernel into numba's disk cache (images, CI)",
                       description="Compile (or load) the fused CPU kernel for every dtype it serves, into "
                                   "numba's disk cache (next to the package, or NUMBA_CACHE_DIR): workers started "
                                   "afterwards switch to it within a second or two instead of compiling for minutes "
                                   "in the background (--cpu-kernels auto) or before they serve (fused).")
    w.add_argument("--threads", type=int, default=1, help="numba threads to compile for (default: 1)")
    w.set_defaults(func=_warm)
    lt = sub.add_parser("loadtest", help="load-test a running service with long contexts")
    from service.client.loadtest.cli import add_arguments

    add_arguments(lt)
    lt.set_defaults(func=_loadtest)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's own parser, whose usage lists the flags it takes
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
