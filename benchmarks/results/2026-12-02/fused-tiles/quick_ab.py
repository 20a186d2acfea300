# Scratch A/B script used for docs/BENCHMARKS.md "Register tiles" (interleaved rows): kept as provenance.
# usage: PYTHONPATH=<tree> python quick_ab.py THREADS N_K DTYPES LAYOUTS [BLOCK]
import sys, time, numpy as np
from workers import BFLOAT16, StreamingKV, fused
from workers.api import partial_attention_resident, partial_attention_shard
from workers.options import AttentionOptions, CpuKernels, KernelOptions
threads = int(sys.argv[1]); sizes = [int(x) for x in sys.argv[2].split(",")]; dts = sys.argv[3].split(",")
layouts = sys.argv[4].split(",") if len(sys.argv) > 4 else ["resident"]
block = int(sys.argv[5]) if len(sys.argv) > 5 else None
import threadpoolctl
threadpoolctl.threadpool_limits(threads)
rng = np.random.default_rng(0)
A = rng.standard_normal((8192, 16384)).astype(np.float32); x = np.ones(16384, np.float32)
def med(f, n=5):
    f(); ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return np.median(ts)
g = A.nbytes / med(lambda: A @ x) / 1e9
print(f"gemv {threads}t {g:.1f} GB/s")
kop = KernelOptions(cpu_kernels=CpuKernels.FUSED, threads=threads, block_size=block)
for n_k in sizes:
    for name in dts:
        dt = {"float32": np.float32, "bfloat16": BFLOAT16, "float16": np.float16}[name]
        k = rng.standard_normal((n_k, 8, 128)).astype(np.float32).astype(dt)
        v = rng.standard_normal((n_k, 8, 128)).astype(np.float32).astype(dt)
        q = rng.standard_normal((1, 32, 128)).astype(dt)
        qpos = np.array([n_k])
        for lay in layouts:
            if lay == "resident":
                view = StreamingKV.from_arrays(k, v, np.arange(n_k)).snapshot()
                f = lambda: partial_attention_resident(q, view, q_pos=qpos, options=AttentionOptions(), kernel=kop)
            else:
                f = lambda: partial_attention_shard(q, k, v, q_pos=qpos, k_pos=np.arange(n_k), options=AttentionOptions(), kernel=kop)
            t = med(f)
            gb = (k.nbytes + v.nbytes) / t / 1e9
            print(f"{lay} {name} {n_k//1024}K {threads}t: {gb:.1f} GB/s = {gb/g:.0%} of GEMV")
