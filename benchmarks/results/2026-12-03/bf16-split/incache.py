# Scratch A/B probe (docs/BENCHMARKS.md "bfloat16 keys split even and odd"): the micro-kernels on blocks that stay in cache.
# usage: TREE=<checkout> python incache.py
import time, numpy as np, numba, sys
import os; sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from workers.fused_micro import scores_dmajor_f32, pv_f32
import ml_dtypes
d, B, R = 128, 256, 4
rng = np.random.default_rng(0)
q = rng.standard_normal((R, d)).astype(np.float32)
kind = np.ones(R, np.int64)
s = np.zeros((R, B), np.float32)
acc = np.zeros((R, d), np.float32)
n = 4  # blocks resident in cache: 4*128*256*2B = 256 KiB for 16-bit
@numba.njit
def loop_s(q, kind, k, s, reps, n):
    for _ in range(reps):
        for b in range(n):
            scores_dmajor_f32(q, kind, 128, k, b * 128 * 256, 256, s, 256)
@numba.njit
def loop_pv(s, kind, v, acc, reps, n):
    for _ in range(reps):
        for b in range(n):
            pv_f32(s, kind, 256, v, b * 256 * 128, 128, acc, 128)
for name in ["float32", "bfloat16", "float16"]:
    x = rng.standard_normal(n * d * B).astype(np.float32)
    if name == "float32": k = x
    elif name == "bfloat16": k = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    else: k = x.astype(np.float16).view(np.int16)
    for f, args in (("scores", (q, kind, k, s)), ("pv", (s, kind, k, acc))):
        fn = loop_s if f == "scores" else loop_pv
        fn(*args, 1, n)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter(); fn(*args, 200, n); ts.append(time.perf_counter() - t0)
        t = min(ts)
        flops = 200 * n * 2 * R * d * B
        print(f"{name:9s} {f:6s} {flops / t / 1e9:6.1f} GFLOP/s  {200*n*d*B*k.itemsize/t/1e9:5.1f} GB/s")
