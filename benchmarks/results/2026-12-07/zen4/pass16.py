"""Probe (2026-12-07, Zen 4): run from a checkout root; a 16-query pass in cache (2K keys) and over 64K keys, one thread, bitwise against each query alone."""
import os
import sys

sys.path.insert(0, os.getcwd())
import numpy as np

from benchmarks import batching as B
from benchmarks import common
from workers.api import partial_attention_resident, partial_attention_resident_many
from workers.store import StreamingKV  # noqa


def run(dtype, n_k, calls, repeat=5):
    kv = B.StreamingKV(B.HEADS["h_kv"], B.HEADS["d"], B.HEADS["d"], B.DTYPES[dtype], capacity=n_k)
    for a, b, k, v in B.pieces(n_k, dtype, 1):
        kv.append(k, v, np.arange(a, b))
    view = kv.snapshot()
    kernel = B.KernelOptions(threads=1, cpu_kernels="fused")
    qs = [(q, np.array([n_k]), B.AttentionOptions()) for q in B.queries(16, dtype, 1)]
    flops = 4.0 * B.HEADS["h_q"] * n_k * B.HEADS["d"]
    with common.blas_threads(1):
        alone = [partial_attention_resident(q, view, q_pos=p, options=o, kernel=kernel) for q, p, o in qs]
        states = partial_attention_resident_many(qs, view, kernel=kernel)
        bit = all(s.acc.tobytes() == a.acc.tobytes() for s, a in zip(states, alone))
        t16 = B.median_time(lambda: [partial_attention_resident_many(qs, view, kernel=kernel) for _ in range(calls)], repeat)
    return calls * 16 * flops / t16 / 1e9, bit
for dt in sys.argv[1].split(","):
    c64, b1 = run(dt, 2048, 20)
    m, b2 = run(dt, 64 * 1024, 1, 3)
    print(f"{os.getcwd()} {dt}: in-cache 16q {c64:.1f} GF/s, 64K keys 16q {m:.1f} GF/s, bitwise {b1 and b2}", flush=True)
