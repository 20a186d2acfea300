"""The cost model of one splitkey request (issue 14; docs/SCALING.md), run: fit, check, predictions, documents.

Run from the repository root::

    .venv/bin/python benchmarks/model.py --scaling benchmarks/results/DATE/scaling.json \\
        --doc docs/SCALING.md --plot docs/images/scaling-decode-latency.png

It reads the raw JSON of ``benchmarks/scaling.py`` (and, when given, ``benchmarks/kernel.py
--json`` for its kernel rates and ``benchmarks/gpu.py``'s ``gpu_bench.json`` for measured GPU
rates), fits the model's constants on those measurements, checks the fitted model against
every measured cell, predicts the decode shape on 8 to 1000 GPUs for contexts of 1M to 100M
tokens, finds the crossover points, and writes the tables between the ``<!-- model:NAME:begin
-->`` / ``<!-- model:NAME:end -->`` markers of ``--doc`` and one plot (matplotlib, Agg).

The model's terms are ``benchmarks/model_terms.py``, its fit and check ``benchmarks/model_fit.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common
from benchmarks.model_fit import (
    Fit,
    Observation,
    check_table,
    error_summary,
    fit,
    fit_table,
    observations,
    predict,
    throughput_table,
)
from benchmarks.model_terms import (
    DECODE_BF16,
    GPU_HOP_S,
    H100,
    H200,
    NET_100,
    NET_400,
    USABLE_MEMORY,
    Breakdown,
    Device,
    Network,
    Problem,
    Stack,
    collective_s,
    devices_for_memory,
    kv_bytes,
    move_cache_s,
    query_bytes,
    replicas_needed,
    request_s,
    ring_kv_s,
    ring_states_s,
    shard_compute_s,
    state_bytes,
    transfer_s,
)

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1000)
CONTEXTS = (1_000_000, 10_000_000, 100_000_000)
#: Layers of a Llama-3-8B-like model with this attention shape (h_q=32, h_kv=8, d=128).
MODEL_LAYERS = 32
DOC_PREFIX = "model"


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
