"""``splitkey loadtest``: the command line of the load generator (docs/LOADTEST.md).

Arguments become one :class:`~service.client.loadtest.config.SweepConfig` (a bad value
is exit status 2 naming the flag), :func:`~service.client.loadtest.runner.run_sweep`
runs it, and the results go to the console and, with ``--out DIR``, to JSON, CSV and
PNG files. Exit status 1 on any wrong answer, failed request or crossed ``--fail-on``
threshold, 130 when interrupted. Loopback or your own hosts only: it stops by itself.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import threading

from service.client.errors import SplitkeyError, UploadError
from service.client.loadtest.config import (
    MODES,
    TOLERANCE,
    FailOn,
    Shape,
    SweepConfig,
    parse_key_count,
    parse_list,
    parse_rate,
    parse_size,
)
from service.client.loadtest.metrics import METRICS
from service.client.loadtest.report import summary, write
from service.client.upload import TRANSPORT_ERRORS
from workers.dtypes import DTYPES

#: What else can stop a sweep before its points: a bad size for the server (an inline body over
#: its limit) or a connection that failed.
SETUP_ERRORS: tuple[type[Exception], ...] = (ValueError, *TRANSPORT_ERRORS)
#: Old names of the modes, still accepted.
ALIASES = {"context": "decode"}
DEFAULT_CONCURRENCY = "1,4,16"
#: Config fields whose flag is not the field's name with dashes.
FLAGS = {"duration_s": "--duration", "rates": "--rate", "modes": "--mode"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="service URL, e.g. http://127.0.0.1:8000 (required)")
    p.add_argument("--api-key-file", default=None, help="file with the bearer token (default: none, no auth)")
    w = p.add_argument_group("workloads")
    w.add_argument("--mode", default="decode", help=f"comma-separated modes: {', '.join(MODES)} (default decode)")
    w.add_argument("--n-k", default="64K", help="context lengths, e.g. 4K,64K,1M (default 64K)")
    w.add_argument("--n-q", type=int, default=1, help="queries per request of decode, inline, shared-prefix, "
                   "multi-turn (default 1)")
    w.add_argument("--prefill-n-q", type=int, default=256, help="new tokens per prefill request (default 256)")
    w.add_argument("--groups", type=int, default=4, help="shared-prefix: contexts after the prefix (default 4)")
    w.add_argument("--suffix-keys", default="4K", help="shared-prefix: keys of each of those (default 4K)")
    w.add_argument("--turn-keys", type=int, default=16, help="multi-turn: keys appended per turn (default 16)")
    w.add_argument("--conversations", type=int, default=8, help="prefill, multi-turn: conversations (default 8)")
    w.add_argument("--h-q", type=int, default=32, help="query heads (default 32, the decode shape)")
    w.add_argument("--h-kv", type=int, default=8, help="key/value heads, dividing --h-q (default 8)")
    w.add_argument("--d", type=int, default=128, help="query and key head size (default 128)")
    w.add_argument("--d-v", type=int, default=None, help="value head size (default --d)")
    w.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="dtype of the tensors sent and stored (default float32; bfloat16 halves the bytes)")
    w.add_argument("--replicas", type=int, default=1, help="replicas of each context stored (default 1)")
    w.add_argument("--chunk-keys", type=int, default=None, help="keys per upload chunk (default: from the server)")
    a = p.add_argument_group("arrivals")
    a.add_argument("--concurrency", default=None,
                   help=f"closed-loop levels (default {DEFAULT_CONCURRENCY}, none when --rate is given)")
    a.add_argument("--rate", default="", help="open-loop request rates per second, e.g. 2,8,32 (default: none)")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps (1: Poisson; < 1 burstier; default 1)")
    a.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per point at most; a point "
                   "ends at this or --requests, whichever comes first (default 30)")
    a.add_argument("--requests", type=int, default=200, help="requests per point at most; slow requests meet "
                   "--duration first and send fewer (default 200)")
    a.add_argument("--warmup", type=int, default=2, help="requests before each point, not counted (default 2)")
    a.add_argument("--max-inflight", type=int, default=256, help="open loop: requests in flight at most (default 256)")
    c = p.add_argument_group("checks and outputs")
    c.add_argument("--verify-every", type=int, default=10,
                   help="check every Nth answer against a float64 reference (default 10)")
    c.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help=f"largest relative error a checked answer may have (default {TOLERANCE:g})")
    c.add_argument("--slo-ms", type=float, default=None, help="latency objective in ms: goodput, SLO attainment "
                   "and a line on the latency plots (default: none)")
    c.add_argument("--fail-on", action="append", default=[], metavar="METRIC<op>N",
                   help="fail when a point crosses it, e.g. latency_p99_ms>500 (repeatable; default: none)")
    c.add_argument("--out", default=None, help="write results.json, results.csv and PNG plots here (default: "
                   "the console only)")
    c.add_argument("--per-request", action="store_true", help="also keep every request (JSON, requests.csv; "
                   "default off)")
    c.add_argument("--no-plots", action="store_true", help="with --out: no PNG files (default: plots when "
                   "matplotlib is installed)")
    c.add_argument("--seed", type=int, default=0, help="seed of every number sent (default 0)")


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    """The sweep the arguments describe; ValueError naming the flag for a bad value."""
    try:
        key = pathlib.Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    except OSError as exc:
        raise ValueError(f"--api-key-file must be a readable file, got {args.api_key_file!r}: "
                         f"{exc.strerror or exc}") from None
    # Each mode once, in the order first named (an old name and its new one are one mode).
    modes = tuple(dict.fromkeys(ALIASES.get(m.strip(), m.strip()) for m in args.mode.split(",") if m.strip()))
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--mode must list {', '.join(MODES)}, got {args.mode!r}")
    rates = tuple(parse_list(args.rate, "--rate", parse_rate))
    concurrency_text = args.concurrency if args.concurrency is not None else ("" if rates else DEFAULT_CONCURRENCY)
    try:
        concurrency = tuple(int(c) for c in concurrency_text.split(",") if c.strip())
    except ValueError:
        raise ValueError(f"--concurrency must list ints >= 1, got {concurrency_text!r}") from None
    if any(c < 1 for c in concurrency):
        raise ValueError(f"--concurrency must list ints >= 1, got {concurrency_text!r}")
    fail_on = tuple(FailOn.parse(f) for f in args.fail_on)
    for rule in fail_on:
        if rule.metric not in METRICS:
            raise ValueError(f"--fail-on must name one of {', '.join(METRICS)}, got {rule.metric!r}")
    try:
        shape = Shape(args.h_q, args.h_kv, args.d, args.d if args.d_v is None else args.d_v, args.dtype)
        return SweepConfig(
            url=args.url, api_key=key, modes=modes, n_k=tuple(parse_list(args.n_k, "--n-k", parse_key_count)),
            concurrency=concurrency, rates=rates, burstiness=args.burstiness, duration_s=args.duration,
            requests=args.requests, warmup=args.warmup, shape=shape, n_q=args.n_q, prefill_n_q=args.prefill_n_q,
            groups=args.groups, suffix_keys=parse_size(args.suffix_keys, "--suffix-keys"), turn_keys=args.turn_keys,
            conversations=args.conversations, replicas=args.replicas, max_inflight=args.max_inflight,
            verify_every=args.verify_every, tolerance=args.tolerance, slo_ms=args.slo_ms, fail_on=fail_on,
            seed=args.seed, chunk_keys=args.chunk_keys, per_request=args.per_request)
    except ValueError as exc:  # the dataclasses name fields; say them as flags
        name, _, rest = str(exc).partition(" ")
        flag = FLAGS.get(name, "--" + name.replace("_", "-")) if name.isidentifier() and rest else None
        raise ValueError(f"{flag} {rest}" if flag else str(exc)) from None


def writable_dir(path: str) -> None:
    """Make ``--out`` (and its parents) now, and check it takes files: before the run, not after it."""
    out = pathlib.Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ValueError(f"--out must be a directory this user can write, got {path!r}: {exc.strerror or exc}") from None


def setup_failed(exc: SplitkeyError, dtype: str) -> str:
    """What to tell the user when storing a ``dtype`` context failed."""
    hint = ""
    if exc.status == 507:
        smaller = "--dtype bfloat16 (half the bytes of float32), " if DTYPES[dtype].itemsize > 2 else ""
        hint = (f"; the workers' memory cannot hold the context: try {smaller}fewer keys (--n-k), or a server "
                "with more workers or a larger --worker-memory-bytes")
    what = "the context upload" if isinstance(exc, UploadError) else "a request of the setup"
    return f"splitkey loadtest: {what} failed: {exc}{hint}"


def main(args: argparse.Namespace) -> int:
    from service.client.loadtest.runner import run_sweep  # here: `splitkey --help` stays fast

    try:
        config = config_from_args(args)
        if args.out:
            writable_dir(args.out)
    except (ValueError, OSError) as exc:
        print(f"splitkey loadtest: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    try:
        result = run_sweep(config, stop=stop)
    except SplitkeyError as exc:
        print(setup_failed(exc, config.shape.dtype), file=sys.stderr)
        return 1
    except SETUP_ERRORS as exc:
        print(f"splitkey loadtest: {exc}", file=sys.stderr)
        return 1
    print(summary(result))
    if args.out:
        out = pathlib.Path(args.out)
        paths = write(result, out)
        if not args.no_plots:
            from service.client.loadtest import plots

            if plots.available():
                paths += plots.write_plots(result, out)
            else:
                print("splitkey loadtest: no plots: matplotlib is not installed (pip install 'splitkey[loadtest]')",
                      file=sys.stderr)
        print("wrote " + ", ".join(str(p) for p in paths))
    if result.interrupted:
        return 130
    return 0 if result.passed() else 1
