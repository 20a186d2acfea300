"""A CPU worker's kernel with ``cpu_kernels="auto"``: it serves at once on NumPy, compiles the fused kernel
in the background, switches, and says which kernel serves and since when."""

import time

import numpy as np
import pytest
from reference import assert_close_to_reference

from merge import finalize
from workers import fused
from workers.actor import ShardWorker
from workers.config import WorkerConfig
from workers.options import AttentionOptions, KernelOptions
from workers.tasks import ShardQuery, ShardRead, ShardWrite


def test_an_auto_worker_serves_on_numpy_at_once_then_switches_to_fused_and_says_since_when(rng, monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.setitem(fused._state, "ready_at", None)
    # The child that compiles runs at nice 19 so that a worker's calls go first; here the other
    # pytest worker's tests would go first and the wait would grow from 1 s to 12.
    monkeypatch.setattr(fused, "COMPILE_NICE", 0)
    w = ShardWorker(WorkerConfig(kernel=KernelOptions(cpu_kernels="auto"), channel=False), "w0")
    k = rng.standard_normal((3000, 2, 32)).astype(np.float32)
    v = rng.standard_normal((3000, 2, 16)).astype(np.float32)
    q = rng.standard_normal((1, 8, 32)).astype(np.float32)
    w.create_shard(ShardWrite("ctx", 0, "float32", 4096, np.arange(3000)), k, v, {"version": 1})
    query = ShardQuery(q_pos=np.array([2999]), options=AttentionOptions())
    first = w.ping()
    answers = []
    deadline = time.monotonic() + fused.COMPILE_APART_S
    while w.ping()["cpu_kernels"] != "fused" and time.monotonic() < deadline:
        _, state = w.partial_resident(q, query, (ShardRead("ctx", 0, 3000),), 2)  # never waits for the compile
        answers.append(state)
        time.sleep(0.05)
    now = w.ping()
    assert first["cpu_kernels"] in ("numpy", "fused") and first["cpu_kernels_since"] == w.started_at
    assert now["cpu_kernels"] == "fused" and now["cpu_kernels_since"] >= w.started_at
    _, state = w.partial_resident(q, query, (ShardRead("ctx", 0, 3000),), 2)
    for st in [*answers, state]:
        out, lse = finalize(st)
        assert_close_to_reference(out, lse, q, k, v)
