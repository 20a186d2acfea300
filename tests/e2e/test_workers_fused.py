"""The fused CPU kernel (workers/fused.py): exact against float64, deterministic, batch-invariant,
chosen explicitly, and replaced by the NumPy kernel when numba is missing or broken.

The first run compiles the kernels (about 10 s per dtype and layout on 2 cores); numba caches
them on disk next to the module, so later runs take seconds.
"""

from __future__ import annotations

import itertools

import pytest

from merge import finalize, merge_all
from workers import StreamingKV, fused
from workers.api import partial_attention_resident, partial_attention_shard
from workers.options import CpuKernels, KernelOptions

pytestmark = pytest.mark.skipif(fused.kernels() is None, reason="numba is not importable")

#: (h_q, h_kv, d, d_v, n_q): MHA, GQA, MQA, d_v != d, several queries.


def fused_opts(**kw) -> KernelOptions:
    return KernelOptions(cpu_kernels=CpuKernels.FUSED, **kw)


def run(layout, q, k, v, k_pos, q_pos, opts, kernel, shards=1):
    """``finalize(merge_all(states))`` over ``shards`` contiguous key ranges, on one layout."""
    bounds = [len(k) * i // shards for i in range(shards + 1)]
    states = []
    for a, b in itertools.pairwise(bounds):
        if layout == "inline":
            states.append(partial_attention_shard(q, k[a:b], v[a:b], q_pos=q_pos, k_pos=k_pos[a:b], options=opts,
                                                  kernel=kernel))
        else:
            view = StreamingKV.from_arrays(k[a:b], v[a:b], k_pos[a:b]).snapshot()
            states.append(partial_attention_resident(q, view, q_pos=q_pos, options=opts, kernel=kernel))
    return finalize(merge_all(states))


# -- selection and fallback ---------------------------------------------------------------------


def test_a_worker_configured_for_fused_compiles_at_start_and_serves_with_it(rng):
    from workers.actor import ShardWorker
    from workers.config import WorkerConfig

    plain = ShardWorker(WorkerConfig(), "w-numpy")
    assert plain.warm_s == {}  # the default kernel compiles nothing
    w = ShardWorker(WorkerConfig(kernel=fused_opts()), "w-fused")
    assert set(w.warm_s) == {"float32", "bfloat16", "float16", "float64"}


