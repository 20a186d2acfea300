"""The direct channel end to end: a real `splitkey serve` sends resident queries over it, exactly."""

from __future__ import annotations

import httpx
import numpy as np
from reference import assert_close_to_reference

from service.client import Client


def channel_calls(url: str) -> tuple[int, bool]:
    workers = httpx.get(f"{url}/v1/cluster", timeout=30).json()["workers"]
    return sum(w["channel_calls"] for w in workers), any(w["channel"] for w in workers)


def test_context_queries_and_batches_go_over_the_direct_channel_exactly(server, rng):
    k = rng.standard_normal((700, 2, 16)).astype(np.float32)  # three shards of 256 keys (the session server's)
    v = rng.standard_normal((700, 2, 8)).astype(np.float32)
    with Client(server.url) as c:
        ctx = c.create_context(k, v)["id"]
        before, _ = channel_calls(server.url)
        qs = [rng.standard_normal((2, 4, 16)).astype(np.float32) for _ in range(3)]
        for q in qs:
            out, lse = c.attention(q, contexts=[ctx], causal=True, softcap=5.0)
            assert_close_to_reference(out, lse, q, k, v, causal=True, softcap=5.0, q_pos=np.array([698, 699]),
                                      k_pos=np.arange(700))
        answers = c.attention_batch([{"q": q, "contexts": [ctx]} for q in qs])
        for q, (out, lse) in zip(qs, answers):
            assert_close_to_reference(out, lse, q, k, v, q_pos=np.array([698, 699]), k_pos=np.arange(700))
        after, open_ = channel_calls(server.url)
        c.delete_context(ctx)
    assert open_ and after - before >= 4  # three single queries (one call per worker each) and the batch
