"""POST /v1/attention end to end: a real uvicorn server, the real embedded Ray, real clients."""

import concurrent.futures
import json
import socket
import time

import httpx
import numpy as np
import pytest
from reference import assert_close_to_reference
from server import read_response

from service.client import Client, SplitkeyError
from service.client.timing import parse_server_timing
from service.wire.safetensors import decode_safetensors, encode_safetensors, to_bytes
from workers import BFLOAT16

pytestmark = pytest.mark.ray

DTYPES = [np.float16, BFLOAT16, np.float32, np.float64]


def inputs(rng, n_q=4, h_q=8, h_kv=2, d=32, d_v=16, n_k=1000, dtype=np.float32):
    return (rng.standard_normal((n_q, h_q, d)).astype(dtype), rng.standard_normal((n_k, h_kv, d)).astype(dtype),
            rng.standard_normal((n_k, h_kv, d_v)).astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_binary_body_is_exact_for_each_dtype(client, rng, dtype):
    q, k, v = inputs(rng, dtype=dtype)
    out, lse = client.attention(q, k, v)
    assert out.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert_close_to_reference(out, lse, q, k, v)


@pytest.mark.parametrize(
    "opts",
    [
        {"causal": True},
        {"causal": True, "q_pos": np.array([10, 500, 999, 3]), "k_pos": np.arange(1000) * 1},
        {"window": (100, 0)},
        {"window": (None, 5), "causal": False},
        {"softcap": 5.0, "scale": 0.3},
        {"alibi_slopes": np.linspace(0.01, 0.2, 8)},
        {"causal": True, "window": (64, None), "softcap": 20.0, "alibi_slopes": np.full(8, 0.05)},
    ],
    ids=["causal", "causal-positions", "window", "window-right", "softcap-scale", "alibi", "everything"],
)
def test_every_option_is_exact_through_http(client, rng, opts):
    q, k, v = inputs(rng)
    out, lse = client.attention(q, k, v, **opts)
    assert_close_to_reference(out, lse, q, k, v, **opts)


def test_mqa_and_gqa_shapes_are_exact(client, rng):
    for h_q, h_kv in ((8, 1), (8, 8), (12, 4)):
        q, k, v = inputs(rng, h_q=h_q, h_kv=h_kv, d=16, d_v=24, n_k=300)
        out, lse = client.attention(q, k, v, causal=True)
        assert_close_to_reference(out, lse, q, k, v, causal=True)


def test_json_body_is_exact_and_writes_null_lse_for_fully_masked_rows(server, rng):
    q, k, v = inputs(rng, n_q=3, n_k=200, dtype=np.float64)
    body = {"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "dtype": "float64", "causal": True,
            "q_pos": [-1, 50, 199]}
    r = httpx.post(server.url + "/v1/attention", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["lse"][0] == [None] * 8  # query at -1 sees no key under causal
    out = np.array(doc["out"])
    lse = np.array([[-np.inf if x is None else x for x in row] for row in doc["lse"]])
    assert_close_to_reference(out, lse, q, k, v, causal=True, q_pos=np.array([-1, 50, 199]))


def test_json_request_can_ask_for_a_safetensors_answer(server, rng):
    q, k, v = inputs(rng, n_k=100)
    body = {"q": q.tolist(), "k": k.tolist(), "v": v.tolist()}
    r = httpx.post(server.url + "/v1/attention", json=body, headers={"Accept": "application/octet-stream"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    res = decode_safetensors(r.content, {"out", "lse"})
    assert_close_to_reference(res["out"], res["lse"], q, k, v)


def test_binary_request_with_query_options_and_json_answer(server, rng):
    q, k, v = inputs(rng, n_k=700)
    body = to_bytes(encode_safetensors({"q": q, "k": k, "v": v}))
    r = httpx.post(server.url + "/v1/attention?causal=true&window=128,&softcap=30", content=body,
                   headers={"Content-Type": "application/vnd.safetensors", "Accept": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert_close_to_reference(np.array(doc["out"]), np.array(doc["lse"]), q, k, v, causal=True,
                              window=(128, None), softcap=30.0)


@pytest.mark.parametrize("route", ["/v1/attention", "/v1/attention/batch"])
@pytest.mark.parametrize("query", ["scale=0.5", "foo=1", "scale=abc"])
def test_query_parameters_beside_a_body_that_carries_the_options_are_422(server, route, query):
    """A JSON body (and any batch) carries its options: a URL option would be ignored, so it is refused."""
    one = {"q": [[[1.0, 2.0]]], "k": [[[1.0, 0.0]], [[0.0, 1.0]]], "v": [[[1.0]], [[2.0]]]}
    body = one if route == "/v1/attention" else {"items": [one]}
    r = httpx.post(f"{server.url}{route}?{query}", json=body, timeout=30)
    assert r.status_code == 422 and r.json()["code"] == "invalid_option", r.text
    assert query.split("=")[0] in r.json()["detail"] and "query parameters" in r.json()["detail"]
    if route.endswith("batch"):
        binary = {"Content-Type": "application/octet-stream"}
        r = httpx.post(f"{server.url}{route}?{query}", content=b"not read", headers=binary, timeout=30)
        assert r.status_code == 422 and r.json()["code"] == "invalid_option", r.text
    assert httpx.post(f"{server.url}{route}", json=body, timeout=30).status_code == 200


def test_thirty_two_concurrent_requests_are_all_exact(server):
    rng = np.random.default_rng(7)
    cases = [inputs(rng, n_q=int(rng.integers(1, 6)), n_k=int(rng.integers(1, 3000))) for _ in range(32)]

    def one(case):
        with Client(server.url) as c:
            return c.attention(*case, causal=True)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, cases))
    for (q, k, v), (out, lse) in zip(cases, results):
        assert_close_to_reference(out, lse, q, k, v, causal=True)


def test_the_same_request_five_times_is_bitwise_identical(client, rng):
    q, k, v = inputs(rng, n_k=5000)
    first = client.attention(q, k, v, causal=True)
    for _ in range(4):
        again = client.attention(q, k, v, causal=True)
        assert again[0].tobytes() == first[0].tobytes() and again[1].tobytes() == first[1].tobytes()


def test_large_prefill_states_merge_on_the_workers_and_stay_exact(server, rng):
    # 8 shards of a 256-query prefill: the states exceed the remote-merge threshold
    # only in the dedicated server below; here we check the local tree with many shards.
    q, k, v = inputs(rng, n_q=256, h_q=4, h_kv=2, d=16, d_v=16, n_k=2048)
    with Client(server.url) as c:
        out, lse = c.attention(q, k, v, causal=True)
    assert_close_to_reference(out, lse, q, k, v, causal=True)


def test_server_timing_header_names_every_stage(server, rng):
    q, k, v = inputs(rng, n_k=100)
    r = httpx.post(server.url + "/v1/attention", content=to_bytes(encode_safetensors({"q": q, "k": k, "v": v})),
                   headers={"Content-Type": "application/octet-stream"}, timeout=60)
    stages = parse_server_timing(r.headers["server-timing"])
    assert {"parse", "scatter", "compute", "worker", "merge", "encode", "total"} <= set(stages), stages
    assert "lookup" not in stages  # no contexts named: nothing to look up
    assert 0 < stages["worker"] <= stages["compute"], stages  # the workers' own pass, within compute


@pytest.mark.parametrize(
    ("content_type", "body", "status", "code", "words"),
    [
        ("application/json", b"{not json", 400, "invalid_body", "JSON"),
        ("text/plain", b"hello", 415, "unsupported_media_type", "text/plain"),
        ("application/json", json.dumps({"q": [[[1.0]]], "k": [[[1.0]]], "v": [[[1.0]], [[2.0]]]}).encode(), 422,
         "invalid_tensor", "v must be"),
        ("application/json", json.dumps({"q": [[[1.0]]], "k": [[[1.0]]], "v": [[[1.0]]], "causal": 1}).encode(), 422,
         "invalid_option", "causal"),
        ("application/json", json.dumps({"q": [[[1.0, 2.0]]], "k": [[[1.0]]], "v": [[[1.0]]]}).encode(), 422,
         "invalid_tensor", "k must have head dim d = 2"),
        ("application/json", json.dumps({"q": [[[1.0]]], "k": [[[1.0]]], "v": [[[1.0]]], "window": [-1, 0]}).encode(),
         422, "invalid_option", "window"),
        ("application/json", json.dumps({"q": [[[1.0]]], "contexts": ["ctx_nope"]}).encode(), 404,
         "context_not_found", "ctx_nope"),
        ("application/octet-stream", b"\x05\x00", 400, "invalid_body", "safetensors"),
    ],
    ids=["bad-json", "media-type", "shape", "causal-int", "head-dim", "window", "unknown-context", "truncated"],
)
def test_client_mistakes_get_4xx_naming_the_field(server, content_type, body, status, code, words):
    r = httpx.post(server.url + "/v1/attention", content=body, headers={"Content-Type": content_type}, timeout=30)
    assert r.status_code == status, r.text
    doc = r.json()
    assert doc["code"] == code
    assert words.lower() in doc["detail"].lower()


def test_non_finite_inputs_are_refused(client):
    q = np.ones((1, 1, 4), np.float32)
    k = np.ones((3, 1, 4), np.float32)
    k[1, 0, 2] = np.nan
    with pytest.raises(SplitkeyError, match="k must be finite") as err:
        client.attention(q, k, np.ones((3, 1, 4), np.float32))
    assert (err.value.status, err.value.code) == (422, "invalid_tensor")


def test_default_query_positions_end_one_past_negative_key_positions(server):
    body = {"q": [[[1.0]], [[1.0]], [[1.0]]], "k": [[[1.0]]], "v": [[[5.0]]], "k_pos": [-5], "causal": True}
    r = httpx.post(f"{server.url}/v1/attention", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"out": [[[0.0]], [[0.0]], [[5.0]]], "lse": [[None], [None], [1.0]]}


def test_default_positions_past_the_range_are_named_as_defaults_not_as_what_the_client_sent(client):
    """docs/API.md section 2: the default q_pos ends one past the largest key position, and inline keys
    without k_pos continue after the contexts'; past 2**61 the 422 names the default (the client sent
    no such tensor, and sending one is the way out)."""
    q, k = np.ones((1, 1, 4), np.float32), np.ones((1, 1, 4), np.float32)
    q2 = np.ones((2, 1, 4), np.float32)
    bottom, top = np.array([-(2**61)]), np.array([2**61])
    with pytest.raises(SplitkeyError) as err:
        client.attention(q2, k, k, k_pos=bottom)  # the default q_pos would be [-2**61 - 1, -2**61]
    assert (err.value.status, err.value.code) == (422, "invalid_tensor")
    assert err.value.detail.startswith("the default q_pos (ending one past the largest key position) must lie "
                                       "within +-2**61"), err.value.detail
    out, _ = client.attention(q2, k, k, k_pos=bottom, q_pos=np.array([-(2**61), 0]))  # sent: served
    np.testing.assert_array_equal(out, np.ones((2, 1, 4), np.float32))
    ctx = client.create_context(k, k, k_pos=top)["id"]
    try:
        for q_pos in (None, top):  # inline keys from 2**61 + 1 (and so the default q_pos): the keys are named
            with pytest.raises(SplitkeyError) as err:
                client.attention(q, k, k, contexts=[ctx], q_pos=q_pos)
            assert err.value.detail.startswith("the default k_pos of the inline keys must lie within +-2**61"), \
                err.value.detail
        with pytest.raises(SplitkeyError) as err:
            client.attention(q, k, k, contexts=[ctx], q_pos=top, k_pos=top + 1)
        assert err.value.detail.startswith("k_pos must lie within +-2**61"), err.value.detail
    finally:
        client.delete_context(ctx)


@pytest.mark.parametrize("case", ["tiny_softcap", "huge_scale", "huge_q_and_k", "every_score_below_float32"])
def test_scores_beyond_float32_are_refused_not_answered_nan(client, case):
    """Scores past float32's range either way: towards +inf the state is NaN; towards -inf on every key a
    row sees, the row read as one that saw no key (out 0, lse -inf) before 2026-12-06."""
    q = np.array([[[1.0, 2.0]]], np.float32)
    k = np.array([[[1.0, 0.0]], [[0.0, 1.0]]], np.float32)
    v = np.array([[[1.0]], [[2.0]]], np.float32)
    opts = {"tiny_softcap": dict(softcap=1e-39), "huge_scale": dict(scale=3.4e38), "huge_q_and_k": {},
            "every_score_below_float32": {}}[case]
    if case in ("huge_q_and_k", "every_score_below_float32"):
        q, k = q * np.float32(1e20 if case == "huge_q_and_k" else -1e20), k * np.float32(1e20)
    with pytest.raises(SplitkeyError, match="within the float32 range") as err:
        client.attention(q, k, v, **opts)
    assert (err.value.status, err.value.code) == (422, "invalid_tensor")
    ctx = client.create_context(k, v)["id"]
    answers = client.attention_batch([{"q": q, "contexts": [ctx], **opts}, {"q": q * 0, "contexts": [ctx]}])
    client.delete_context(ctx)
    assert isinstance(answers[0], SplitkeyError) and answers[0].status == 422, answers[0]
    out, _ = answers[1]
    np.testing.assert_allclose(out[0, 0], [1.5], rtol=1e-6)
    out, lse = client.attention(q.astype(np.float64), k, v, **opts)  # float64 holds these scores
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_values_whose_weighted_sum_passes_float32_are_refused_not_answered_inf(client):
    # Equal scores over 4096 keys of v = 1e36: the exact out is 1e36, but the sum in acc is 4e39.
    q = np.zeros((1, 1, 2), np.float32)
    k = np.ones((4096, 1, 2), np.float32)
    v = np.full((4096, 1, 1), 1e36, np.float32)
    with pytest.raises(SplitkeyError, match="values v so large that their weighted sum passed it") as err:
        client.attention(q, k, v)
    assert (err.value.status, err.value.code) == (422, "invalid_tensor")
    out, _ = client.attention(q.astype(np.float64), k, v)  # float64 holds the sum
    np.testing.assert_allclose(out, np.full((1, 1, 1), 1e36), rtol=1e-6)


def test_non_finite_alibi_slopes_over_a_context_are_422_not_a_worker_failure(client):
    ctx = client.create_context(np.ones((8, 1, 4), np.float32), np.ones((8, 1, 4), np.float32))
    slopes = np.array([np.nan], np.float32)
    with pytest.raises(SplitkeyError, match="alibi_slopes must be finite") as err:
        client.attention(np.ones((1, 1, 4), np.float32), contexts=[ctx["id"]], alibi_slopes=slopes)
    assert (err.value.status, err.value.code) == (422, "invalid_tensor")  # a tensor's values, as q's
    with pytest.raises(SplitkeyError, match=r"alibi_slopes must have shape \[1\]") as err:
        client.attention(np.ones((1, 1, 4), np.float32), contexts=[ctx["id"]], alibi_slopes=np.ones(2, np.float32))
    assert (err.value.status, err.value.code) == (422, "invalid_tensor")
    client.delete_context(ctx["id"])


def test_body_over_the_limit_gets_413_from_content_length_and_from_chunks(server):
    # A raw socket: declare 65 MiB and send none of it; the answer must come from the header alone.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                     b"Content-Length: " + str(65 * 2**20).encode() + b"\r\n\r\n")
        head = read_response(sock)
    assert head.startswith("HTTP/1.1 413") and "body_too_large" in head

    def chunks():
        for _ in range(70):
            yield b"\0" * 2**20

    r = httpx.post(server.url + "/v1/attention", content=chunks(), headers={"Content-Type": "application/octet-stream"},
                   timeout=60)
    assert r.status_code == 413 and "chunked" in r.json()["detail"]
    assert httpx.get(server.url + "/healthz").status_code == 200


def test_a_request_head_over_its_limit_gets_431_and_the_connection_closes(server):
    from service.http_protocol import MAX_HEAD_BYTES

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /v1/limits HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        try:
            while sent < 8 * MAX_HEAD_BYTES:  # one header that never ends; the answer comes before all of it
                sock.sendall(b"a" * 4096)
                sent += 4096
        except OSError:
            pass  # the server closed the connection: what the answer below says
        head = read_response(sock)
    assert head.startswith("HTTP/1.1 431 Request Header Fields Too Large"), head[:200]
    assert "connection: close" in head.lower() and "x-request-id:" in head.lower()
    body = json.loads(head.partition("\r\n\r\n")[2])
    assert body["code"] == "header_too_large" and body["request_id"]
    assert body["detail"].startswith(f"the request line and headers must be at most {MAX_HEAD_BYTES} bytes, got ")
    # A head that ends in the read it began in is measured whole: a header or a request line over
    # the limit, sent in one write, or in pieces whose last one ends it.
    big_header = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 2048) + b"\r\n\r\n"
    big_line = b"GET /healthz?" + b"a" * (MAX_HEAD_BYTES + 2048) + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    for head, pieces in ((big_header, 1), (big_line, 1), (big_header, 17)):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            step = -(-len(head) // pieces)
            for i in range(0, len(head), step):
                sock.sendall(head[i:i + step])
                time.sleep(0.005 if pieces > 1 else 0)
            answer = read_response(sock)
        assert answer.startswith("HTTP/1.1 431 "), (pieces, answer[:300])
        assert json.loads(answer.partition("\r\n\r\n")[2])["code"] == "header_too_large"
    # A head under the limit is served, and on a kept connection a request whose head and body come
    # in one read is not counted against the next one's head.
    r = httpx.get(server.url + "/v1/limits", headers={"X-Big": "a" * (MAX_HEAD_BYTES - 1024)})
    assert r.status_code == 200
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 2, 8)).astype(np.float32), rng.standard_normal((8000, 2, 8)).astype(np.float32)
    body_bytes = to_bytes(encode_safetensors({"q": q, "k": k, "v": k}))  # 512 KB, well over the head limit
    request = (b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
               b"Accept: application/json\r\nContent-Length: " + str(len(body_bytes)).encode() + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        for _ in range(3):
            sock.sendall(request + body_bytes)
            assert read_response(sock).startswith("HTTP/1.1 200")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).startswith("HTTP/1.1 200")


def test_shapes_declared_beyond_the_body_are_refused_before_allocation(server):
    header = json.dumps({"q": {"dtype": "F32", "shape": [100000, 100000, 1000], "data_offsets": [0, 16]}}).encode()
    body = len(header).to_bytes(8, "little") + header + b"\0" * 16
    r = httpx.post(server.url + "/v1/attention", content=body, headers={"Content-Type": "application/octet-stream"})
    # The offsets cannot hold the declared shape: a malformed body (400), found from the header alone.
    assert r.status_code == 400 and r.json()["code"] == "invalid_body"
    assert "q data_offsets must span prod(shape) * itemsize = 40000000000000 bytes" in r.json()["detail"]


def test_operations_endpoints(server, client, rng):
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/readyz").json()
    assert ready["ready"] and ready["alive"] == 2
    cluster = httpx.get(server.url + "/v1/cluster").json()
    assert len(cluster["workers"]) == 2 and cluster["device"] == "cpu" and len(cluster["nodes"]) == 1
    client.attention(*inputs(rng, n_k=300))
    text = httpx.get(server.url + "/metrics").text
    for needle in ('splitkey_request_stage_seconds_bucket{le="0.001",route="/v1/attention",stage="compute"}',
                   'splitkey_requests_total{code="200",route="/v1/attention"}', "splitkey_inflight_requests",
                   'splitkey_workers{state="alive"} 2.0', "splitkey_request_body_bytes_total"):
        assert needle in text, needle
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/attention" in spec["paths"] and "422" in spec["paths"]["/v1/attention"]["post"]["responses"]


def test_an_answer_over_the_element_limit_is_refused_before_any_work(client):
    # q and v are each small; out [n_q, h_q, d_v] would be 2**28 + 16384 elements (1 GiB of float32).
    q = np.ones((2**14 + 1, 1, 1), np.float32)
    k, v = np.ones((1, 1, 1), np.float32), np.ones((1, 1, 2**14), np.float32)
    with pytest.raises(SplitkeyError) as err:
        client.attention(q, k, v)
    assert (err.value.status, err.value.code) == (413, "body_too_large")
    assert "answer out [n_q, h_q, d_v] of at most 268435456 elements, got 268451840" in err.value.detail
    out, _ = client.attention(q[:4], k, v)  # the server is up and answers what fits
    assert out.shape == (4, 1, 2**14)
