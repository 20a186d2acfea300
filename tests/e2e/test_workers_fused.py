"""The fused CPU kernel (workers/fused.py): exact against float64, deterministic, batch-invariant,
chosen explicitly, and replaced by the NumPy kernel when numba is missing or broken.

The first run compiles the kernels (about 10 s per dtype and layout on 2 cores); numba caches
them on disk next to the module, so later runs take seconds.
"""

from __future__ import annotations


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


