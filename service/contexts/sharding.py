"""How a context is cut into shards: the plan of a new one, the allocation of a new shard, and the
shards an append fills (docs/API.md section 6.3; ``service.contexts.service`` writes them)."""

from __future__ import annotations

from dataclasses import dataclass

from service.cluster.orchestrator import shard_bounds
from service.contexts.records import ContextRecord, ShardEntry
from service.core.errors import InvalidOption
from service.wire.request import ContextWrite


@dataclass(frozen=True)
class ShardPlan:
    """How a new context is cut: its shards, their capacity, and where the first body's keys go."""

    capacity: int  #: keys each shard holds before a new one opens
    bounds: list[tuple[int, int]]  #: the first body's keys ``[lo, hi)`` in each shard, in order
    reserve: int  #: keys each shard is allocated for at once (0: only those written; it grows)

    @property
    def sizes(self) -> list[int]:
        """What placement balances: each shard's keys when it grows, else its whole allocation."""
        return [self.reserve or hi - lo for lo, hi in self.bounds]


def plan_shards(write: ContextWrite, live: int, shard_keys: int) -> ShardPlan:
    """The shards of a new context (docs/API.md section 6.3).

    Without ``expected_length`` the body is cut into balanced shards that grow as keys
    are appended. With it, the shard count and capacity are computed for the total, the
    body fills the shards in order, and every shard is allocated for its capacity now:
    the appends that follow fill them and open new ones at that same capacity, a
    context that cannot fit fails here, and no shard is ever copied into a larger array.
    """
    n = write.kv.dims.n_k
    total = n if write.expected_length is None else write.expected_length
    n_shards = write.shards if write.shards is not None else max(1, min(live, -(-total // shard_keys)))
    if n_shards > max(total, 1):
        raise InvalidOption(f"shards must be in [1, {max(total, 1)}] (one key at least each), got {n_shards}")
    capacity = max(-(-total // n_shards), shard_keys)
    if write.expected_length is None:
        return ShardPlan(capacity, shard_bounds(n, n_shards), reserve=0)
    bounds = [(min(i * capacity, n), min((i + 1) * capacity, n)) for i in range(n_shards)]
    return ShardPlan(capacity, bounds, reserve=capacity)


def reserve_of(record: ContextRecord) -> int:
    """Keys a new shard of the context is allocated for at once (0: it grows as keys come)."""
    return record["shard_capacity"] if record.get("expected_length") is not None else 0


def open_shards(shards: list[ShardEntry]) -> list[ShardEntry]:
    """The shards an append fills, in order: the last one holding keys, then the empty ones planned after it."""
    holding = [i for i, s in enumerate(shards) if s["length"]]
    return shards[holding[-1] if holding else 0:]
