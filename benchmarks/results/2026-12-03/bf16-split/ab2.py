# Scratch A/B probe (docs/BENCHMARKS.md "bfloat16 keys split even and odd"): fused resident decode with a GEMV timed beside it.
# usage: PYTHONPATH=<tree> python ab2.py THREADS N_K DTYPES
import sys, time, numpy as np
from workers import BFLOAT16, StreamingKV
from workers.api import partial_attention_resident
from workers.options import AttentionOptions, CpuKernels, KernelOptions
import threadpoolctl
threads = int(sys.argv[1]); n_k = int(sys.argv[2]); dts = sys.argv[3].split(",")
threadpoolctl.threadpool_limits(threads)
rng = np.random.default_rng(0)
A = rng.standard_normal((8192, 16384)).astype(np.float32); x = np.ones(16384, np.float32)
kop = KernelOptions(cpu_kernels=CpuKernels.FUSED, threads=threads)
def once(f):
    t0 = time.perf_counter(); f(); return time.perf_counter() - t0
for name in dts:
    dt = {"float32": np.float32, "bfloat16": BFLOAT16, "float16": np.float16}[name]
    k = rng.standard_normal((n_k, 8, 128)).astype(np.float32).astype(dt)
    v = rng.standard_normal((n_k, 8, 128)).astype(np.float32).astype(dt)
    q = rng.standard_normal((1, 32, 128)).astype(dt)
    view = StreamingKV.from_arrays(k, v, np.arange(n_k)).snapshot()
    f = lambda: partial_attention_resident(q, view, q_pos=np.array([n_k]), options=AttentionOptions(), kernel=kop)
    g = lambda: A @ x
    f(); g()
    tk, tg = [], []
    for _ in range(7):
        tg.append(once(g)); tk.append(once(f))
    gk = (k.nbytes + v.nbytes) / np.median(tk) / 1e9; gg = A.nbytes / np.median(tg) / 1e9
    print(f"{name} {n_k//1024}K {threads}t kernel {gk:.1f} GB/s gemv {gg:.1f} share {gk/gg:.2f}")
