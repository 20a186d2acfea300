"""What a Ray actor call costs on this machine, beside what it runs (issue 17: where a call's time goes).

Run from the repository root::

    .venv/bin/python benchmarks/ray_calls.py --calls 100 --out /tmp/ray_calls.md
    .venv/bin/python benchmarks/ray_calls.py --n-k 64 --calls 400   # the transport, beside a tiny kernel

An embedded Ray (2 CPUs) and one shard worker started as ``service.cluster.pool`` starts them
(threaded, ``max_concurrency=64``, one CPU), holding one decode-shape context shard of ``--n-k``
keys (4096).
Timed from the driver, sequential calls, medians: ``ping``; ``echo`` (the arguments and the
return value of a decode query, no work); ``sleep`` (blocks 8 ms: what the call costs around a
fixed wait); ``partial_resident`` (the query itself) and, for it, the worker's own compute
seconds (``ComputeStatus.seconds``) and the same kernel in this process; the same query over
the worker's direct channel (``workers.channel``, what the front end uses for resident queries).
The difference between a Ray call and what it runs is Ray's: serialising arguments and results,
the RPC, the hand-off to the method's thread and back.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ray

from benchmarks import common
from merge import State
from service.cluster.channel import WorkerChannel
from workers import StreamingKV, partial_attention_resident
from workers.actor import ShardWorker
from workers.config import WorkerConfig
from workers.options import AttentionOptions, KernelOptions
from workers.tasks import ShardQuery, ShardRead, ShardWrite

H_Q, H_KV, D = 32, 8, 128
SLEEP_S = 0.008


class Probe(ShardWorker):
    """The shard worker with two methods that do no work: what the call alone costs."""

    def echo(self, q: Any, query: ShardQuery, reads: Any) -> State:
        return State(m=np.zeros((1, H_Q), np.float32), l=np.ones((1, H_Q), np.float32),
                     acc=np.zeros((1, H_Q, D), np.float32))

    def sleep(self, q: Any, query: ShardQuery, reads: Any) -> None:
        time.sleep(SLEEP_S)


def median_ms(fn: Callable[[], Any], calls: int) -> float:
    seconds, _ = common.time_calls(fn, calls)
    return statistics.median(seconds) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=common.positive, default=100)
    p.add_argument("--n-k", type=common.positive, default=4096, help="keys of the worker's shard")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    n_k = args.n_k
    # address="local": a cluster of its own, whatever RAY_ADDRESS a parent process left in the environment
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        h = ray.remote(Probe).options(max_concurrency=64, num_cpus=1).remote(WorkerConfig(), "probe")
        rng = np.random.default_rng(0)
        k = rng.standard_normal((n_k, H_KV, D), dtype=np.float32)
        v = rng.standard_normal((n_k, H_KV, D), dtype=np.float32)
        ray.get(h.create_shard.remote(ShardWrite("c", 0, "float32", n_k, np.arange(n_k)), k, v, {"version": 1}))
        ray.get(h.note_context.remote("c", {"version": 1}))  # committed, as the service notes a create
        q = rng.standard_normal((1, H_Q, D), dtype=np.float32)
        query = ShardQuery(q_pos=np.array([n_k]), options=AttentionOptions())
        reads = (ShardRead("c", 0, n_k, 1),)
        view = StreamingKV.from_arrays(k, v, np.arange(n_k)).snapshot()
        loop = asyncio.new_event_loop()
        lane = loop.run_until_complete(WorkerChannel.open("probe", ray.get(h.channel.remote())))
        rows = []
        for _ in range(2):  # two passes: the first warms everything up; both are reported
            ping = median_ms(lambda: ray.get(h.ping.remote()), args.calls)
            echo = median_ms(lambda: ray.get(h.echo.remote(q, query, reads)), args.calls)
            sleep = median_ms(lambda: ray.get(h.sleep.remote(q, query, reads)), args.calls)
            call = median_ms(lambda: ray.get(h.partial_resident.remote(q, query, reads, 2)), args.calls)
            channel = median_ms(lambda: loop.run_until_complete(lane.resident(q, query, reads, 2)), args.calls)
            inside = statistics.median(ray.get(h.partial_resident.remote(q, query, reads, 2))[0].seconds * 1e3
                                       for _ in range(args.calls))
            with common.blas_threads(1):
                local = median_ms(lambda: partial_attention_resident(q, view, q_pos=np.array([n_k]),
                                                                     options=AttentionOptions(),
                                                                     kernel=KernelOptions(threads=1)), args.calls)
            rows.append([f"{ping:.2f}", f"{echo:.2f}", f"{sleep:.2f} ({sleep - SLEEP_S * 1e3:.2f} beyond the sleep)",
                         f"{call:.2f}", f"{channel:.2f}", f"{inside:.2f}", f"{local:.2f}", f"{call - inside:.2f}",
                         f"{channel - inside:.2f}"])
        lane.close()
        loop.run_until_complete(asyncio.sleep(0))  # the reader task sees its cancellation
        loop.close()
    finally:
        ray.shutdown()
    text = "\n".join([
        f"### Ray actor calls ({n_k}-key decode shard, h_q={H_Q}, h_kv={H_KV}, d={D}, float32; ms, medians of "
        f"{args.calls})", "", "Command: `.venv/bin/python benchmarks/ray_calls.py "
        + " ".join(argv if argv is not None else sys.argv[1:]) + "`", "",
        common.markdown_table(["ping", "echo (a query's arguments and state, no work)", "sleep 8 ms",
                               "partial_resident", "the same over the direct channel", "its compute on the worker",
                               "the kernel in this process", "call - compute", "channel - compute"], rows), ""])
    common.emit_report(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
