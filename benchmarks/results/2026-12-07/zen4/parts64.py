"""Probe (2026-12-07, Zen 4): run from a checkout root; times the scores and p @ v micro-kernels of 64 rows x 1024 keys in cache against sgemm, one thread."""
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import numpy as np

from workers import fused_micro as M

R, d, nb = 64, 128, 1024
rng = np.random.default_rng(0)
q = rng.standard_normal((R, d), dtype=np.float32)
k = rng.standard_normal(d * nb, dtype=np.float32)
s = np.zeros((R, nb), np.float32)
kind = np.ones(R, np.int64)
v = rng.standard_normal(nb * d, dtype=np.float32)
acc = np.zeros((R, d), np.float32)
M.scores_dmajor_f32(q, kind, d, k, 0, nb, s, nb)
M.pv_f32(s, kind, nb, v, 0, d, acc, d)
def t(fn, n=200):
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best
fl = 2.0 * R * nb * d
ts = t(lambda: M.scores_dmajor_f32(q, kind, d, k, 0, nb, s, nb))
tp = t(lambda: M.pv_f32(s, kind, nb, v, 0, d, acc, d))
print(f"{os.getcwd()}: scores {ts*1e6:.0f} us {fl/ts/1e9:.1f} GF/s; pv {tp*1e6:.0f} us {fl/tp/1e9:.1f} GF/s")
import numpy as np

A = rng.standard_normal((R, d), dtype=np.float32); Bm = rng.standard_normal((d, nb), dtype=np.float32)
from threadpoolctl import threadpool_limits

with threadpool_limits(1):
    tg = t(lambda: A @ Bm)
print(f"sgemm same shape 1t: {tg*1e6:.0f} us {fl/tg/1e9:.1f} GF/s")
Big = rng.standard_normal((1024, 1024), dtype=np.float32)
with threadpool_limits(1):
    tb = t(lambda: Big @ Big, 5)
print(f"sgemm 1024^3 1t: {2*1024**3/tb/1e9:.1f} GF/s")
