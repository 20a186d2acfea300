"""The contexts one query names, resolved: their records, shared dims and positions, and the jobs they
make (``service.contexts.service.ContextService.resolve`` builds one; the attention and batch paths
read it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.cluster.orchestrator import Job
from service.cluster.surface import ResidentWork, WorkerSurface
from service.contexts.records import ContextRecord
from service.core.errors import InvalidTensor, client_input
from service.wire.request import AttentionRequest
from workers.problem import KVDims, check_heads
from workers.tasks import ShardRead


@dataclass(frozen=True)
class Resolved:
    """The contexts one query names, as committed when it started, in the order named.

    Keys of a request are the keys of each named context (in the order named), then
    the inline keys (docs/API.md section 6); a query reads each shard's committed
    prefix on one of its replicas.
    """

    records: tuple[ContextRecord, ...]
    dims: KVDims  #: the contexts' shared [h_kv, d, d_v], and their keys in all
    next_pos: int  #: where keys after these contexts start by default: past every context's positions
    dtypes: tuple[np.dtype, ...]  #: the stored dtypes (they set the accumulation dtype)
    cached: bool = False  #: read from the front end's cache, not the directory (service.contexts.cache)

    def check(self, req: AttentionRequest) -> None:
        """The query's heads read these contexts, and inline keys have their shape."""
        dims = self.dims
        with client_input():
            check_heads(req.h_q, req.d, dims, keys="the contexts")
        if req.kv is not None:
            inline = req.kv.dims
            if (inline.h_kv, inline.d, inline.d_v) != (dims.h_kv, dims.d, dims.d_v):
                raise InvalidTensor(f"k, v must have [h_kv, d, d_v] = {[dims.h_kv, dims.d, dims.d_v]} as the "
                                    f"contexts, got {[inline.h_kv, inline.d, inline.d_v]}")

    def jobs(self, pool: WorkerSurface, fanin: int) -> list[Job]:
        """One job per non-empty shard, in key order; only the shard's replicas may run it. Each read names
        the record's version, and whether it is cached (a worker refuses a cached record it cannot vouch
        for) or was read from the directory for this query (``fresh``: committed when the query began;
        whatever commits while it runs, the answer is of a whole committed state, and none is refused).
        See ``workers.store.ShardStore.check_read``."""
        return [Job(work=ResidentWork((ShardRead(rec["id"], shard["index"], shard["length"], int(rec["version"]),
                                                 not self.cached),),
                                      fanin),
                    candidates=tuple(pool.indexes(shard["workers"])),
                    label=f"shard {shard['index']} of context {rec['id']}")
                for rec in self.records for shard in rec["shards"] if shard["length"]]
