"""Answers written as JSON text: bounded (``Limits.max_json_answer_elements``) before any work, and
written off the event loop in pieces (``service.wire.json_text``), so a large one neither takes
gigabytes nor stops the server answering others meanwhile."""

import json
import threading
import time

import httpx
import numpy as np
import pytest

from service.wire.rules import Limits
from service.wire.safetensors import decode_safetensors, encode_safetensors, to_bytes

LIMIT = Limits().max_json_answer_elements
SAFETENSORS = "application/octet-stream"


def tiny(n_q: int, h_q: int, d_v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A body of a few KB whose answer ``out [n_q, h_q, d_v]`` is large: one key, values of ``d_v``.
    Its exact answer is v's one row for every (query, head): softmax over one key is 1."""
    q = np.linspace(-1, 1, n_q * h_q, dtype=np.float32).reshape(n_q, h_q, 1)
    k = np.ones((1, 1, 1), np.float32)
    v = np.linspace(-2, 2, d_v, dtype=np.float32).reshape(1, 1, d_v)
    return q, k, v


def post(server, path: str, tensors: dict, accept: str | None, metadata: dict | None = None,
         timeout: float = 120) -> httpx.Response:
    headers = {"Content-Type": SAFETENSORS, **({"Accept": accept} if accept else {})}
    return httpx.post(server.url + path, content=to_bytes(encode_safetensors(tensors, metadata)), headers=headers,
                      timeout=timeout)


def test_a_json_answer_over_its_limit_is_refused_before_work_and_comes_whole_as_safetensors(server):
    q, k, v = tiny(64, 64, 513)  # out: 64 x 64 x 513 = 2101248 elements, over 2**21
    r = post(server, "/v1/attention", {"q": q, "k": k, "v": v}, "application/json")
    assert r.status_code == 413, r.text
    body = r.json()
    assert body["code"] == "body_too_large"
    assert f"JSON answer out [n_q, h_q, d_v] of at most {LIMIT} elements, got 2101248" in body["detail"]
    assert f"ask for {SAFETENSORS} (Accept)" in body["detail"]
    r = post(server, "/v1/attention", {"q": q, "k": k, "v": v}, None)  # safetensors, as the request
    assert r.status_code == 200, r.text
    out = decode_safetensors(r.content, {"out", "lse"})["out"]
    assert out.shape == (64, 64, 513)
    np.testing.assert_array_equal(out, np.broadcast_to(v[0, 0], out.shape))


def test_a_json_request_gets_the_same_refusal_by_default_and_its_answer_when_it_fits(server):
    q, k, v = tiny(64, 64, 513)
    doc = {"q": q.tolist(), "k": k.tolist(), "v": v.tolist()}
    r = httpx.post(server.url + "/v1/attention", json=doc, timeout=120)
    assert r.status_code == 413 and "JSON answer out" in r.json()["detail"], r.text
    q, k, v = tiny(4, 64, 513)  # within the limit: answered as JSON
    r = httpx.post(server.url + "/v1/attention", json={"q": q.tolist(), "k": k.tolist(), "v": v.tolist()},
                   timeout=120)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(np.array(r.json()["out"], np.float32), np.broadcast_to(v[0, 0], (4, 64, 513)))


def test_a_batch_whose_json_answers_are_over_the_limit_in_all_is_refused_whole(server):
    q, k, v = tiny(64, 64, 257)  # 1052672 elements each: two fit alone, not together
    tensors = {f"{i}.{name}": a for i in range(2) for name, a in (("q", q), ("k", k), ("v", v))}
    items = {"items": json.dumps([{}, {}])}  # each item's options: none
    r = post(server, "/v1/attention/batch", tensors, "application/json", items)
    assert r.status_code == 413, r.text
    assert f"JSON answers of at most {LIMIT} out elements in all" in r.json()["detail"]
    assert "got 2105344" in r.json()["detail"]
    r = post(server, "/v1/attention/batch", tensors, SAFETENSORS, items)
    assert r.status_code == 200, r.text
    got = decode_safetensors(r.content, {"0.out", "0.lse", "1.out", "1.lse"})
    for i in range(2):
        np.testing.assert_array_equal(got[f"{i}.out"], np.broadcast_to(v[0, 0], (64, 64, 257)))


@pytest.mark.parametrize("binary, how", [(False, "outputs"), (True, "outputs"), (True, "binary_data_output")])
def test_kserve_out_as_json_is_held_to_the_limit_and_binary_outputs_are_not(server, binary, how):
    q, k, v = tiny(64, 64, 513)
    header = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "FP32",
                          "parameters": {"binary_data_size": a.nbytes}} for n, a in (("q", q), ("k", k), ("v", v))]}
    if how == "outputs":
        header["outputs"] = [{"name": "out", "parameters": {"binary_data": binary}}]
    else:  # the request's default for every output
        header["parameters"] = {"binary_data_output": binary}
    head = json.dumps(header).encode()
    r = httpx.post(server.url + "/v2/models/attention/infer", content=head + q.tobytes() + k.tobytes() + v.tobytes(),
                   headers={"Inference-Header-Content-Length": str(len(head))}, timeout=120)
    if not binary:
        assert r.status_code == 413, r.text
        detail = r.json()["detail"]
        assert f"JSON answer out [n_q, h_q, d_v] of at most {LIMIT} elements, got 2101248" in detail
        # The advice is this route's: the format of a KServe output is asked for in the body, not by Accept.
        assert "outputs[].parameters.binary_data = true" in detail and "Accept" not in detail, detail
        return
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    outputs = json.loads(r.content[:n])["outputs"]
    assert outputs[0]["name"] == "out", outputs  # out's bytes come first
    out = np.frombuffer(r.content[n:n + outputs[0]["parameters"]["binary_data_size"]], "<f4").reshape(64, 64, 513)
    np.testing.assert_array_equal(out, np.broadcast_to(v[0, 0], out.shape))


def test_a_large_json_answer_is_written_while_the_server_answers_others(server):
    # 2**21 - 2**12 numbers: about 40 MB of JSON text and 1-3 s of writing on these machines. Written
    # in one json.dumps, even in a thread, it held the GIL, and so the event loop, for all of it.
    q, k, v = tiny(64, 64, 511)
    done: dict[str, float] = {}

    def big() -> None:
        t0 = time.perf_counter()
        r = post(server, "/v1/attention", {"q": q, "k": k, "v": v}, "application/json")
        assert r.status_code == 200 and len(r.content) > 2**24, r.text[:200]
        done["seconds"] = time.perf_counter() - t0

    probes: list[float] = []
    with httpx.Client(timeout=60) as probe:
        probe.get(server.url + "/healthz")
        worker = threading.Thread(target=big)
        worker.start()
        while worker.is_alive():
            t0 = time.perf_counter()
            assert probe.get(server.url + "/healthz").status_code == 200
            probes.append(time.perf_counter() - t0)
            time.sleep(0.01)
        worker.join()
    assert "seconds" in done and len(probes) > 5, (done, len(probes))
    # One probe waiting out the whole writing would take most of the request's time.
    assert max(probes) < 0.5 * done["seconds"], (max(probes), done["seconds"])
