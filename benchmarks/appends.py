"""One-key appends against decode queries (issue 47, point 3): is an append cheap enough for the decode path?

Run from the repository root (``pip install -e '.[bench]'``)::

    .venv/bin/python benchmarks/appends.py --rounds 400 --out /tmp/appends.md
    .venv/bin/python benchmarks/appends.py --quick          # smoke run, 40 rounds

One ``splitkey serve --workers 2`` (embedded Ray, on loopback) holds three contexts of
``h_kv=8, d=128``, float32: a 4096-key context that decode queries read (``n_q=1, h_q=32``,
two shards of 2048 keys, one per worker) and two contexts that take appends, one with
``replicas=1`` and one with ``replicas=2`` (each created with 16 keys). Each round sends, from
one client in turn, a one-key append to each of the two, then one decode query: the three
are timed side by side under the same load. ``--warmup`` rounds come first and are not counted.

Reported: p50, p90 and p99 of each kind, the ratio of each append's p50 to the decode's, and the
median Server-Timing stages of the appends (each stage's share of the median total).

Target: the replicas-1 append's p50 <= the decode query's p50.

``--baseline DIR`` first runs the same rounds against a server from another checkout (say
``git archive`` of an earlier commit unpacked in DIR), then against this tree's: before and after
on the same machine in one run, one server at a time.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common
from benchmarks.service import TimedClient

HEADS = {"h_q": 32, "h_kv": 8, "d": 128}
DECODE_KEYS = 4096
START_KEYS = 16
SEED = 20261206
#: Server-Timing stages of an append, in the order they run (others the server reports follow).
APPEND_STAGES = ("parse", "put", "lease", "place", "store", "commit", "note", "total")
KINDS = ("append r1", "append r2", "decode")


def arrays(n_k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    shape = (n_k, HEADS["h_kv"], HEADS["d"])
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def percentile(seconds: Sequence[float], p: float) -> float:
    return float(np.percentile(seconds, p)) if seconds else float("nan")


def run(url: str, args: argparse.Namespace) -> dict[str, list[common.Record]]:
    rng = np.random.default_rng(SEED)
    q = rng.standard_normal((1, HEADS["h_q"], HEADS["d"]), dtype=np.float32)
    one_k, one_v = arrays(1, rng)
    records: dict[str, list[common.Record]] = {kind: [] for kind in KINDS}
    with TimedClient(url) as c:
        decode_id = c.create_context(*arrays(DECODE_KEYS, rng))["id"]
        r1 = c.create_context(*arrays(START_KEYS, rng), replicas=1)["id"]
        r2 = c.create_context(*arrays(START_KEYS, rng), replicas=2)["id"]
        calls = {"append r1": lambda: c.append(r1, one_k, one_v),
                 "append r2": lambda: c.append(r2, one_k, one_v),
                 "decode": lambda: c.attention(q, contexts=[decode_id])}
        for i in range(args.warmup + args.rounds):
            for kind in KINDS:
                t0 = time.perf_counter()
                calls[kind]()
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    records[kind].append(common.Record(dt, c.last_stages()))
        for ctx_id, want in ((r1, START_KEYS), (r2, START_KEYS)):
            got = c.get_context(ctx_id)["length"]
            if got != want + args.warmup + args.rounds:
                raise RuntimeError(f"context {ctx_id} holds {got} keys, not {want + args.warmup + args.rounds}")
    return records


def report(args: argparse.Namespace, runs: dict[str, dict[str, list[common.Record]]], notes: list[str]) -> str:
    command = " ".join([".venv/bin/python", "benchmarks/appends.py", *args.argv])
    lines = [f"### Append benchmark, {datetime.date.today().isoformat()}", "", f"Command: `{command}`", "",
             *common.machine_lines(),
             (f"- decode: n_q=1, h_q={HEADS['h_q']} over a {DECODE_KEYS}-key context (h_kv={HEADS['h_kv']}, "
              f"d={HEADS['d']}, float32); appends: one key each to contexts created with {START_KEYS} keys, "
              f"replicas 1 and 2; {args.rounds} rounds of the three in turn from one client, after "
              f"{args.warmup} warm-up rounds"),
             *notes, ""]
    for name, records in runs.items():
        lines += [f"#### {name}", "", *tables(records)]
    return "\n".join(lines)


def tables(records: dict[str, list[common.Record]]) -> list[str]:
    secs = {kind: [r.seconds for r in records[kind]] for kind in KINDS}
    p50 = {kind: percentile(secs[kind], 50) for kind in KINDS}
    rows = [[kind, len(secs[kind]), common.ms(p50[kind]), common.ms(percentile(secs[kind], 90)),
             common.ms(percentile(secs[kind], 99)), f"{p50[kind] / p50['decode']:.2f}"] for kind in KINDS]
    table = common.markdown_table(["request", "n", "p50 ms", "p90 ms", "p99 ms", "p50 / decode p50"], rows)
    stage_rows = []
    for kind in ("append r1", "append r2"):
        st = common.median_stages([r.stages for r in records[kind]])
        names = [s for s in APPEND_STAGES if s in st] + sorted(s for s in st if s not in APPEND_STAGES)
        total = st.get("total", float("nan"))
        stage_rows.append([kind, ", ".join(f"{s} {common.ms(st[s])} ({st[s] / total:.0%})" for s in names)])
    decode_st = common.median_stages([r.stages for r in records["decode"]])
    stage_rows.append(["decode", ", ".join(f"{s} {common.ms(v)}" for s, v in decode_st.items())])
    ratio = p50["append r1"] / p50["decode"]
    return [table, "", f"Target: append (replicas 1) p50 <= decode p50: {ratio:.2f}x ({common.met(ratio <= 1.0)})",
            "", "Server-Timing, median ms (share of the median total):", "",
            common.markdown_table(["request", "stages"], stage_rows), ""]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="40 rounds, 5 warm-up: a smoke run")
    p.add_argument("--rounds", type=common.positive, default=400, help="rounds of the three requests (default 400)")
    p.add_argument("--warmup", type=common.count, default=20, help="rounds not counted (default 20)")
    p.add_argument("--workers", type=common.positive, default=2)
    p.add_argument("--baseline", type=Path, default=None,
                   help="another checkout to measure first, with the same rounds (before and after)")
    p.add_argument("--no-wait", action="store_true", help="do not wait for other benchmarks to finish")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.rounds, args.warmup = 40, 5
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    common.raise_on_sigterm()
    notes = [common.wait_for_quiet(not args.no_wait and not args.quick)]
    t0 = time.monotonic()
    checkouts = {"this tree": common.ROOT}
    if args.baseline is not None:
        checkouts = {f"baseline ({args.baseline})": args.baseline.resolve(), **checkouts}
    runs = {}
    for name, cwd in checkouts.items():
        with tempfile.TemporaryDirectory(prefix="splitkey-append-bench-") as tmp, \
                common.splitkey_server(Path(tmp), workers=args.workers, cwd=cwd) as url:
            runs[name] = run(url, args)
    notes += [f"- load average after: {common.load_average()}", f"- whole run: {time.monotonic() - t0:.0f} s"]
    common.emit_report(report(args, runs, notes), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
