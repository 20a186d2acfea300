"""The ``splitkey`` command: ``serve`` and ``loadtest``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pydantic import ValidationError


def _serve(args: argparse.Namespace) -> int:
    import uvicorn  # imported here to keep `splitkey --help` fast

    from service.app import create_app
    from service.settings import ServiceSettings

    given = {k: v for k, v in {
        "host": args.host, "port": args.port, "ray_address": args.ray_address, "workers": args.workers,
        "device": args.device, "api_key_file": args.api_key_file, "max_body_bytes": args.max_body_bytes,
        "max_inflight": args.max_inflight, "request_timeout_s": args.request_timeout,
        "max_inflight_bytes": args.max_inflight_bytes, "body_timeout_s": args.body_timeout,
        "min_body_rate": args.min_body_rate, "body_grace_s": args.body_grace,
        "worker_memory_bytes": args.worker_memory_bytes, "batch_rows": args.batch_rows,
        "worker_cpus": args.worker_cpus, "shutdown_grace_s": args.shutdown_grace, "persist_dir": args.persist_dir,
    }.items() if v is not None}
    try:
        settings = ServiceSettings(**given)
        settings.api_key()  # fail now, not at the first request, if the key file is unreadable
        warning = settings.check_exposure(args.insecure)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"splitkey serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if warning:
        logging.getLogger("splitkey").warning(warning)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                           timeout_keep_alive=30))

    def stop() -> None:  # after the drain (service.drain): exit without re-raising the signal, status 0
        server.should_exit = True

    app.state.splitkey.drain.stop = stop
    server.run()
    return 0 if server.started else 1


def _loadtest(args: argparse.Namespace) -> int:
    from service.client.loadtest.cli import main as loadtest_main

    return loadtest_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitkey", description="Exact split-key attention service.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the HTTP service (embedded Ray unless --ray-address)")
    s.add_argument("--host", default=None, help="bind address (default 127.0.0.1; another needs --api-key-file "
                   "or --insecure)")
    s.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without --api-key-file (anyone who reaches it can use it)")
    s.add_argument("--port", type=int, default=None, help="port (default 8000)")
    s.add_argument("--ray-address", default=None, help="'auto' or HOST:PORT to join a cluster; omit for embedded Ray")
    s.add_argument("--workers", type=int, default=None, help="shard workers (default one per CPU, or per GPU)")
    s.add_argument("--device", choices=["auto", "cpu", "gpu"], default=None, help="kernel device (default cpu)")
    s.add_argument("--api-key-file", default=None, help="file with the bearer token; unset: no auth")
    s.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (default 2 GiB)")
    s.add_argument("--max-inflight", type=int, default=None, help="requests admitted at once (default 64)")
    s.add_argument("--max-inflight-bytes", type=int, default=None,
                   help="request body bytes held at once by all requests together (default 4 GiB; 429 past it)")
    s.add_argument("--request-timeout", type=float, default=None, help="per-request deadline in seconds (default 120)")
    s.add_argument("--body-timeout", type=float, default=None,
                   help="seconds a request body may take to arrive (default 120; 408 past it)")
    s.add_argument("--min-body-rate", type=float, default=None,
                   help="bytes/s a body must average once --body-grace is over (default 65536; 0: none)")
    s.add_argument("--body-grace", type=float, default=None,
                   help="seconds a body may start slowly or pause before --min-body-rate applies (default 10)")
    s.add_argument("--persist-dir", default=None,
                   help="keep resident contexts on disk here and load them when the service starts again")
    s.add_argument("--shutdown-grace", type=float, default=None,
                   help="on SIGTERM/SIGINT, seconds requests in flight may run before they are cut (default 30)")
    s.add_argument("--worker-cpus", type=float, default=None,
                   help="CPUs Ray reserves for each worker (default 1; e.g. 0.5 for two workers per core)")
    s.add_argument("--worker-memory-bytes", type=int, default=None, help="resident context bytes per worker (default 4 GiB)")
    s.add_argument("--batch-rows", type=int, default=None,
                   help="query rows one pass over resident keys serves together (default 1024; 1: no batching)")
    s.set_defaults(func=_serve)
    lt = sub.add_parser("loadtest", help="load-test a running service with long contexts")
    from service.client.loadtest.cli import add_arguments

    add_arguments(lt)
    lt.set_defaults(func=_loadtest)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
