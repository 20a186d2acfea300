"""Resident contexts end to end: create, append, query (also across contexts), delete."""

import concurrent.futures
import itertools
import re
import threading

import httpx
import numpy as np
import pytest
from reference import assert_close_to_reference, reference

from service.client import Client, SplitkeyError
from service.client.timing import parse_server_timing
from workers import BFLOAT16
from workers.layout import bytes_per_key, padded_capacity, page_keys

pytestmark = pytest.mark.ray


def kv(rng, n, h_kv=2, d=16, d_v=8, dtype=np.float32):
    return rng.standard_normal((n, h_kv, d)).astype(dtype), rng.standard_normal((n, h_kv, d_v)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64], ids=lambda t: np.dtype(t).name)
def test_context_query_is_exact_after_create_and_appends(client, rng, dtype):
    k, v = kv(rng, 700, dtype=dtype)
    ctx = client.create_context(k[:300], v[:300], shards=2)
    assert ctx["length"] == 300 and ctx["shards"] == 2 and ctx["dtype"] == np.dtype(dtype).name
    for a, b in ((300, 301), (301, 650), (650, 700)):
        desc = client.append(ctx["id"], k[a:b], v[a:b])
        assert desc["length"] == b
    # Appends go to the shortest shard: the two stay balanced (docs/CONTEXTS.md, "Placement and storage").
    assert client.get_context(ctx["id"])["shard_lengths"] == [350, 350]
    q = rng.standard_normal((3, 4, 16)).astype(dtype)
    out, lse = client.attention(q, contexts=[ctx["id"]], causal=True)
    assert_close_to_reference(out, lse, q, k, v, causal=True)
    client.delete_context(ctx["id"])


def test_appends_open_the_shards_a_create_of_the_contexts_length_would_cut(client, rng):
    k, v = kv(rng, 1000)
    ctx = client.create_context(k[:100], v[:100])
    assert ctx["shards"] == 1  # 100 keys: under context_shard_keys (256 on the test server)
    desc = client.append(ctx["id"], k[100:], v[100:])
    # 1000 keys would be cut over both workers: the append opens the second shard and levels the two.
    assert desc["shard_lengths"] == [500, 500]
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[ctx["id"]])
    assert_close_to_reference(out, lse, q, k, v)
    client.delete_context(ctx["id"])


def _calls(client):
    return {w["name"]: w["calls"] for w in client.cluster()["workers"]}


def test_a_query_over_many_shards_costs_one_call_per_worker_and_stays_exact(client, rng):
    k, v = kv(rng, 2000)
    a = client.create_context(k[:1200], v[:1200], shards=6)  # three shards on each of the two workers
    b = client.create_context(k[1200:], v[1200:], k_pos=np.arange(1200, 2000), shards=4)
    ids = [a["id"], b["id"]]
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    q_pos = np.array([1500, 1999])
    client.attention(q, contexts=ids)  # the records into the front end's cache
    before = _calls(client)
    for _ in range(3):
        out, lse = client.attention(q, contexts=ids, causal=True, q_pos=q_pos)
        assert_close_to_reference(out, lse, q, k, v, causal=True, q_pos=q_pos)
    after = _calls(client)
    # ten shards on two workers: a call per worker and query (three queries), not one per shard (30)
    assert sorted(after[n] - before[n] for n in after) in ([0, 3], [3, 3]), (before, after)
    # inline keys after the contexts (positions 2000..2049): a shard of their own, the answer exact over all
    k2, v2 = kv(rng, 50)
    q_pos = np.array([2010, 2049])
    out, lse = client.attention(q, k2, v2, contexts=ids, causal=True, q_pos=q_pos)
    assert_close_to_reference(out, lse, q, np.concatenate([k, k2]), np.concatenate([v, v2]), causal=True,
                              q_pos=q_pos)
    for ctx in ids:
        client.delete_context(ctx)


def test_a_context_query_times_its_record_lookup_apart_from_the_scatter(client, rng):
    k, v = kv(rng, 300)
    ctx = client.create_context(k, v, shards=2)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    for _ in range(2):  # the first reads the directory, the second the front end's record cache
        client.attention(q, contexts=[ctx["id"]])
        stages = parse_server_timing(client.last_server_timing)
        assert {"parse", "lookup", "scatter", "compute", "worker", "merge", "encode"} <= set(stages), stages
        assert all(sec >= 0 for sec in stages.values()), stages
        assert 0 < stages["worker"] <= stages["compute"], stages  # over the direct channel too
    client.delete_context(ctx["id"])


def test_shared_prefix_with_private_suffixes_is_exact_and_stores_the_prefix_once(client, server, rng):
    p = 20_000  # a prefix whose copy would dwarf the page each suffix shard may hold beyond its keys
    k, v = kv(rng, p + 500)
    prefix = client.create_context(k[:p], v[:p])
    held = client.cluster()["bytes_held"]
    spans = ((p, p + 200), (p + 200, p + 500))
    suffixes = [client.create_context(k[lo:hi], v[lo:hi], k_pos=np.arange(p, p + hi - lo)) for lo, hi in spans]
    grown = client.cluster()["bytes_held"] - held
    per_key = bytes_per_key(2, 16, 8, np.float32)
    shards = sum(s["shards"] for s in suffixes)
    assert grown <= 500 * per_key + shards * page_keys(4) * per_key < p * per_key, \
        "suffixes must hold their own keys (and at most a page a shard), not a copy of the prefix"
    for sfx, (lo, hi) in zip(suffixes, spans):
        q = rng.standard_normal((2, 4, 16)).astype(np.float32)
        keys = np.concatenate([k[:p], k[lo:hi]])
        vals = np.concatenate([v[:p], v[lo:hi]])
        kpos = np.concatenate([np.arange(p), np.arange(p, p + hi - lo)])
        out, lse = client.attention(q, contexts=[prefix["id"], sfx["id"]], causal=True)
        assert_close_to_reference(out, lse, q, keys, vals, causal=True, k_pos=kpos)
    for c in [prefix, *suffixes]:
        client.delete_context(c["id"])


def test_causal_prefill_chunk_over_contexts_plus_inline_keys_with_positions(client, rng):
    k, v = kv(rng, 1200)
    ctx = client.create_context(k[:1000], v[:1000], shards=2)
    # The next chunk of a prefill: 200 new tokens sent inline, their queries at 1000..1199.
    q = rng.standard_normal((200, 4, 16)).astype(np.float32)
    q_pos = np.arange(1000, 1200)
    out, lse = client.attention(q, k[1000:], v[1000:], contexts=[ctx["id"]], causal=True, q_pos=q_pos,
                                k_pos=np.arange(1000, 1200))
    assert_close_to_reference(out, lse, q, k, v, causal=True, q_pos=q_pos)
    # Default positions give the same: inline keys continue the context, queries are the last ones.
    out2, lse2 = client.attention(q, k[1000:], v[1000:], contexts=[ctx["id"]], causal=True)
    np.testing.assert_array_equal(out, out2)
    client.delete_context(ctx["id"])


def test_queries_during_concurrent_appends_see_whole_appends_only(server, rng):
    k, v = kv(rng, 1200)
    chunks = [(0, 400)] + [(400 + 100 * i, 500 + 100 * i) for i in range(8)]
    with Client(server.url) as c:
        ctx = c.create_context(k[:400], v[:400])
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    q_pos = np.array([10**6])  # after every key: each answer is attention over some prefix
    refs = {hi: reference(q, k[:hi], v[:hi], q_pos=q_pos, k_pos=np.arange(hi))[0] for _, hi in chunks}
    done = threading.Event()

    def appender():
        with Client(server.url) as c:
            for lo, hi in chunks[1:]:
                c.append(ctx["id"], k[lo:hi], v[lo:hi])
        done.set()

    def querier():
        seen = []
        with Client(server.url) as c:
            while True:
                # A query sent after the last append returned must see every key: read it
                # before the request, so that the last answer of each querier is such a query.
                finished = done.is_set()
                out, _ = c.attention(q, contexts=[ctx["id"]], q_pos=q_pos)
                err = {hi: float(np.max(np.abs(out - ref))) for hi, ref in refs.items()}
                best = min(err, key=err.get)
                assert err[best] < 1e-5, f"answer matches no whole prefix: {err}"
                seen.append(best)
                if finished and len(seen) >= 3:
                    return seen

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        fa = pool.submit(appender)
        fq = [pool.submit(querier) for _ in range(2)]
        fa.result()
        seen = [f.result() for f in fq]
    assert all(s[-1] == 1200 for s in seen), seen
    assert all(a <= b for s in seen for a, b in itertools.pairwise(s)), f"a later query saw fewer keys: {seen}"
    with Client(server.url) as c:
        c.delete_context(ctx["id"])


def test_concurrent_appends_to_one_context_are_serialised(server, rng):
    k, v = kv(rng, 800)
    with Client(server.url) as c:
        ctx = c.create_context(k[:100], v[:100])

    def append(i):
        with Client(server.url) as c:
            lo = 100 + 100 * i
            return c.append(ctx["id"], k[lo:lo + 100], v[lo:lo + 100], k_pos=np.arange(lo, lo + 100))

    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        list(pool.map(append, range(7)))
    with Client(server.url) as c:
        assert c.get_context(ctx["id"])["length"] == 800
        q = rng.standard_normal((2, 2, 16)).astype(np.float32)
        out, lse = c.attention(q, contexts=[ctx["id"]], q_pos=np.array([5000, 5000]))
        # Appends landed in some order; attention over a set of keys does not depend on it.
        assert_close_to_reference(out, lse, q, k, v, q_pos=np.array([5000, 5000]))
        c.delete_context(ctx["id"])


def test_delete_frees_memory_and_then_the_context_is_404(client, server, rng):
    before = client.cluster()["bytes_held"]
    k, v = kv(rng, 500)
    ctx = client.create_context(k, v, replicas=2)
    assert client.cluster()["bytes_held"] > before
    listed = [c["id"] for c in client.list_contexts()]
    assert ctx["id"] in listed
    client.delete_context(ctx["id"])
    assert client.cluster()["bytes_held"] == before
    for call in (lambda: client.get_context(ctx["id"]), lambda: client.delete_context(ctx["id"]),
                 lambda: client.append(ctx["id"], k, v),
                 lambda: client.attention(np.ones((1, 2, 16), np.float32), contexts=[ctx["id"]])):
        with pytest.raises(SplitkeyError) as err:
            call()
        assert err.value.status == 404 and err.value.code == "context_not_found"


def test_context_ids_are_unguessable(client, rng):
    k, v = kv(rng, 10)
    ids = [client.create_context(k, v)["id"] for _ in range(3)]
    assert len(set(ids)) == 3 and all(len(i) >= 20 for i in ids)
    for i in ids:
        client.delete_context(i)


@pytest.mark.parametrize(
    ("call", "status", "words"),
    [
        (lambda c, k, v: c.create_context(k, v, replicas=3), 422, "replicas"),
        (lambda c, k, v: c.create_context(k, v[:, :1]), 422, "v must be"),
        (lambda c, k, v: c.create_context(k, v, shards=11), 422, "shards"),
        (lambda c, k, v: c.create_context(k, v, k_pos=np.arange(3)), 422, "k_pos"),
    ],
    ids=["too-many-replicas", "shape", "too-many-shards", "positions"],
)
def test_bad_context_requests_are_422_naming_the_field(client, rng, call, status, words):
    k, v = kv(rng, 10)
    with pytest.raises(SplitkeyError) as err:
        call(client, k, v)
    assert err.value.status == status and words in err.value.detail


def test_append_with_wrong_dtype_or_dims_is_refused_and_changes_nothing(client, rng):
    k, v = kv(rng, 50)
    ctx = client.create_context(k, v)
    with pytest.raises(SplitkeyError, match="dtype float32"):
        client.append(ctx["id"], k.astype(np.float16), v.astype(np.float16))
    with pytest.raises(SplitkeyError, match=r"\[h_kv, d, d_v\]"):
        client.append(ctx["id"], k[:, :1], v[:, :1])
    assert client.get_context(ctx["id"])["length"] == 50
    client.delete_context(ctx["id"])


def test_a_query_over_contexts_of_different_dims_is_refused_naming_each_in_the_querys_order(client, rng):
    a = client.create_context(*kv(rng, 30, h_kv=2, d=16, d_v=8))["id"]
    b = client.create_context(*kv(rng, 30, h_kv=2, d=16, d_v=8))["id"]
    c = client.create_context(*kv(rng, 30, h_kv=1, d=16, d_v=4))["id"]
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    try:
        for order, first, other in (([a, b, c], a, c), ([c, a], c, a)):
            with pytest.raises(SplitkeyError) as err:
                client.attention(q, contexts=order)
            assert (err.value.status, err.value.code) == (422, "invalid_option")
            dims = {a: [2, 16, 8], b: [2, 16, 8], c: [1, 16, 4]}
            assert err.value.detail == (f"contexts must share [h_kv, d, d_v], got {dims[first]} for {first} and "
                                        f"{dims[other]} for {other}"), err.value.detail
    finally:
        for ctx in (a, b, c):
            client.delete_context(ctx)


def test_json_create_and_query(server, rng):
    k, v = kv(rng, 20)
    r = httpx.post(server.url + "/v1/contexts", json={"k": k.tolist(), "v": v.tolist(), "replicas": 2})
    assert r.status_code == 201, r.text
    ctx = r.json()
    assert r.headers["location"] == f"/v1/contexts/{ctx['id']}"
    assert {"id", "length", "h_kv", "d", "d_v", "dtype", "shards", "replicas"} <= set(ctx)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    r = httpx.post(server.url + "/v1/attention", json={"q": q.tolist(), "contexts": [ctx["id"]]})
    assert r.status_code == 200, r.text
    assert_close_to_reference(np.array(r.json()["out"]), np.array(r.json()["lse"]), q, k, v)
    assert httpx.delete(server.url + f"/v1/contexts/{ctx['id']}").status_code == 200


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=["float32", "float16", "bfloat16"])
def test_context_with_nan_keys_is_refused_and_nothing_is_stored(client, rng, dtype):
    k, v = kv(rng, 40, dtype=dtype)
    k[7, 1, 3] = np.nan
    before = client.cluster()["bytes_held"]
    with pytest.raises(SplitkeyError) as err:
        client.create_context(k, v)
    assert err.value.status == 422 and "k must be finite" in err.value.detail
    assert client.cluster()["bytes_held"] == before


def post_kv(url, path, k, v, **params):
    """A raw safetensors context write (``params`` as the query): the httpx response."""
    from service.wire.safetensors import encode_safetensors, to_bytes

    return httpx.post(url + path, params=params, content=to_bytes(encode_safetensors({"k": k, "v": v})),
                      headers={"Content-Type": "application/octet-stream"}, timeout=60)


def test_expected_length_plans_the_shards_for_the_total_and_allocates_them_at_create(client, server, rng):
    k, v = kv(rng, 1100)
    before = client.cluster()["bytes_held"]
    r = post_kv(server.url, "/v1/contexts", k[:100], v[:100], expected_length=1000)
    assert r.status_code == 201, r.text
    ctx = r.json()
    # Two live workers, 1000 planned keys: 2 shards of capacity 500 (not 1 shard sized for 100 keys);
    # the body fills them in order, and both are allocated in full now.
    assert ctx["expected_length"] == 1000 and ctx["shard_lengths"] == [100, 0]
    per_key = bytes_per_key(2, 16, 8, np.float32)
    allocated = 2 * padded_capacity(500, 4) * per_key
    assert client.cluster()["bytes_held"] - before == allocated
    assert client.append(ctx["id"], k[100:800], v[100:800])["shard_lengths"] == [500, 300]
    # Past the plan the shards grow, levelled, page by page: no new shard, no new reservation.
    assert client.append(ctx["id"], k[800:1100], v[800:1100])["shard_lengths"] == [550, 550]
    grown = client.cluster()["bytes_held"] - before - allocated
    assert 0 <= grown <= 2 * (50 + page_keys(4)) * per_key, grown
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[ctx["id"]], causal=True)
    assert_close_to_reference(out, lse, q, k, v, causal=True)
    client.delete_context(ctx["id"])
    assert client.cluster()["bytes_held"] == before


def test_a_planned_context_that_cannot_fit_fails_at_create_and_leaves_nothing(client, server, rng):
    k, v = kv(rng, 10)
    before = client.cluster()["bytes_held"]
    r = post_kv(server.url, "/v1/contexts", k, v, expected_length=10**8)  # 20 GB planned, 4 GiB per worker
    assert r.status_code == 507 and r.json()["code"] == "insufficient_capacity", r.text
    # The worker's own words, not the traceback Ray wraps them in.
    assert re.fullmatch(r"the new context does not fit \(it was not created\): shard \d+ of context ctx_\S+ needs "
                        r"\d+ bytes, but this worker holds \d+ of its 4294967296-byte budget \(\d+ free\)", r.json()["detail"]), \
        r.json()["detail"]
    assert client.cluster()["bytes_held"] == before
    r = post_kv(server.url, "/v1/contexts", k, v, expected_length=9)
    assert r.status_code == 422 and "expected_length must be at least the 10 keys of this body, got 9" in r.text


def test_a_create_of_the_most_shards_allowed_keeps_the_workers_answering_and_other_contexts_served(client, server,
                                                                                                   rng):
    """1024 shards (API.md's most) sent one call per shard, each with the record that lists them all, cost
    the square of the count: 50 s on 2 cores, the workers missed their pings and were counted dead, and
    the other contexts on them were lost (an outside test, 2026-12-06). One call per worker now."""
    k, v = kv(rng, 200)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    other = client.create_context(k, v)["id"]
    out, lse = client.attention(q, contexts=[other])
    logged = len(server.log())
    r = post_kv(server.url, "/v1/contexts", k[:1], v[:1], expected_length=64 * 1024, shards=1024)
    assert r.status_code == 201, r.text
    big = r.json()
    assert big["shards"] == 1024 and big["shard_lengths"][:2] == [1, 0]
    assert "did not answer" not in server.log()[logged:]
    assert {w["name"]: w["alive"] for w in client.cluster()["workers"]} == {
        "splitkey-worker-0": True, "splitkey-worker-1": True}
    got, got_lse = client.attention(q, contexts=[other])
    assert got.tobytes() == out.tobytes() and got_lse.tobytes() == lse.tobytes()
    out, lse = client.attention(q, contexts=[big["id"]], q_pos=[0, 0])
    assert_close_to_reference(out, lse, q, k[:1], v[:1], q_pos=np.zeros(2, dtype=np.int64),
                              k_pos=np.zeros(1, dtype=np.int64))
    for ctx in (other, big["id"]):
        client.delete_context(ctx)


def test_an_append_after_the_wrong_length_is_409_naming_the_length_and_changes_nothing(client, server, rng):
    k, v = kv(rng, 30)
    ctx = client.create_context(k[:10], v[:10])
    path = f"/v1/contexts/{ctx['id']}/append"
    for wrong in (0, 9, 11, 20):
        r = post_kv(server.url, path, k[10:20], v[10:20], after=wrong)
        assert r.status_code == 409, r.text
        assert r.json() == {"code": "length_mismatch", "detail": f"after must be the context's length 10, got {wrong}",
                            "request_id": r.headers["x-request-id"]}
    assert post_kv(server.url, path, k[10:20], v[10:20], after=10).json()["length"] == 20
    # The same chunk sent again (a retry whose first attempt was stored) is refused: stored once.
    assert post_kv(server.url, path, k[10:20], v[10:20], after=10).status_code == 409
    r = httpx.post(server.url + path, json={"k": k[20:].tolist(), "v": v[20:].tolist(), "after": 20})
    assert r.status_code == 200 and r.json()["length"] == 30
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[ctx["id"]])
    assert_close_to_reference(out, lse, q, k, v)
    client.delete_context(ctx["id"])


def test_concurrent_appends_after_the_same_length_store_exactly_one(server, client, rng):
    k, v = kv(rng, 100)
    ctx = client.create_context(k[:20], v[:20])
    path = f"/v1/contexts/{ctx['id']}/append"
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda i: post_kv(server.url, path, k[20 + 10 * i:30 + 10 * i],
                                                v[20 + 10 * i:30 + 10 * i], after=20).status_code, range(6)))
    assert sorted(codes) == [200] + [409] * 5  # the check runs under the context's lease
    assert client.get_context(ctx["id"])["length"] == 30
    client.delete_context(ctx["id"])


def test_context_writes_report_their_stages_in_server_timing_and_metrics(server, rng):
    k, v = kv(rng, 300)
    created = post_kv(server.url, "/v1/contexts", k[:200], v[:200])
    appended = post_kv(server.url, f"/v1/contexts/{created.json()['id']}/append", k[200:], v[200:])
    for r, expected in ((created, {"parse", "place", "put", "store", "commit", "total"}),
                        (appended, {"parse", "put", "lease", "store", "commit", "note", "total"})):  # place: new shards
        stages = {part.split(";")[0].strip() for part in r.headers["server-timing"].split(",")}
        assert expected <= stages
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    for route in ("/v1/contexts", "/v1/contexts/{id}/append"):
        assert f'splitkey_request_stage_seconds_count{{route="{route}",stage="store"}}' in metrics
    httpx.delete(f"{server.url}/v1/contexts/{created.json()['id']}", timeout=30)


@pytest.mark.parametrize("case", ["f64_inline_over_f32_context", "f32_inline_over_f64_context",
                                  "f32_and_f64_contexts", "f64_and_f32_contexts", "f64_v_only"])
def test_a_query_mixing_float32_and_float64_keys_computes_in_float64(client, rng, case):
    """docs/API.md section 2: float64 as soon as one of q, k, v (or a context's stored dtype) is."""
    k32, v32 = kv(rng, 300)
    k64, v64 = kv(rng, 200, dtype=np.float64)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    c32 = client.create_context(k32, v32, shards=2)["id"]
    c64 = client.create_context(k64, v64)["id"]
    inline = {"f64_inline_over_f32_context": ([c32], k64, v64), "f32_inline_over_f64_context": ([c64], k32, v32),
              "f32_and_f64_contexts": ([c32, c64], None, None), "f64_and_f32_contexts": ([c64, c32], None, None),
              "f64_v_only": ([c32], k32[:50], v64[:50])}
    names, k, v = inline[case]
    out, lse = client.attention(q, k, v, contexts=names, causal=True)
    held = {c32: (k32, v32), c64: (k64, v64)}
    keys = [held[c] for c in names] + ([(k, v)] if k is not None else [])
    k_all = np.concatenate([a.astype(np.float64) for a, _ in keys])
    v_all = np.concatenate([b.astype(np.float64) for _, b in keys])
    # Positions: each context's keys from 0, inline keys after the furthest context (docs/API.md section 2).
    positions = [np.arange(len(held[c][0])) for c in names]
    nxt = max(len(held[c][0]) for c in names)
    if k is not None:
        positions.append(nxt + np.arange(len(k)))
    k_pos = np.concatenate(positions)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    q_pos = k_pos.max() - 1 + np.arange(2)  # the n_q positions ending one past the last key's
    assert_close_to_reference(out, lse, q.astype(np.float64), k_all, v_all, causal=True, k_pos=k_pos, q_pos=q_pos)
    for c in (c32, c64):
        client.delete_context(c)


def test_an_unknown_hex_like_context_id_is_named_in_the_404(client):
    unknown = "a" * 32  # as long as a Ray actor id: the client's own value, echoed, not withheld
    with pytest.raises(SplitkeyError) as err:
        client.get_context(unknown)
    assert err.value.status == 404 and unknown in err.value.detail, err.value.detail
    with pytest.raises(SplitkeyError) as err:
        client.attention(np.ones((1, 2, 16), np.float32), contexts=[unknown])
    assert err.value.status == 404 and unknown in err.value.detail, err.value.detail


def test_a_continuing_chunk_after_another_writers_chunk_of_the_same_size_is_409_and_changes_nothing(client, server,
                                                                                                     rng):
    k, v = kv(rng, 40)
    ctx = client.create_context(k[:10], v[:10])
    path, get = f"/v1/contexts/{ctx['id']}/append", server.url + f"/v1/contexts/{ctx['id']}"
    r = post_kv(server.url, path, k[10:20], v[10:20], after=10, upload="mine")  # the upload's first chunk
    assert r.status_code == 200 and r.json()["length"] == 20, r.text
    assert httpx.get(get, params={"upload": "mine"}).json()["upload"] == {"id": "mine", "start": 10, "end": 20}
    # Another writer's chunk as long as the upload's next one: the length is what that chunk's after
    # expected (30), but its keys would follow another writer's, not the upload's own.
    assert post_kv(server.url, path, k[20:30], v[20:30], after=20, upload="theirs").status_code == 200
    r = post_kv(server.url, path, k[30:40], v[30:40], after=30, upload="mine", continues="true")
    assert r.status_code == 409 and r.json()["code"] == "length_mismatch", r.text
    assert r.json()["detail"] == ("continues needs the context's last append to be upload mine's; another writer "
                                  "appended since (the context holds 30 keys)")
    state = httpx.get(get, params={"upload": "mine"}).json()
    assert state["length"] == 30 and state["upload"] == {"id": "mine", "start": 10, "end": 20}
    assert httpx.get(get, params={"upload": "theirs"}).json()["upload"] == {"id": "theirs", "start": 20, "end": 30}
    assert httpx.get(get, params={"upload": "nobody"}).json()["upload"] is None
    assert "upload" not in httpx.get(get).json()  # asked for only
    # A plain append between two chunks of an upload breaks its run too.
    assert post_kv(server.url, path, k[30:35], v[30:35], after=30, upload="theirs", continues="true").json()[
        "length"] == 35
    assert post_kv(server.url, path, k[35:38], v[35:38]).status_code == 200
    r = post_kv(server.url, path, k[38:40], v[38:40], after=38, upload="theirs", continues="true")
    assert r.status_code == 409, r.text
    # An upload's first chunk sent with continues: no other writer to blame, and the detail says so.
    r = post_kv(server.url, path, k[38:40], v[38:40], after=38, upload="new", continues="true")
    assert r.status_code == 409 and "the context holds no chunk of it" in r.json()["detail"], r.text
    # A chunk that continues its own upload right after it is stored (JSON body as well as query).
    r = httpx.post(server.url + path, json={"k": k[38:40].tolist(), "v": v[38:40].tolist(), "after": 38,
                                            "upload": "last", "continues": False})
    assert r.status_code == 200, r.text
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[ctx["id"]])
    assert_close_to_reference(out, lse, q, k, v)  # every key once, in the order it was stored
    assert httpx.get(get, params={"upload": "theirs"}).json()["upload"] == {"id": "theirs", "start": 20, "end": 35}
    client.delete_context(ctx["id"])


@pytest.mark.parametrize(
    ("params", "detail"),
    [({"upload": "a b", "after": 10}, "upload must be 1 to 64 characters A-Z a-z 0-9 _ -, got \"a b\""),
     ({"upload": "x" * 65, "after": 10}, "upload must be 1 to 64 characters"),
     ({"upload": "mine"}, "upload must come with after (the context's length before this chunk), got upload \"mine\" "
                          "without after"),
     ({"continues": "true", "after": 10}, "continues must come with upload"),
     ({"continues": "yes", "after": 10, "upload": "mine"}, "continues must be true or false, got \"yes\"")],
    ids=["space", "too-long", "no-after", "no-upload", "not-bool"],
)
def test_bad_upload_options_are_422_naming_the_field_and_change_nothing(client, server, rng, params, detail):
    k, v = kv(rng, 20)
    ctx = client.create_context(k[:10], v[:10])
    r = post_kv(server.url, f"/v1/contexts/{ctx['id']}/append", k[10:], v[10:], **params)
    assert r.status_code == 422 and r.json()["code"] == "invalid_option" and detail in r.json()["detail"], r.text
    r = httpx.get(server.url + f"/v1/contexts/{ctx['id']}", params={"upload": "a/b"})
    assert r.status_code == 422 and "upload must be 1 to 64 characters" in r.json()["detail"], r.text
    assert client.get_context(ctx["id"])["length"] == 10
    client.delete_context(ctx["id"])


def test_next_pos_is_one_past_the_largest_position_stored_however_the_keys_came(client, rng):
    k, v = kv(rng, 4)
    created = client.create_context(k[:2], v[:2], k_pos=np.array([-20, -16]))
    assert created["next_pos"] == -15
    empty = client.create_context(k[:0], v[:0])
    assert empty["next_pos"] == 0  # no key yet: default positions start at 0
    appended = client.append(empty["id"], k[:2], v[:2], k_pos=np.array([-30, -29]))
    assert appended["next_pos"] == -28  # the empty context's 0 was no key's position
    assert client.append(empty["id"], k[2:], v[2:], k_pos=np.array([-40, -35]))["next_pos"] == -28
    # Default positions continue from there: a causal query at the default q_pos sees every key.
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    out, lse = client.attention(q, contexts=[empty["id"]], causal=True)
    assert_close_to_reference(out, lse, q, k, v, causal=True, q_pos=np.array([-29]),
                              k_pos=np.array([-30, -29, -40, -35]))
    client.delete_context(created["id"])
    client.delete_context(empty["id"])


def test_a_context_id_too_long_to_quote_whole_is_cut_visibly_in_the_404(server):
    ctx_id = "b" * 100 + "c" * 29
    r = httpx.get(f"{server.url}/v1/contexts/{ctx_id}")
    assert r.status_code == 404 and r.json()["code"] == "context_not_found", r.text
    assert r.json()["detail"] == f"id must name an existing context, got {'b' * 64!r}... (129 characters)"
    r = httpx.get(f"{server.url}/v1/contexts/a$b")  # short: quoted whole
    assert r.json()["detail"] == "id must name an existing context, got 'a$b'"


def test_every_refused_append_leaves_the_context_and_the_workers_memory_exactly_as_acknowledged(tmp_path, rng):
    """Issue 47, point 7: an append of the wrong dtype, heads or dims, a body cut short, a client gone mid-upload
    and an append the workers have no room for (507 naming the bytes needed and free) each leave the context
    holding exactly what was acknowledged, answering the same bits, and the workers holding the same bytes."""
    import socket

    from server import Server

    from service.wire.safetensors import encode_safetensors, to_bytes

    srv = Server(tmp_path, args=("--workers", "2"), env={"SPLITKEY_WORKER_MEMORY_BYTES": str(48 * 2**20)}).start()
    try:
        with Client(srv.url) as c:
            k, v = kv(rng, 60_000, h_kv=4, d=64, d_v=64)  # 2056 bytes a key: 48 MiB a worker holds ~24K
            ctx = c.create_context(k[:4000], v[:4000])["id"]
            c.append(ctx, k[4000:5000], v[4000:5000])  # past the shards' bodies: into their tails
            q = rng.standard_normal((2, 8, 64)).astype(np.float32)
            q_pos = np.array([4998, 4999])
            answer = c.attention(q, contexts=[ctx], q_pos=q_pos)

            def unchanged(what):
                desc = c.get_context(ctx)
                assert desc["length"] == 5000 and desc["state"] == "ready", (what, desc)
                assert c.cluster()["bytes_held"] == held, what
                out, lse = c.attention(q, contexts=[ctx], q_pos=q_pos)
                assert out.tobytes() == answer[0].tobytes() and lse.tobytes() == answer[1].tobytes(), what

            held = c.cluster()["bytes_held"]
            for bad_k, bad_v, words in ((k[:5].astype(np.float16), v[:5].astype(np.float16), "dtype float32"),
                                        (k[:5, :1], v[:5, :1], r"\[h_kv, d, d_v\]"),
                                        (k[:5, :, :8], v[:5], r"\[h_kv, d, d_v\]")):
                with pytest.raises(SplitkeyError, match=words) as err:
                    c.append(ctx, bad_k, bad_v)
                assert err.value.status == 422
                unchanged(words)
            body = to_bytes(encode_safetensors({"k": k[5000:8000], "v": v[5000:8000]}))
            for cut in (len(body) // 2, len(body) - 10):  # a body cut short, its client gone mid-upload
                with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
                    sock.sendall(f"POST /v1/contexts/{ctx}/append HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                 f"application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n".encode())
                    sock.sendall(body[:cut])
                unchanged(f"cut at {cut}")
            # 55K more keys, 113 MB, in one request (the client would send chunks, each its own append):
            # past the 2 x 48 MiB of the workers.
            r = post_kv(srv.url, f"/v1/contexts/{ctx}/append", k[5000:], v[5000:])
            assert (r.status_code, r.json()["code"]) == (507, "insufficient_capacity"), r.text
            assert re.search(r"needs \d+ bytes, but this worker holds \d+ of its 50331648-byte budget \(\d+ free\)",
                             r.json()["detail"]), r.text
            unchanged("507")
            c.delete_context(ctx)
            assert c.cluster()["bytes_held"] == 0
    finally:
        srv.stop()
