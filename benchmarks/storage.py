"""Context storage as an engine uses it (issue 47, point 8): memory held against data, appended against
created contexts, one-key appends against decode queries.

Run from the repository root (``pip install -e '.[bench]'``)::

    .venv/bin/python benchmarks/storage.py --out /tmp/storage.md   # 64K keys, 200 and 10,000 appends: 4-7 min
    .venv/bin/python benchmarks/storage.py --quick                  # smoke run, 4K-key contexts: under a minute
    .venv/bin/python benchmarks/storage.py --parts memory --appends 2000 --grow-appends 2000   # many appends: 6 min

(times on 2 shared cores, 2026-12-06; an append costs 10-20 ms, so (a) runs about 8 x ``--appends`` of them.)

One ``splitkey serve --workers 2`` (embedded Ray on loopback, started and stopped here) serves
every part, after an untimed warm-up (a small context appended to, queried and deleted). Only public surfaces are used: ``service.client.Client`` (creates, appends, queries,
``GET /v1/contexts/{id}``) and ``GET /v1/cluster`` (each worker's ``bytes_held``), so the script
measures any storage layout the service may have. Keys are decode-shaped (``h_kv=8, d=128``).

**(a) memory held against data.** For each ``--dtypes`` (float16, float32):

1. one context of ``--n-k`` keys (64K) made by one ``create_context``, then ``--appends`` (200)
   single-key appends; ``bytes_held`` per worker and in all, and the context's shards, after the
   create and after 1, 10, 100, ... and all the appends;
2. two such contexts, created one after the other, then appended to in turn;
3. a context created with 1 key and grown by ``--grow-appends`` (200) appends of 16 keys.

Each row gives bytes held / data bytes and held - data, with the shard count (data = the K+V
bytes the contexts hold; positions and padding count as overhead). Everything is deleted after
each case, and ``bytes_held`` must come back to where it was.

**(b) decode over an appended and a created context.** The same ``--decode-n-k`` +
``--decode-appends`` keys (64K + 10,000, ``--decode-dtype`` float32): created by one
``create_context`` in one context, and in another created from the first 64K and grown by
single-key appends (sequentially: an append without ``after`` is not idempotent, and appends
to one context take turns under its lease anyway, so threads would not make them faster and
would reorder the keys). Then ``--decode-rounds`` decode queries (``n_q=1, h_q=32``) over each,
interleaved (the order alternating), p50 of each, the ratio appended / created and each one's
shards. Both answers are checked against a float64 NumPy reference: the error must be at most
2 x that of a one-shot computation in the kernel's precision (float32) plus a few ulps.

**(c) append latency beside query latency.** A 4096-key context queried by decode queries, and
two 4096-key contexts (replicas 1 and 2) appended one key at a time, in one loop of
``--side-rounds`` rounds (each round one query and one append of each kind, in rotating order):
p50 and p90 of each, the appends' p50 over the query's p50, and the median Server-Timing stages.

Target (issue 47): (a) held <= data + one page per shard; (b) appended / created <= 1.1 with
shards not growing with the appends; (c) a one-key append's p50 <= the decode query's p50.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common
from benchmarks.service import TimedClient
from service.client import Client

HEADS = {"h_q": 32, "h_kv": 8, "d": 128}
DTYPES = {"float16": np.float16, "float32": np.float32}
SEED = 20261206
SIDE_KEYS = 4096
GROW_KEYS = 16
#: Server-Timing stages of a context write and of a query, as reported.
WRITE_STAGES = ("parse", "place", "put", "store", "commit", "total")
DECODE_TARGET = 1.1


# ------------------------------------------------------------------ inputs and checks


def kv(n_k: int, dtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``k, v [n_k, h_kv, d]`` in ``dtype``, drawn in float32 a slice at a time."""
    shape = (n_k, HEADS["h_kv"], HEADS["d"])
    k, v = np.empty(shape, DTYPES[dtype]), np.empty(shape, DTYPES[dtype])
    for a in range(0, n_k, 65536):
        b = min(a + 65536, n_k)
        k[a:b] = rng.standard_normal((b - a, *shape[1:]), dtype=np.float32)
        v[a:b] = rng.standard_normal((b - a, *shape[1:]), dtype=np.float32)
    return k, v


def query(dtype: str, seed: int) -> np.ndarray:
    """The decode query ``q [1, h_q, d]``."""
    q = np.random.default_rng(seed).standard_normal((1, HEADS["h_q"], HEADS["d"]), dtype=np.float32)
    return q.astype(DTYPES[dtype])


def data_bytes(n_k: int, dtype: str) -> int:
    """Bytes of K and V of ``n_k`` keys: what a context holds, nothing else."""
    return 2 * n_k * HEADS["h_kv"] * HEADS["d"] * np.dtype(DTYPES[dtype]).itemsize


def one_shot(q: np.ndarray, k: np.ndarray, v: np.ndarray, dtype: type) -> np.ndarray:
    """Materialised softmax attention of the last position over every key, in ``dtype``: ``out [1, h_q, d]``.

    Grouped by kv head (query head ``i`` reads kv head ``i // g``) without repeating the keys."""
    n_q, h_q, d = q.shape
    h_kv = k.shape[1]
    g = h_q // h_kv
    out = np.empty((n_q, h_q, v.shape[2]), dtype)
    scale = dtype(1.0 / np.sqrt(d))
    for h in range(h_kv):
        qh = q[:, h * g:(h + 1) * g].reshape(-1, d).astype(dtype)  # [n_q * g, d]
        s = (qh @ k[:, h].astype(dtype).T) * scale  # [n_q * g, n_k]
        p = np.exp(s - s.max(axis=1, keepdims=True))
        o = (p @ v[:, h].astype(dtype)) / p.sum(axis=1, keepdims=True)
        out[:, h * g:(h + 1) * g] = o.reshape(n_q, g, -1)
    return out


@dataclass
class Exactness:
    error: float  # the service's largest |out - float64 reference|
    one_shot_error: float  # a one-shot float32 computation's
    bound: float  # 2 x one_shot_error + 4 ulps of max |v|

    @property
    def ok(self) -> bool:
        return self.error <= self.bound


def exactness(out: np.ndarray, truth: np.ndarray, base: np.ndarray, v: np.ndarray) -> Exactness:
    err = float(np.max(np.abs(out.astype(np.float64) - truth)))
    base_err = float(np.max(np.abs(base.astype(np.float64) - truth)))
    vmax = max(1.0, float(np.max(np.abs(v.astype(np.float32)))))
    return Exactness(err, base_err, 2 * base_err + 4 * float(np.finfo(np.float32).eps) * vmax)


# ------------------------------------------------------------------ the public surfaces


def held(c: Client) -> list[int]:
    """``bytes_held`` of each worker, from ``GET /v1/cluster``."""
    return [int(w.get("bytes_held", 0)) for w in c.cluster()["workers"]]


def checkpoints(m: int) -> list[int]:
    """1, 10, 100, ... below ``m``, and ``m``: after which appends memory is read."""
    marks = [10**i for i in range(12) if 10**i < m]
    return [*marks, m] if m else []


def lengths_label(lengths: Sequence[int]) -> str:
    """Shard lengths, the middle cut short when there are many."""
    if len(lengths) <= 6:
        return ", ".join(map(str, lengths))
    return f"{', '.join(map(str, lengths[:3]))}, ... ({len(lengths) - 5} more), {', '.join(map(str, lengths[-2:]))}"


# ------------------------------------------------------------------ (a) memory held against data


@dataclass
class MemoryRow:
    case: str
    dtype: str
    step: str  # "created", "after 1 append", ...
    contexts: int
    keys: int
    shards: int
    shard_lengths: list[int]
    data: int
    held_workers: list[int]  # each worker's bytes_held less its own before the case

    @property
    def held(self) -> int:
        return sum(self.held_workers)


@dataclass
class MemoryCase:
    case: str
    dtype: str
    rows: list[MemoryRow] = field(default_factory=list)
    append_s: list[float] = field(default_factory=list)
    left_after_delete: list[int] = field(default_factory=list)  # bytes_held per worker after the deletes, less before


def snapshot(c: Client, case: MemoryCase, step: str, ids: Sequence[str], base: Sequence[int]) -> None:
    descs = [c.get_context(i) for i in ids]
    now = held(c)
    keys = sum(int(d["length"]) for d in descs)
    lengths = [int(n) for d in descs for n in d["shard_lengths"]]
    case.rows.append(MemoryRow(case.case, case.dtype, step, len(ids), keys, sum(int(d["shards"]) for d in descs),
                               lengths, data_bytes(keys, case.dtype), [a - b for a, b in zip(now, base)]))


def timed_append(c: Client, ctx_id: str, k: np.ndarray, v: np.ndarray, into: list[float]) -> None:
    t0 = time.perf_counter()
    c.append(ctx_id, k, v)
    into.append(time.perf_counter() - t0)


def memory_case(c: Client, name: str, dtype: str, n_k: int, contexts: int, appends: int, keys_per_append: int,
                rng: np.random.Generator) -> MemoryCase:
    """``contexts`` contexts of ``n_k`` keys, then ``appends`` appends of ``keys_per_append`` keys to each, in turn."""
    case = MemoryCase(name, dtype)
    k, v = kv(n_k, dtype, rng)
    ka, va = kv(max(1, appends * keys_per_append), dtype, rng)
    base = held(c)
    ids: list[str] = []
    try:
        for _ in range(contexts):
            ids.append(c.create_context(k, v)["id"])
        snapshot(c, case, "created", ids, base)
        marks = set(checkpoints(appends))
        for i in range(appends):
            span = slice(i * keys_per_append, (i + 1) * keys_per_append)
            for ctx_id in ids:
                timed_append(c, ctx_id, ka[span], va[span], case.append_s)
            if i + 1 in marks:
                snapshot(c, case, f"after {i + 1} append{'s' if i else ''}", ids, base)
    finally:
        for ctx_id in ids:
            c.delete_context(ctx_id)
    case.left_after_delete = [a - b for a, b in zip(held(c), base)]
    want = contexts * (n_k + appends * keys_per_append)
    if case.rows[-1].keys != want:
        raise RuntimeError(f"{name} {dtype}: the contexts hold {case.rows[-1].keys} keys, not {want}")
    return case


def warm_up(url: str, rng: np.random.Generator, appends: int = 20) -> None:
    """A small context created, appended to, queried and deleted before anything is measured: the first
    writes and queries of a fresh server pay for the connections and the workers' first calls."""
    k, v = kv(SIDE_KEYS + appends, "float32", rng)
    with Client(url) as c:
        ctx_id = c.create_context(k[:SIDE_KEYS], v[:SIDE_KEYS])["id"]
        try:
            for i in range(SIDE_KEYS, SIDE_KEYS + appends):
                c.append(ctx_id, k[i:i + 1], v[i:i + 1])
                c.attention(query("float32", i), contexts=[ctx_id])
        finally:
            c.delete_context(ctx_id)


def run_memory(url: str, args: argparse.Namespace, rng: np.random.Generator) -> list[MemoryCase]:
    cases = []
    with Client(url) as c:
        for dtype in args.dtypes:
            label = common.size_label(args.n_k)
            cases.append(memory_case(c, f"one context of {label} + {args.appends} x 1 key", dtype, args.n_k, 1,
                                     args.appends, 1, rng))
            cases.append(memory_case(c, f"two contexts of {label} + {args.appends} x 1 key each", dtype, args.n_k, 2,
                                     args.appends, 1, rng))
            cases.append(memory_case(c, f"one context of 1 key + {args.grow_appends} x {GROW_KEYS} keys", dtype, 1, 1,
                                     args.grow_appends, GROW_KEYS, rng))
            for case in cases[-3:]:
                last = case.rows[-1]
                print(f"memory {case.case} {dtype}: held {common.bytes_label(last.held)} for "
                      f"{common.bytes_label(last.data)} ({last.held / last.data:.2f}x), {last.shards} shards",
                      file=sys.stderr)
    return cases


# ------------------------------------------------------------------ (b) decode over appended and created contexts


@dataclass
class DecodeResult:
    dtype: str
    n_k: int
    appends: int
    created: dict = field(default_factory=dict)  # the description
    appended: dict = field(default_factory=dict)
    created_held: int = 0  # bytes_held that each one's writes added, all workers
    appended_held: int = 0
    create_s: float = float("nan")  # the whole create of the created one
    append_s: list[float] = field(default_factory=list)  # each single-key append
    shards_after: list[tuple[int, int]] = field(default_factory=list)  # (appends so far, the appended one's shards)
    created_q: list[common.Record] = field(default_factory=list)
    appended_q: list[common.Record] = field(default_factory=list)
    created_exact: Exactness | None = None
    appended_exact: Exactness | None = None

    @property
    def ratio(self) -> float:
        return (common.summarize([r.seconds for r in self.appended_q]).p50
                / common.summarize([r.seconds for r in self.created_q]).p50)

    @property
    def paired_ratio(self) -> float:
        """The median of each round's appended / created: the two queries of a round ran back to back, so a
        machine whose load drifts during the run moves both."""
        return float(np.median([a.seconds / c.seconds for a, c in zip(self.appended_q, self.created_q)]))


def timed_query(c: TimedClient, q: np.ndarray, ctx_id: str) -> tuple[common.Record, np.ndarray]:
    t0 = time.perf_counter()
    out, _ = c.attention(q, contexts=[ctx_id])
    return common.Record(time.perf_counter() - t0, c.last_stages()), out


def run_decode(url: str, args: argparse.Namespace, rng: np.random.Generator) -> DecodeResult:
    dtype, n_k, m = args.decode_dtype, args.decode_n_k, args.decode_appends
    res = DecodeResult(dtype, n_k, m)
    k, v = kv(n_k + m, dtype, rng)
    q = query(dtype, args.seed)
    print(f"decode: reference over {n_k + m} keys", file=sys.stderr)
    truth = one_shot(q, k, v, np.float64)
    base = one_shot(q, k, v, np.float32)
    with TimedClient(url) as c:
        before = sum(held(c))
        t0 = time.perf_counter()
        created = c.create_context(k, v)["id"]
        res.create_s = time.perf_counter() - t0
        mid = sum(held(c))
        appended = c.create_context(k[:n_k], v[:n_k])["id"]
        try:
            t0 = time.perf_counter()
            marks = {0, *checkpoints(m)}
            for i in range(n_k, n_k + m + 1):
                if i - n_k in marks:
                    res.shards_after.append((i - n_k, int(c.get_context(appended)["shards"])))
                if i == n_k + m:
                    break
                timed_append(c, appended, k[i:i + 1], v[i:i + 1], res.append_s)
                if (i - n_k + 1) % 1000 == 0:
                    print(f"decode: {i - n_k + 1}/{m} appends, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            res.created_held, res.appended_held = mid - before, sum(held(c)) - mid
            res.created, res.appended = c.get_context(created), c.get_context(appended)
            for d in (res.created, res.appended):
                if d["length"] != n_k + m:
                    raise RuntimeError(f"context {d['id']} holds {d['length']} keys, not {n_k + m}")
            _, out_c = timed_query(c, q, created)  # warm-up, checked
            _, out_a = timed_query(c, q, appended)
            res.created_exact = exactness(out_c, truth, base, v)
            res.appended_exact = exactness(out_a, truth, base, v)
            for name, e in (("created", res.created_exact), ("appended", res.appended_exact)):
                if not e.ok:
                    raise RuntimeError(f"the {name} context's answer is off the float64 reference by {e.error:.3g}, "
                                       f"over 2 x the one-shot error + 4 ulps ({e.bound:.3g})")
            for r in range(args.decode_rounds):
                order = [(created, res.created_q), (appended, res.appended_q)]
                for ctx_id, into in order if r % 2 == 0 else order[::-1]:
                    into.append(timed_query(c, q, ctx_id)[0])
        finally:
            c.delete_context(created)
            c.delete_context(appended)
    print(f"decode: appended / created p50 {res.ratio:.2f}, shards {res.appended['shards']} against "
          f"{res.created['shards']}", file=sys.stderr)
    return res


# ------------------------------------------------------------------ (c) append latency beside query latency


@dataclass
class SideResult:
    dtype: str
    query: list[common.Record] = field(default_factory=list)
    append1: list[common.Record] = field(default_factory=list)  # replicas 1
    append2: list[common.Record] = field(default_factory=list)  # replicas 2
    shards: dict[str, int] = field(default_factory=dict)


def run_side(url: str, args: argparse.Namespace, rng: np.random.Generator) -> SideResult:
    dtype = args.decode_dtype
    res = SideResult(dtype)
    k, v = kv(SIDE_KEYS, dtype, rng)
    ka, va = kv(args.side_rounds + args.warmup, dtype, rng)
    q = query(dtype, args.seed)
    with TimedClient(url) as c:
        ids = {"query": c.create_context(k, v)["id"], "append1": c.create_context(k, v, replicas=1)["id"],
               "append2": c.create_context(k, v, replicas=2)["id"]}
        try:
            res.shards = {name: int(c.get_context(i)["shards"]) for name, i in ids.items()}
            def append(name: str) -> Callable[[int], common.Record]:
                def step(i: int) -> common.Record:
                    t0 = time.perf_counter()
                    c.append(ids[name], ka[i:i + 1], va[i:i + 1])
                    return common.Record(time.perf_counter() - t0, c.last_stages())
                return step

            steps: dict[str, Callable[[int], common.Record]] = {"query": lambda i: timed_query(c, q, ids["query"])[0], "append1": append("append1"),
                     "append2": append("append2")}
            into = {"query": res.query, "append1": res.append1, "append2": res.append2}
            orders = list(itertools.permutations(steps))
            for i in range(args.warmup + args.side_rounds):
                for name in orders[i % len(orders)]:
                    record = steps[name](i)
                    if i >= args.warmup:
                        into[name].append(record)
        finally:
            for i in ids.values():
                c.delete_context(i)
    p50 = {n: common.summarize([r.seconds for r in into[n]]).p50 for n in into}
    print(f"side by side: append p50 {common.ms(p50['append1'])} ms (replicas 2: {common.ms(p50['append2'])}), "
          f"decode p50 {common.ms(p50['query'])} ms", file=sys.stderr)
    return res


# ------------------------------------------------------------------ report


def lscpu_line() -> str:
    """lscpu's model name, CPU family and model (the host behind a session varies)."""
    if shutil.which("lscpu") is None:
        return "- lscpu: not installed"
    text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    got = [f"{name} {fields[name].strip()}" for name in ("Model name", "CPU family", "Model") if name in fields]
    return "- lscpu: " + ("; ".join(got) if got else "no model fields")


def memory_table(cases: Sequence[MemoryCase]) -> str:
    rows = []
    for case in cases:
        for r in case.rows:
            per_shard = common.bytes_label(r.held / r.shards) if r.shards else "-"
            rows.append([case.case, case.dtype, r.step, r.keys, r.shards, lengths_label(r.shard_lengths),
                         common.bytes_label(r.data), common.bytes_label(r.held),
                         " / ".join(common.bytes_label(h) for h in r.held_workers),
                         f"{r.held / r.data:.3f}", common.bytes_label(r.held - r.data), per_shard])
    return common.markdown_table(["case", "dtype", "when", "keys", "shards", "shard lengths", "data (K+V)",
                                  "held", "held per worker", "held / data", "held - data", "held per shard"], rows)


def memory_summary(cases: Sequence[MemoryCase]) -> str:
    rows = []
    for case in cases:
        first, last = case.rows[0], case.rows[-1]
        grow = last.held - first.held
        added = last.data - first.data
        app = common.summarize(case.append_s)
        rows.append([case.case, case.dtype, f"{first.held / first.data:.3f}", f"{last.held / last.data:.3f}",
                     common.bytes_label(added), common.bytes_label(grow),
                     f"{grow / added:.0f}x" if added else "-", f"{first.shards} -> {last.shards}",
                     common.ms(app.p50), " / ".join(common.bytes_label(b) for b in case.left_after_delete)])
    return common.markdown_table(["case", "dtype", "held / data, created", "held / data, at the end",
                                  "data the appends added", "held they added", "held added / data added",
                                  "shards", "append p50 ms", "held after the deletes"], rows)


def decode_table(res: DecodeResult) -> str:
    rows = []
    for name, desc, recs, held_b, ex in (("created", res.created, res.created_q, res.created_held, res.created_exact),
                                         ("appended", res.appended, res.appended_q, res.appended_held,
                                          res.appended_exact)):
        s = common.summarize([r.seconds for r in recs])
        compute = common.median_stages([r.stages for r in recs]).get("compute", float("nan"))
        rows.append([name, desc["length"], desc["shards"], lengths_label(desc["shard_lengths"]),
                     common.bytes_label(held_b), f"{held_b / data_bytes(desc['length'], res.dtype):.3f}",
                     common.ms_spread(s), common.ms(s.p90), common.ms(compute),
                     f"{ex.error:.2e} (bound {ex.bound:.2e})" if ex else "-"])
    return common.markdown_table(["context", "keys", "shards", "shard lengths", "held", "held / data",
                                  "decode p50 ms (min-max)", "p90 ms", "Server-Timing compute ms",
                                  "max abs error vs float64"], rows)


def side_table(res: SideResult) -> str:
    q50 = common.summarize([r.seconds for r in res.query]).p50
    rows = []
    for name, label, recs in (("query", f"decode query, {SIDE_KEYS}-key context", res.query),
                              ("append1", "one-key append, replicas 1", res.append1),
                              ("append2", "one-key append, replicas 2", res.append2)):
        s = common.summarize([r.seconds for r in recs])
        st = common.median_stages([r.stages for r in recs])
        names = common.STAGES if name == "query" else WRITE_STAGES
        rows.append([label, res.shards.get(name, "-"), s.n, common.ms(s.p50), common.ms(s.p90),
                     f"{s.p50 / q50:.2f}", ", ".join(f"{n} {common.ms(st[n])}" for n in names if n in st)])
    return common.markdown_table(["call", "shards", "calls", "p50 ms", "p90 ms", "p50 / query p50",
                                  "Server-Timing, median ms"], rows)


def report(args: argparse.Namespace, memory: Sequence[MemoryCase], decode: DecodeResult | None,
           side: SideResult | None, notes: Sequence[str]) -> str:
    command = " ".join([".venv/bin/python", "benchmarks/storage.py", *args.argv])
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    shape = f"h_kv={HEADS['h_kv']}, d={HEADS['d']}"
    lines = [f"### Context storage benchmark, {now}", "", f"Command: `{command}`", "",
             *common.machine_lines(), lscpu_line(),
             (f"- server: `splitkey serve --workers {args.workers}{' ' + args.server_args if args.server_args else ''}` "
              "(embedded Ray, loopback), one for every part; client `service.client.Client`; memory from "
              "`GET /v1/cluster` (`bytes_held`), shards from `GET /v1/contexts/{id}`"),
             f"- keys of {shape}; decode query n_q=1, h_q={HEADS['h_q']}; data = K+V bytes only", *notes, ""]
    if memory:
        lines += [f"#### (a) Memory held against data ({', '.join(args.dtypes)})", "",
                  ("Each case: the contexts created (`create_context`, chunked by the client as it chooses), then "
                   "the appends, in turn to each context; held = the workers' `bytes_held` less what they held "
                   "before the case. Target (issue 47): held <= data + one page per shard."), "",
                  memory_summary(memory), "", "Every reading:", "", memory_table(memory), ""]
    if decode:
        ratio = decode.ratio
        trail = ", ".join(f"{n} after {a}" for a, n in decode.shards_after)
        lines += [f"#### (b) Decode over an appended and a created context ({decode.dtype})", "",
                  (f"The same {decode.n_k + decode.appends} keys: one `create_context` of all of them "
                   f"({decode.create_s:.1f} s), and `create_context` of the first {decode.n_k} then {decode.appends} "
                   f"single-key appends (p50 {common.ms(common.summarize(decode.append_s).p50)} ms, "
                   f"{sum(decode.append_s):.0f} s in all); {args.decode_rounds} decode queries over each, "
                   f"interleaved. Errors against a float64 reference; the bound is 2 x a one-shot float32 "
                   f"computation's error + 4 ulps."), "", decode_table(decode), "",
                  (f"Appended / created decode p50: **{ratio:.2f}** (target <= {DECODE_TARGET}: "
                   f"{common.met(ratio <= DECODE_TARGET)}; the median of the rounds' own ratios: "
                   f"{decode.paired_ratio:.2f}); shards {decode.appended['shards']} appended against "
                   f"{decode.created['shards']} created. The appended context's shards after so many appends "
                   f"(target: not growing with the appends): {trail}."), ""]
    if side:
        q50 = common.summarize([r.seconds for r in side.query]).p50
        a50 = common.summarize([r.seconds for r in side.append1]).p50
        lines += [f"#### (c) One-key appends beside decode queries ({side.dtype})", "",
                  (f"{args.side_rounds} rounds after {args.warmup} untimed, each one decode query over a "
                   f"{SIDE_KEYS}-key context and one single-key append to each of two {SIDE_KEYS}-key contexts "
                   "(replicas 1 and 2), in rotating order."), "", side_table(side), "",
                  (f"Append (replicas 1) p50 / decode p50: **{a50 / q50:.2f}** (target <= 1: "
                   f"{common.met(a50 <= q50)})."), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="4K-key contexts, 20 appends, 4K + 200 keys in (b), 40 rounds in (c): a smoke run")
    p.add_argument("--parts", default="memory,decode,side", help="which parts run (default memory,decode,side)")
    p.add_argument("--dtypes", default="float16,float32", help="(a): context dtypes (default float16,float32)")
    p.add_argument("--n-k", type=lambda s: common.parse_keys(s)[0], default=64 * common.KIB,
                   help="(a): keys of each created context (default 64K)")
    p.add_argument("--appends", type=common.count, default=200,
                   help="(a): single-key appends to each context (default 200; e.g. 10000 for many)")
    p.add_argument("--grow-appends", type=common.count, default=200,
                   help=f"(a): appends of {GROW_KEYS} keys to a context created with 1 key (default 200)")
    p.add_argument("--decode-dtype", choices=sorted(DTYPES), default="float32", help="(b) and (c) (default float32)")
    p.add_argument("--decode-n-k", type=lambda s: common.parse_keys(s)[0], default=64 * common.KIB,
                   help="(b): keys created before the appends (default 64K)")
    p.add_argument("--decode-appends", type=common.count, default=10000,
                   help="(b): single-key appends to the appended context (default 10000: about 2 minutes)")
    p.add_argument("--decode-rounds", type=common.positive, default=40, help="(b): queries over each (default 40)")
    p.add_argument("--side-rounds", type=common.positive, default=300, help="(c): rounds (default 300)")
    p.add_argument("--warmup", type=common.count, default=10, help="(c): untimed rounds first (default 10)")
    p.add_argument("--workers", type=common.positive, default=2)
    p.add_argument("--server-args", default="", help="more `splitkey serve` flags, e.g. '--cpu-kernels fused'")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--no-wait", action="store_true", help="do not wait for benchmarks/kernel.py to finish")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    p.add_argument("--json", default=None, help="also write the raw results here (every call)")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if args.parts - {"memory", "decode", "side"}:
        p.error(f"--parts takes memory, decode and side, got {sorted(args.parts)}")
    args.dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    if set(args.dtypes) - set(DTYPES):
        p.error(f"--dtypes takes {', '.join(DTYPES)}, got {args.dtypes}")
    if args.quick:
        args.n_k, args.appends, args.grow_appends = 4 * common.KIB, 20, 20
        args.decode_n_k, args.decode_appends, args.decode_rounds = 4 * common.KIB, 200, 10
        args.side_rounds, args.warmup = 40, 3
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    common.raise_on_sigterm()
    notes = [common.wait_for_quiet(not args.no_wait and not args.quick),
             f"- load average before: {common.load_average()}"]
    t0 = time.monotonic()
    rng = np.random.default_rng(args.seed)
    memory: list[MemoryCase] = []
    decode: DecodeResult | None = None
    side: SideResult | None = None
    with tempfile.TemporaryDirectory(prefix="splitkey-storage-bench-") as tmp, \
            common.splitkey_server(Path(tmp), workers=args.workers, args=args.server_args.split()) as url:
        warm_up(url, rng)
        timings: dict[str, tuple[float, float]] = {}  # part: (seconds, cores other processes kept busy)
        for part, run in (("memory", run_memory), ("decode", run_decode), ("side", run_side)):
            if part in args.parts:
                before = common.cpu_sample()
                result = run(url, args, rng)
                after = common.cpu_sample()
                timings[part] = (after.t - before.t, common.others_cores(before, after))
                if part == "memory":
                    memory = result
                elif part == "decode":
                    decode = result
                else:
                    side = result
    notes += [f"- load average after: {common.load_average()}",
              f"- whole run: {time.monotonic() - t0:.0f} s ("
              + ", ".join(f"{p} {s:.0f} s" for p, (s, _) in timings.items()) + ")",
              "- cores other processes than this run (and its server) kept busy meanwhile, of "
              f"{os.cpu_count()}: " + ", ".join(f"{p} {o:.2f}" for p, (_, o) in timings.items())]
    if args.json:
        common.write_json(args.json, {"benchmark": "storage", "command": " ".join(["benchmarks/storage.py", *args.argv]),
                                      "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                                      "machine": [*common.machine_lines(), lscpu_line()], "notes": notes,
                                      "memory": memory, "decode": decode, "side": side})
    common.emit_report(report(args, memory, decode, side, notes), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
