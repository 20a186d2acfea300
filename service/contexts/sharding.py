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


#: Keys a shard of a context created without ``expected_length`` may grow to. Its memory is held page by
#: page as keys come (``workers.layout``, "Pages"), so a shard's reach costs address space only; the
#: worker's budget bounds what it holds.
GROWING_SHARD_KEYS = 1 << 24


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
        return ShardPlan(max(capacity, GROWING_SHARD_KEYS), shard_bounds(n, n_shards), reserve=0)
    bounds = [(min(i * capacity, n), min((i + 1) * capacity, n)) for i in range(n_shards)]
    return ShardPlan(capacity, bounds, reserve=capacity)


def reach_of(record: ContextRecord) -> int:
    """Keys a shard of the context may grow to on its worker (``ShardWrite.max_capacity``): a planned
    shard past its plan too, once the appends pass ``expected_length`` (:func:`plan_append`)."""
    return max(record["shard_capacity"], GROWING_SHARD_KEYS)


def reserve_of(record: ContextRecord) -> int:
    """Keys a new shard of the context is allocated for at once (0: it grows as keys come)."""
    return record["shard_capacity"] if record.get("expected_length") is not None else 0


def open_shards(shards: list[ShardEntry]) -> list[ShardEntry]:
    """The shards an append fills, in order: the last one holding keys, then the empty ones planned after it."""
    holding = [i for i, s in enumerate(shards) if s["length"]]
    return shards[holding[-1] if holding else 0:]


@dataclass(frozen=True)
class AppendPlan:
    """Where an append's keys go: spans of the write (in key order) into existing shards and new ones."""

    fills: list[tuple[int, int, int]]  #: ``(shard index, lo, keys)``: keys ``[lo, lo + keys)`` of the write
    new: list[tuple[int, int]]  #: ``(lo, keys)`` of each new shard, opened after the existing ones


def plan_append(record: ContextRecord, n: int, live: int, shard_keys: int) -> AppendPlan:
    """The shards an append of ``n`` keys fills and opens (docs/CONTEXTS.md, "Placement and storage").

    A context sized with ``expected_length`` fills its planned shards in order (:func:`open_shards`)
    up to their capacity. Past that, and for a context created without it, the shards are kept
    balanced: a shard opens while the context has fewer than ``min(live, ceil(length /
    shard_keys))`` (the count a create of that length would cut), and the keys go to the shards
    holding the fewest, up to their reach (:func:`reach_of`), so a context grown key by key is cut
    as one created whole. Each shard takes one span of the write.
    """
    cap, shards = record["shard_capacity"], record["shards"]
    lengths = [s["length"] for s in shards]
    takes = [0] * len(shards)
    left = n
    if record.get("expected_length") is not None:  # the plan first: its shards in order, to its capacity
        for s in open_shards(shards):
            take = min(cap - s["length"], left)
            takes[s["index"]] += take
            left -= take
    if left:  # then level: the shortest shards first, a new one while a create would cut more
        total = sum(lengths) + n
        lengths += [0] * max(0, min(live, -(-total // shard_keys)) - len(shards))
        takes += [0] * (len(lengths) - len(takes))
        grown = [length + take for length, take in zip(lengths, takes)]
        for i, more in enumerate(_level(grown, reach_of(record), left)):
            takes[i] += more
        left = n - sum(takes)
    fills: list[tuple[int, int, int]] = []
    new: list[tuple[int, int]] = []
    lo = 0
    for index, take in enumerate(takes):
        if take > 0:
            if index < len(shards):
                fills.append((index, lo, take))
            else:
                new.append((lo, take))
            lo += take
    new += [(lo + i, min(cap, n - lo - i)) for i in range(0, left, cap)]  # past every shard's reach
    return AppendPlan(fills, new)


def _level(lengths: list[int], cap: int, n: int) -> list[int]:
    """Keys each shard takes so that the ``n`` keys raise the shortest first (water-filling), none past
    ``cap``; what does not fit is left over."""
    take = [0] * len(lengths)
    left = n
    while left > 0:
        room = [i for i, x in enumerate(lengths) if x + take[i] < cap]
        if not room:
            break
        low = min(lengths[i] + take[i] for i in room)
        at_low = [i for i in room if lengths[i] + take[i] == low]
        above = [lengths[i] + take[i] for i in room if lengths[i] + take[i] > low]
        # Raise the shortest shards together to the next level (the next shard's length, or capacity).
        step = min(min(above, default=cap), cap) - low
        each, extra = divmod(min(left, step * len(at_low)), len(at_low))
        for j, i in enumerate(at_low):
            take[i] += each + (1 if j < extra else 0)
        left -= each * len(at_low) + extra
    return take
