"""The cost model of one splitkey request (issue 14; docs/SCALING.md): terms, fit, check, predictions.

Run from the repository root::

    .venv/bin/python benchmarks/model.py --scaling benchmarks/results/DATE/scaling.json \\
        --doc docs/SCALING.md --plot docs/images/scaling-decode-latency.png

It reads the raw JSON of ``benchmarks/scaling.py`` (and, when given, ``benchmarks/kernel.py
--json`` for its kernel rates and ``benchmarks/gpu.py``'s ``gpu_bench.json`` for measured GPU
rates), fits the model's constants on those measurements, checks the fitted model against
every measured cell, predicts the decode shape on 8 to 1000 GPUs for contexts of 1M to 100M
tokens, finds the crossover points, and writes the tables between the ``<!-- model:NAME:begin
-->`` / ``<!-- model:NAME:end -->`` markers of ``--doc`` and one plot (matplotlib, Agg).

The model (one function per term below; units in the names: ``_s`` seconds, ``_bytes``,
``_bytes_per_s``, ``_flops``, ``_flops_per_s``). One request over ``S`` shards of ``n_k``
keys, ``W`` workers, merge fan-in ``f``::

    T = frontend + directory + scatter + compute + return + merge (+ network)
    frontend  = a_fe + b_fe * (q_bytes + out_bytes)             parse, encode, HTTP, client
    scatter   = a_sc + b_sc * q_bytes                           q into the object store, jobs
    compute   = ceil(S / W) * (c_w + shard(n_k / S)) / share   share = min(1, cores / min(S, W))
    shard(n)  = call + max(kv_bytes(n) / read_rate, batch * flops(n) / flop_rate)
    return    = a_ret + dispatch * S + [local] b_ret * S * state_bytes
    merge     = [local]  a_m + b_m * S * state_bytes
                [remote] a_m + depth * (hop + b_hop * f * state_bytes),  depth = ceil(log_f S)
    network   = latency + S_remote * (q_bytes + [local] state_bytes) / bandwidth
                + [remote] depth * (latency + f * state_bytes / bandwidth)

with ``state_bytes = n_q * h_q * (d_v + 2) * 4`` per shard and ``remote`` the orchestrator's rule
(``S > f`` and ``S * state_bytes`` above ``--remote-merge-bytes``). The "collective floor"
variant (what a compiled stack with NCCL-style collectives could reach, Tree Attention's
setting) drops the software constants and broadcasts q and reduces the states over trees:
``T = depth * (latency + q_bytes / bw) + shard(n_k / S) + depth * (latency + f * state_bytes / bw + hop)``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common

#: The orchestrator's default ``--remote-merge-bytes``.
REMOTE_MERGE_BYTES = 8 * 2**20
GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1000)
CONTEXTS = (1_000_000, 10_000_000, 100_000_000)
#: Share of a device's memory a context may take (the rest: the runtime, scratch, other layers' weights).
USABLE_MEMORY = 0.9
#: Layers of a Llama-3-8B-like model with this attention shape (h_q=32, h_kv=8, d=128).
MODEL_LAYERS = 32
DOC_PREFIX = "model"


# ------------------------------------------------------------------ the problem and the hardware


@dataclass(frozen=True)
class Problem:
    """One attention call: ``q [n_q, h_q, d]`` over keys ``[n_k, h_kv, d]`` and values ``[n_k, h_kv, d_v]``.

    ``kv_itemsize`` bytes per stored element, ``q_itemsize`` per query element, states in
    ``acc_itemsize`` (float32: 4).
    """

    n_q: int
    h_q: int = 32
    h_kv: int = 8
    d: int = 128
    d_v: int = 128
    kv_itemsize: int = 4
    q_itemsize: int = 4
    acc_itemsize: int = 4


#: The decode shape of the predictions: one query, Llama-3-8B-like heads, bfloat16 keys and query.
DECODE_BF16 = Problem(n_q=1, kv_itemsize=2, q_itemsize=2)


@dataclass(frozen=True)
class Device:
    """What computes one shard: its rates (per shard worker) and memory."""

    name: str
    read_bytes_per_s: float  # K+V bytes per second the decode kernel streams
    flops_per_s: float  # attention flops per second when compute-bound
    call_s: float  # fixed cost of one shard's kernel call (launch, Python, plan)
    memory_bytes: float
    source: str  # "measured here ..." or "assumed: ..."


@dataclass(frozen=True)
class Network:
    """Point-to-point transfers: ``latency_s + bytes / bytes_per_s``."""

    name: str
    latency_s: float
    bytes_per_s: float
    source: str


@dataclass(frozen=True)
class Stack:
    """The software's own costs per request (seconds, seconds per byte), fitted on this machine."""

    frontend_s: float = 0.0
    frontend_s_per_byte: float = 0.0
    worker_call_s: float = 0.0  # per shard call in the worker around the kernel: Python, the plan, views
    directory_s: float = 0.0
    scatter_s: float = 0.0
    scatter_s_per_byte: float = 0.0
    return_s: float = 0.0
    dispatch_s_per_shard: float = 0.0
    return_s_per_byte: float = 0.0
    merge_s: float = 0.0
    merge_s_per_byte: float = 0.0
    hop_s: float = 0.0  # one level of a merge on the workers (one worker call)
    hop_s_per_byte: float = 0.0
    remote_merge_bytes: int = REMOTE_MERGE_BYTES

    def cpu_s(self, p: Problem, shards: int) -> float:
        """Front-end CPU seconds one request costs (what bounds one front end's requests per second)."""
        return (self.frontend_s + self.frontend_s_per_byte * http_bytes(p) + self.scatter_s
                + self.scatter_s_per_byte * query_bytes(p) + self.dispatch_s_per_shard * shards + self.merge_s)


# Assumed hardware, never measured here (docs/GPU.md: no GPU run so far; the copy rate was read on a lent H200 by an earlier session).
H200 = Device("H200", read_bytes_per_s=4.3e12, flops_per_s=989e12 * 0.6, call_s=10e-6, memory_bytes=141e9,
              source=("assumed: HBM3e 4.8 TB/s spec; decode streams at the 4.3 TB/s a device-to-device copy "
                      "moved on the lent H200 (field notes); 989 TFLOP/s dense bf16 spec at 60%; 10 us per call"))
H100 = Device("H100", read_bytes_per_s=3.35e12 * 4.3 / 4.8, flops_per_s=989e12 * 0.6, call_s=10e-6,
              memory_bytes=80e9, source="assumed: HBM3 3.35 TB/s spec at the H200's copy/spec ratio (0.9)")
NET_400 = Network("400 Gbit/s", latency_s=10e-6, bytes_per_s=50e9, source="assumed: 400 Gbit/s RDMA, 10 us per hop")
NET_100 = Network("100 Gbit/s", latency_s=10e-6, bytes_per_s=12.5e9, source="assumed: 100 Gbit/s RDMA, 10 us per hop")
#: One merge node's kernel on a GPU (a few elementwise passes over a 17 KB state): assumed.
GPU_HOP_S = 5e-6


# ------------------------------------------------------------------ terms: bytes, flops, tree


def kv_bytes(p: Problem, n_k: float) -> float:
    """K+V bytes of ``n_k`` keys: ``n_k * h_kv * (d + d_v) * kv_itemsize``."""
    return n_k * p.h_kv * (p.d + p.d_v) * p.kv_itemsize


def query_bytes(p: Problem) -> int:
    """``q [n_q, h_q, d]``: what goes out to every shard."""
    return p.n_q * p.h_q * p.d * p.q_itemsize


def state_bytes(p: Problem) -> int:
    """One shard's ``(m, l, acc)``: ``n_q * h_q * (d_v + 2)`` numbers of the accumulation dtype."""
    return p.n_q * p.h_q * (p.d_v + 2) * p.acc_itemsize


def http_bytes(p: Problem) -> int:
    """Body bytes of one request and its answer: q in; ``out [n_q, h_q, d_v]`` and ``lse`` back (float32)."""
    return query_bytes(p) + p.n_q * p.h_q * (p.d_v + 1) * 4


def attention_flops(p: Problem, n_k: float) -> float:
    """``2 n_q h_q n_k (d + d_v)``: QK and PV (``4 n_q h_q n_k d`` when d_v = d)."""
    return 2.0 * p.n_q * p.h_q * n_k * (p.d + p.d_v)


@dataclass(frozen=True)
class Moved:
    """Bytes one request moves between the front end and the shards."""

    query_out_bytes: int  # q to every shard
    states_back_bytes: int  # one state from every shard


def bytes_moved(p: Problem, shards: int) -> Moved:
    """``S * q_bytes`` out and ``S * n_q * h_q * (d_v + 2) * 4`` back, whatever ``n_k`` is."""
    return Moved(shards * query_bytes(p), shards * state_bytes(p))


def tree_depth(shards: int, fanin: int) -> int:
    """Levels of the merge tree, ``ceil(log_fanin(shards))`` (0 for one shard), in integers:
    each level groups ``fanin`` consecutive states, as ``merge.tree_levels`` does."""
    if shards < 1 or fanin < 2:
        raise ValueError(f"shards must be >= 1 and fanin >= 2, got {shards}, {fanin}")
    depth, width = 0, shards
    while width > 1:
        width, depth = -(-width // fanin), depth + 1
    return depth


def remote_merge(p: Problem, shards: int, fanin: int, limit_bytes: int = REMOTE_MERGE_BYTES) -> bool:
    """The orchestrator's rule: merge on the workers when ``S > fanin`` and the states pass ``limit_bytes``."""
    return shards > fanin and shards * state_bytes(p) > limit_bytes


# ------------------------------------------------------------------ terms: time


def transfer_s(nbytes: float, net: Network) -> float:
    """One transfer: ``latency + bytes / bandwidth``."""
    return net.latency_s + nbytes / net.bytes_per_s


def shard_compute_s(p: Problem, keys: float, dev: Device, batch: int = 1) -> float:
    """One shard's kernel call over ``keys`` keys for ``batch`` queries sharing the pass (roofline):
    ``call + max(kv_bytes / read_rate, batch * flops / flop_rate)``."""
    return dev.call_s + max(kv_bytes(p, keys) / dev.read_bytes_per_s, batch * attention_flops(p, keys) / dev.flops_per_s)


def cpu_share(shards: int, workers: int, cores: float) -> float:
    """Share of a core each busy worker gets: ``min(1, cores / min(S, W))`` (1 on GPUs: one device each)."""
    return min(1.0, cores / max(1, min(shards, workers)))


def compute_s(p: Problem, n_k: float, shards: int, dev: Device, workers: int | None = None,
              cores: float | None = None, call_s: float = 0.0) -> float:
    """The busiest worker's compute: ``ceil(S / W)`` shard calls of ``n_k / S`` keys one after the other
    (each ``call_s`` of the worker's own plus the kernel), at its share of the cores."""
    w = shards if workers is None else workers
    share = 1.0 if cores is None else cpu_share(shards, w, cores)
    return math.ceil(shards / w) * (call_s + shard_compute_s(p, n_k / shards, dev)) / share


def frontend_s(p: Problem, st: Stack) -> float:
    """Parse, encode, HTTP and the client: ``a_fe + b_fe * (q_bytes + out_bytes)``."""
    return st.frontend_s + st.frontend_s_per_byte * http_bytes(p)


def scatter_s(p: Problem, st: Stack) -> float:
    """q into the object store and the jobs built: ``a_sc + b_sc * q_bytes`` (the directory lookup apart)."""
    return st.scatter_s + st.scatter_s_per_byte * query_bytes(p)


def return_s(p: Problem, shards: int, fanin: int, st: Stack) -> float:
    """Dispatch and the states' way back (beyond the busiest worker's compute): ``a_ret + dispatch * S``,
    plus ``b_ret * S * state_bytes`` when the states come back to the front end (local merge)."""
    local = not remote_merge(p, shards, fanin, st.remote_merge_bytes)
    return st.return_s + st.dispatch_s_per_shard * shards + local * st.return_s_per_byte * shards * state_bytes(p)


def merge_s(p: Problem, shards: int, fanin: int, st: Stack) -> float:
    """The merge: at the front end ``a_m + b_m * S * state_bytes``; on the workers
    ``a_m + depth * (hop + b_hop * fanin * state_bytes)``, one worker call per level."""
    if remote_merge(p, shards, fanin, st.remote_merge_bytes):
        level = st.hop_s + st.hop_s_per_byte * fanin * state_bytes(p)
        return st.merge_s + tree_depth(shards, fanin) * level
    return st.merge_s + st.merge_s_per_byte * shards * state_bytes(p)


def network_s(p: Problem, shards: int, fanin: int, net: Network | None, remote_shards: int | None = None,
              limit_bytes: int = REMOTE_MERGE_BYTES) -> float:
    """Crossing the network (0 without one): q out to and states back from the ``remote_shards``
    on other machines, serialised through the front end's link, one latency; plus, for a merge
    on the workers, one transfer of ``fanin`` states per tree level."""
    if net is None:
        return 0.0
    far = shards if remote_shards is None else remote_shards
    remote = remote_merge(p, shards, fanin, limit_bytes)
    out = 0.0 if far == 0 else transfer_s(far * (query_bytes(p) + (not remote) * state_bytes(p)), net)
    if remote:
        out += tree_depth(shards, fanin) * transfer_s(fanin * state_bytes(p), net)
    return out


@dataclass(frozen=True)
class Breakdown:
    """One request's predicted stages (seconds)."""

    frontend: float
    directory: float
    scatter: float
    compute: float
    state_return: float
    merge: float
    network: float

    @property
    def total(self) -> float:
        return sum(asdict(self).values())


def request_s(p: Problem, n_k: float, shards: int, fanin: int, dev: Device, st: Stack, net: Network | None = None,
              workers: int | None = None, cores: float | None = None, remote_shards: int | None = None) -> Breakdown:
    """The stages of one request as splitkey runs it (the model's equation in the module docstring)."""
    return Breakdown(frontend=frontend_s(p, st), directory=st.directory_s, scatter=scatter_s(p, st),
                     compute=compute_s(p, n_k, shards, dev, workers, cores, st.worker_call_s),
                     state_return=return_s(p, shards, fanin, st),
                     merge=merge_s(p, shards, fanin, st),
                     network=network_s(p, shards, fanin, net, remote_shards, st.remote_merge_bytes))


def collective_s(p: Problem, n_k: float, shards: int, fanin: int, dev: Device, net: Network,
                 hop_s: float = GPU_HOP_S) -> Breakdown:
    """The collective floor: q broadcast and states reduced over trees of ``fanin``, no software constants."""
    depth = tree_depth(shards, fanin)
    return Breakdown(frontend=0.0, directory=0.0, scatter=0.0, compute=shard_compute_s(p, n_k / shards, dev),
                     state_return=0.0, merge=depth * hop_s,
                     network=depth * (transfer_s(query_bytes(p), net) + transfer_s(fanin * state_bytes(p), net)))


def ring_kv_s(p: Problem, n_k: float, devices: int, dev: Device, net: Network) -> float:
    """Ring Attention's pattern for one decode step: KV blocks of ``n_k / G`` keys travel the ring,
    ``G - 1`` steps of ``max(compute, transfer)`` (communication overlapped) after the first block."""
    block = n_k / devices
    step = max(shard_compute_s(p, block, dev), transfer_s(kv_bytes(p, block), net))
    return shard_compute_s(p, block, dev) + (devices - 1) * step


def ring_states_s(p: Problem, n_k: float, devices: int, dev: Device, net: Network, hop_s: float = GPU_HOP_S) -> float:
    """Partial states passed along a ring instead of a tree: ``G - 1`` sequential hops."""
    return shard_compute_s(p, n_k / devices, dev) + (devices - 1) * (transfer_s(state_bytes(p), net) + hop_s)


def move_cache_s(p: Problem, n_k: float, devices: int, dev: Device, net: Network) -> float:
    """Move the cache, not the query: the other devices' K+V fetched to the query's device, then one pass."""
    return transfer_s(kv_bytes(p, n_k) * (devices - 1) / devices, net) + shard_compute_s(p, n_k, dev)


# ------------------------------------------------------------------ throughput and capacity


def devices_for_memory(p: Problem, n_k: float, dev: Device, layers: int = 1) -> int:
    """Devices a context's K+V needs (``layers`` layers of it), at ``USABLE_MEMORY`` of each device."""
    return max(1, math.ceil(layers * kv_bytes(p, n_k) / (USABLE_MEMORY * dev.memory_bytes)))


def group_throughput(p: Problem, n_k: float, shards: int, dev: Device, st: Stack, batch: int = 1,
                     front_ends: int = 1) -> float:
    """Requests per second of one replica group (``shards`` devices holding one copy), all busy:
    ``min(batch / shard pass, front_ends / front-end CPU per request)``."""
    device = batch / (st.worker_call_s + shard_compute_s(p, n_k / shards, dev, batch))
    cpu = st.cpu_s(p, shards)
    return device if cpu <= 0 else min(device, front_ends / cpu)


def replicas_needed(target_per_s: float, group_per_s: float) -> int:
    """Replica groups (each a full copy of the context) for ``target_per_s`` requests per second."""
    return max(1, math.ceil(target_per_s / group_per_s))


def cpu_throughput(p: Problem, n_k: float, shards: int, workers: int, concurrency: int, dev: Device, st: Stack,
                   cores: float, latency_s: float) -> float:
    """A closed loop on this machine: bounded by the clients (``c / latency``), by the workers' compute
    threads (``min(W, cores) / compute core-seconds``) and by all cores together (compute + front end)."""
    work = shards * (st.worker_call_s + shard_compute_s(p, n_k / shards, dev))
    return min(concurrency / latency_s, min(workers, cores) / work, cores / (work + st.cpu_s(p, shards)))


# ------------------------------------------------------------------ observations and the fit


@dataclass(frozen=True)
class Observation:
    """One measured cell (seconds; medians), as ``benchmarks/scaling.py`` derives it."""

    label: str
    problem: Problem
    n_k: int
    shards: int
    workers: int
    nodes: int
    fanin: int
    frontend: float
    directory: float
    scatter: float
    compute: float  # the busiest worker's compute (probe)
    state_return: float
    merge: float
    total: float  # client p50
    loop_concurrency: int = 0
    loop_per_s: float = float("nan")
    remote_merge_bytes: int = REMOTE_MERGE_BYTES  # the front end's --remote-merge-bytes
    others_cores: float = 0.0  # cores other processes kept busy during the cell's rounds
    loop_others_cores: float = 0.0  # ... during its closed loop

    @property
    def remote(self) -> bool:
        """Whether this cell's merge ran on the workers."""
        return remote_merge(self.problem, self.shards, self.fanin, self.remote_merge_bytes)

    @property
    def remote_shards(self) -> int:
        """Shards on other nodes than the front end's (one worker per node, spread)."""
        return 0 if self.nodes <= 1 else self.shards - math.ceil(self.shards / self.nodes)


def observations(scaling: dict) -> list[Observation]:
    """The cells of a ``scaling.py --json`` file."""
    heads = scaling["heads"]
    out = []
    for c in scaling["cells"]:
        p = Problem(n_q=c["n_q"], h_q=heads["h_q"], h_kv=heads["h_kv"], d=heads["d"], d_v=heads["d"])
        probe = c["probe"]
        d = common.model_stages([(r["seconds"], r["stages"]) for r in c["requests"]], probe["directory_s"],
                                probe["wall_s"], probe["shard_s"], probe["shard_workers"], c["rounds"])
        loop = c.get("loop") or {}
        limit = int(c.get("remote_merge_bytes", REMOTE_MERGE_BYTES))
        forced = ", merge on workers" if limit != REMOTE_MERGE_BYTES else ""
        label = f"{c['setup']}, S={c['shards']}, f={c['fanin']}{forced}, {c['shape']}"
        out.append(Observation(label, p, c["n_k"], c["shards"], c["workers"], c["nodes"], c["fanin"], d["frontend"],
                               d["directory"], d["scatter"], d["compute"], d["state_return"], d["merge"], d["total"],
                               int(loop.get("concurrency", 0)), float(loop.get("per_second", float("nan"))), limit,
                               float(c.get("others_cores", 0.0)), float(loop.get("others_cores", 0.0))))
    return out


def nnls(columns: Sequence[Sequence[float]], y: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """Non-negative least squares for a handful of columns: the best of every subset's
    unconstrained fit whose coefficients are all >= 0 (columns of zeros get 0). ``weights``
    scale each row's residual (``1 / total``: relative errors, so that cells of seconds do not
    drown cells of milliseconds)."""
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=float)
    a = np.asarray(columns, dtype=float).T * w[:, None]  # [rows, cols]
    b = np.asarray(y, dtype=float) * w
    cols = a.shape[1]
    usable = [j for j in range(cols) if np.any(a[:, j] != 0)]
    best, best_err = [0.0] * cols, float(np.sum(b**2))
    for r in range(1, len(usable) + 1):
        for subset in itertools.combinations(usable, r):
            coef, *_ = np.linalg.lstsq(a[:, subset], b, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((a[:, subset] @ coef - b) ** 2))
            if err < best_err - 1e-18:
                best, best_err = [0.0] * cols, err
                for j, c in zip(subset, coef):
                    best[j] = float(c)
    return best


@dataclass
class Fit:
    """The fitted constants and where each came from."""

    stack: Stack
    cpu: Device
    core_share: float  # of the cores other processes left, the share the workers got (fitted)
    machine_cores: float
    loopback: Network | None  # between Ray nodes on loopback (fitted on the multi-node cells)
    notes: list[str] = field(default_factory=list)

    def cores(self, others: float) -> float:
        """Cores the workers had while others kept ``others`` busy: ``share * (machine - others)``."""
        return free_cores(self.core_share, self.machine_cores, others)


def free_cores(share: float, machine: float, others: float) -> float:
    """``share * (machine - others)``, at least a tenth of a core."""
    return max(0.1, share * (machine - others))


def fit_cpu(obs: Sequence[Observation], read_bytes_per_s: float, flops_per_s: float, machine_cores: float,
            memory_bytes: float) -> tuple[Device, float, float]:
    """The CPU device, the share of the free cores the workers got and the worker's per-call seconds, from the cells' compute
    (kernel rates fixed: in-process, one thread); least squared log error over a grid of shares.
    Each cell's free cores are the machine's minus what other processes used meanwhile."""
    single = [o for o in obs if o.nodes == 1 and o.compute > 0]
    base = Device("cpu", read_bytes_per_s, flops_per_s, 0.0, memory_bytes, "")
    best: tuple[float, float, float] = (float("inf"), 0.0, 1.0)
    for share in np.arange(0.3, 1.5 + 1e-9, 0.02):
        cores = [free_cores(float(share), machine_cores, o.others_cores) for o in single]
        # compute = ceil(S / W) / share * (call + work): linear in call for fixed cores
        scale = [math.ceil(o.shards / o.workers) / cpu_share(o.shards, o.workers, c) for o, c in zip(single, cores)]
        work = [compute_s(o.problem, o.n_k, o.shards, base, o.workers, c) for o, c in zip(single, cores)]
        resid = [(o.compute - w) / o.compute for o, w in zip(single, work)]
        weights = [s / o.compute for s, o in zip(scale, single)]
        call = max(0.0, float(np.dot(weights, resid) / max(np.dot(weights, weights), 1e-30))) if single else 0.0
        err = sum((math.log((w + s * call) / o.compute)) ** 2 for o, w, s in zip(single, work, scale))
        if err < best[0]:
            best = (err, call, float(share))
    _, call, share = best
    dev = Device("this machine's CPU (one worker thread)", read_bytes_per_s, flops_per_s, 0.0, memory_bytes,
                 "measured here: in-process resident kernel, one thread")
    return dev, share, call


def fit(obs: Sequence[Observation], kernel: dict, machine_cores: float, memory_bytes: float = 24e9) -> Fit:
    """Fit every constant on its own stage (each stage is measured apart), then the cross-node extra
    on the multi-node cells; least squares of errors relative to each cell's total, coefficients
    >= 0. ``kernel``: ``{"decode": {"gb_per_s"}, "prefill": {"gflop_per_s"}}``."""
    notes = []
    cpu, share, call = fit_cpu(obs, kernel["decode"]["gb_per_s"] * 1e9, kernel["prefill"]["gflop_per_s"] * 1e9,
                               machine_cores, memory_bytes)
    one = [o for o in obs if o.nodes == 1]
    rel, rel_one = [1 / o.total for o in obs], [1 / o.total for o in one]
    fe = nnls([[1.0] * len(obs), [http_bytes(o.problem) for o in obs]], [o.frontend for o in obs], rel)
    sc = nnls([[1.0] * len(obs), [query_bytes(o.problem) for o in obs]], [o.scatter for o in obs], rel)
    local = [0.0 if o.remote else 1.0 for o in one]
    ret = nnls([[1.0] * len(one), [o.shards for o in one],
                [lc * o.shards * state_bytes(o.problem) for lc, o in zip(local, one)]], [o.state_return for o in one],
               rel_one)
    mg = nnls([[1.0] * len(one), [lc * o.shards * state_bytes(o.problem) for lc, o in zip(local, one)],
               [(1 - lc) * tree_depth(o.shards, o.fanin) for lc, o in zip(local, one)],
               [(1 - lc) * tree_depth(o.shards, o.fanin) * o.fanin * state_bytes(o.problem) for lc, o in zip(local, one)]],
              [o.merge for o in one], rel_one)
    stack = Stack(frontend_s=fe[0], frontend_s_per_byte=fe[1], worker_call_s=call,
                  directory_s=statistics.median(o.directory for o in obs) if obs else 0.0,
                  scatter_s=sc[0], scatter_s_per_byte=sc[1], return_s=ret[0], dispatch_s_per_shard=ret[1],
                  return_s_per_byte=ret[2], merge_s=mg[0], merge_s_per_byte=mg[1], hop_s=mg[2], hop_s_per_byte=mg[3])
    if not any(1 - lc for lc in local):
        stack = replace(stack, hop_s=stack.return_s + stack.dispatch_s_per_shard)
        notes.append("no measured merge on the workers: one level taken as one shard call's return + dispatch")
    loopback = None
    multi = [o for o in obs if o.nodes > 1 and o.remote_shards > 0]
    if multi:
        # What the one-node model leaves over in the multi-node cells' return and merge stages,
        # against network_s's two columns: transfers (latency each) and bytes (over the bandwidth).
        extra = [o.state_return + o.merge - return_s(o.problem, o.shards, o.fanin, on(stack, o))
                 - merge_s(o.problem, o.shards, o.fanin, on(stack, o)) for o in multi]
        unit = Network("unit", 1.0, 1.0, "")
        transfers = [network_s(o.problem, o.shards, o.fanin, replace(unit, bytes_per_s=math.inf), o.remote_shards,
                               o.remote_merge_bytes) for o in multi]
        nbytes = [network_s(o.problem, o.shards, o.fanin, replace(unit, latency_s=0.0), o.remote_shards,
                            o.remote_merge_bytes) for o in multi]
        lat, per_byte = nnls([transfers, nbytes], extra, [1 / o.total for o in multi])
        loopback = Network("Ray nodes on loopback", lat, 1 / per_byte if per_byte > 0 else math.inf,
                           f"fitted here on {len(multi)} cells of the multi-node setup (loopback TCP between Ray nodes)")
    return Fit(stack, cpu, share, machine_cores, loopback, notes)


# ------------------------------------------------------------------ the check


def on(st: Stack, o: Observation) -> Stack:
    """The stack as the cell's front end ran (its ``--remote-merge-bytes``)."""
    return replace(st, remote_merge_bytes=o.remote_merge_bytes)


def predict(o: Observation, f: Fit) -> Breakdown:
    """The fitted model's stages for one measured cell."""
    return request_s(o.problem, o.n_k, o.shards, o.fanin, f.cpu, on(f.stack, o), f.loopback if o.nodes > 1 else None,
                     o.workers, f.cores(o.others_cores), o.remote_shards)


def check_rows(obs: Sequence[Observation], f: Fit) -> list[list[str]]:
    rows = []
    for o in obs:
        b = predict(o, f)
        err = (b.total - o.total) / o.total
        terms = {"compute": (o.compute, b.compute), "return": (o.state_return, b.state_return + b.network),
                 "merge": (o.merge, b.merge), "front end": (o.frontend, b.frontend)}
        worst = max(terms, key=lambda k: abs(terms[k][1] - terms[k][0]))
        rows.append([o.label, common.ms(o.total), common.ms(b.total), f"{err:+.0%}", common.ms(o.compute),
                     common.ms(b.compute), common.ms(o.state_return), common.ms(b.state_return + b.network),
                     common.ms(o.merge), common.ms(b.merge),
                     f"{worst} ({(terms[worst][1] - terms[worst][0]) * 1e3:+.2f} ms)"])
    return rows


def check_table(obs: Sequence[Observation], f: Fit) -> str:
    head = ["cell", "measured ms", "model ms", "error", "compute meas.", "model", "return meas.", "model",
            "merge meas.", "model", "largest miss"]
    return common.markdown_table(head, check_rows(obs, f))


def throughput_table(obs: Sequence[Observation], f: Fit) -> str:
    rows = []
    for o in obs:
        if not o.loop_concurrency:
            continue
        lat = predict(o, f).total
        pred = cpu_throughput(o.problem, o.n_k, o.shards, o.workers, o.loop_concurrency, f.cpu, on(f.stack, o),
                              f.cores(o.loop_others_cores), lat)
        rows.append([o.label, o.loop_concurrency, f"{o.loop_others_cores:.2f}", f"{o.loop_per_s:.2f}", f"{pred:.2f}",
                     f"{(pred - o.loop_per_s) / o.loop_per_s:+.0%}"])
    return common.markdown_table(["cell", "concurrency", "cores others used", "measured req/s", "model req/s", "error"],
                                 rows)


def error_summary(obs: Sequence[Observation], f: Fit) -> dict[str, float]:
    errs = [abs(predict(o, f).total - o.total) / o.total for o in obs]
    return {"median_abs_error": statistics.median(errs) if errs else float("nan"),
            "max_abs_error": max(errs) if errs else float("nan")}


def fit_table(f: Fit, kernel_note: str) -> str:
    s = f.stack
    us = 1e6

    def per(x: float, unit: float = 1e6) -> str:
        return f"{x * unit:.3g}"

    rows = [
        ["decode read rate, one worker thread", f"{f.cpu.read_bytes_per_s / 1e9:.2f} GB/s", kernel_note],
        ["prefill flop rate, one worker thread", f"{f.cpu.flops_per_s / 1e9:.1f} GFLOP/s", kernel_note],
        ["per shard call in the worker (Python, plan)", f"{s.worker_call_s * us:.0f} us",
         "fitted: cells' compute (Server-Timing compute - state return), with the core share"],
        ["workers' share of the free cores", f"{f.core_share:.2f}",
         f"fitted: cells' compute; free = {f.machine_cores:g} cores - what other processes used (per cell)"],
        ["front end, per request", f"{s.frontend_s * us:.0f} us",
         "fitted: client time - lookup - scatter - compute - merge"],
        ["front end, per MB of q + out", f"{per(s.frontend_s_per_byte, 1e9)} ms/MB", "same fit"],
        ["directory lookup", f"{s.directory_s * us:.0f} us",
         "Server-Timing lookup (record cache hits; older results: a probe of the directory actor's get_many)"],
        ["scatter (q put, jobs)", f"{s.scatter_s * us:.0f} us + {per(s.scatter_s_per_byte, 1e9)} ms/MB of q",
         "fitted: Server-Timing scatter"],
        ["return, per request", f"{s.return_s * us:.0f} us",
         "fitted: the shard probe's wall time - its busiest worker's compute"],
        ["dispatch, per shard", f"{s.dispatch_s_per_shard * us:.0f} us", "same fit"],
        ["state return, per MB of states", f"{per(s.return_s_per_byte, 1e9)} ms/MB", "same fit (local merges)"],
        ["merge at the front end", f"{s.merge_s * us:.0f} us + {per(s.merge_s_per_byte, 1e9)} ms/MB of states",
         "fitted: Server-Timing merge"],
        ["merge on the workers, per level", f"{s.hop_s * us:.0f} us + {per(s.hop_s_per_byte, 1e9)} ms/MB",
         "same fit (remote merges)"],
    ]
    if f.loopback is not None:
        bw = "unbounded" if math.isinf(f.loopback.bytes_per_s) else f"{f.loopback.bytes_per_s / 1e9:.2f} GB/s"
        rows.append(["between Ray nodes (loopback)", f"{f.loopback.latency_s * us:.0f} us + bytes at {bw}",
                     f.loopback.source])
    return common.markdown_table(["constant", "value", "source"], rows)


# ------------------------------------------------------------------ predictions


def fmt_s(seconds: float) -> str:
    """Seconds as us, ms or s, three significant digits."""
    if not math.isfinite(seconds):
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def tokens_label(n: float) -> str:
    return f"{n / 1e6:g}M"


def best_fanin(p: Problem, n_k: float, g: int, dev: Device, st: Stack, net: Network) -> tuple[int, Breakdown]:
    """The fan-in (2, 4, 8, 16) with the lowest predicted latency as built."""
    options = [(f, request_s(p, n_k, g, f, dev, st, net)) for f in (2, 4, 8, 16)]
    return min(options, key=lambda x: x[1].total)


def prediction_rows(p: Problem, dev: Device, st: Stack, net: Network, counts: Sequence[int] = GPU_COUNTS,
                    contexts: Sequence[float] = CONTEXTS) -> list[list[str]]:
    rows = []
    for g in counts:
        row = [str(g)]
        for n_k in contexts:
            if devices_for_memory(p, n_k, dev) > g:
                row += ["does not fit"] * 3
                continue
            fanin, built = best_fanin(p, n_k, g, dev, st, net)
            floor = collective_s(p, n_k, g, 2, dev, net)
            row += [f"{fmt_s(built.total)} (f={fanin})", fmt_s(floor.total),
                    f"{1 / (st.worker_call_s + shard_compute_s(p, n_k / g, dev)):.0f}"]
        rows.append(row)
    return rows


def prediction_table(p: Problem, dev: Device, st: Stack, net: Network) -> str:
    head = ["GPUs"]
    for n_k in CONTEXTS:
        t = tokens_label(n_k)
        head += [f"{t}: as built", f"{t}: collective floor", f"{t}: req/s per copy"]
    return common.markdown_table(head, prediction_rows(p, dev, st, net))


def first_g(pred: Callable[[int], bool], upto: int = 4096) -> int | None:
    """The smallest device count from 1 to ``upto`` where ``pred`` holds."""
    return next((g for g in range(1, upto + 1) if pred(g)), None)


def argmin_g(fn: Callable[[int], float], lo: int, upto: int = 4096) -> int:
    return min(range(lo, upto + 1), key=fn)


def software_s(b: Breakdown) -> float:
    """The stack's own share of a request: everything but the compute, the merge and the network."""
    return b.frontend + b.directory + b.scatter + b.state_return


def crossover_row(p: Problem, n_k: float, dev: Device, st: Stack, net: Network) -> list[str]:
    """One context's crossovers: the devices its memory needs; from how many devices the software,
    and the merge tree with the network, cost more than the compute; the fastest device count."""
    lo = devices_for_memory(p, n_k, dev)

    def built(g: int, f: int = 2) -> Breakdown:
        return request_s(p, n_k, g, f, dev, st, net)

    def floor(g: int) -> Breakdown:
        return collective_s(p, n_k, g, 2, dev, net)

    def fastest(g: int) -> float:
        return best_fanin(p, n_k, g, dev, st, net)[1].total

    def show(g: int | None) -> str:
        return "never (to 4096)" if g is None else str(g)

    best = argmin_g(fastest, lo)
    return [tokens_label(n_k), f"{lo} ({devices_for_memory(p, n_k, dev, MODEL_LAYERS)} for {MODEL_LAYERS} layers)",
            show(first_g(lambda g: g >= lo and software_s(built(g)) > built(g).compute)),
            show(first_g(lambda g: g >= lo and built(g).merge + built(g).network > built(g).compute)),
            f"{best} ({fmt_s(fastest(best))})",
            show(first_g(lambda g: g >= lo and floor(g).network + floor(g).merge > floor(g).compute)),
            f"{(fb := argmin_g(lambda g: floor(g).total, lo))} ({fmt_s(floor(fb).total)})"]


def crossover_rows(p: Problem, dev: Device, st: Stack, net: Network) -> list[list[str]]:
    return [crossover_row(p, n_k, dev, st, net) for n_k in CONTEXTS]


def crossover_table(p: Problem, dev: Device, st: Stack, net: Network) -> str:
    head = ["context", "devices its K+V needs", "as built: software > compute from",
            "as built: merge + network > compute from", "as built: fastest at (latency)",
            "floor: network + merge > compute from", "floor: fastest at (latency)"]
    return common.markdown_table(head, crossover_rows(p, dev, st, net))


def break_even_lines(p: Problem, dev: Device, st: Stack, net: Network) -> list[str]:
    """The same crossovers as tokens per device: where a fixed cost equals one shard's compute."""
    per_token_s = kv_bytes(p, 1) / dev.read_bytes_per_s
    fixed = software_s(request_s(p, 1, 1, 2, dev, st, net)) + st.worker_call_s
    level = transfer_s(query_bytes(p), net) + transfer_s(2 * state_bytes(p), net) + GPU_HOP_S
    rate = f"{dev.read_bytes_per_s / 1e12:.1f} TB/s"
    token = f"one token of one layer costs {per_token_s * 1e9:.2f} ns of {dev.name} compute ({rate})"
    software = (f"as built, the software's fixed cost per request ({fmt_s(fixed)}) is the compute of "
                f"{fixed / per_token_s / 1e6:.1f}M tokens per device: shards smaller than that are software-bound")
    tree = (f"collective floor, one tree level each way ({fmt_s(level)} on {net.name}) is the compute of "
            f"{level / per_token_s / 1e3:.0f}K tokens per device: below that, one more level of devices costs "
            "more than it saves")
    return [token, software, tree]


def capacity_line(p: Problem, dev: Device) -> str:
    per_key = kv_bytes(p, 1)
    one = USABLE_MEMORY * dev.memory_bytes / per_key
    return (f"{dev.name}: {per_key:.0f} B of K+V per token and layer; one device holds {one / 1e6:.1f}M tokens of "
            f"one layer, {one / MODEL_LAYERS / 1e6:.2f}M tokens of all {MODEL_LAYERS} layers")


def replica_rows(p: Problem, dev: Device, st: Stack, net: Network, targets: Sequence[float] = (100, 1000, 10000),
                 batches: Sequence[int] = (1, 32)) -> list[list[str]]:
    rows = []
    for n_k in CONTEXTS:
        g = devices_for_memory(p, n_k, dev)
        for batch in batches:
            dev_only = batch / (st.worker_call_s + shard_compute_s(p, n_k / g, dev, batch))
            fe = 1 / st.cpu_s(p, g) if st.cpu_s(p, g) > 0 else float("inf")
            rows.append([tokens_label(n_k), g, batch, f"{dev_only:.0f}", f"{fe:.0f}",
                         *(f"{replicas_needed(t, dev_only)} x {g} GPU + {math.ceil(t / fe)} FE" for t in targets)])
    return rows


def replica_table(p: Problem, dev: Device, st: Stack, net: Network) -> str:
    head = ["context", "GPUs per copy", "queries per pass", "req/s per copy (devices)", "req/s per front end",
            "100 req/s", "1000 req/s", "10000 req/s"]
    return common.markdown_table(head, replica_rows(p, dev, st, net))


COMPARED = ((1e6, 8), (1e6, 128), (1e8, 128))


def comparison_rows(p: Problem, dev: Device, st: Stack, net: Network,
                    cases: Sequence[tuple[float, int]] = COMPARED) -> list[list[str]]:
    q, s = query_bytes(p), state_bytes(p)

    def at(fn: Callable[[float, int], float]) -> list[str]:
        return [fmt_s(fn(n_k, g)) for n_k, g in cases]

    def one_device(n_k: float, g: int) -> float:
        return shard_compute_s(p, n_k, dev) if devices_for_memory(p, n_k, dev) == 1 else math.inf

    return [
        ["splitkey as built (Ray, HTTP)", "q out, states back; tree merge at the front end or on the workers",
         f"G x ({q} + {s}) B", *at(lambda n, g: best_fanin(p, n, g, dev, st, net)[1].total)],
        ["tree reduction (Tree Attention; splitkey's collective floor)", "q broadcast, states reduced over a tree",
         f"log2(G) hops of {q} B and of {2 * s} B", *at(lambda n, g: collective_s(p, n, g, 2, dev, net).total)],
        ["states passed along a ring", "states, G - 1 sequential hops", f"(G - 1) x {s} B",
         *at(lambda n, g: ring_states_s(p, n, g, dev, net))],
        ["Ring Attention pattern (K+V blocks rotate)", "K+V blocks, G - 1 steps, overlapped with compute",
         "(G - 1) / G of the K+V per device", *at(lambda n, g: ring_kv_s(p, n, g, dev, net))],
        ["move the cache (fetch K+V to the query's device)", "K+V to one device, then one pass",
         "(G - 1) / G of the K+V into one device",
         *at(lambda n, g: move_cache_s(p, n, g, dev, net) if devices_for_memory(p, n, dev) == 1 else math.inf)],
        ["Flash-Decoding (one device, split-K within it)", "nothing off the device", "0", *at(one_device)],
    ]


def comparison_table(p: Problem, dev: Device, st: Stack, net: Network) -> str:
    head = ["scheme", "what moves per decode step", "bytes per step",
            *(f"{tokens_label(n_k)} tokens, {g} GPUs" for n_k, g in COMPARED)]
    return common.markdown_table(head, comparison_rows(p, dev, st, net))


def inputs_table(devices: Sequence[Device], nets: Sequence[Network]) -> str:
    rows = [[d.name, f"{d.read_bytes_per_s / 1e12:.2f} TB/s", f"{d.flops_per_s / 1e12:.0f} TFLOP/s",
             f"{d.call_s * 1e6:.0f} us", f"{d.memory_bytes / 1e9:.0f} GB", d.source] for d in devices]
    rows += [[n.name, f"{n.bytes_per_s / 1e9:.1f} GB/s", "", f"{n.latency_s * 1e6:.0f} us", "", n.source]
             for n in nets]
    return common.markdown_table(["hardware", "read / link rate", "flop rate", "per call / hop", "memory", "source"],
                                 rows)


# ------------------------------------------------------------------ the plot


def plot(path: Path, p: Problem, dev: Device, st: Stack, net: Network, fits: Sequence[tuple[str, float, float]]) -> None:
    """Predicted decode latency against GPUs (log-log): as built and the collective floor, per context;
    the measured CPU cells (client p50 against model) in a second panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.6, 1]})
    gs = np.unique(np.round(np.geomspace(1, 1024, 60)).astype(int))
    for n_k, color in zip(CONTEXTS, ("tab:blue", "tab:orange", "tab:green")):
        ok = [g for g in gs if devices_for_memory(p, n_k, dev) <= g]
        built = [best_fanin(p, n_k, int(g), dev, st, net)[1].total for g in ok]
        floor = [collective_s(p, n_k, int(g), 2, dev, net).total for g in ok]
        ax.plot(ok, np.array(built) * 1e3, color=color, label=f"{tokens_label(n_k)} tokens, as built")
        ax.plot(ok, np.array(floor) * 1e3, color=color, linestyle="--", label=f"{tokens_label(n_k)}, collective floor")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPUs holding the context (one shard each)")
    ax.set_ylabel("predicted decode latency, ms")
    ax.set_title(f"Decode, one layer, bf16; {dev.name} (assumed), {net.name} (assumed)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    if fits:
        meas = [m * 1e3 for _, m, _ in fits]
        model = [x * 1e3 for _, _, x in fits]
        bx.scatter(meas, model, s=14)
        lo, hi = min(meas + model) * 0.8, max(meas + model) * 1.25
        bx.plot([lo, hi], [lo, hi], color="gray", linewidth=0.8)
        bx.set_xscale("log")
        bx.set_yscale("log")
    for axis in (bx.xaxis, bx.yaxis):
        axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    bx.set_xlabel("measured client p50, ms (this machine)")
    bx.set_ylabel("model, ms")
    bx.set_title("Check: every measured cell", fontsize=9)
    bx.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ inputs from other benchmarks


def kernel_rates(scaling: dict, kernel_json: dict | None) -> tuple[dict, str]:
    """The CPU kernel rates per worker thread: scaling.py's in-process run (default), or
    ``kernel.py --json``'s resident rates divided by its threads."""
    if kernel_json is None:
        k = scaling["kernel"]
        return k, f"measured here: scaling.py, in-process resident kernel, one thread, {common.size_label(k['keys'])} keys"
    threads = kernel_json["threads"]
    dec = max((r for r in kernel_json["decode"] if r.get("resident_s")), key=lambda r: r["n_k"])
    pre = kernel_json["prefill"][0]
    rates = {"decode": {"gb_per_s": dec["kv_bytes"] / dec["resident_s"] / 1e9 / threads},
             "prefill": {"gflop_per_s": pre["flops"] / pre["resident_s"] / 1e9 / threads}}
    return rates, f"measured: kernel.py --json ({kernel_json.get('date', '?')}), resident, per thread of {threads}"


def gpu_device(gpu_json: dict | None) -> Device:
    """The H200 of the predictions: assumed, or with the decode rate ``benchmarks/gpu.py`` measured."""
    if not gpu_json:
        return H200
    best = [r for r in gpu_json.get("results", []) if r.get("case") == "decode" and r.get("dtype") == "bfloat16"
            and r.get("path") in ("fused", "generic") and r.get("gb_per_s")]
    if not best:
        return H200
    rate = max(r["gb_per_s"] for r in best) * 1e9
    return replace(H200, read_bytes_per_s=rate, source=f"measured: benchmarks/gpu.py decode bf16, {rate / 1e12:.2f} TB/s")


# ------------------------------------------------------------------ documents


PREDICTIONS_NOTE = ("decode n_q=1, h_q=32, h_kv=8, d=128, bf16, one layer. As built: the stack constants fitted "
                    "above, the best fan-in of 2/4/8/16; collective floor: fan-in 2, no software constants; req/s per "
                    "copy: what the GPUs holding one copy of the context serve, one query per pass (front ends apart: "
                    "see the replicas).")
REPLICAS_NOTE = ("the fewest GPUs that hold one copy; a pass serves `queries per pass` queries at once (batching, "
                 "roofline); front ends (FE) counted apart: stateless, their CPU per request fitted here.")


def blocks(scaling: dict, f: Fit, obs: Sequence[Observation], kernel_note: str, gpu: Device) -> dict[str, str]:
    """The generated tables of docs/SCALING.md, by marker name."""
    p, st = DECODE_BF16, f.stack
    errs = error_summary(obs, f)
    machine = "; ".join(line.removeprefix("- ") for line in scaling.get("machine", []))
    command = scaling.get("command", "benchmarks/scaling.py").replace(str(ROOT) + "/", "")
    source = (f"Generated by `benchmarks/model.py` from `{command}` "
              f"({scaling.get('date', '?')}; {machine}).")
    summary = (f"Median |error| {errs['median_abs_error']:.0%}, largest {errs['max_abs_error']:.0%} over {len(obs)} "
               "cells (client p50 against the model's total).")
    return {
        "fit": "\n".join([source, "", fit_table(f, kernel_note), *(f"\n- {n}" for n in f.notes)]),
        "check": "\n".join([summary, "", check_table(obs, f), "", "Closed loops:", "", throughput_table(obs, f)]),
        "inputs": "\n".join([inputs_table([gpu, H100], [NET_400, NET_100]), "", f"- {capacity_line(p, gpu)}",
                             f"- {capacity_line(p, H100)}"]),
        "predictions": "\n".join([f"{gpu.name}, {NET_400.name}; {PREDICTIONS_NOTE}", "",
                                  prediction_table(p, gpu, st, NET_400), "", f"The same on {NET_100.name}:", "",
                                  prediction_table(p, gpu, st, NET_100)]),
        "crossovers": "\n".join([f"{gpu.name}, {NET_400.name}, fan-in 2 (the fastest fan-in for 'fastest at'):", "",
                                 crossover_table(p, gpu, st, NET_400), "", f"{H100.name}, {NET_100.name}:", "",
                                 crossover_table(p, H100, st, NET_100), "",
                                 *(f"- {line}" for line in break_even_lines(p, gpu, st, NET_400))]),
        "replicas": "\n".join([f"{gpu.name}, {REPLICAS_NOTE}", "", replica_table(p, gpu, st, NET_400)]),
        "comparison": "\n".join([f"Predicted by this model for the decode shape, {gpu.name}, {NET_400.name}:", "",
                                 comparison_table(p, gpu, st, NET_400)]),
    }


def update_doc(path: Path, parts: dict[str, str]) -> None:
    text = path.read_text()
    for name, body in parts.items():
        text = common.replace_marked(text, f"{DOC_PREFIX}:{name}", body)
    path.write_text(text)


def to_json(f: Fit, obs: Sequence[Observation], gpu: Device) -> dict[str, Any]:
    p = DECODE_BF16
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "stack": asdict(f.stack), "cpu": asdict(f.cpu), "core_share": f.core_share,
            "machine_cores": f.machine_cores,
            "loopback": asdict(f.loopback) if f.loopback else None, "notes": f.notes,
            "errors": error_summary(obs, f),
            "check": [{"label": o.label, "measured_s": o.total, "model": asdict(predict(o, f)),
                       "model_s": predict(o, f).total} for o in obs],
            "gpu": asdict(gpu),
            "predictions": [{"gpus": g, "n_k": n_k, "as_built_s": best_fanin(p, n_k, g, gpu, f.stack, NET_400)[1].total,
                             "floor_s": collective_s(p, n_k, g, 2, gpu, NET_400).total}
                            for g in GPU_COUNTS for n_k in CONTEXTS if devices_for_memory(p, n_k, gpu) <= g]}


def load(path: str | None) -> dict | None:
    return json.loads(Path(path).read_text()) if path else None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scaling", required=True, help="raw JSON of benchmarks/scaling.py --json")
    p.add_argument("--kernel", default=None, help="raw JSON of benchmarks/kernel.py --json (its rates per thread)")
    p.add_argument("--gpu", default=None, help="gpu_bench.json of benchmarks/gpu.py (a measured GPU decode rate)")
    p.add_argument("--doc", default=None, help="update the generated tables of this file (docs/SCALING.md)")
    p.add_argument("--plot", default=None, help="write the plot here (PNG)")
    p.add_argument("--out", default=None, help="also write the markdown tables here")
    p.add_argument("--json", default=None, help="write the fitted constants, the check and the predictions here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    scaling = load(args.scaling)
    assert scaling is not None
    rates, kernel_note = kernel_rates(scaling, load(args.kernel))
    obs = observations(scaling)
    f = fit(obs, rates, machine_cores=float(scaling.get("cores") or 2))
    gpu = gpu_device(load(args.gpu))
    parts = blocks(scaling, f, obs, kernel_note, gpu)
    if args.doc:
        update_doc(Path(args.doc), parts)
    if args.plot:
        plot(Path(args.plot), DECODE_BF16, gpu, f.stack, NET_400, [(o.label, o.total, predict(o, f).total) for o in obs])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(to_json(f, obs, gpu), indent=1, default=float))
    text = "\n\n".join(f"### {name}\n\n{body}" for name, body in parts.items()) + "\n"
    common.emit_report(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
