"""The cost model of one splitkey request (issue 14; docs/SCALING.md): the problem, the hardware
and one function per term; ``benchmarks/model_fit.py`` fits its constants, ``benchmarks/model.py``
predicts with it and writes the documents.

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

import math
from dataclasses import asdict, dataclass

#: The orchestrator's default ``--remote-merge-bytes``.
REMOTE_MERGE_BYTES = 8 * 2**20
#: Share of a device's memory a context may take (the rest: the runtime, scratch, other layers' weights).
USABLE_MEMORY = 0.9


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
