"""Scratch A/B kept beside the raw results (not a benchmark): the whole fused resident decode (benchmarks/kernel.py's builders, n_q = 1, h_q = 32, h_kv = 8, d = d_v = 128) in ONE process, the commit before (copies of its workers/fused_micro.py and fused_kernels.py in /tmp/base-src, compiled uncached) against the working tree, interleaved call by call with a GEMV beside; env T threads, NK keys, DTS dtypes, R rounds."""
import os, sys, time, statistics, types as pytypes
sys.path.insert(0, "/work/main")
import numpy as np
import workers.fused as wf
import workers.fused_kernels as fk8
import workers.fused_micro as fm8

def load_copy(name, path, patch=None):
    src = open(path).read().replace("cache=True", "cache=False")
    mod = pytypes.ModuleType(name); mod.__file__ = path
    if patch: src = patch(src)
    sys.modules[name] = mod
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod

fmb = load_copy("fmb", "/tmp/base-src/fused_micro.py")
saved = sys.modules["workers.fused_micro"]; sys.modules["workers.fused_micro"] = fmb
fkb = load_copy("fkb", "/tmp/base-src/fused_kernels.py")
sys.modules["workers.fused_micro"] = saved
assert hasattr(fm8, "PREFETCH_KEYS") and not hasattr(fmb, "PREFETCH_KEYS")

from benchmarks import kernel as kb
from workers.options import CpuKernels
from workers.dtypes import dtype_of
T = int(os.environ.get("T", 1)); n_k = int(os.environ.get("NK", 262144))
a, x = kb.gemv_operands(False)
for name in os.environ.get("DTS", "bfloat16,float16").split(","):
    dt = dtype_of(name)
    view, _ = kb.resident_kv(n_k, 8, 128, 128, 0, None, dt)
    q = kb.queries(1, 32, 128, 0)
    mods = {"base": fkb, "new": fk8}
    outs, ts = {}, {m: [] for m in mods}
    for m, mod in mods.items():
        wf.kernels = lambda mod=mod: mod
        outs[m] = kb.ours_resident(q, view, False, T, CpuKernels.FUSED)[0]
    gs = []
    for _ in range(int(os.environ.get("R", 7))):
        for m, mod in mods.items():
            wf.kernels = lambda mod=mod: mod
            time.sleep(0.1); t0 = time.perf_counter(); kb.ours_resident(q, view, False, T, CpuKernels.FUSED); ts[m].append(time.perf_counter() - t0)
        time.sleep(0.1); t0 = time.perf_counter(); kb.gemv(a, x, T); gs.append(time.perf_counter() - t0)
    kvb = 2 * n_k * 8 * 128 * np.dtype(dt).itemsize
    g = a.nbytes / statistics.median(gs) / 1e9
    print(f"T={T} n_k={n_k} {name:8s} " + "  ".join(f"{m}: {kvb/statistics.median(v)/1e9:4.1f} GB/s ({kvb/statistics.median(v)/1e9/g:.0%} of GEMV {g:.1f})" for m, v in ts.items())
          + f"  new/base speed-up pairwise median {statistics.median([p/q_ for p, q_ in zip(ts['base'], ts['new'])]):.2f}"
          + f"  bitwise {np.array_equal(outs['base'], outs['new'])}")
    del view
