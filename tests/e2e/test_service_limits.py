"""Limits and protection on a deliberately tight server: auth, 429, 504, 507, remote merges."""

import re
import threading
import time

import httpx
import numpy as np
import pytest
from reference import assert_close_to_reference
from server import Server

from service.client import Client, SplitkeyError
from service.core.errors import internals
from service.wire.safetensors import decode_safetensors, encode_safetensors, to_bytes

pytestmark = pytest.mark.ray

KEY = "s3cret-test-key"


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    home = tmp_path_factory.mktemp("tight-home")
    key_file = home / "key"
    home.mkdir(exist_ok=True)
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    srv = Server(home, args=("--workers", "4", "--api-key-file", str(key_file), "--max-inflight", "1",
                             "--request-timeout", "0.5", "--worker-memory-bytes", str(2**20)),
                 env={"SPLITKEY_WORKER_CPUS": "0.5", "SPLITKEY_MIN_SHARD_KEYS": "16", "SPLITKEY_REMOTE_MERGE_BYTES": "0",
                      "SPLITKEY_CONTEXT_SHARD_KEYS": "16"})
    srv.start(api_key=KEY)
    yield srv
    srv.stop()


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def test_missing_or_wrong_key_gets_401_and_probes_stay_open(tight):
    assert httpx.get(tight.url + "/healthz").status_code == 200
    assert httpx.get(tight.url + "/readyz").status_code == 200
    for headers in ({}, auth("wrong"), {"Authorization": KEY}):
        r = httpx.get(tight.url + "/v1/cluster", headers=headers)
        assert r.status_code == 401 and r.json()["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(tight.url + "/v1/cluster", headers=auth()).status_code == 200
    assert httpx.get(tight.url + "/metrics").status_code == 401
    assert httpx.get(tight.url + "/v1/limits").status_code == 401
    assert httpx.get(tight.url + "/v1/limits", headers=auth()).json()["max_body_bytes"] == 2 * 2**30


@pytest.mark.parametrize("content_type, what", [
    ("application/json", "a JSON request body (the JSON limit; safetensors bodies may be larger) must be at most "
                         "67108864 bytes"),
    ("application/octet-stream", "request body must be at most 2147483648 bytes"),
])
def test_a_body_over_its_limit_names_which_limit(tight, content_type, what):
    import socket

    from server import read_response

    declared = 64 * 2**20 + 1 if content_type == "application/json" else 2 * 2**30 + 1
    with socket.create_connection(("127.0.0.1", tight.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/attention HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: {content_type}\r\nContent-Length: {declared}\r\n\r\n".encode())
        answer = read_response(sock)
    assert answer.startswith("HTTP/1.1 413") and what in answer, answer


def test_remote_merge_tree_over_four_shards_is_exact_and_deterministic(tight):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((64, 4, 16)).astype(np.float32)
    k = rng.standard_normal((400, 2, 16)).astype(np.float32)
    v = rng.standard_normal((400, 2, 8)).astype(np.float32)
    with Client(tight.url, api_key=KEY) as c:
        out, lse = c.attention(q, k, v, causal=True)
        again = c.attention(q, k, v, causal=True)
    assert_close_to_reference(out, lse, q, k, v, causal=True)
    assert out.tobytes() == again[0].tobytes()


def test_capacity_error_is_507_and_leaves_nothing_behind(tight):
    rng = np.random.default_rng(4)
    with Client(tight.url, api_key=KEY) as c:
        k = rng.standard_normal((4096, 2, 64)).astype(np.float32)  # 4 MiB over 4 workers of 1 MiB: no room
        with pytest.raises(SplitkeyError) as err:
            c.create_context(k, k, shards=4)
        assert err.value.status == 507 and err.value.code == "insufficient_capacity"
        assert "budget" in err.value.detail
        assert c.list_contexts() == []
        assert c.cluster()["bytes_held"] == 0
        small = rng.standard_normal((64, 2, 64)).astype(np.float32)
        ctx = c.create_context(small, small)
        with pytest.raises(SplitkeyError) as err:
            c.append(ctx["id"], k, k)
        assert err.value.status == 507 and err.value.detail.startswith("the append does not fit: "), err.value.detail
        assert c.get_context(ctx["id"])["length"] == 64  # the failed append left the context as it was
        out, lse = c.attention(small[:1].repeat(2, axis=1), contexts=[ctx["id"]])
        assert_close_to_reference(out, lse, small[:1].repeat(2, axis=1), small, small)
        held = c.cluster()["bytes_held"]
        c.delete_context(ctx["id"])
        assert c.cluster()["bytes_held"] < held and c.list_contexts() == []


def fill(c: Client, h_kv: int, d: int) -> list[str]:
    """Contexts of ``[h_kv, d]`` float32 keys created until no worker has room for one of a single key
    (each size in turn until a 507: a create goes to the worker holding least, so a 507 means none fits)."""
    made = []
    for n in (1024, 64, 1):
        k = np.zeros((n, h_kv, d), np.float32)
        while True:
            try:
                made.append(c.create_context(k, k)["id"])
            except SplitkeyError as exc:
                assert exc.status == 507, exc
                break
    return made


def test_a_507_mid_generation_raises_a_backend_error_naming_its_cause(tight):
    """The workers fill up while a model generates over splitkey: the pass whose keys no longer fit raises a
    BackendError caused by the 507 (the step can be sent again once there is room), never a token."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from service.hf import ATTENTION, BackendError, SplitkeyCache

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(ATTENTION)
    ids = torch.randint(3, 64, (1, 14), generator=torch.Generator().manual_seed(1))
    with Client(tight.url, api_key=KEY) as c, SplitkeyCache(c, model.config) as cache:
        out = model(input_ids=ids, cache=cache, use_cache=True)
        fillers = fill(c, h_kv=2, d=8)
        try:
            with pytest.raises(BackendError, match=r"layer \d") as caught:
                for _ in range(2 * 16):  # a new page or shard well before then
                    out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
            cause = caught.value.__cause__
            assert cause.status == 507 and cause.code == "insufficient_capacity", cause
            with pytest.raises(BackendError, match="an earlier pass failed"):
                model(input_ids=ids[:, :1], cache=cache, use_cache=True)
        finally:
            for ctx in fillers:
                c.delete_context(ctx)
    with Client(tight.url, api_key=KEY) as c:
        assert c.list_contexts() == []


def metric(srv, series: str) -> float:
    """The value of one series of the server's /metrics (0 when it has none yet)."""
    text = httpx.get(srv.url + "/metrics", headers=auth()).text
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")), 0.0)


def test_body_and_answer_bytes_are_counted_under_their_own_routes(tight):
    rng = np.random.default_rng(8)
    k = rng.standard_normal((20, 2, 8)).astype(np.float32)
    created = 'splitkey_request_body_bytes_total{route="/v1/contexts"}'
    appended = 'splitkey_request_body_bytes_total{route="/v1/contexts/{id}/append"}'
    out_create = 'splitkey_response_body_bytes_total{route="/v1/contexts"}'
    with Client(tight.url, api_key=KEY) as c:
        ctx = c.create_context(k, k)["id"]
        before = {s: metric(tight, s) for s in (created, appended, out_create)}
        body = to_bytes(encode_safetensors({"k": k, "v": k}))
        r = httpx.post(f"{tight.url}/v1/contexts/{ctx}/append", content=body, timeout=30,
                       headers={**auth(), "Content-Type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        refused = httpx.post(tight.url + "/v1/contexts", content=body)  # no key: 401, answered before any route
        assert refused.status_code == 401
        assert metric(tight, appended) - before[appended] == len(body)  # an append's body, under the append route
        assert metric(tight, created) == before[created]
        assert metric(tight, out_create) - before[out_create] == len(refused.content)  # the 401's bytes count too
        c.delete_context(ctx)


def inflight(srv) -> float:
    """The server's ``splitkey_inflight_requests`` gauge."""
    text = httpx.get(srv.url + "/metrics", headers=auth()).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("splitkey_inflight_requests ")))


def test_a_second_request_while_one_works_gets_429_with_retry_after(tight):
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((1, 2, 8)).astype(np.float32), rng.standard_normal((50, 2, 8)).astype(np.float32)
    heavy = {"q": rng.standard_normal((512, 8, 64)).astype(np.float32),
             "k": rng.standard_normal((60000, 2, 64)).astype(np.float32)}
    heavy["v"] = heavy["k"]
    heavy_body = to_bytes(encode_safetensors(heavy))
    light_body = to_bytes(encode_safetensors({"q": q, "k": k, "v": k}))  # ready before the race starts
    headers = {**auth(), "Content-Type": "application/octet-stream"}

    def first(results):  # works until the 0.5 s deadline cuts it (504), holding the one slot meanwhile
        results["first"] = httpx.post(tight.url + "/v1/attention", content=heavy_body, timeout=30, headers=headers)

    # The second request must arrive within the first's 0.5 s: on a loaded machine it may come after
    # the 504 and be admitted. That proves nothing either way, so the race is run again (at most 4 times).
    with httpx.Client(timeout=30) as second:
        for _ in range(4):
            results: dict[str, httpx.Response] = {}
            t = threading.Thread(target=first, args=(results,))
            t.start()
            deadline = time.monotonic() + 20
            while inflight(tight) < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            r = second.post(tight.url + "/v1/attention", content=light_body, headers=headers)
            t.join()
            if r.status_code == 429:
                break
    # A path with no route is 404 whatever its prefix: it takes no slot, so it is never 429.
    miss = httpx.get(tight.url + "/v1/attentionXYZ", headers=auth())
    assert miss.status_code == 404, miss.text
    assert r.status_code == 429 and r.json()["code"] == "overloaded", r.text
    assert int(r.headers["retry-after"]) >= 1 and r.headers["x-request-id"] == r.json()["request_id"]
    assert internals(r.text) is None and internals(results["first"].text) is None  # the 504 too
    assert results["first"].status_code == 504


def test_a_request_still_sending_its_body_holds_no_slot(tight):
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((1, 2, 8)).astype(np.float32), rng.standard_normal((50, 2, 8)).astype(np.float32)
    body = to_bytes(encode_safetensors({"q": q, "k": k, "v": k}))
    started, second_answered = threading.Event(), threading.Event()

    def slow_body():
        yield body[:10]
        started.set()
        # The rest of the body follows once the second request has its answer: the first one holds
        # no slot meanwhile, and the second holds none afterwards (however slow the machine is).
        second_answered.wait(30)
        time.sleep(0.1)
        yield body[10:]

    results = {}

    def first():
        results["first"] = httpx.post(tight.url + "/v1/attention", content=slow_body(), timeout=30,
                                      headers={**auth(), "Content-Type": "application/octet-stream"})

    t = threading.Thread(target=first)
    t.start()
    started.wait(10)
    time.sleep(0.2)
    try:
        r = httpx.post(tight.url + "/v1/attention", content=body, timeout=30,
                       headers={**auth(), "Content-Type": "application/octet-stream"})
    finally:
        second_answered.set()
    t.join()
    # The one slot was free for the second request: it was admitted, not refused with 429. (Each
    # may still meet this server's 0.5 s deadline on a loaded machine: 504 is admitted work too.)
    assert r.status_code in (200, 504) and results["first"].status_code in (200, 504), (r.text, results["first"].text)
    if r.status_code == results["first"].status_code == 200:
        assert results["first"].content == r.content


def test_work_past_the_deadline_gets_504_and_the_server_stays_up(tight):
    rng = np.random.default_rng(6)
    q = rng.standard_normal((512, 8, 64)).astype(np.float32)
    k = rng.standard_normal((60000, 2, 64)).astype(np.float32)
    with Client(tight.url, api_key=KEY) as c:
        with pytest.raises(SplitkeyError) as err:
            c.attention(q, k, k)
        assert err.value.status == 504 and err.value.code == "deadline_exceeded"
    assert httpx.get(tight.url + "/healthz").status_code == 200


def test_kserve_paths_get_an_error_key_from_auth_and_admission(tight):
    r = httpx.post(tight.url + "/v2/models/attention/infer", json={"inputs": []})
    assert r.status_code == 401
    doc = r.json()
    assert doc["code"] == "unauthorized" and doc["error"] == doc["detail"]
    assert "error" not in httpx.get(tight.url + "/v1/cluster").json()


def test_an_answer_left_unread_counts_its_bytes_until_the_connection_is_aborted(tmp_path):
    """A client that never reads its answer: the bytes waiting to be sent count against the
    in-flight byte budget (new bodies get 429, not more memory) but hold no slot; with nothing
    read in --body-grace seconds the connection is aborted and the bytes freed."""
    srv = Server(tmp_path, args=("--workers", "1"),
                 env={"SPLITKEY_BODY_GRACE_S": "2", "SPLITKEY_MAX_INFLIGHT_BYTES": str(8 * 2**20),
                      "SPLITKEY_MAX_BODY_BYTES": str(4 * 2**20)}).start()
    try:
        q, k, v = large_answer(60000)  # out [60000, 2, 64]: 30.7 MB
        sock = answer_request(srv, q, k, v, rcvbuf=4096)
        t0 = time.monotonic()
        held = 0.0
        while time.monotonic() - t0 < 1.5 and held < 20e6:
            held = gauge(srv, "splitkey_inflight_body_bytes")
        assert held >= 20e6 and gauge(srv, "splitkey_inflight_requests") == 0, held  # bytes, but no slot
        r = httpx.post(srv.url + "/v1/attention", content=to_bytes(encode_safetensors({"q": q[:1], "k": k, "v": v})),
                       timeout=30, headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 429 and "request bodies in flight must stay within 8388608 bytes" in r.json()["detail"]
        deadline = time.monotonic() + 30
        while gauge(srv, "splitkey_inflight_body_bytes") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gauge(srv, "splitkey_inflight_body_bytes") == 0
        got = read_all(sock)
        assert got.startswith(b"HTTP/1.1 200") and len(got) < 30e6, len(got)  # aborted short of the answer
        assert "a client read 0 bytes of its answer in 2 s" in srv.log()
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'splitkey_rejected_requests_total{reason="slow_answer"} 1.0' in metrics
        with Client(srv.url) as c:
            out, lse = c.attention(q[:3], k, v)
        assert_close_to_reference(out, lse, q[:3], k, v)
    finally:
        srv.stop()


def test_an_answer_read_slowly_but_steadily_arrives_whole(tmp_path):
    srv = Server(tmp_path, args=("--workers", "1"), env={"SPLITKEY_BODY_GRACE_S": "1"}).start()
    try:
        q, k, v = large_answer(20000)  # out [20000, 2, 64]: 10.2 MB, read at about 3 MB/s
        sock = answer_request(srv, q, k, v, rcvbuf=65536)
        got = read_all(sock, chunk=32768, pause_s=0.01)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and len(body) == int(re.search(rb"content-length: (\d+)", head, re.I)[1])
        out = decode_safetensors(body, {"out", "lse"})
        assert_close_to_reference(np.array(out["out"]), np.array(out["lse"]), q, k, v)
        assert "connection aborted" not in srv.log()
        assert 'reason="slow_answer"' not in httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()


def large_answer(n_q: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [n_q, 2, 1], k [16, 1, 1], v [16, 1, 64]: a small body whose answer is n_q * 512 bytes."""
    rng = np.random.default_rng(10)
    return (rng.standard_normal((n_q, 2, 1)).astype(np.float32), rng.standard_normal((16, 1, 1)).astype(np.float32),
            rng.standard_normal((16, 1, 64)).astype(np.float32))


def answer_request(srv, q, k, v, *, rcvbuf: int):
    """A raw connection with a small receive buffer that has sent one attention request."""
    import socket

    body = to_bytes(encode_safetensors({"q": q, "k": k, "v": v}))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def read_all(sock, chunk: int = 2**16, pause_s: float = 0.0) -> bytes:
    """What arrives until the answer is whole (by its Content-Length), the server closes, or resets.

    Kept cheap per read (a bytearray, the head parsed once): a reader that copies its whole buffer
    at every read falls behind the pace it means to keep on a loaded machine."""
    sock.settimeout(30)
    got = bytearray()
    end = None  # bytes of the whole answer, once its head is in
    try:
        while data := sock.recv(chunk):
            got += data
            if end is None and (cut := got.find(b"\r\n\r\n")) >= 0:
                length = re.search(rb"content-length: (\d+)", bytes(got[:cut]), re.I)
                end = cut + 4 + int(length[1]) if length is not None else -1
            if end is not None and 0 <= end <= len(got):
                break
            time.sleep(pause_s)
    except ConnectionResetError:
        pass
    sock.close()
    return bytes(got)


def gauge(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_head_that_does_not_arrive_in_time_gets_408_and_idle_keep_alive_is_left_alone(tmp_path):
    import socket

    srv = Server(tmp_path, args=("--workers", "1"), env={"SPLITKEY_BODY_TIMEOUT_S": "2"}).start()
    try:
        silent = socket.create_connection(("127.0.0.1", srv.port))  # sends nothing at all
        trickle = socket.create_connection(("127.0.0.1", srv.port))
        kept = socket.create_connection(("127.0.0.1", srv.port))
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_all(kept_copy := kept.dup()).startswith(b"HTTP/1.1 200")  # read off a copy: kept stays open
        t0 = time.monotonic()
        for piece in (b"POST /v1/attention HTTP/1.1\r\n", b"Host: x\r\n", b"X-A: 1\r\n", b"X-B: 2\r\n", b"X-C: 3\r\n"):
            trickle.sendall(piece)
            time.sleep(0.6)
        for sock in (silent, trickle):
            answer = read_all(sock)
            assert answer.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in answer, answer[:200]
            assert b"the request line and headers must arrive within 2 s" in answer
        assert time.monotonic() - t0 < 10
        # Idle longer than the head's time between two requests: uvicorn's keep-alive (30 s) rules there.
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_all(kept).startswith(b"HTTP/1.1 200")
        kept_copy.close()
        assert httpx.get(srv.url + "/healthz").status_code == 200
    finally:
        srv.stop()
