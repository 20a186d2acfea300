"""Scaling of one request over resident contexts (issue 14): workers, nodes, shards and merge fan-in.

Run from the repository root (``pip install -e '.[bench]'``)::

    .venv/bin/python benchmarks/scaling.py --rounds 3 --json scaling.json --out scaling.md
    .venv/bin/python benchmarks/scaling.py --quick --json /tmp/s.json     # smoke run, under a minute

Every setup is a Ray cluster started in this process (``ray.cluster_utils.Cluster``, loopback
only, Ray's token auth on) and ``splitkey serve --ray-address`` joined to it, so that this
process, connected to the same cluster, can also call the directory actor and the shard
workers directly (the probes below). The full plan (``plan``):

* **workers** 1, 2, 3 and 4 on one node with 2 logical CPUs (the machine's 2 cores):
  ``--worker-cpus`` 1 for one or two workers, 0.5 for three or four (so that four fit on two
  cores; they then share the cores, as the report says);
* **shards** 1, 2, 4 and 8 of one context on the four-worker setup (eight shards: two per
  worker, computed one after the other);
* **merge fan-in** 2, 4 and 8 on the same workers and contexts: the front end is restarted
  with ``--merge-fanin`` (the workers and the contexts are detached and stay); and once more
  with ``--remote-merge-bytes 1``, so that decode's small states also merge on the workers
  (decode only, 4 and 8 shards): the cost of a merge level apart from the bytes it moves;
* **nodes**: three one-CPU Ray nodes on loopback with one worker each, against the one-node
  three-worker setup.

Each setup holds one context per shard count, ``n_k`` keys (default 64K) of ``h_kv=8, d=128``
float32 (the same keys in every context), uploaded by the client. Shapes: **decode**
``n_q=1, h_q=32`` and **prefill** ``n_q=256`` (``--prefill-nq``) of the same heads, non-causal,
both through ``Client.attention(q, contexts=[id])``. The front ends run with ``--batch-rows 1``
(each query its own pass over the keys): the cost model (``benchmarks/model.py``) models one
query's pass; what batching adds is in docs/BENCHMARKS.md (issue 9).

Per cell (setup, shard count, fan-in, shape):

1. a warm-up answer checked against the in-process one (``workers.attention``);
2. ``--rounds`` rounds of requests at concurrency 1 (decode 4, prefill 2 per round): client
   seconds and the ``Server-Timing`` stages of every request;
3. **probes** of the stages Server-Timing does not split: the directory actor's ``get_many``
   (20 calls from this process before the rounds: what a query whose record is not in the
   front end's cache pays; Server-Timing ``lookup`` is what the cell's queries paid, cache
   hits after the first) and, in each round right after the shape's requests, the shards' compute (each
   shard's ``partial_resident`` called directly on its worker, all at once as the orchestrator
   does; each worker reports the seconds its compute thread spent, ``ComputeStatus.seconds``).
   The critical compute is the busiest worker's sum; the rest of the probe's wall time is
   dispatch and state return;
4. where shards = workers (the first fan-in of a setup), a closed loop (decode at concurrency
   4, prefill at 2) for requests per second.

While the rounds run, and again while a closed loop runs, the cores that processes other than
this benchmark's own (its cluster, servers and clients) kept busy are recorded (``/proc``): the
machine is shared, and the model takes the cores that were left.

Before any server starts, the resident kernel runs in this process on one thread (BLAS at one
thread) over one shard's worth of keys for both shapes: the kernel rates the model uses.

``--json PATH`` writes everything raw (every request, every probe); ``--out PATH`` the markdown
report. Waits for a quiet machine first (``--no-wait`` skips; ``--quick`` never waits).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Ray reads these once, at import: token auth like the tests' clusters, and loopback addresses
# kept as they are (tests/conftest.py). Set before anything imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common
from benchmarks.service import TimedClient, closed_loop
from merge import tree_levels
from workers import StreamingKV, partial_attention_resident
from workers import attention as inprocess_attention
from workers.options import AttentionOptions, KernelOptions

HEADS = {"h_q": 32, "h_kv": 8, "d": 128}
DTYPE = "float32"
N_K = 64 * common.KIB
PREFILL_NQ = 256
QUICK_N_K = 8 * common.KIB
QUICK_PREFILL_NQ = 16
SEED = 20261201
#: Requests per round at concurrency 1, per shape.
PER_ROUND = {"decode": 4, "prefill": 2}
#: Closed-loop concurrency and requests per shape (setups that sweep workers or nodes).
LOOP = {"decode": (4, 12), "prefill": (2, 4)}
DIRECTORY_CALLS = 20
#: Object store of each Ray node: chunks of 16 MiB and q pass through it.
OBJECT_STORE_BYTES = 1 * common.GIB
#: The orchestrator merges on the workers above this many bytes of states (``--remote-merge-bytes``).
REMOTE_MERGE_BYTES = 8 * common.MIB
NAMESPACE = "splitkey"
DIRECTORY = "splitkey-directory"


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class FrontEnd:
    """One front end started on a setup's cluster: its merge settings and the cells it measures."""

    fanin: int
    shards: tuple[int, ...]  # one context each (created by the setup's first front end)
    remote_merge_bytes: int = REMOTE_MERGE_BYTES  # 1: every merge with more shards than the fan-in on the workers
    shapes: tuple[str, ...] = ("decode", "prefill")


@dataclass(frozen=True)
class Setup:
    """One Ray cluster and the front ends started on it in turn (workers and contexts stay)."""

    name: str
    node_cpus: tuple[int, ...]  # logical CPUs of each Ray node (one node per entry)
    workers: int
    worker_cpus: float
    front_ends: tuple[FrontEnd, ...]
    sweep: str  # "workers", "shards" or "nodes": the table it belongs to

    @property
    def nodes(self) -> int:
        return len(self.node_cpus)

    @property
    def shard_counts(self) -> tuple[int, ...]:
        return tuple(sorted({s for fe in self.front_ends for s in fe.shards}))


def plan(quick: bool) -> list[Setup]:
    """The setups of a full run, or of a smoke run (one two-worker node, two contexts, two fan-ins)."""
    if quick:
        return [Setup("1 node, 2 workers", (2,), 2, 1.0, (FrontEnd(2, (1, 2)), FrontEnd(4, (2,))), "workers")]
    return [
        Setup("1 node, 1 worker", (2,), 1, 1.0, (FrontEnd(2, (1,)),), "workers"),
        Setup("1 node, 2 workers", (2,), 2, 1.0, (FrontEnd(2, (2,)),), "workers"),
        Setup("1 node, 3 workers", (2,), 3, 0.5, (FrontEnd(2, (3,)),), "workers"),
        Setup("1 node, 4 workers", (2,), 4, 0.5,
              (FrontEnd(2, (4, 1, 2, 8)), FrontEnd(4, (4, 8)), FrontEnd(8, (8,)),
               FrontEnd(2, (4, 8), remote_merge_bytes=1, shapes=("decode",))), "shards"),
        Setup("3 nodes, 3 workers", (1, 1, 1), 3, 1.0, (FrontEnd(2, (3,)),), "nodes"),
    ]


@dataclass(frozen=True)
class Shape:
    """``q [n_q, h_q, d]`` over the context's ``[n_k, h_kv, d]`` keys (d_v = d), float32."""

    name: str
    n_q: int

    def q_bytes(self) -> int:
        return self.n_q * HEADS["h_q"] * HEADS["d"] * 4

    def out_bytes(self) -> int:
        """``out [n_q, h_q, d_v]`` and ``lse [n_q, h_q]``, float32."""
        return self.n_q * HEADS["h_q"] * (HEADS["d"] + 1) * 4

    def state_bytes(self) -> int:
        """One shard's state ``(m, l, acc)``: ``n_q * h_q * (d_v + 2)`` float32."""
        return self.n_q * HEADS["h_q"] * (HEADS["d"] + 2) * 4

    def flops(self, n_k: int) -> float:
        """``4 n_q h_q n_k d`` (QK and PV)."""
        return 4.0 * self.n_q * HEADS["h_q"] * n_k * HEADS["d"]


def kv_bytes(n_k: int) -> int:
    """K+V bytes of ``n_k`` float32 keys of the decode heads."""
    return 2 * n_k * HEADS["h_kv"] * HEADS["d"] * 4


def tree_depth(shards: int, fanin: int) -> int:
    """Levels of the merge tree over ``shards`` states: ``merge.tree_levels`` counted."""
    return len(tree_levels(shards, fanin)) if shards > 1 else 0


def remote_merge(shards: int, fanin: int, state_bytes: int, limit: int = REMOTE_MERGE_BYTES) -> bool:
    """Whether the orchestrator merges on the workers (``service.cluster.orchestrator``'s rule)."""
    return shards > fanin and state_bytes * shards > limit


# ------------------------------------------------------------------ results


@dataclass
class Probe:
    """Direct calls beside the HTTP requests (seconds)."""

    directory_s: list[float] = field(default_factory=list)  # one get_many call each
    wall_s: list[float] = field(default_factory=list)  # all shards at once, per round
    shard_s: list[list[float]] = field(default_factory=list)  # per round, per shard: the worker's compute seconds
    shard_workers: list[str] = field(default_factory=list)  # the worker of each shard (first replica)

    def critical(self) -> list[float]:
        """Per round: the busiest worker's summed compute seconds (its shards run one after the other)."""
        return [common.critical_seconds(seconds, self.shard_workers) for seconds in self.shard_s]


@dataclass
class Cell:
    """One (setup, shard count, fan-in, shape): requests, stages, throughput and probes."""

    setup: str
    sweep: str
    nodes: int
    workers: int
    worker_cpus: float
    shards: int
    fanin: int
    shape: str
    n_q: int
    n_k: int
    depth: int
    remote_merge_bytes: int
    remote_merge: bool
    q_bytes: int
    out_bytes: int
    state_bytes: int
    kv_bytes: int
    flops: float
    max_abs_diff: float = float("nan")
    others_cores: float = 0.0  # cores other processes than this benchmark's kept busy during the rounds
    requests: list[common.Record] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)  # each round's median client seconds
    loop: dict[str, float] | None = None  # concurrency, requests, errors, seconds, per_second, p50_s
    probe: Probe = field(default_factory=Probe)

    @property
    def label(self) -> str:
        forced = ", merge on workers" if self.remote_merge_bytes != REMOTE_MERGE_BYTES else ""
        return f"{self.setup}, {self.shards} shard{'s' * (self.shards > 1)}, fan-in {self.fanin}{forced}, {self.shape}"

    def p50(self) -> float:
        """Median of the rounds' medians (client seconds)."""
        return statistics.median(self.rounds) if self.rounds else float("nan")

    def stages(self) -> dict[str, float]:
        return common.median_stages([r.stages for r in self.requests])


# ------------------------------------------------------------------ inputs and the in-process kernel


def make_kv(n_k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``k, v [n_k, h_kv, d]`` float32, the same for the same seed."""
    rng = np.random.default_rng(seed)
    shape = (n_k, HEADS["h_kv"], HEADS["d"])
    k, v = np.empty(shape, np.float32), np.empty(shape, np.float32)
    rng.standard_normal(dtype=np.float32, out=k)
    rng.standard_normal(dtype=np.float32, out=v)
    return k, v


def make_q(shape: Shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + shape.n_q)
    return rng.standard_normal((shape.n_q, HEADS["h_q"], HEADS["d"]), dtype=np.float32)


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The in-process answer every service answer is checked against."""
    with common.blas_threads(1):
        out, _ = inprocess_attention(q, k, v, threads=2)
    return out


def kernel_rates(k: np.ndarray, v: np.ndarray, shapes: Sequence[Shape], keys: int, repeat: int) -> dict[str, Any]:
    """The resident kernel on one thread (BLAS at one) over the first ``keys`` keys, per shape:
    seconds per run, and GB/s of K+V (decode) or GFLOP/s (prefill)."""
    store = StreamingKV(HEADS["h_kv"], HEADS["d"], HEADS["d"], np.dtype(np.float32), capacity=keys)
    store.append(k[:keys], v[:keys], np.arange(keys))
    view = store.snapshot()
    rates: dict[str, Any] = {"keys": keys, "threads": 1}
    for shape in shapes:
        q = make_q(shape, SEED)
        q_pos = np.arange(keys - shape.n_q, keys)

        def run(q: np.ndarray = q, q_pos: np.ndarray = q_pos) -> Any:
            with common.blas_threads(1):
                return partial_attention_resident(q, view, q_pos=q_pos, options=AttentionOptions(),
                                                  kernel=KernelOptions(threads=1))

        seconds, _ = common.time_calls(run, repeat)
        med = statistics.median(seconds)
        rates[shape.name] = {"n_q": shape.n_q, "seconds": seconds, "median_s": med,
                             "gb_per_s": kv_bytes(keys) / med / 1e9, "gflop_per_s": shape.flops(keys) / med / 1e9}
    return rates


# ------------------------------------------------------------------ clusters and servers


@contextlib.contextmanager
def ray_cluster(node_cpus: Sequence[int]) -> Iterator[str]:
    """A Ray cluster of ``len(node_cpus)`` loopback nodes, this process connected in the splitkey
    namespace; yields its address. Always shut down."""
    import ray
    from ray.cluster_utils import Cluster

    common_args = {"node_ip_address": "127.0.0.1", "object_store_memory": OBJECT_STORE_BYTES}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": node_cpus[0], "include_dashboard": False,
                                                      **common_args})
    try:
        for cpus in node_cpus[1:]:
            c.add_node(num_cpus=cpus, **common_args)
        c.wait_for_nodes()
        ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
        try:
            yield c.address
        finally:
            ray.shutdown()
    finally:
        c.shutdown()


def server_args(address: str, setup: Setup, fe: FrontEnd) -> list[str]:
    return ["--ray-address", address, "--worker-cpus", f"{setup.worker_cpus:g}", "--merge-fanin", str(fe.fanin),
            "--remote-merge-bytes", str(fe.remote_merge_bytes), "--batch-rows", "1", "--context-shard-keys", "1024"]


def upload(url: str, k: np.ndarray, v: np.ndarray, shards: Sequence[int]) -> dict[int, str]:
    """One context per shard count, the same keys in each: ``{shards: id}``."""
    ids = {}
    with TimedClient(url) as c:
        for s in shards:
            desc = c.create_context(k, v, shards=s)
            if desc["shards"] != s or desc["length"] != len(k):
                raise RuntimeError(f"context must have {s} shards of {len(k)} keys, got {desc}")
            ids[s] = desc["id"]
    return ids


# ------------------------------------------------------------------ probes


def probe_directory(ctx_id: str, calls: int) -> tuple[list[float], dict]:
    """Seconds of ``calls`` directory lookups from this process, and the record."""
    import ray

    directory = ray.get_actor(DIRECTORY, namespace=NAMESPACE)
    record = ray.get(directory.get_many.remote([ctx_id]))[0]
    seconds = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ray.get(directory.get_many.remote([ctx_id]))
        seconds.append(time.perf_counter() - t0)
    return seconds, record


def probe_shards(record: dict, q: np.ndarray, fanin: int) -> tuple[float, list[float], list[str]]:
    """Every shard's ``partial_resident`` on its first replica, all at once: the wall seconds,
    each worker's reported compute seconds and the workers."""
    import ray

    from workers.tasks import ShardQuery, ShardRead

    n_k = sum(s["length"] for s in record["shards"])
    query = ShardQuery(q_pos=np.arange(n_k - q.shape[0], n_k), options=AttentionOptions())
    workers = [s["workers"][0] for s in record["shards"]]
    handles = {w: ray.get_actor(w, namespace=NAMESPACE) for w in set(workers)}
    q_ref = ray.put(q)
    t0 = time.perf_counter()
    refs = [handles[w].partial_resident.remote(q_ref, query, (ShardRead(record["id"], s["index"], s["length"]),),
                                               fanin) for w, s in zip(workers, record["shards"])]
    results = ray.get(refs)
    wall = time.perf_counter() - t0
    return wall, [float(status.seconds) for status, _ in results], workers


# ------------------------------------------------------------------ one cell


def new_cell(setup: Setup, shards: int, fe: FrontEnd, shape: Shape, n_k: int) -> Cell:
    return Cell(setup=setup.name, sweep=setup.sweep, nodes=setup.nodes, workers=setup.workers,
                worker_cpus=setup.worker_cpus, shards=shards, fanin=fe.fanin, shape=shape.name, n_q=shape.n_q, n_k=n_k,
                depth=tree_depth(shards, fe.fanin), remote_merge_bytes=fe.remote_merge_bytes,
                remote_merge=remote_merge(shards, fe.fanin, shape.state_bytes(), fe.remote_merge_bytes),
                q_bytes=shape.q_bytes(), out_bytes=shape.out_bytes(), state_bytes=shape.state_bytes(),
                kv_bytes=kv_bytes(n_k), flops=shape.flops(n_k))


def measure_cells(url: str, ctx_id: str, cells: dict[str, Cell], queries: dict[str, np.ndarray],
                  refs: dict[str, np.ndarray], rounds: int, throughput: bool, loop_s: float) -> None:
    """Warm-up (checked); rounds at concurrency 1, the shapes alternating, each shape's requests
    followed by its shard probe (same machine state); directory probes; closed loops."""
    directory_s, record = probe_directory(ctx_id, DIRECTORY_CALLS)
    with TimedClient(url) as c:
        for name, cell in cells.items():
            out, _ = c.attention(queries[name], contexts=[ctx_id])
            cell.max_abs_diff = common.check_same(cell.label, out, refs[name])
            cell.probe.directory_s = list(directory_s)
        before = common.cpu_sample()
        for _ in range(rounds):
            for name, cell in cells.items():
                seconds = []
                for _ in range(PER_ROUND[name]):
                    t0 = time.perf_counter()
                    c.attention(queries[name], contexts=[ctx_id])
                    seconds.append(time.perf_counter() - t0)
                    cell.requests.append(common.Record(seconds[-1], c.last_stages()))
                cell.rounds.append(statistics.median(seconds))
                wall, shard_s, workers = probe_shards(record, queries[name], cell.fanin)
                cell.probe.wall_s.append(wall)
                cell.probe.shard_s.append(shard_s)
                cell.probe.shard_workers = workers
        others = common.others_cores(before, common.cpu_sample())
        for cell in cells.values():
            cell.others_cores = others
    if throughput:
        for name, cell in cells.items():
            concurrency, n = LOOP[name]

            def send(client: TimedClient, q: np.ndarray = queries[name]) -> None:
                client.attention(q, contexts=[ctx_id])

            before = common.cpu_sample()
            _, level = closed_loop(url, send, concurrency, n, loop_s)
            cell.loop = {"concurrency": concurrency, "requests": level.requests, "errors": level.errors,
                         "seconds": level.seconds, "per_second": level.per_second, "p50_s": level.p50_ms / 1000,
                         "others_cores": common.others_cores(before, common.cpu_sample())}


def run_setup(setup: Setup, args: argparse.Namespace, k: np.ndarray, v: np.ndarray, shapes: Sequence[Shape],
              queries: dict[str, np.ndarray], refs: dict[str, np.ndarray], workdir: Path) -> list[Cell]:
    cells: list[Cell] = []
    with ray_cluster(setup.node_cpus) as address:
        ids: dict[int, str] = {}
        for i, fe in enumerate(setup.front_ends):
            with common.splitkey_server(workdir, setup.workers, server_args(address, setup, fe)) as url:
                if i == 0:
                    t0 = time.perf_counter()
                    ids = upload(url, k, v, setup.shard_counts)
                    print(f"{setup.name}: {len(ids)} contexts uploaded in {time.perf_counter() - t0:.1f} s",
                          file=sys.stderr)
                for shards in fe.shards:
                    group = {s.name: new_cell(setup, shards, fe, s, len(k)) for s in shapes if s.name in fe.shapes}
                    loops = i == 0 and shards == setup.workers
                    measure_cells(url, ids[shards], group, queries, refs, args.rounds, loops, args.loop_seconds)
                    cells += group.values()
                    print(f"{group[next(iter(group))].label}: "
                          + ", ".join(f"{n} {common.ms(c.p50())} ms" for n, c in group.items()), file=sys.stderr)
    return cells


# ------------------------------------------------------------------ report


def derived(cell: Cell) -> dict[str, float]:
    """The model's stages of one cell (seconds; medians): ``common.model_stages`` says how the
    probes split what Server-Timing does not."""
    p = cell.probe
    return common.model_stages([(r.seconds, r.stages) for r in cell.requests], p.directory_s, p.wall_s, p.shard_s,
                               p.shard_workers, cell.rounds)


def spread(values: Sequence[float]) -> str:
    return common.ms_spread(common.summarize(values))


def rate_cell(cell: Cell) -> str:
    return "-" if cell.loop is None else f"{cell.loop['per_second']:.2f} (c={cell.loop['concurrency']:g})"


def sweep_table(cells: Sequence[Cell], sweeps: Sequence[str]) -> str:
    """Latency and throughput per setup (the first fan-in, shards = workers)."""
    rows = []
    plain = [c for c in cells if c.remote_merge_bytes == REMOTE_MERGE_BYTES]
    by = {(c.setup, c.shards, c.fanin, c.shape): c for c in plain}
    for c in plain:
        if c.sweep not in sweeps or c.shape != "decode" or c.shards != c.workers or c.fanin != 2:
            continue
        p = by.get((c.setup, c.shards, c.fanin, "prefill"))
        others = "/".join(f"{x.others_cores:.2f}" for x in (c, p) if x)
        rows.append([c.setup, c.nodes, c.workers, f"{c.worker_cpus:g}", c.shards, spread(c.rounds), rate_cell(c),
                     spread(p.rounds) if p else "-", rate_cell(p) if p else "-", others])
    head = ["setup", "nodes", "workers", "CPUs each", "shards", "decode p50 ms (rounds' range)", "decode req/s",
            "prefill p50 ms (rounds' range)", "prefill req/s", "cores others used (decode/prefill)"]
    return common.markdown_table(head, rows)


def shards_table(cells: Sequence[Cell]) -> str:
    """Shard count and fan-in on the four-worker setup."""
    rows = []
    by = {(c.shards, c.fanin, c.remote_merge_bytes, c.shape): c for c in cells if c.sweep == "shards"}
    for (shards, fanin, limit, shape), c in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
        if shape != "decode":
            continue
        p = by.get((shards, fanin, limit, "prefill"))
        merge_where = "/".join(("workers" if x.remote_merge else "front end") for x in (c, p) if x)
        rows.append([shards, fanin, c.depth, merge_where, spread(c.rounds), common.ms(c.stages().get("merge", 0.0)),
                     spread(p.rounds) if p else "-", common.ms(p.stages().get("merge", 0.0)) if p else "-"])
    head = ["shards", "fan-in", "tree depth", "merge on (decode/prefill)", "decode p50 ms", "decode merge ms",
            "prefill p50 ms", "prefill merge ms"]
    return common.markdown_table(head, rows)


def breakdown_table(cells: Sequence[Cell]) -> str:
    rows = []
    for c in cells:
        d = derived(c)
        rows.append([c.label, *(common.ms(d[k]) for k in ("frontend", "directory", "scatter", "compute",
                                                          "state_return", "merge", "total")), f"{c.others_cores:.2f}"])
    head = ["cell", "front end", "directory", "scatter", "compute", "state return", "merge", "client p50",
            "cores others used"]
    return common.markdown_table(head, rows)


def timing_table(cells: Sequence[Cell]) -> str:
    rows = [[c.label, *common.stage_cells(c.stages()), common.ms(c.p50()),
             common.ms(statistics.median(c.probe.wall_s)) if c.probe.wall_s else "-",
             " / ".join(common.ms(statistics.median(col)) for col in zip(*c.probe.shard_s)) if c.probe.shard_s
             else "-"] for c in cells]
    head = ["cell", *common.STAGES, "client p50", "probe wall", "probe compute per shard"]
    return common.markdown_table(head, rows)


def kernel_table(rates: dict[str, Any]) -> str:
    rows = []
    for name in ("decode", "prefill"):
        if name in rates:
            r = rates[name]
            rows.append([name, r["n_q"], common.size_label(rates["keys"]), spread(r["seconds"]),
                         f"{r['gb_per_s']:.1f}", f"{r['gflop_per_s']:.1f}"])
    return common.markdown_table(["shape", "n_q", "keys", "ms (min-max)", "GB/s of K+V", "GFLOP/s"], rows)


def report(args: argparse.Namespace, cells: Sequence[Cell], rates: dict[str, Any], notes: Sequence[str]) -> str:
    command = " ".join([".venv/bin/python", "benchmarks/scaling.py", *args.argv])
    lines = [f"### Scaling benchmark, {datetime.date.today().isoformat()}", "", f"Command: `{command}`", "",
             *common.machine_lines(), *notes,
             (f"- context: {common.size_label(args.n_k)} keys, h_kv={HEADS['h_kv']}, d={HEADS['d']}, float32 "
              f"({common.bytes_label(kv_bytes(args.n_k))} of K+V); decode n_q=1, prefill n_q={args.prefill_nq}, "
              f"h_q={HEADS['h_q']}; batching off (`--batch-rows 1`); {args.rounds} rounds"),
             ("- workers share the machine's cores: three or four workers hold 0.5 CPU each (Ray's accounting; "
              "they time-share the 2 cores)"), "",
             "In-process resident kernel, one thread (the model's compute rates):", "", kernel_table(rates), "",
             "Workers and nodes (shards = workers, fan-in 2; p50: median of the rounds' medians):", "",
             sweep_table(cells, ("workers", "shards", "nodes")), "",
             "Shards and merge fan-in (one node, 4 workers; 8 shards are two per worker):", "",
             shards_table(cells), "",
             ("Per request, the model's stages (median ms): front end = client time minus lookup, scatter, compute "
              "and merge; directory = Server-Timing lookup (the record, from the front end's cache after the first "
              "query; results from before that stage: the directory actor's lookup, probed, and scatter minus it); "
              "state return = the shard probe's wall time minus its busiest worker's compute seconds; "
              "compute = Server-Timing compute minus that state return:"), "", breakdown_table(cells), "",
             "Server-Timing (median ms), and the shard probe (median ms):", "", timing_table(cells), ""]
    return "\n".join(lines)


def to_json(args: argparse.Namespace, cells: Sequence[Cell], rates: dict[str, Any], notes: Sequence[str]) -> dict:
    return {"benchmark": "scaling", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(["benchmarks/scaling.py", *args.argv]), "machine": common.machine_lines(),
            "cores": os.cpu_count(), "notes": list(notes), "heads": HEADS, "dtype": DTYPE, "n_k": args.n_k,
            "rounds": args.rounds, "remote_merge_bytes": REMOTE_MERGE_BYTES, "kernel": rates,
            "cells": [{**asdict(c), "derived": derived(c), "p50_s": c.p50()} for c in cells]}


# ------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one two-worker setup, tiny context: a smoke run (< 60 s)")
    p.add_argument("--rounds", type=common.positive, default=3, help="rounds of requests per cell (default 3)")
    p.add_argument("--n-k", type=common.parse_keys, default=None, help="keys of the context (default 64K)")
    p.add_argument("--prefill-nq", type=common.positive, default=None, help="queries of the prefill shape (256)")
    p.add_argument("--loop-seconds", type=float, default=20.0, help="seconds per closed loop at most")
    p.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--json", default=None, help="write the raw results here")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.n_k is not None and len(args.n_k) != 1:
        p.error("--n-k takes one size")
    if args.quick:
        args.rounds = min(args.rounds, 2)
        args.loop_seconds = min(args.loop_seconds, 3.0)
    args.n_k = args.n_k[0] if args.n_k else (QUICK_N_K if args.quick else N_K)
    args.prefill_nq = args.prefill_nq or (QUICK_PREFILL_NQ if args.quick else PREFILL_NQ)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    common.raise_on_sigterm()
    t0 = time.monotonic()
    notes = [common.wait_for_quiet(not args.no_wait and not args.quick), f"- load average before: {common.load_average()}"]
    shapes = [Shape("decode", 1), Shape("prefill", args.prefill_nq)]
    k, v = make_kv(args.n_k, args.seed)
    queries = {s.name: make_q(s, args.seed) for s in shapes}
    refs = {s.name: reference(queries[s.name], k, v) for s in shapes}
    rates = kernel_rates(k, v, shapes, keys=args.n_k // 4 if not args.quick else args.n_k, repeat=args.rounds + 1)
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="splitkey-scaling-") as tmp:
        for setup in plan(args.quick):
            notes.append(f"- before {setup.name}: load average {common.load_average()}")
            cells += run_setup(setup, args, k, v, shapes, queries, refs, Path(tmp))
    notes += [f"- load average after: {common.load_average()}", f"- whole run: {time.monotonic() - t0:.0f} s"]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(to_json(args, cells, rates, notes), indent=1, default=float))
    common.emit_report(report(args, cells, rates, notes), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
