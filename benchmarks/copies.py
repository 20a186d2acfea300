"""The storage copies of an upload (workers/copies.py) against the host's copy rate.

Run from the repository root::

    .venv/bin/python benchmarks/copies.py                         # this tree
    .venv/bin/python benchmarks/copies.py --tree /tmp/old-checkout # another commit's copies, same script

Each chunk of an upload lands in a shard by two copies: the keys ``k [n, h_kv, d]`` transposed
into the d-major ``kt [h_kv, d, capacity]`` (:func:`copy_keys_dmajor`) and the values
``v [n, h_kv, d_v]`` heads first into ``[h_kv, capacity, d_v]`` (:func:`copy_values`). This times
both for a chunk of ``--chunk-keys`` keys (decode shape ``h_kv=8, d=128``) written at successive
offsets of one ``--capacity``-key shard, its memory reserved and faulted in beforehand (as the
worker's background prefault does), best of ``--reps``; beside them the roof: ``np.copyto`` of the
same bytes, contiguous to contiguous, on the same thread. GB/s are of the chunk's bytes.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def best_rate(fn, nbytes: int, reps: int) -> float:
    """GB/s of ``nbytes`` over the fastest of ``reps`` calls of ``fn(i)``."""
    fn(0)  # compiles (or loads) what it needs
    best = min(_timed(fn, i) for i in range(1, reps + 1))
    return nbytes / best / 1e9


def _timed(fn, i: int) -> float:
    t0 = time.perf_counter()
    fn(i)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                    help="checkout whose workers/copies.py is timed (default: this one)")
    ap.add_argument("--chunk-keys", type=int, default=8192, help="keys per copy (default 8192: 16 MiB of bf16 K+V)")
    ap.add_argument("--capacity", type=int, default=131072, help="keys the shard holds (default 131072)")
    ap.add_argument("--reps", type=int, default=15, help="calls per measurement; the best counts (default 15)")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32", help="comma-separated (default bfloat16,float16,float32)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(args.tree.resolve()))
    from workers import DTYPES
    from workers.copies import copy_keys_dmajor, copy_values, prefault, reserve

    h_kv, d, n, cap = 8, 128, args.chunk_keys, args.capacity
    if not 0 < n <= cap:
        raise ValueError(f"--chunk-keys must be in 1..--capacity, got {n}")
    print(f"# copies of {args.tree}: {cpu_model()}, one thread, chunk {n} keys into a {cap}-key shard, "
          f"h_kv={h_kv}, d={d}")
    print("| dtype | keys transpose GB/s | values copy GB/s | np.copyto GB/s (roof) | transpose / roof |")
    print("| --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
        k = rng.standard_normal((n, h_kv, d), dtype=np.float32).astype(dt)  # [n, h_kv, d]
        kt = reserve((h_kv, d, cap), dt)  # [h_kv, d, capacity]
        vv = reserve((h_kv, cap, d), dt)  # [h_kv, capacity, d_v]
        prefault(kt)
        prefault(vv)
        slots = cap // n

        def at(i: int) -> slice:
            return slice((i % slots) * n, (i % slots) * n + n)

        keys = best_rate(lambda i: copy_keys_dmajor(kt[:, :, at(i)], k), k.nbytes, args.reps)
        vals = best_rate(lambda i: copy_values(vv[:, at(i)], k), k.nbytes, args.reps)
        src, dst = k.reshape(-1).view(np.uint8), np.empty(k.nbytes, np.uint8)
        roof = best_rate(lambda i: np.copyto(dst, src), k.nbytes, args.reps)
        print(f"| {name} | {keys:.2f} | {vals:.2f} | {roof:.2f} | {keys / roof:.2f} |")


if __name__ == "__main__":
    main()
