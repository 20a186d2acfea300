"""The Ray shard worker: one process, one device, a kernel and a store of resident shards.

The class is plain Python (testable without Ray); ``service.pool`` wraps it with
``ray.remote`` and the resources it needs. Configuration arrives through the
constructor as a :class:`workers.config.WorkerConfig`.

Every method returns plain data (``State``, dicts of ints and strings); Ray
moves numpy arrays through its object store without copying them on read.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from merge import State, merge_all, merge_group
from workers.api import partial_attention, partial_attention_resident
from workers.config import WorkerConfig
from workers.options import AttentionOptions
from workers.store import ShardStore


def _host_state(st: State) -> State:
    """A State with numpy arrays (copies device arrays back to the host)."""
    if isinstance(st.m, np.ndarray):
        return st
    return State(m=st.m.get(), l=st.l.get(), acc=st.acc.get())


class ShardWorker:
    """Computes partial states over inline shards and over the resident shards it holds."""

    def __init__(self, config: WorkerConfig, name: str) -> None:
        self.config = config
        self.name = name
        self.xp = np
        if config.device == "gpu":
            from workers import gpu

            self.xp = gpu.array_module()
        self.store = ShardStore(config.memory_budget_bytes, self.xp)
        self.calls = 0

    # -- health -----------------------------------------------------------------
    def ping(self) -> dict:
        node_id = ""
        try:
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:
            node_id = ""
        return {
            "name": self.name,
            "device": self.config.device,
            "node_id": node_id,
            "pid": os.getpid(),
            "bytes_held": self.store.used,
            "budget_bytes": self.store.budget,
            "shards": len(self.store.held()),
            "calls": self.calls,
        }

    # -- inline shards --------------------------------------------------------
    # Compute methods return ``(status, state)``; the pool calls them with
    # ``num_returns=2`` so the front end awaits the small status and leaves the
    # state in the object store until the merge tree needs it.
    def partial(self, q: Any, k: Any, v: Any, q_pos: Any, k_pos: Any, options: dict) -> tuple[dict, State]:
        """The state of ``q`` over one inline shard ``k, v`` at positions ``k_pos``."""
        self.calls += 1
        t0 = time.perf_counter()
        xp = self.xp
        if xp is not np:
            q, k, v = xp.asarray(q), xp.asarray(k), xp.asarray(v)
        kern = self.config.kernel
        st = partial_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, block_size=kern.block_size, threads=kern.threads,
                               gpu_kernels=kern.gpu_kernels, **options)
        st = _host_state(st)
        return {"worker": self.name, "seconds": time.perf_counter() - t0, "nbytes": st.nbytes}, st

    # -- resident shards ------------------------------------------------------
    def partial_resident(self, q: Any, q_pos: Any, options: dict, shards: list[tuple[str, int, int]],
                         fanin: int = 2) -> tuple[dict, State]:
        """The merged state of ``q`` over the first ``length`` keys of each listed shard.

        ``shards`` is ``[(context_id, index, length), ...]`` in key order; the
        shards' states merge here over ``merge_all``'s fixed tree.
        """
        self.calls += 1
        t0 = time.perf_counter()
        xp = self.xp
        opts = AttentionOptions(**options)
        if xp is not np:
            q = xp.asarray(q)
            q_pos = xp.asarray(q_pos)
        views = [self.store.view(c, i, n) for c, i, n in shards]  # raises ShardMissing first
        states = [partial_attention_resident(q, view, q_pos=q_pos, options=opts, kernel=self.config.kernel)
                  for view in views]
        st = _host_state(merge_all(states, fanin=fanin))
        return {"worker": self.name, "seconds": time.perf_counter() - t0, "nbytes": st.nbytes}, st

    def create_shard(self, context_id: str, index: int, k: Any, v: Any, k_pos: Any, dtype: str,
                     max_capacity: int, context: dict) -> dict:
        return self.store.create(context_id, index, k, v, k_pos, dtype=dtype, max_capacity=max_capacity,
                                 context=context).to_dict()

    def append_shard(self, context_id: str, index: int, k: Any, v: Any, k_pos: Any, max_capacity: int,
                     committed: int) -> dict:
        return self.store.append(context_id, index, k, v, k_pos, max_capacity=max_capacity,
                                 committed=committed).to_dict()

    def truncate_shard(self, context_id: str, index: int, length: int) -> None:
        self.store.truncate(context_id, index, length)

    def note_context(self, context_id: str, record: dict) -> None:
        self.store.note_context(context_id, record)

    def drop(self, context_id: str, index: int | None = None) -> int:
        return self.store.drop(context_id, index)

    def held(self) -> list[dict]:
        return [info.to_dict() for info in self.store.held()]

    # -- merge tree -----------------------------------------------------------
    def merge_states(self, *states: State) -> State:
        """One node of the distributed merge tree (same ``merge_group`` as a local merge)."""
        return merge_group(list(states))
