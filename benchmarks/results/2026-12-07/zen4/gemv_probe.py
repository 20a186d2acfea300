"""Probe (2026-12-07, Zen 4): a 256 MiB float32 GEMV back to back, and after a 0.3 s pause and an untimed call, at 2 and 1 BLAS threads."""
import time

import numpy as np
from threadpoolctl import threadpool_limits

a = np.random.default_rng(0).standard_normal(64*2**20, dtype=np.float32)
A = a.reshape(16384, 4096); x = np.ones(4096, np.float32)
for mode in ("back-to-back", "pause+untimed"):
    for th in (2, 1):
        with threadpool_limits(th):
            ts=[]
            for _ in range(5):
                if mode != "back-to-back":
                    time.sleep(0.3); A @ x
                t=time.perf_counter(); A @ x; ts.append(time.perf_counter()-t)
        print(mode, th, " ".join(f"{a.nbytes/t/1e9:.1f}" for t in ts))
