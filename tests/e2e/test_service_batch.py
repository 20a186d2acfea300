"""POST /v1/attention/batch end to end: many items per request, each answered (or refused) on its own."""

import json
import struct

import httpx
import numpy as np
import pytest
from reference import assert_close_to_reference

from service.client import Client, SplitkeyError
from service.client.batch import encode_batch
from service.client.timing import parse_server_timing
from service.wire.safetensors import decode_safetensors, encode_safetensors, to_bytes

pytestmark = pytest.mark.ray

BINARY = "application/octet-stream"


def kv(rng, n, h_kv=2, d=16, d_v=8, dtype=np.float32):
    return rng.standard_normal((n, h_kv, d)).astype(dtype), rng.standard_normal((n, h_kv, d_v)).astype(dtype)


@pytest.fixture(scope="module")
def contexts(server):
    """Three contexts (one over several shards, one float16) and their keys."""
    rng = np.random.default_rng(17)
    made = {}
    with Client(server.url) as c:
        for name, n, dtype in (("long", 900, np.float32), ("short", 70, np.float32), ("half", 300, np.float16)):
            k, v = kv(rng, n, dtype=dtype)
            made[name] = (c.create_context(k, v)["id"], k, v)
    yield made
    with Client(server.url) as c:
        for ctx_id, _, _ in made.values():
            c.delete_context(ctx_id)


def items_of_every_kind(rng, contexts):
    """Items over one or two contexts with every option, and inline ones; the keys each reads."""
    (long_id, lk, lv), (short_id, sk, sv), (half_id, hk, hv) = (contexts[n] for n in ("long", "short", "half"))
    q = lambda n_q, h_q=4, dtype=np.float32: rng.standard_normal((n_q, h_q, 16)).astype(dtype)  # noqa: E731
    ik, iv = kv(rng, 130)
    items = [
        ({"q": q(1), "contexts": [long_id]}, (lk, lv), {}),
        ({"q": q(3), "contexts": [long_id], "causal": True}, (lk, lv), {"causal": True}),
        ({"q": q(2), "contexts": [short_id], "window": (20, 0), "q_pos": np.array([40, 69])}, (sk, sv),
         {"window": (20, 0), "q_pos": np.array([40, 69])}),
        ({"q": q(1), "contexts": [long_id, short_id], "softcap": 5.0, "scale": 0.3},
         (np.concatenate([lk, sk]), np.concatenate([lv, sv])),
         {"softcap": 5.0, "scale": 0.3, "k_pos": np.concatenate([np.arange(900), np.arange(70)])}),
        ({"q": q(2, dtype=np.float16), "contexts": [half_id]}, (hk, hv), {}),
        ({"q": q(2), "k": ik, "v": iv, "causal": True}, (ik, iv), {"causal": True}),
        ({"q": q(1, h_q=2), "contexts": [short_id], "alibi_slopes": np.array([0.5, 0.25])}, (sk, sv),
         {"alibi_slopes": np.array([0.5, 0.25])}),
    ]
    return items


def test_batch_answers_each_item_exactly_and_bitwise_as_alone(client, contexts, rng):
    items = items_of_every_kind(rng, contexts)
    answers = client.attention_batch([item for item, _, _ in items])
    assert len(answers) == len(items)
    for (item, (k, v), ref_opts), answer in zip(items, answers):
        assert not isinstance(answer, SplitkeyError), answer
        out, lse = answer
        assert_close_to_reference(out, lse, item["q"], k, v, **ref_opts)
        alone = client.attention(**item)
        assert np.array_equal(out, alone[0]) and np.array_equal(lse, alone[1]), item.get("contexts")


def test_batch_of_many_items_over_the_same_context_shares_the_workers(client, contexts, rng):
    ctx_id, k, v = contexts["long"]
    qs = [rng.standard_normal((1, 4, 16)).astype(np.float32) for _ in range(64)]
    answers = client.attention_batch([{"q": q, "contexts": [ctx_id], "causal": True} for q in qs])
    for q, (out, lse) in zip(qs, answers):
        assert_close_to_reference(out, lse, q, k, v, causal=True)
    stages = parse_server_timing(client.last_server_timing)
    assert {"lookup", "scatter", "compute", "worker", "merge"} <= set(stages), stages  # one lookup for the 64 items
    assert 0 < stages["worker"] <= stages["compute"], stages  # the longest pass, within the calls that ran it


def batch_item_counts(url):
    """``splitkey_batch_items_total`` by code, from the server's /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return {line.split('code="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("splitkey_batch_items_total{")}


def test_batch_item_errors_are_their_own_and_the_others_are_answered(server, client, contexts, rng):
    ctx_id, k, v = contexts["short"]
    before = batch_item_counts(server.url)
    good = rng.standard_normal((1, 4, 16)).astype(np.float32)
    items = [
        {"q": good, "contexts": [ctx_id]},
        {"q": good, "contexts": ["ctx_does_not_exist"]},
        {"q": rng.standard_normal((1, 4, 12)).astype(np.float32), "contexts": [ctx_id]},  # d 12 != 16
        {"q": good, "contexts": [ctx_id], "window": (-1, 0)},
        {"q": good, "k": k[:5], "v": v[:6]},
        {"q": good, "contexts": [ctx_id], "causal": True},
    ]
    answers = client.attention_batch(items)
    for i in (0, 5):
        out, lse = answers[i]
        assert_close_to_reference(out, lse, good, k, v, causal=i == 5)
    expected = {1: (404, "context_not_found", "ctx_does_not_exist"), 2: (422, "invalid_tensor", "d"),
                3: (422, "invalid_option", "window"), 4: (422, "invalid_tensor", "v")}
    for i, (status, code, word) in expected.items():
        err = answers[i]
        assert isinstance(err, SplitkeyError), (i, err)
        assert (err.status, err.code) == (status, code), err
        assert err.detail.startswith(f"items[{i}]: ") and word in err.detail, err.detail
    after = batch_item_counts(server.url)  # each item counted by its own code
    grew = {code: after[code] - before.get(code, 0.0) for code in after}
    assert {code: n for code, n in grew.items() if n} == {"200": 2, "404": 1, "422": 3}


def test_batch_items_mixing_float32_and_float64_keys_compute_in_float64(client, contexts, rng):
    """An item over a float32 and a float64 context (the grouped path), and one with float64 inline keys
    over a float32 context (the single path), beside a plain float32 item: each answered in its dtype."""
    (long_id, lk, lv), (short_id, sk, sv) = contexts["long"], contexts["short"]
    k64, v64 = kv(rng, 90, dtype=np.float64)
    c64 = client.create_context(k64, v64)["id"]
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    items = [{"q": q, "contexts": [short_id, c64]}, {"q": q, "contexts": [long_id], "k": k64, "v": v64},
             {"q": q, "contexts": [short_id]}]
    answers = client.attention_batch(items)
    client.delete_context(c64)
    up = lambda *a: np.concatenate([x.astype(np.float64) for x in a])  # noqa: E731
    wanted = [(up(sk, k64), up(sv, v64), np.concatenate([np.arange(70), np.arange(90)])),
              (up(lk, k64), up(lv, v64), np.concatenate([np.arange(900), 900 + np.arange(90)])),
              (sk, sv, np.arange(70))]
    for (out, lse), (k, v, k_pos), dtype in zip(answers, wanted, (np.float64, np.float64, np.float32)):
        assert out.dtype == dtype and lse.dtype == dtype
        assert_close_to_reference(out, lse, q.astype(dtype), k, v, k_pos=k_pos)


def test_batch_in_json_answers_per_item(server, contexts, rng):
    ctx_id, k, v = contexts["short"]
    q = rng.standard_normal((2, 4, 16))
    body = {"items": [{"q": q.tolist(), "contexts": [ctx_id], "causal": True},
                      {"q": q.tolist(), "contexts": [ctx_id], "causal": "yes"},
                      {"q": q[:1].tolist(), "k": k[:10].tolist(), "v": v[:10].tolist()}]}
    r = httpx.post(server.url + "/v1/attention/batch", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()["items"]
    out = np.array(got[0]["out"], dtype=np.float32)
    lse = np.array(got[0]["lse"], dtype=np.float32)
    assert_close_to_reference(out, lse, q.astype(np.float32), k, v, causal=True)
    assert got[1]["error"]["status"] == 422 and got[1]["error"]["code"] == "invalid_option"
    assert "causal" in got[1]["error"]["detail"] and got[1].keys() == {"error"}
    out = np.array(got[2]["out"], dtype=np.float32)
    lse = np.array(got[2]["lse"], dtype=np.float32)
    assert_close_to_reference(out, lse, q[:1].astype(np.float32), k[:10], v[:10])


def post(server, body, content_type=BINARY):
    return httpx.post(server.url + "/v1/attention/batch", content=body, headers={"Content-Type": content_type},
                      timeout=60)


def header_of(buffers) -> dict:
    raw = to_bytes(buffers)
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n])


@pytest.mark.parametrize("case", ["no_metadata", "items_not_a_list", "no_items", "too_many", "item_out_of_range",
                                  "bad_name", "truncated", "json_not_items"])
def test_batch_body_that_is_not_a_batch_is_refused_whole_and_the_server_stays_up(server, client, contexts, case):
    q = np.ones((1, 4, 16), np.float32)
    ctx_id = contexts["short"][0]
    one = {"items": json.dumps([{"contexts": [ctx_id]}])}
    bodies = {
        "no_metadata": (to_bytes(encode_safetensors({"0.q": q})), 400, "invalid_body", "__metadata__"),
        "items_not_a_list": (to_bytes(encode_safetensors({"0.q": q}, {"items": "{}"})), 422, "invalid_option", "items"),
        "no_items": (to_bytes(encode_safetensors({}, {"items": "[]"})), 422, "invalid_option", "items"),
        "too_many": (to_bytes(encode_safetensors({"0.q": q}, {"items": json.dumps([{}] * 257)})), 422,
                     "invalid_option", "256"),
        "item_out_of_range": (to_bytes(encode_safetensors({"0.q": q, "1.q": q}, one)), 422, "invalid_tensor", "1.q"),
        "bad_name": (to_bytes(encode_safetensors({"q": q}, one)), 422, "invalid_tensor", "ITEM.NAME"),
        "truncated": (to_bytes(encode_batch([{"q": q, "contexts": [ctx_id]}]))[:-3], 400, "invalid_body", ""),
        "json_not_items": (json.dumps({"q": [[[1.0]]]}).encode(), 400, "invalid_body", "items"),
    }
    body, status, code, word = bodies[case]
    r = post(server, body, "application/json" if case.startswith("json") else BINARY)
    assert r.status_code == status, r.text
    assert r.json()["code"] == code and word in r.json()["detail"], r.json()
    out, _ = client.attention(q, contexts=[ctx_id])  # the server answers the next request
    assert out.shape == (1, 4, 8)


def test_batch_item_over_an_empty_context_goes_the_single_way(client, rng):
    k, v = kv(rng, 0)
    empty = client.create_context(k, v)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    (out, lse), = client.attention_batch([{"q": q, "contexts": [empty["id"]]}])
    alone = client.attention(q, contexts=[empty["id"]])  # alone too (this was a 500 before the batch work)
    assert np.array_equal(out, alone[0]) and np.array_equal(lse, alone[1])
    assert out.shape == (1, 4, 8) and not out.any() and np.all(np.isneginf(lse))  # attention over no keys
    client.delete_context(empty["id"])


def test_batch_answers_carry_the_item_statuses_in_safetensors(server, contexts):
    q = np.ones((1, 4, 16), np.float32)
    r = post(server, to_bytes(encode_batch([{"q": q, "contexts": [contexts["short"][0]]},
                                            {"q": q, "contexts": ["nope"]}])))
    assert r.status_code == 200
    statuses = json.loads(header_of([r.content])["__metadata__"]["items"])
    assert statuses[0] == {"status": 200} and statuses[1]["status"] == 404
    tensors = decode_safetensors(r.content, {"0.out", "0.lse"})
    assert tensors["0.out"].shape == (1, 4, 8) and tensors["0.lse"].shape == (1, 4)


def test_batch_answers_over_the_element_limit_are_refused_before_any_work(client, rng):
    # A context whose values are long rows: each item's q is small, its answer is not.
    ctx = client.create_context(np.ones((1, 1, 1), np.float32), np.ones((1, 1, 2**14), np.float32))["id"]
    try:
        small = np.ones((2, 1, 1), np.float32)
        answers = client.attention_batch([{"q": small, "contexts": [ctx]},
                                          {"q": np.ones((2**14 + 1, 1, 1), np.float32), "contexts": [ctx]}])
        assert answers[0][0].shape == (2, 1, 2**14)
        err = answers[1]
        assert isinstance(err, SplitkeyError) and (err.status, err.code) == (413, "body_too_large"), err
        assert err.detail.startswith("items[1]: ") and "answer out [n_q, h_q, d_v]" in err.detail
        # Each item within the limit, 2**27 + 2**27 + 2**27 elements in all: the whole batch is refused.
        third = {"q": np.ones((2**13, 1, 1), np.float32), "contexts": [ctx]}
        with pytest.raises(SplitkeyError) as whole:
            client.attention_batch([third] * 3)
        assert (whole.value.status, whole.value.code) == (413, "body_too_large")
        assert "got 402653184: send them in several batches" in whole.value.detail
    finally:
        client.delete_context(ctx)


def test_an_item_appends_its_keys_once_even_when_its_request_is_sent_again_and_is_answered_over_them(server):
    rng = np.random.default_rng(23)
    k, v = kv(rng, 40)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    with Client(server.url) as c:
        ctx, other = (c.create_context(k[:30], v[:30])["id"] for _ in range(2))
        try:
            item = {"q": q, "contexts": [ctx], "causal": True,
                    "append": {"k": k[30:], "v": v[30:], "after": 30, "upload": "step-30"}}
            [first] = c.attention_batch([item])
            [again] = c.attention_batch([item])  # as after a lost answer: stored once, answered again
            assert c.get_context(ctx)["length"] == 40
            assert_close_to_reference(*first, q, k, v)  # the query at position 39 sees all 40 keys
            assert np.array_equal(first[0], again[0])
            stale = {**item, "contexts": [other], "append": {**item["append"], "after": 20}}
            [refused, answered] = c.attention_batch([stale, {"q": q, "contexts": [other]}])
            assert isinstance(refused, SplitkeyError) and refused.status == 409 and refused.code == "length_mismatch"
            assert not isinstance(answered, SplitkeyError) and c.get_context(other)["length"] == 30
            body = {"items": [{"q": q.tolist(), "contexts": [other],
                               "append": {"k": k[30:].tolist(), "v": v[30:].tolist(), "after": 30}}]}
            answer = httpx.post(server.url + "/v1/attention/batch", json=body, timeout=30).json()["items"][0]
            assert "out" in answer and c.get_context(other)["length"] == 40
        finally:
            c.delete_context(ctx)
            c.delete_context(other)
