"""What the shard size costs under load: closed loops over many resident contexts, for each ``--context-shard-keys``.

Run from the repository root (``pip install -e '.[bench]'``)::

    .venv/bin/python benchmarks/shard_keys.py --rounds 2 --out /tmp/shard_keys.md --json /tmp/shard_keys.json
    .venv/bin/python benchmarks/shard_keys.py --quick          # smoke run

Decode shape ``n_q=1, h_q=32, h_kv=8, d=128`` float32; ``splitkey serve --workers 2`` started fresh for
every setting and round (rounds alternate the order of the settings). Each server holds ``--contexts``
contexts of ``--n-k`` keys, created with its ``--context-shard-keys`` (with 4096-key contexts: 2048 cuts
each in two shards, one per worker; 4096 keeps each whole, the contexts placed over the two workers).

For each concurrency level C, C client threads (each its own ``Client``, one keep-alive connection) call
``Client.attention(q, contexts=[id])`` back to back for ``--seconds``, thread i starting at context i and
stepping through them all, so the calls at any moment read different contexts (as different sequences of
an engine's clients would). Reported: requests per second (completed calls / wall time) and the p50/p99 of
the calls. Every context's first answer is checked against a float64 reference computed here.

The question it answers (docs/CONTEXTS.md "Why 2048 keys a shard"): a split context runs a lone query
on both cores, but every query then costs a call on each worker; when many queries overlap, both
cores are busy either way, and the extra call per query is all the split adds.

**Fragments** (``--fragment-shards``, default 2,8,16): one context of ``--fragment-n-k`` keys (32K) created
with S shards each (what appends leave: a context grown from a short prompt opens a shard every
``--context-shard-keys`` keys, placed over the workers in turn), single sequential calls in blocks, the
contexts taking turns; p50 per S. With ``--baseline DIR`` (a checkout of another commit) the same on its
server, in the same rounds: what a query over many shards costs before and after a change.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from service.client import Client

H_Q, H_KV, D = 32, 8, 128
SEED = 17


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``softmax(q kᵀ / sqrt(d)) v`` in float64, GQA (query head i reads kv head i // g): ``[n_q, h_q, d_v]``."""
    g = q.shape[1] // k.shape[1]
    kk = np.repeat(k.astype(np.float64), g, axis=1)  # [n_k, h_q, d]
    vv = np.repeat(v.astype(np.float64), g, axis=1)  # [n_k, h_q, d_v]
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), kk) / np.sqrt(q.shape[2])  # [h_q, n_q, n_k]
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vv)  # [n_q, h_q, d_v]


def closed_loop(url: str, ids: Sequence[str], qs: Sequence[np.ndarray], level: int, seconds: float) -> dict[str, Any]:
    """``level`` threads calling back to back for ``seconds``; thread i starts at context i and steps through all."""
    latencies: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(level + 1)
    stop_at = [0.0]

    def run(i: int) -> None:
        own: list[float] = []
        with Client(url) as c:
            c.attention(qs[i % len(qs)], contexts=[ids[i % len(ids)]])  # the connection open before the clock
            start.wait()
            j = i
            while time.perf_counter() < stop_at[0]:
                t0 = time.perf_counter()
                c.attention(qs[j % len(qs)], contexts=[ids[j % len(ids)]])
                own.append(time.perf_counter() - t0)
                j += 1
        with lock:
            latencies.extend(own)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(level)]
    for t in threads:
        t.start()
    stop_at[0] = time.perf_counter() + seconds  # set before the barrier releases the threads
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"level": level, "calls": len(lat), "wall_s": wall, "rps": len(lat) / wall,
            "p50": statistics.median(lat), "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def one_round(args: argparse.Namespace, shard_keys: int, workdir: Path, data: dict[str, Any]) -> dict[str, Any]:
    with common.splitkey_server(workdir, workers=2, args=("--context-shard-keys", str(shard_keys))) as url:
        with Client(url) as c:
            ids = [c.create_context(k, v)["id"] for k, v in data["contexts"]]
            diffs = []
            for cid, want in zip(ids, data["answers"]):
                out, _ = c.attention(data["qs"][0], contexts=[cid])
                diffs.append(float(np.max(np.abs(out.astype(np.float64) - want))))
            shards = [int(c.get_context(cid)["shards"]) for cid in ids]
        levels = [closed_loop(url, ids, data["qs"], level, args.seconds) for level in args.levels]
    return {"shard_keys": shard_keys, "shards_per_context": shards, "max_diff": max(diffs), "levels": levels}


def fragments(args: argparse.Namespace, workdir: Path, cwd: Path, data: dict[str, Any]) -> dict[str, Any]:
    """p50 of single calls over one context cut in S shards, for each S, the contexts taking turns."""
    k, v = data["fragment"]
    with common.splitkey_server(workdir, workers=2, cwd=cwd) as url, Client(url) as c:
        ids = {s: c.create_context(k, v, shards=s)["id"] for s in args.fragment_shards}
        diffs = []
        for cid in ids.values():
            out, _ = c.attention(data["qs"][0], contexts=[cid])
            diffs.append(float(np.max(np.abs(out.astype(np.float64) - data["fragment_answer"]))))
        lat: dict[int, list[float]] = {s: [] for s in ids}
        for _ in range(args.fragment_blocks):
            for s, cid in ids.items():
                for _ in range(3):  # untimed: this context's keys and its calls' path warm again
                    c.attention(data["qs"][0], contexts=[cid])
                for j in range(args.fragment_calls):
                    t0 = time.perf_counter()
                    c.attention(data["qs"][j % len(data["qs"])], contexts=[cid])
                    lat[s].append(time.perf_counter() - t0)
    return {"max_diff": max(diffs), "p50": {s: statistics.median(x) for s, x in lat.items()}}


def report(args: argparse.Namespace, result: dict[str, Any]) -> str:
    lines = [f"Decode n_q=1, h_q={H_Q}, h_kv={H_KV}, d={D}, float32, `splitkey serve --workers 2`, "
             f"{args.rounds} round(s) (each a fresh server); {result['date']}.", "",
             f"```bash\n{result['command']}\n```", "",
             *result["machine"], *([f"- load average at the end: {result['load_average']}"]
                                   if "load_average" in result else [])]
    if result["rounds"]:
        lines += ["", f"Closed loops over {args.contexts} contexts of {args.n_k} keys, {args.seconds:g} s per level; "
                  f"every context's first answer against the float64 reference: max abs diff "
                  f"{max(r['max_diff'] for rs in result['rounds'].values() for r in rs):.2g}. req/s and p50 ms "
                  f"per round, then the median over the rounds:", ""]
        rows = []
        for level in args.levels:
            for sk, rounds in result["rounds"].items():
                cells = [next(x for x in r["levels"] if x["level"] == level) for r in rounds]
                rps = [x["rps"] for x in cells]
                p50 = [x["p50"] for x in cells]
                p99 = [x["p99"] for x in cells]
                rows.append([level, f"{sk} ({rounds[0]['shards_per_context'][0]} shard(s) a context)",
                             " / ".join(f"{x:.0f}" for x in rps), " / ".join(common.ms(x) for x in p50),
                             f"{statistics.median(rps):.0f}", common.ms(statistics.median(p50)),
                             common.ms(statistics.median(p99))])
        lines.append(common.markdown_table(["concurrency", "--context-shard-keys", "req/s per round",
                                            "p50 per round", "req/s", "p50", "p99"], rows))
    if result.get("fragments"):
        lines += ["", f"Single calls over one context of {args.fragment_n_k} keys cut in S shards (default settings), "
                  f"{args.fragment_blocks} blocks of {args.fragment_calls} calls per context, the contexts taking "
                  f"turns; p50 ms per round, then the median; max abs diff against the float64 reference "
                  f"{max(r['max_diff'] for rs in result['fragments'].values() for r in rs):.2g}:", ""]
        frows = []
        for server, rounds in result["fragments"].items():
            def p50(r: dict[str, Any], sh: int) -> float:
                return float(r["p50"][sh] if sh in r["p50"] else r["p50"][str(sh)])  # JSON keys are strings
            first = args.fragment_shards[0]
            for sh in args.fragment_shards:
                per = [p50(r, sh) for r in rounds]
                ratio = [p50(r, sh) / p50(r, first) for r in rounds]
                frows.append([server, sh, " / ".join(common.ms(x) for x in per), common.ms(statistics.median(per)),
                              " / ".join(f"{x:.2f}x" for x in ratio)])
        lines.append(common.markdown_table(["server", "shards", "p50 per round", "p50",
                                            f"against {args.fragment_shards[0]} shards, per round"], frows))
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--contexts", type=common.positive, default=8)
    p.add_argument("--n-k", type=common.positive, default=4096)
    p.add_argument("--shard-keys", default="2048,4096", help="the --context-shard-keys settings compared")
    p.add_argument("--levels", default="1,2,4,16", help="closed-loop concurrencies")
    p.add_argument("--seconds", type=float, default=8.0, help="seconds per level")
    p.add_argument("--rounds", type=common.positive, default=2)
    p.add_argument("--fragment-n-k", type=common.positive, default=32768)
    p.add_argument("--fragment-shards", default="2,8,16", help="shard counts of the fragments' context (empty: none)")
    p.add_argument("--fragment-blocks", type=common.positive, default=6)
    p.add_argument("--fragment-calls", type=common.positive, default=30)
    p.add_argument("--sections", default="load,fragments", help="load (closed loops), fragments, or both")
    p.add_argument("--baseline", default=None, help="a checkout of another commit: its server too, fragments only")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 small contexts, 1 round, short levels")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.shard_keys = [int(x) for x in args.shard_keys.split(",")]
    args.levels = [int(x) for x in args.levels.split(",")]
    args.fragment_shards = [int(x) for x in args.fragment_shards.split(",") if x]
    args.sections = set(args.sections.split(","))
    if args.quick:
        args.contexts, args.n_k, args.rounds, args.seconds, args.levels = 2, 512, 1, 0.5, [1, 2]
        args.shard_keys = [256, 512]
        args.fragment_n_k, args.fragment_shards, args.fragment_blocks, args.fragment_calls = 1024, [1, 4], 1, 3
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    common.raise_on_sigterm()
    rng = np.random.default_rng(SEED)
    contexts = [(rng.standard_normal((args.n_k, H_KV, D)).astype(np.float32),
                 rng.standard_normal((args.n_k, H_KV, D)).astype(np.float32)) for _ in range(args.contexts)]
    qs = [rng.standard_normal((1, H_Q, D)).astype(np.float32) for _ in range(8)]
    data: dict[str, Any] = {"contexts": contexts, "qs": qs, "answers": [reference(qs[0], k, v) for k, v in contexts]}
    if "fragments" in args.sections and args.fragment_shards:
        fk = rng.standard_normal((args.fragment_n_k, H_KV, D)).astype(np.float32)
        fv = rng.standard_normal((args.fragment_n_k, H_KV, D)).astype(np.float32)
        data["fragment"], data["fragment_answer"] = (fk, fv), reference(qs[0], fk, fv)
    servers = [("this tree", common.ROOT)] + ([("baseline", Path(args.baseline).resolve())] if args.baseline else [])
    result: dict[str, Any] = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                              "command": " ".join([".venv/bin/python", "benchmarks/shard_keys.py",
                                                   *(sys.argv[1:] if argv is None else argv)]),
                              "machine": common.machine_lines(),
                              "rounds": {sk: [] for sk in args.shard_keys} if "load" in args.sections else {},
                              "fragments": {name: [] for name, _ in servers} if "fragment" in data else {}}
    with tempfile.TemporaryDirectory(prefix="splitkey-shard-keys-") as tmp:
        for r in range(args.rounds):
            for name, cwd in (servers if r % 2 == 0 else servers[::-1]) if "fragment" in data else []:
                got = fragments(args, Path(tmp) / f"f{r}-{name.replace(' ', '-')}", cwd, data)
                result["fragments"][name].append(got)
                print(f"round {r + 1}, fragments, {name}: " + ", ".join(
                    f"{sh} shards p50 {common.ms(x)}" for sh, x in got["p50"].items()), file=sys.stderr, flush=True)
            order = args.shard_keys if r % 2 == 0 else args.shard_keys[::-1]
            for sk in order if "load" in args.sections else []:
                got = one_round(args, sk, Path(tmp) / f"r{r}-{sk}", data)
                result["rounds"][sk].append(got)
                summary = ", ".join(f"C{x['level']} {x['rps']:.0f} req/s p50 {common.ms(x['p50'])}"
                                    for x in got["levels"])
                print(f"round {r + 1}, shard keys {sk}: {summary}", file=sys.stderr, flush=True)
    result["load_average"] = common.load_average()
    common.emit_report(report(args, result), args.out)
    if args.json:
        common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
