"""A shard worker configured for the GPU: inline shards copied to the device, resident shards held there."""

import numpy as np
import pytest
from reference import assert_close_to_reference

from merge import finalize, merge_all
from workers.actor import ShardWorker
from workers.config import WorkerConfig
from workers.gpu import backend as gpu
from workers.options import AttentionOptions, KernelOptions
from workers.problem import Arange
from workers.tasks import ShardQuery, ShardRead, ShardWrite

REASON = gpu.unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"GPU tests need a GPU: {REASON}")]



@pytest.mark.parametrize("kernels", ["generic", "fused"])
def test_gpu_worker_inline_and_resident_shards_are_exact(rng, kernels):
    # No direct channel: this tests the device, and the unit tier opens no socket.
    w = ShardWorker(WorkerConfig(device="gpu", kernel=KernelOptions(gpu_kernels=kernels), channel=False), "gpu0")
    q = rng.standard_normal((3, 8, 64)).astype(np.float16)
    k = rng.standard_normal((5000, 2, 64)).astype(np.float16)
    v = rng.standard_normal((5000, 2, 64)).astype(np.float16)
    query = ShardQuery(q_pos=np.arange(4997, 5000), options=AttentionOptions(causal=True))
    w.create_shard(ShardWrite("ctx", 0, "float16", 4096, np.arange(3000)), k[:3000], v[:3000], {"version": 1})
    assert isinstance(w.store.view("ctx", 0, 3000).parts[0].kt, gpu.cupy.ndarray)  # the shard lives on the device
    _, resident = w.partial_resident(q, query, (ShardRead("ctx", 0, 3000),), 2)
    _, inline = w.partial(q, k[3000:], v[3000:], query, Arange(3000, 2000))
    assert isinstance(inline.m, np.ndarray)  # states come back to the host for the merge
    out, lse = finalize(merge_all([resident, inline]))
    assert_close_to_reference(out, lse, q, k, v, causal=True)
