"""Scratch A/B kept beside the raw results (not a benchmark): one resident block's scores, one thread,
in ONE process, the commit before (a copy of its workers/fused_micro.py, BASE_SRC) against the working
tree, over d-major keys in cache (one 1024-key block, 200 calls) and streamed from DRAM (256K keys,
runs n_k apart, as the resident layout lays out one kv head). float32 also against the loop it ran on
before (workers.fused_kernels._scores_dmajor). Ratios are pairwise medians of interleaved rounds."""
import os, sys, time, statistics, types as pytypes
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
import numpy as np, numba
import workers.fused_micro as new
import workers.fused_kernels as fk
from workers.dtypes import dtype_of
from workers.fused import _kernel_dtype

def load_copy(name, path):
    mod = pytypes.ModuleType(name); mod.__file__ = path; sys.modules[name] = mod
    exec(compile(open(path).read(), path, "exec"), mod.__dict__)
    return mod

base = load_copy("fm_base", os.environ.get("BASE_SRC", "/tmp/base-src/fused_micro.py"))

def streamer(f):
    @numba.njit(nogil=True)
    def stream(q, kind, d, k, step, s, nb, n_blocks, reps):
        for _ in range(reps):
            for b in range(n_blocks):
                f(q, kind, d, k, b * nb, step, s, nb)
    return stream

@numba.njit(fastmath=fk.FASTMATH, nogil=True)
def loop(q, kind, d, k, base_, step, s, nb):
    fk._scores_dmajor(q, kind, d, k, base_, step, s, nb)

R, d, nb = int(os.environ.get("ROWS", 4)), 128, 1024
rng = np.random.default_rng(0)
q = rng.standard_normal((R, d), dtype=np.float32) / np.float32(np.sqrt(d))
kind = np.ones(R, np.int64)
s = np.zeros((R, nb), np.float32)
for name in os.environ.get("DTS", "float32,bfloat16,float16").split(","):
    dt = dtype_of(name); kd = _kernel_dtype(dt)
    variants = {"before": streamer(base.scores_dmajor_f32), "now": streamer(new.scores_dmajor_f32)}
    if name == "float32":
        variants = {"loop (before)": streamer(loop), **variants}
    first = next(iter(variants))
    for label, n_k, reps in (("in cache", nb, 200), ("DRAM", 262144, 1)):
        k = rng.standard_normal(d * n_k, dtype=np.float32).astype(dt).view(kd)
        for fn in variants.values():
            fn(q, kind, d, k, n_k, s, nb, n_k // nb, 1)
        ts = {p: [] for p in variants}
        for _ in range(int(os.environ.get("R", 9))):
            for p, fn in variants.items():
                t0 = time.perf_counter(); fn(q, kind, d, k, n_k, s, nb, n_k // nb, reps); ts[p].append((time.perf_counter() - t0) / reps)
        byt = d * n_k * k.itemsize
        print(f"{name:8s} {label:8s} | " + " | ".join(
            f"{p}: {byt / statistics.median(v) / 1e9:.1f} GB/s ({statistics.median([a / b for a, b in zip(ts[first], v)]):.2f}x)"
            for p, v in ts.items()))
