"""An inference engine's calls (issue 17): per-call overhead of single decode queries and per-item cost of
batches over resident contexts, against the in-process kernel, side by side in one run.

Run from the repository root (``pip install -e '.[bench]'``)::

    .venv/bin/python benchmarks/engine.py --rounds 3 --out /tmp/engine.md --json /tmp/engine.json
    .venv/bin/python benchmarks/engine.py --baseline /tmp/base   # also a checkout of another commit
    .venv/bin/python benchmarks/engine.py --quick                # smoke run

Decode shape ``h_q=32, h_kv=8, d=128`` float32, ``n_q=1``; ``splitkey serve --workers 2``
with the default settings. Per round (rounds alternate the servers, each started fresh):

1. **in-process**: ``partial_attention_resident`` + ``finalize`` on the same keys in the
   resident layout, one kernel thread and BLAS at one thread (what one worker runs), median
   of ``--calls``; for the single context (``--n-k``, 4096 keys: with the default
   ``--context-shard-keys`` of 2048 a create of that size cuts it in two shards, one on each worker),
   for one of its shards (what each worker runs) and for one small context (``--small-n-k``);
2. **single calls**: ``--calls`` sequential ``Client.attention(q, contexts=[id])`` (sync
   client, one keep-alive connection), the same with ``AsyncClient`` from one event loop, and
   over the KServe v2 gRPC channel with ``tritonclient.grpc`` (``--grpc-port``), and as one
   pre-encoded request on a raw keep-alive socket (no client library; ``GET /healthz`` too,
   the floor of an HTTP round trip here), and that raw request over the first small context (the
   same path after a kernel whose keys do not push the rest out of the caches, compared with
   that context's kernel), and ``Client`` and the raw request over ``--layers`` contexts of
   ``--n-k`` keys in turn, as an engine's layers call theirs (compared with the in-process
   kernel over the same contexts in turn: no call finds its keys in the caches, on either
   side); in ``--blocks`` blocks per client, each block right
   after the single context's in-process kernel measured anew, the clients taking turns;
   p50/p99, Server-Timing stage medians; overhead = p50 - the round's in-process kernel, and
   "beside it" = the median over the calls of (call - its block's kernel);
3. **batches** (this tree only): ``--contexts`` small contexts, ``POST /v1/attention/batch``
   of B items (B in ``--batch``), item i over context i mod ``--contexts``; per-item cost =
   (p50 of the batch - B x the small context's in-process time) / B, and against the same B items
   computed in-process, each over its own context (64 contexts of 4 MiB do not stay in the caches
   as one context called again does), on one thread and on two: (p50 - that) / B; and B over one context
   (a shared scan). Every answer of the warm-up is checked against the in-process answer.

Step 2 also runs against this tree's server with ``--worker-channel false`` (every query a
Ray call: what the direct channel saves) and with ``--context-shard-keys`` ``--shard-keys-beside``
(4096: the single context in one shard, on one worker, as before 2026-12-05); neither with ``--quick``. ``--baseline DIR`` runs
step 2 with the server of another checkout (its ``service`` package,
same Python) beside this one's, in the same rounds, so "before" and "after" share the machine's
state. Targets (issue 17): single-call overhead <= 2 ms p50; per item <= 0.3 ms at 64 items.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common
from merge import finalize
from service.client import AsyncClient, Client, SplitkeyError
from service.client.timing import parse_server_timing
from service.core.settings import ServiceSettings
from service.wire.safetensors import encode_safetensors, to_bytes
from workers import StreamingKV, partial_attention_resident
from workers.options import AttentionOptions, KernelOptions

HEADS = {"h_q": 32, "h_kv": 8, "d": 128}
#: Workers of every server (``splitkey serve --workers``).
WORKERS = 2
#: The server of this tree with every worker call through Ray (no direct channel).
RAY_ONLY = "this tree --worker-channel false, Client"
#: The server of this tree with other context shards (``--shard-keys-beside``).
SHARDS_BESIDE = "this tree --context-shard-keys {}, Client"


def keys(n_k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (n_k, HEADS["h_kv"], HEADS["d"])
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def query(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, HEADS["h_q"], HEADS["d"]), dtype=np.float32)


def largest_shard(n_k: int, workers: int, shard_keys: int) -> int:
    """Keys of the first (largest) shard a create of ``n_k`` keys makes on ``workers`` live workers
    (``service.contexts.service.plan_shards`` with ``expected_length`` = ``n_k``, as the client sends)."""
    shards = max(1, min(workers, -(-n_k // shard_keys)))
    return min(n_k, max(-(-n_k // shards), shard_keys))


def resident(k: np.ndarray, v: np.ndarray) -> Any:
    """The keys in the resident layout, as a worker holds them."""
    return StreamingKV.from_arrays(k, v, np.arange(k.shape[0])).snapshot()


def inprocess(view: Any, q: np.ndarray, calls: int) -> tuple[float, tuple[Any, Any]]:
    """Median seconds of one worker's kernel call on these keys (resident layout, one thread), and its answer."""
    q_pos = np.array([view.k_pos.shape[0]])

    def once() -> tuple[Any, Any]:
        return finalize(partial_attention_resident(q, view, q_pos=q_pos, options=AttentionOptions(),
                                                   kernel=KernelOptions(threads=1)))
    with common.blas_threads(1):
        seconds, answer = common.time_calls(once, calls)
    return statistics.median(seconds), answer


def inprocess_layers(views: list[Any], q: np.ndarray, calls: int) -> float:
    """Median seconds of one kernel call as an engine's layers make them: call i over ``views[i % L]``,
    so no call finds its keys left in the caches by the call before (L contexts of 32 MiB pass 4 x 32
    MiB through this machine's 32 MiB L3 between two calls over the same one)."""
    q_pos = [np.array([v.k_pos.shape[0]]) for v in views]
    seconds = []
    with common.blas_threads(1):
        for i in range(calls + len(views)):  # one untimed pass over the layers first
            t0 = time.perf_counter()
            finalize(partial_attention_resident(q, views[i % len(views)], q_pos=q_pos[i % len(views)],
                                                options=AttentionOptions(), kernel=KernelOptions(threads=1)))
            if i >= len(views):
                seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def inprocess_batch(views: list[Any], q: np.ndarray, items: int, repeat: int, threads: int = 1) -> float:
    """Median seconds of a batch's items computed in-process: item i over ``views[i % len(views)]``,
    as the service's batch of ``items`` reads them, one after another on each of ``threads`` threads
    (items dealt out in turn, as the service's two workers get about half each). Distinct contexts
    do not share the caches that one context called again and again enjoys (64 of 4 MiB are 8x this
    machine's L3), so this, not ``items`` x one small context's time, is what the batch's kernels cost."""
    q_pos = [np.array([v.k_pos.shape[0]]) for v in views]
    order = [i % len(views) for i in range(items)]

    def run(part: list[int]) -> None:
        for i in part:
            finalize(partial_attention_resident(q, views[i], q_pos=q_pos[i], options=AttentionOptions(),
                                                kernel=KernelOptions(threads=1)))
    parts = [order[t::threads] for t in range(threads)]
    with common.blas_threads(1), ThreadPoolExecutor(threads) as pool:
        seconds, _ = common.time_calls(lambda: list(pool.map(run, parts)), repeat)
    return statistics.median(seconds)


def kernel_times(data: dict, calls: int, batches: Sequence[int] = ()) -> dict[str, Any]:
    """The in-process kernel now, for the single context and one small one, and for each batch size in
    ``batches`` the batch's items in-process (what a round's calls are compared with: this machine's
    speed drifts over minutes)."""
    return {"single": inprocess(data["view"], data["q"], calls)[0],
            "small": inprocess(data["small_views"][0], data["q"], calls)[0],
            **({"layers": inprocess_layers(data["layer_views"], data["q"], calls)} if data["layer_views"] else {}),
            "shard": inprocess(data["shard_view"], data["q"], calls)[0],
            "batches": {b: inprocess_batch(data["small_views"], data["q"], b, max(3, min(20, 2000 // b)))
                        for b in batches},
            "batches_2t": {b: inprocess_batch(data["small_views"], data["q"], b, max(3, min(20, 2000 // b)), 2)
                           for b in batches}}


def quantiles(seconds: Sequence[float]) -> dict[str, float]:
    s = sorted(seconds)
    return {"p50": statistics.median(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))], "n": len(s)}


#: A client's block of sequential calls: ``block(n)`` -> (seconds of each call, Server-Timing stages of each).
Block = Callable[[int], tuple[list[float], list[dict[str, float]]]]


def client_block(url: str, ctx_ids: Sequence[str], q: np.ndarray) -> tuple[Block, Callable[[], None]]:
    """Sync ``Client`` calls on one keep-alive connection, over ``ctx_ids`` in turn (one context: the
    same one every call; several: an engine's layers, each over its own); its block and its close."""
    c = Client(url)
    for i in range(5):
        c.attention(q, contexts=[ctx_ids[i % len(ctx_ids)]])
    turn = iter(itertools.cycle(ctx_ids))

    def block(n: int) -> tuple[list[float], list[dict[str, float]]]:
        seconds, stages = [], []
        for _ in range(n):
            ctx_id = next(turn)
            t0 = time.perf_counter()
            c.attention(q, contexts=[ctx_id])
            seconds.append(time.perf_counter() - t0)
            stages.append(parse_server_timing(c.last_server_timing))
        return seconds, stages
    return block, c.close


def raw_block(url: str, request: bytes | Sequence[bytes]) -> tuple[Block, Callable[[], None]]:
    """Round trips of one pre-encoded HTTP/1.1 request (or of several in turn) on a keep-alive socket (no
    client library, nothing encoded or decoded per call): what the server and the network take alone."""
    turn = iter(itertools.cycle([request] if isinstance(request, bytes) else request))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def block(n: int) -> tuple[list[float], list[dict[str, float]]]:
        seconds, stages = [], []
        for _ in range(n):
            sent = next(turn)
            t0 = time.perf_counter()
            sock.sendall(sent)
            status, headers = _response(sock)
            seconds.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"{sent[:40]!r} answered {status}")
            stages.append(parse_server_timing(headers.get("server-timing")))
        return seconds, stages
    block(5)
    return block, sock.close


def raw_calls(url: str, request: bytes, calls: int) -> dict[str, Any]:
    """``calls`` sequential round trips of a pre-encoded request (``raw_block``): quantiles and stages."""
    block, close = raw_block(url, request)
    try:
        seconds, stages = block(calls)
    finally:
        close()
    return {**quantiles(seconds), "stages": common.median_stages(stages)}


def _response(sock: socket.socket) -> tuple[int, dict[str, str]]:
    """The status and headers of one response read off ``sock`` (its body read and dropped)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    left = int(headers.get("content-length", "0")) - len(body)
    while left > 0:
        chunk = sock.recv(min(left, 65536))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        left -= len(chunk)
    return int(lines[0].split()[1]), headers


def attention_request(ctx_id: str, q: np.ndarray) -> bytes:
    """``POST /v1/attention?contexts=ID`` with q as safetensors, as bytes on the wire."""
    body = to_bytes(encode_safetensors({"q": q}))
    return (f"POST /v1/attention?contexts={ctx_id} HTTP/1.1\r\nHost: splitkey\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: splitkey\r\n\r\n"


def async_block(url: str, ctx_id: str, q: np.ndarray) -> tuple[Block, Callable[[], None]]:
    """``AsyncClient`` calls, one after another, each block in one run of its own event loop."""
    loop = asyncio.new_event_loop()
    c = AsyncClient(url)

    async def calls(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await c.attention(q, contexts=[ctx_id])
            out.append(time.perf_counter() - t0)
        return out

    def close() -> None:
        loop.run_until_complete(c.aclose())
        loop.close()
    loop.run_until_complete(calls(5))
    return (lambda n: (loop.run_until_complete(calls(n)), [])), close


def grpc_block(target: str, ctx_id: str, q: np.ndarray) -> tuple[Block, Callable[[], None]]:
    """``tritonclient.grpc`` unary calls on one channel (the persistent channel)."""
    import tritonclient.grpc as triton

    client = triton.InferenceServerClient(target)
    inp = triton.InferInput("q", list(q.shape), "FP32")
    inp.set_data_from_numpy(q)
    outputs = [triton.InferRequestedOutput(n) for n in ("out", "lse")]

    def block(n: int) -> tuple[list[float], list[dict[str, float]]]:
        seconds = []
        for _ in range(n):
            t0 = time.perf_counter()
            client.infer("attention", [inp], outputs=outputs, parameters={"contexts": ctx_id})
            seconds.append(time.perf_counter() - t0)
        return seconds, []
    block(5)
    return block, client.close


#: The client block over the first small context (the others are over the single context).
SMALL_RAW = "raw_small"
#: The client blocks over the layers' contexts in turn (compared with the in-process kernel over them in turn).
LAYERS = ("client_layers", "raw_layers")


def interleaved(blocks: dict[str, Block], data: dict, calls: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Each client's ``calls`` single calls, in ``rounds`` blocks each right after the in-process kernel
    measured anew (9 calls; the small context's too when ``SMALL_RAW`` is among the blocks), the clients
    in a rotating order: ``beyond`` is the median over the calls of (call - its block's kernel), so the
    kernel it is compared with was measured within about a second of it (this VM's speed drifts by more
    than the target over minutes)."""
    per = max(10, calls // rounds)
    got: dict[str, dict[str, list[Any]]] = {name: {"seconds": [], "beyond": [], "stages": []} for name in blocks}
    names = list(blocks)
    for r in range(rounds):
        kernel = {"single": inprocess(data["view"], data["q"], 9)[0]}
        if SMALL_RAW in blocks:
            kernel["small"] = inprocess(data["small_views"][0], data["q"], 9)[0]
        if any(name in blocks for name in LAYERS):
            kernel["layers"] = inprocess_layers(data["layer_views"], data["q"], 9)
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds, stages = blocks[name](per)
            got[name]["seconds"] += seconds
            which = "small" if name == SMALL_RAW else "layers" if name in LAYERS else "single"
            got[name]["beyond"] += [t - kernel[which] for t in seconds]
            got[name]["stages"] += stages
    return {name: {**quantiles(g["seconds"]), "beyond": statistics.median(g["beyond"]),
                   "stages": common.median_stages(g["stages"])} for name, g in got.items()}


def batch_calls(c: Client, items: list[dict], calls: int, check: Callable[[list], None]) -> dict[str, Any]:
    check(c.attention_batch(items))
    seconds, stages = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        answers = c.attention_batch(items)
        seconds.append(time.perf_counter() - t0)
        stages.append(parse_server_timing(c.last_server_timing))
        if any(isinstance(a, SplitkeyError) for a in answers):
            raise RuntimeError(f"a batch item failed: {next(a for a in answers if isinstance(a, SplitkeyError))}")
    return {**quantiles(seconds), "stages": common.median_stages(stages)}


def run_server(root: Path, workdir: Path, fn: Callable[[str, str | None], Any], grpc: bool,
               extra: Sequence[str] = ()) -> Any:
    port = common.free_port() if grpc else None
    args = (("--grpc-port", str(port)) if grpc else ()) + tuple(extra)
    with common.splitkey_server(workdir, workers=WORKERS, cwd=root, args=args) as url:
        return fn(url, f"127.0.0.1:{port}" if grpc else None)


def round_for(args: argparse.Namespace, root: Path, workdir: Path, batches: bool, data: dict,
              extra: Sequence[str] = (), clients: bool = True) -> dict[str, Any]:
    """One server's round: single calls; with ``batches`` the batch table too, and with ``clients`` as well
    the async client and gRPC."""
    def work(url: str, grpc_target: str | None) -> dict[str, Any]:
        measured = args.batch if batches else ()
        out: dict[str, Any] = {"kernel": [kernel_times(data, max(10, args.calls // 5), measured)]}
        with Client(url) as c:
            ctx = c.create_context(*data["single"])["id"]
            want = data["single_answer"]
            got = c.attention(data["q"], contexts=[ctx])
            out["single_max_diff"] = max(common.max_diff(got[0], want[0]), common.max_diff(got[1], want[1]))
            if out["single_max_diff"] > 1e-5:
                raise RuntimeError(f"the service's answer differs from the in-process one by {out['single_max_diff']}")
            opened = {"single": client_block(url, [ctx], data["q"])}
            small = [c.create_context(*kv)["id"] for kv in data["small"]] if batches else []
            layers: list[str] = []
            try:
                if batches and clients:
                    opened["raw"] = raw_block(url, attention_request(ctx, data["q"]))
                    # The path with a kernel that leaves the caches alone: what the big one's footprint costs.
                    opened[SMALL_RAW] = raw_block(url, attention_request(small[0], data["q"]))
                    opened["async"] = async_block(url, ctx, data["q"])
                    opened["grpc"] = grpc_block(str(grpc_target), ctx, data["q"])
                    if data["layers"]:  # an engine's layers: each call over the next layer's context
                        layers += [c.create_context(*kv)["id"] for kv in data["layers"]]
                        for cid, want in zip(layers, data["layer_answers"]):
                            got = c.attention(data["q"], contexts=[cid])
                            if common.max_diff(got[0], want[0]) > 1e-5:
                                raise RuntimeError(f"layer context {cid}: the answer differs from the in-process one")
                        opened["client_layers"] = client_block(url, layers, data["q"])
                        opened["raw_layers"] = raw_block(url, [attention_request(cid, data["q"]) for cid in layers])
                out.update(interleaved({name: block for name, (block, _) in opened.items()}, data, args.calls,
                                       args.blocks))
            finally:
                for _, close in opened.values():
                    close()
            if batches and clients:
                out["healthz"] = raw_calls(url, HEALTHZ, args.calls)
            if batches:
                out["batch"] = {}
                for b in args.batch:
                    items = [{"q": data["q"], "contexts": [small[i % len(small)]]} for i in range(b)]

                    def check(answers: list, b: int = b) -> None:
                        for i, a in enumerate(answers):
                            ref = data["small_answers"][i % len(small)]
                            if isinstance(a, SplitkeyError) or common.max_diff(a[0], ref[0]) > 1e-5:
                                raise RuntimeError(f"batch of {b}: item {i} is wrong: {a}")
                    out["batch"][b] = batch_calls(c, items, max(5, args.calls // max(1, b // 4)), check)
                same = [{"q": query(100 + i), "contexts": [ctx]} for i in range(64)]
                out["batch_same_context"] = batch_calls(c, same, max(5, args.calls // 16), lambda a: None)
                for cid in small + layers:
                    c.delete_context(cid)
            c.delete_context(ctx)
        out["kernel"].append(kernel_times(data, max(10, args.calls // 5), measured))
        return out
    return run_server(root, workdir, work, grpc=batches and clients, extra=extra)


def round_kernel(r: dict[str, Any], which: str) -> float:
    """The round's in-process kernel time: the median of its measurements before and after its calls."""
    return statistics.median(k[which] for k in r["kernel"])


def round_batch(r: dict[str, Any], b: int, key: str = "batches") -> float:
    """The round's in-process time of a batch of ``b`` items (before and after its calls); ``key``
    "batches_2t": on two threads."""
    return statistics.median(k[key][str(b)] if str(b) in k[key] else k[key][b] for k in r["kernel"])


def report(args: argparse.Namespace, result: dict[str, Any]) -> str:
    kern = statistics.median(round_kernel(r, "single") for rounds in result["single"].values() for r in rounds)
    small_kern = statistics.median(round_kernel(r, "small") for r in result["this_tree_rounds"]) if result["this_tree_rounds"] else 0.0
    lines = [f"### Engine calls: decode n_q=1, h_q=32, h_kv=8, d=128 float32, 2 workers ({result['date']})", "",
             f"Command: `{result['command']}`", "",
             f"In-process kernel (one thread, resident layout), measured before and after each round's calls, "
             f"median over the rounds: {common.ms(kern)} for {args.n_k} keys, {common.ms(small_kern)} for "
             f"{args.small_n_k} keys; each round's calls are compared with its own. Service answers vs in-process: "
             f"max abs diff {max(result['max_diff']):.1e}. Times in ms.", ""]

    def row(name: str, rounds: list[dict], kernels: list[float], stages: bool) -> list[Any]:
        over = statistics.median(r["p50"] - k for r, k in zip(rounds, kernels))
        beside = statistics.median(r["beyond"] for r in rounds) if all("beyond" in r for r in rounds) else None
        cells = [name, common.ms(statistics.median(r["p50"] for r in rounds)),
                 common.ms(statistics.median(r["p99"] for r in rounds)), common.ms(over),
                 "-" if beside is None else common.ms(beside)]
        st = common.median_stages([r["stages"] for r in rounds]) if stages else {}
        return cells + [", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(st.items())) or "-"]

    rows = [row(name, [r["single"] for r in rounds], [round_kernel(r, "single") for r in rounds], True)
            for name, rounds in result["single"].items()]
    own = result["this_tree_rounds"]
    if own:
        kernels = [round_kernel(r, "single") for r in own]
        rows.append(row("this tree, AsyncClient", [r["async"] for r in own], kernels, False))
        rows.append(row("this tree, gRPC (tritonclient.grpc)", [r["grpc"] for r in own], kernels, False))
        rows.append(row("this tree, raw HTTP/1.1 (no client library)", [r["raw"] for r in own], kernels, True))
        if all(name in r for r in own for name in LAYERS):
            kernels = [round_kernel(r, "layers") for r in own]
            rows.append(row(f"this tree, Client, {args.layers} contexts of {args.n_k} keys in turn",
                            [r["client_layers"] for r in own], kernels, True))
            rows.append(row(f"this tree, raw HTTP/1.1, {args.layers} contexts in turn",
                            [r["raw_layers"] for r in own], kernels, True))
        if all(SMALL_RAW in r for r in own):
            rows.append(row(f"this tree, raw HTTP/1.1, over a {args.small_n_k}-key context",
                            [r[SMALL_RAW] for r in own], [round_kernel(r, "small") for r in own], True))
    shard_keys = largest_shard(args.n_k, WORKERS, ServiceSettings().context_shard_keys)
    default = result["single"]["this tree, Client"]
    shard_note = [] if shard_keys == args.n_k else [
        f"With the default `--context-shard-keys` ({ServiceSettings().context_shard_keys}) the {args.n_k}-key context "
        f"is cut in shards of {shard_keys} keys, one per worker, computed in parallel: the in-process kernel over one "
        f"shard (what each worker runs) took {common.ms(statistics.median(round_kernel(r, 'shard') for r in default))}, "
        f"and `this tree, Client`'s p50 minus it is "
        f"{common.ms(statistics.median(r['single']['p50'] - round_kernel(r, 'shard') for r in default))}: what the call "
        "costs beyond the work of one worker.", ""]
    lines += ["#### Single calls (sequential; medians over the rounds)", "",
              f"p50 - kernel: the p50 minus the round's in-process kernel (measured before and after all its "
              f"calls). Beside it: the median over the calls of (call - the in-process kernel measured right "
              f"before its block of calls), {args.blocks} blocks per client and round, the clients in turn: "
              f"the yardstick is at most seconds older than the call, not minutes.", "",
              common.markdown_table(["server, client", "p50", "p99", "p50 - kernel", "beyond the kernel beside it",
                                     "Server-Timing medians"], rows),
              "", *shard_note]
    if own:
        healthz = statistics.median(r["healthz"]["p50"] for r in own)
        lines += ["raw HTTP/1.1: the same request pre-encoded once, sent on a keep-alive socket and its answer "
                  "read without decoding it (what the client library adds is the Client row minus this one); "
                  f"over a {args.small_n_k}-key context, the same path after a kernel that streams "
                  f"{args.small_n_k / args.n_k:.0%} of the bytes through the caches (its rows are compared with "
                  "that context's kernel). "
                  f"`GET /healthz` the same way (an HTTP round trip that does no work): p50 {common.ms(healthz)}.",
                  ""]
    if own:
        ray_only = result.get("ray_only_rounds") or []

        def cells(rounds: list[dict], b: int, inproc: bool) -> list[str]:
            p50s = [r["batch"][str(b)]["p50"] if str(b) in r["batch"] else r["batch"][b]["p50"] for r in rounds]
            per = statistics.median((p - b * round_kernel(r, "small")) / b for p, r in zip(p50s, rounds))
            beyond = [common.ms(statistics.median(round_batch(r, b, key) for r in rounds)) + " / "
                      + common.ms(statistics.median((p - round_batch(r, b, key)) / b for p, r in zip(p50s, rounds)))
                      for key in ("batches", "batches_2t")]
            return [common.ms(statistics.median(p50s)), common.ms(statistics.median(p50s) / b), common.ms(per),
                    *(beyond if inproc else [])]

        rows = [[b, *cells(own, b, True), *(cells(ray_only, b, False) if ray_only else [])] for b in args.batch]
        head = ["items", "batch p50", "per item", "per item - kernel", "in-process batch, 1 thread: time / per item beyond",
                "in-process batch, 2 threads: time / per item beyond"]
        if ray_only:
            head += ["Ray only: batch p50", "per item", "per item - kernel"]
        lines += [f"#### Batches over {args.contexts} contexts of {args.small_n_k} keys (item i over context i mod "
                  f"{args.contexts})", "",
                  "per item - kernel: (batch p50 - items x the round's in-process kernel time of one item, "
                  "that item's context called again and again) / items. in-process batch: the same items "
                  "computed in-process, each over its own context as the batch reads them (distinct contexts "
                  "do not stay in the caches), one after another on one thread, or dealt out in turn to two "
                  "threads (as the service's two workers get about half each); per item "
                  "beyond: (batch p50 - that) / items, the service's own cost per item."
                  + (" Ray only: the same tree with `--worker-channel false`." if ray_only else ""), "",
                  common.markdown_table(head, rows), ""]
        same = statistics.median(r["batch_same_context"]["p50"] for r in own)
        lines += [f"64 items over the one {args.n_k}-key context (a shared scan): p50 {common.ms(same)}, "
                  f"{common.ms(same / 64)} per item, against {common.ms(kern)} for one item's kernel alone.", ""]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=common.positive, default=3)
    p.add_argument("--calls", type=common.positive, default=300)
    p.add_argument("--blocks", type=common.positive, default=10,
                   help="blocks of single calls per client and round, each after the in-process kernel measured anew")
    p.add_argument("--n-k", type=common.positive, default=4096)
    p.add_argument("--small-n-k", type=common.positive, default=512)
    p.add_argument("--contexts", type=common.positive, default=64)
    p.add_argument("--layers", type=common.count, default=4,
                   help="contexts of --n-k keys called in turn, as an engine's layers call theirs (0: none)")
    p.add_argument("--batch", type=common.parse_keys, default=[1, 4, 16, 64, 256])
    p.add_argument("--shard-keys-beside", type=common.count, default=4096,
                   help="also a server with this --context-shard-keys, single calls only (0: not)")
    p.add_argument("--baseline", default=None, help="a checkout of another commit: its server too, step 2 only")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, few calls, small batches")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.calls, args.blocks, args.contexts, args.batch = 1, 20, 2, 4, [1, 8]
        args.small_n_k, args.layers = 256, min(args.layers, 2)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    common.raise_on_sigterm()
    k, v = keys(args.n_k, 1)
    q = query(2)
    small = [keys(args.small_n_k, 10 + i) for i in range(args.contexts)]
    view = resident(k, v)
    small_views = [resident(*kv) for kv in small]
    layers = [keys(args.n_k, 50 + i) for i in range(args.layers)]
    layer_views = [resident(*kv) for kv in layers]
    shard = largest_shard(args.n_k, WORKERS, ServiceSettings().context_shard_keys)
    data = {"single": (k, v), "view": view, "single_answer": inprocess(view, q, 3)[1], "q": q, "small": small,
            "shard_view": resident(k[:shard], v[:shard]),
            "small_views": small_views, "small_answers": [inprocess(sv, q, 3)[1] for sv in small_views],
            "layers": layers, "layer_views": layer_views,
            "layer_answers": [inprocess(lv, q, 3)[1] for lv in layer_views]}
    servers: list[tuple[str, Path, bool, tuple[str, ...]]] = [("this tree, Client", ROOT, True, ())]
    if not args.quick:  # the same tree with every query a Ray call: what the direct channel saves
        servers.append((RAY_ONLY, ROOT, True, ("--worker-channel", "false")))
    if not args.quick and args.shard_keys_beside and args.shard_keys_beside != ServiceSettings().context_shard_keys:
        servers.append((SHARDS_BESIDE.format(args.shard_keys_beside), ROOT, False,
                        ("--context-shard-keys", str(args.shard_keys_beside))))
    if args.baseline:
        servers.append(("baseline, Client", Path(args.baseline).resolve(), False, ()))
    result: dict[str, Any] = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                              "command": " ".join([".venv/bin/python", "benchmarks/engine.py", *(argv or sys.argv[1:])]),
                              "machine": common.machine_lines(),
                              "single": {name: [] for name, _, _, _ in servers}, "max_diff": [],
                              "this_tree_rounds": [], "ray_only_rounds": []}
    with tempfile.TemporaryDirectory(prefix="splitkey-engine-") as tmp:
        for r in range(args.rounds):
            for name, root, batches, extra in (servers if r % 2 == 0 else servers[::-1]):
                got = round_for(args, root, Path(tmp) / f"r{r}-{len(result['single'][name])}-{batches}", batches, data,
                                extra, clients=name != RAY_ONLY)
                result["single"][name].append({"single": got["single"], "kernel": got["kernel"]})
                result["max_diff"].append(got["single_max_diff"])
                if batches:
                    result["ray_only_rounds" if name == RAY_ONLY else "this_tree_rounds"].append(got)
                print(f"round {r + 1}: {name} p50 {common.ms(got['single']['p50'])}", file=sys.stderr, flush=True)
    text = report(args, result)
    common.emit_report(text, args.out)
    if args.json:
        common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
