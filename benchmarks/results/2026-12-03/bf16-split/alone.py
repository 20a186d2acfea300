# Scratch A/B probe (docs/BENCHMARKS.md "bfloat16 keys split even and odd"): one query alone, fused resident bfloat16, one thread.
# usage: PYTHONPATH=<tree> python alone.py N_K [N_K ...]
import sys, time, numpy as np
from workers import BFLOAT16, StreamingKV
from workers.api import partial_attention_resident
from workers.options import AttentionOptions, CpuKernels, KernelOptions
import threadpoolctl
threadpoolctl.threadpool_limits(1)
rng = np.random.default_rng(0)
kop = KernelOptions(cpu_kernels=CpuKernels.FUSED, threads=1)
for n_k in [int(a) for a in sys.argv[1:]]:
    k = rng.standard_normal((n_k, 8, 128)).astype(np.float32).astype(BFLOAT16)
    q = rng.standard_normal((1, 32, 128)).astype(BFLOAT16)
    view = StreamingKV.from_arrays(k, k, np.arange(n_k)).snapshot()
    f = lambda: partial_attention_resident(q, view, q_pos=np.array([n_k]), options=AttentionOptions(), kernel=kop)
    f()
    ts = []
    for _ in range(7 if n_k > 4096 else 200):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    print(f"n_k={n_k} {np.median(ts)*1e3:.3f} ms")
