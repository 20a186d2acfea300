"""The cost model's constants fitted on measured cells (``benchmarks/scaling.py``'s raw JSON), and the
fitted model checked against every cell (docs/SCALING.md; the terms: ``benchmarks/model_terms.py``)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from benchmarks import common
from benchmarks.model_terms import (
    REMOTE_MERGE_BYTES,
    Breakdown,
    Device,
    Network,
    Problem,
    Stack,
    compute_s,
    cpu_share,
    cpu_throughput,
    http_bytes,
    merge_s,
    network_s,
    query_bytes,
    remote_merge,
    request_s,
    return_s,
    state_bytes,
    tree_depth,
)


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
