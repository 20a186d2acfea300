"""Probe (2026-12-07, Zen 4): run from a checkout root; batches of 4 and 8 decode queries over 256K keys, one thread (note: it makes 4 queries, so x8 repeats x4)."""
import os
import sys

sys.path.insert(0, os.getcwd())
import numpy as np

from benchmarks import batching as B
from benchmarks import common
from workers.api import partial_attention_resident_many


def run(dtype, n_k):
    kv = B.StreamingKV(B.HEADS["h_kv"], B.HEADS["d"], B.HEADS["d"], B.DTYPES[dtype], capacity=n_k)
    for a, b, k, v in B.pieces(n_k, dtype, 1):
        kv.append(k, v, np.arange(a, b))
    view = kv.snapshot()
    kernel = B.KernelOptions(threads=1, cpu_kernels="fused")
    qs = [(q, np.array([n_k]), B.AttentionOptions()) for q in B.queries(4, dtype, 1)]
    out = []
    with common.blas_threads(1):
        for n in (4, 8):
            partial_attention_resident_many(qs[:n], view, kernel=kernel)
            t = B.median_time(lambda: partial_attention_resident_many(qs[:n], view, kernel=kernel), 7)  # noqa: B023
            out.append(f"x{n} {t*1e3:.1f} ms")
    return out
for dt in sys.argv[1].split(","):
    print(os.getcwd(), dt, run(dt, 256 * 1024), flush=True)
