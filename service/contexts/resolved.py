"""The contexts one query names, as committed when it started, and the work they make.

Keys of a request are, in this order: the keys of each named context (in the
order named), then the inline keys (docs/API.md section 6). A query reads each
shard's committed prefix on one of its replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.cluster.orchestrator import Job
from service.cluster.pool import ResidentWork, WorkerPool
from service.contexts.records import ContextRecord
from service.errors import InvalidTensor
from service.wire.request import AttentionRequest
from workers.dtypes import dtype_of
from workers.problem import KVDims, check_heads
from workers.tasks import ShardRead


@dataclass(frozen=True)
class Resolved:
    """The named contexts' records (all of one ``[h_kv, d, d_v]``), in the order named."""

    records: tuple[ContextRecord, ...]

    @property
    def dims(self) -> KVDims:
        r = self.records[0]
        return KVDims(n_k=sum(s["length"] for rec in self.records for s in rec["shards"]),
                      h_kv=r["h_kv"], d=r["d"], d_v=r["d_v"])

    @property
    def next_pos(self) -> int:
        """Where keys after these contexts start by default: past every context's positions."""
        return max(r["next_pos"] for r in self.records)

    @property
    def dtypes(self) -> list[object]:
        return [dtype_of(r["dtype"]) for r in self.records]

    def check(self, req: AttentionRequest) -> None:
        """The query's heads read these contexts, and inline keys have their shape."""
        dims = self.dims
        try:
            check_heads(req.h_q, req.d, dims, keys="the contexts")
        except ValueError as exc:
            raise InvalidTensor(str(exc)) from None
        if req.kv is not None:
            inline = req.kv.dims
            if (inline.h_kv, inline.d, inline.d_v) != (dims.h_kv, dims.d, dims.d_v):
                raise InvalidTensor(f"k, v must have [h_kv, d, d_v] = {[dims.h_kv, dims.d, dims.d_v]} as the "
                                    f"contexts, got {[inline.h_kv, inline.d, inline.d_v]}")

    def jobs(self, pool: WorkerPool, fanin: int) -> list[Job]:
        """One job per non-empty shard, in key order; only the shard's replicas may run it."""
        return [Job(work=ResidentWork((ShardRead(rec["id"], shard["index"], shard["length"]),), fanin),
                    candidates=tuple(pool.indexes(shard["workers"])),
                    label=f"shard {shard['index']} of context {rec['id']}")
                for rec in self.records for shard in rec["shards"] if shard["length"]]
