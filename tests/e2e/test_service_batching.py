"""Concurrent decode queries through a real server: batched on the workers, exact, and bitwise stable.

Batching is opportunistic (no timers): queries batch when they reach a worker
while it computes. Sixteen clients released together make that happen; a round
where it did not is tried again, a few times at most.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from reference import assert_close_to_reference

from service.client import Client

pytestmark = pytest.mark.ray

CLIENTS = 16
ROUNDS = 5


def kv(rng, n, h_kv=2, d=64, dtype=np.float32):
    return rng.standard_normal((n, h_kv, d)).astype(dtype), rng.standard_normal((n, h_kv, d)).astype(dtype)


def totals(c: Client) -> tuple[int, int]:
    workers = c.cluster()["workers"]
    return sum(w["calls"] for w in workers), sum(w["batches"] for w in workers)


def together(url: str, asks: list[tuple[np.ndarray, list[str]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every ask at once, one client each, released by a barrier."""
    start = threading.Barrier(len(asks))

    def one(ask):
        q, contexts = ask
        with Client(url) as c:
            c.cluster()  # connect first: the barrier releases requests, not handshakes
            start.wait()
            return c.attention(q, contexts=contexts)

    with ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(one, asks))


def batched_round(url: str, client: Client, asks, alone) -> bool:
    """One round: answers exact to the bit of the answers alone; True when some queries shared a pass."""
    calls0, batches0 = totals(client)
    answers = together(url, asks)
    for (out, lse), (want_out, want_lse) in zip(answers, alone):
        assert out.tobytes() == want_out.tobytes() and lse.tobytes() == want_lse.tobytes()
    calls1, batches1 = totals(client)
    return batches1 - batches0 < calls1 - calls0


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_concurrent_queries_on_one_context_share_passes_and_answer_as_alone(server, client, rng, dtype):
    k, v = kv(rng, 65536, dtype=dtype)
    ctx = client.create_context(k, v)
    asks = [(rng.standard_normal((1, 8, 64)).astype(dtype), [ctx["id"]]) for _ in range(CLIENTS)]
    alone = [client.attention(q, contexts=c) for q, c in asks]  # one at a time: nothing to batch with
    for (q, _), (out, lse) in zip(asks[:3], alone):
        assert_close_to_reference(out, lse, q, k, v, q_pos=np.array([65536]))
    assert any(batched_round(server.url, client, asks, alone) for _ in range(ROUNDS))
    client.delete_context(ctx["id"])


def test_queries_over_suffixes_of_one_shared_prefix_batch_and_stay_exact(server, client, rng):
    # Which queries shared a pass is checked on a worker (tests/e2e/test_workers_batch.py); here the
    # service answers each suffix's queries, batched, to the bit of their answers alone.
    pk, pv = kv(rng, 32768)
    prefix = client.create_context(pk, pv)
    suffixes = []
    for n in (500, 900):
        sk, sv = kv(rng, n)
        ctx = client.create_context(sk, sv, np.arange(32768, 32768 + n))
        suffixes.append((ctx["id"], sk, sv))
    asks = [(rng.standard_normal((1, 8, 64)).astype(np.float32), [prefix["id"], suffixes[i % 2][0]])
            for i in range(CLIENTS)]
    alone = [client.attention(q, contexts=c) for q, c in asks]
    for i, ((q, _), (out, lse)) in enumerate(zip(asks[:2], alone)):
        _, sk, sv = suffixes[i % 2]
        k_pos = np.concatenate([np.arange(32768), np.arange(32768, 32768 + len(sk))])
        assert_close_to_reference(out, lse, q, np.concatenate([pk, sk]), np.concatenate([pv, sv]), k_pos=k_pos)
    assert any(batched_round(server.url, client, asks, alone) for _ in range(ROUNDS))
    for ctx_id in [prefix["id"], *(s[0] for s in suffixes)]:
        client.delete_context(ctx_id)
