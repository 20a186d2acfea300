"""The fused CPU kernel (workers/fused.py): exact against float64, deterministic, batch-invariant,
chosen explicitly, and replaced by the NumPy kernel when numba is missing or broken.

The first run compiles the kernels (about 10 s per dtype and layout on 2 cores); numba caches
them on disk next to the module, so later runs take seconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from workers import fused
from workers.options import CpuKernels, KernelOptions

pytestmark = pytest.mark.skipif(fused.kernels() is None, reason="numba is not importable")

#: (h_q, h_kv, d, d_v, n_q): MHA, GQA, MQA, d_v != d, several queries.


def fused_opts(**kw) -> KernelOptions:
    return KernelOptions(cpu_kernels=CpuKernels.FUSED, **kw)


# -- selection and fallback ---------------------------------------------------------------------


def test_a_worker_configured_for_fused_compiles_at_start_and_serves_with_it(rng):
    from workers.actor import ShardWorker
    from workers.config import WorkerConfig

    plain = ShardWorker(WorkerConfig(), "w-numpy")
    assert plain.warm_s == {}  # the default kernel compiles nothing
    w = ShardWorker(WorkerConfig(kernel=fused_opts()), "w-fused")
    assert set(w.warm_s) == {"float32", "bfloat16", "float16", "float64"}




# -- the disk cache -----------------------------------------------------------------------------

_CACHED_CHILD = """
import sys, time
import numpy as np
from workers import StreamingKV, partial_attention_resident, partial_attention_shard
from workers.options import AttentionOptions, KernelOptions
rng = np.random.default_rng(5)
out = {}
t0 = time.perf_counter()
cases = [(np.float32, n_q, n_k, block) for n_q, n_k, block in [(1, 1000, None), (3, 300, 7), (20, 700, 64)]]
for i, (dt, n_q, n_k, block) in enumerate(cases):
    q = rng.standard_normal((n_q, 16, 64)).astype(dt)  # [n_q, h_q, d]
    k, v = (rng.standard_normal((n_k, 4, 64)).astype(dt) for _ in range(2))  # [n_k, h_kv, d]
    opts = AttentionOptions(causal=True)
    ko = KernelOptions(threads=2, cpu_kernels="fused", block_size=block)
    view = StreamingKV.from_arrays(k, v, np.arange(n_k)).snapshot()
    states = {"resident": partial_attention_resident(q, view, q_pos=np.arange(n_k - n_q, n_k), options=opts, kernel=ko)}
    if n_q == 1:  # the inline layout runs fused for decode
        states["inline"] = partial_attention_shard(q, k, v, q_pos=None, k_pos=None, options=opts, kernel=ko)
    for layout, st in states.items():
        for name in ("m", "l", "acc"):
            out[f"{i}-{layout}-{name}"] = np.asarray(getattr(st, name))
out["seconds"] = np.float64(time.perf_counter() - t0)
np.savez(sys.argv[1], **out)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_kernel_loaded_from_the_disk_cache_answers_bitwise_as_the_process_that_compiled_it(tmp_path):
    # The kernels compile with reassoc, and LLVM grouped the sum of a row's probabilities one way in the
    # process that compiled them and another in a process that loaded them from numba's disk cache: a
    # worker restarted over the same cache changed the last bit of some l. The sum is now written in
    # one order (workers.fused_kernels.sum_in_order); this runs a compile and a load, float32 only (every
    # dtype would take minutes of a CI machine's two cores; float64's loops agreed too when measured,
    # benchmarks/results/2026-12-07/NOTES.md), and compares every bit.
    import os
    import subprocess
    import sys

    cache = tmp_path / "numba-cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    runs = []
    for name in ("compiled", "loaded"):
        subprocess.run([sys.executable, "-c", _CACHED_CHILD, str(tmp_path / f"{name}.npz")], env=env, check=True,
                       timeout=540)
        runs.append(np.load(tmp_path / f"{name}.npz"))
    compiled, loaded = runs
    assert any(cache.rglob("*.nbi")), "the first child must have written numba's cache"
    assert float(loaded["seconds"]) < float(compiled["seconds"]) / 2, "the second child must have loaded it"
    keys = [k for k in compiled.files if k != "seconds"]
    assert len(keys) == 3 * 3 + 3
    for key in keys:
        np.testing.assert_array_equal(compiled[key], loaded[key], err_msg=key, strict=True)
        assert compiled[key].tobytes() == loaded[key].tobytes(), key  # bits: -0.0 is not 0.0 here
