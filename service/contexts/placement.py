"""Where context shards and their replicas go (pure: no Ray, no arrays).

Rules, in order: the replicas of one shard are on distinct workers; they are on
distinct nodes while there are nodes left to use; among the allowed workers the
one holding the fewest bytes (counting what this placement already put there)
comes first, ties by worker index. Deterministic for the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    index: int
    node_id: str
    bytes_held: int


def place(shard_bytes: list[int], replicas: int, workers: list[WorkerLoad]) -> list[list[int]]:
    """Worker indexes for each shard's replicas (``len(shard_bytes)`` lists of ``replicas`` each)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if replicas > len(workers):
        raise ValueError(f"replicas must be at most the number of live workers ({len(workers)}), got {replicas}")
    load = {w.index: w.bytes_held for w in workers}
    node = {w.index: w.node_id for w in workers}
    out = []
    for nbytes in shard_bytes:
        chosen: list[int] = []
        for _ in range(replicas):
            used_nodes = {node[i] for i in chosen}
            free = [w.index for w in workers if w.index not in chosen]
            fresh = [i for i in free if node[i] not in used_nodes]
            pick = min(fresh or free, key=lambda i: (load[i], i))
            chosen.append(pick)
            load[pick] += nbytes
        out.append(chosen)
    return out
