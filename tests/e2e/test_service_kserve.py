"""The Open Inference Protocol end to end: a real server, the real tritonclient.http, raw httpx for the edges."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from reference import assert_close_to_reference
from server import read_response
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from service.client import Client
from service.core import VERSION
from workers import BFLOAT16

pytestmark = pytest.mark.ray

DTYPES = [np.float16, BFLOAT16, np.float32, np.float64]
INFER = "/v2/models/attention/infer"
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "KSERVE.md"


@pytest.fixture(scope="module")
def tc(server):
    client = triton.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=120.0)
    yield client
    client.close()


def inputs(rng, n_q=4, h_q=8, h_kv=2, d=32, d_v=16, n_k=300, dtype=np.float32):
    return (rng.standard_normal((n_q, h_q, d)).astype(dtype), rng.standard_normal((n_k, h_kv, d)).astype(dtype),
            rng.standard_normal((n_k, h_kv, d_v)).astype(dtype))


def infer_inputs(binary=True, **tensors):
    """tritonclient inputs named as the contract's tensors."""
    out = []
    for name, a in tensors.items():
        t = triton.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
        t.set_data_from_numpy(a, binary_data=binary)
        out.append(t)
    return out


def run(tc, tensors, binary=True, binary_output=True, parameters=None):
    outputs = [triton.InferRequestedOutput(n, binary_data=binary_output) for n in ("out", "lse")]
    result = tc.infer("attention", infer_inputs(binary, **tensors), outputs=outputs, parameters=parameters)
    return result.as_numpy("out"), result.as_numpy("lse")


def post(server, header: dict, binary: bytes = b"", **headers) -> httpx.Response:
    body = json.dumps(header).encode()
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(body))
    return httpx.post(server.url + INFER, content=body + binary, headers=headers, timeout=60)


# -- health and metadata ---------------------------------------------------------------------

def test_health_and_model_readiness_answer_through_tritonclient(tc):
    assert tc.is_server_live() and tc.is_server_ready()
    assert tc.is_model_ready("attention") and tc.is_model_ready("attention", "1")
    assert not tc.is_model_ready("no-such-model")


def test_server_and_model_metadata_describe_the_attention_model(tc):
    assert tc.get_server_metadata() == {"name": "splitkey", "version": VERSION, "extensions": ["binary_tensor_data"]}
    meta = tc.get_model_metadata("attention")
    assert meta["name"] == "attention" and meta["versions"] == ["1"] and meta["platform"] == "splitkey"
    assert [t["name"] for t in meta["inputs"]] == ["q", "k", "v", "q_pos", "k_pos", "alibi_slopes"]
    assert [(t["name"], t["shape"]) for t in meta["outputs"]] == [("out", [-1, -1, -1]), ("lse", [-1, -1])]
    assert tc.get_model_metadata("attention", "1") == meta


# -- inference -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_binary_tensors_from_tritonclient_are_exact_for_each_dtype(tc, rng, dtype):
    q, k, v = inputs(rng, dtype=dtype)
    out, lse = run(tc, {"q": q, "k": k, "v": v})
    wide = np.float64 if dtype == np.float64 else np.float32
    assert out.dtype == wide and lse.dtype == wide and out.shape == (4, 8, 16) and lse.shape == (4, 8)
    assert_close_to_reference(out.reshape(4, 8, 16), lse.reshape(4, 8), q, k, v)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda t: np.dtype(t).name)
def test_json_tensors_and_json_outputs_are_exact(tc, rng, dtype):
    q, k, v = inputs(rng, n_q=2, n_k=40, dtype=dtype)
    out, lse = run(tc, {"q": q, "k": k, "v": v}, binary=False, binary_output=False)
    assert_close_to_reference(out.reshape(2, 8, 16), lse.reshape(2, 8), q, k, v)


def test_tritonclient_with_default_outputs_gets_binary_outputs(tc, rng):
    q, k, v = inputs(rng)
    result = tc.infer("attention", infer_inputs(q=q, k=k, v=v), request_id="req-7")
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_name"] == "attention"
    assert all("binary_data_size" in o["parameters"] for o in response["outputs"])
    assert_close_to_reference(result.as_numpy("out"), result.as_numpy("lse"), q, k, v)


@pytest.mark.parametrize(
    ("parameters", "opts"),
    [
        ({"causal": True}, {"causal": True}),
        ({"window": "100,0"}, {"window": (100, 0)}),
        ({"window": ",5", "causal": False}, {"window": (None, 5)}),
        ({"softcap": 5.0, "scale": 0.3}, {"softcap": 5.0, "scale": 0.3}),
        ({"causal": True, "window": "64,", "softcap": 20}, {"causal": True, "window": (64, None), "softcap": 20.0}),
    ],
    ids=["causal", "window", "window-right", "softcap-scale", "everything"],
)
def test_parameters_carry_every_option(tc, rng, parameters, opts):
    q, k, v = inputs(rng)
    out, lse = run(tc, {"q": q, "k": k, "v": v}, parameters=parameters)
    assert_close_to_reference(out, lse, q, k, v, **opts)


def test_positions_and_alibi_slopes_travel_as_tensors(tc, rng):
    q, k, v = inputs(rng)
    q_pos = np.array([10, 150, 299, 3], dtype=np.int64)
    k_pos = np.arange(300, dtype=np.int32)
    slopes = np.linspace(0.01, 0.2, 8).astype(np.float32)
    out, lse = run(tc, {"q": q, "k": k, "v": v, "q_pos": q_pos, "k_pos": k_pos, "alibi_slopes": slopes},
                   parameters={"causal": True})
    assert_close_to_reference(out, lse, q, k, v, causal=True, q_pos=q_pos, k_pos=k_pos, alibi_slopes=slopes)


def test_fully_masked_rows_are_negative_infinity_in_binary_and_null_in_json(server, tc, rng):
    q, k, v = inputs(rng, n_q=2, n_k=50)
    q_pos = np.array([-1, 49], dtype=np.int64)
    out, lse = run(tc, {"q": q, "k": k, "v": v, "q_pos": q_pos}, parameters={"causal": True})
    assert np.isneginf(lse[0]).all() and np.isfinite(lse[1]).all()
    assert_close_to_reference(out, lse, q, k, v, causal=True, q_pos=q_pos)
    doc = post(server, {"inputs": [{"name": n, "shape": list(a.shape), "datatype": np_to_triton_dtype(a.dtype),
                                    "data": a.reshape(-1).tolist()} for n, a in (("q", q), ("k", k), ("v", v),
                                                                               ("q_pos", q_pos))],
                        "parameters": {"causal": True}}).json()
    lse_json = next(o for o in doc["outputs"] if o["name"] == "lse")
    assert lse_json["data"][:8] == [None] * 8 and None not in lse_json["data"][8:]


def test_contexts_by_id_are_read_through_the_parameters(server, tc, rng):
    q, k, v = inputs(rng, n_k=600)
    with Client(server.url) as c:
        ctx = c.create_context(k, v)
    try:
        out, lse = run(tc, {"q": q}, parameters={"contexts": ctx["id"], "causal": True})
        assert_close_to_reference(out, lse, q, k, v, causal=True)
    finally:
        with Client(server.url) as c:
            c.delete_context(ctx["id"])


def test_raw_bfloat16_bits_over_httpx_match_tritonclient(server, tc, rng):
    q, k, v = inputs(rng, dtype=BFLOAT16)
    header = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "BF16",
                          "parameters": {"binary_data_size": a.nbytes}} for n, a in (("q", q), ("k", k), ("v", v))],
              "outputs": [{"name": "out", "parameters": {"binary_data": True}}]}
    r = post(server, header, b"".join(a.view(np.uint16).tobytes() for a in (q, k, v)))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream" and "total;dur=" in r.headers["server-timing"]
    n = int(r.headers["inference-header-content-length"])
    doc = json.loads(r.content[:n])
    assert [o["name"] for o in doc["outputs"]] == ["out"]
    out = np.frombuffer(r.content[n:], "<f4").reshape(4, 8, 16)
    expected, _ = run(tc, {"q": q, "k": k, "v": v})
    assert out.tobytes() == expected.tobytes()


def test_infer_is_timed_and_counted_in_the_metrics(server, tc, rng):
    q, k, v = inputs(rng, n_k=100)
    run(tc, {"q": q, "k": k, "v": v})
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for needle in ('route="/v2/models/attention/infer",stage="compute"',
                   'splitkey_requests_total{code="200",route="/v2/models/attention/infer"}'):
        assert needle in text, needle


def test_the_timeout_parameter_shortens_the_deadline(tc, rng):
    q, k, v = inputs(rng, n_k=2000)
    with pytest.raises(InferenceServerException) as info:
        tc.infer("attention", infer_inputs(q=q, k=k, v=v), timeout=1)  # one microsecond
    assert info.value.status() == "504" and "within its KServe timeout parameter of 1e-06 s" in info.value.message()


def test_the_timeout_header_shortens_the_deadline_too_and_a_bad_one_is_refused_naming_it(tc, rng):
    q, k, v = inputs(rng, n_k=2000)
    with pytest.raises(InferenceServerException) as info:
        tc.infer("attention", infer_inputs(q=q, k=k, v=v), headers={"X-Request-Timeout": "1e-6"})
    assert info.value.status() == "504" and "X-Request-Timeout" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        tc.infer("attention", infer_inputs(q=q, k=k, v=v), headers={"X-Request-Timeout": "-1"})
    assert info.value.status() == "422" and 'X-Request-Timeout must be a number of seconds > 0, got "-1"' in (
        info.value.message())
    out, lse = run(tc, {"q": q, "k": k, "v": v})  # and with time enough, the answer
    assert_close_to_reference(out, lse, q, k, v)


# -- errors ----------------------------------------------------------------------------------

def triton_error(tc, tensors, parameters=None, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        tc.infer("attention", infer_inputs(**tensors), parameters=parameters, **kwargs)
    return info.value


def test_client_mistakes_reach_tritonclient_as_4xx_with_the_detail(tc, rng):
    q, k, v = inputs(rng, n_k=20)
    err = triton_error(tc, {"q": q, "k": k, "v": v[:, :, :].reshape(20, 1, 32)})
    assert err.status() == "422" and "v must be [n_k, h_kv, d_v]" in err.message()
    err = triton_error(tc, {"q": q, "keys": k, "v": v})
    assert err.status() == "422" and "keys" in err.message()
    err = triton_error(tc, {"q": q.astype(np.int8), "k": k, "v": v})
    assert err.status() == "422" and "q datatype must be FP16, BF16, FP32, FP64, got \"INT8\"" in err.message()
    err = triton_error(tc, {"q": q, "k": k, "v": v}, parameters={"temperature": 0.7})
    assert err.status() == "422" and "temperature" in err.message()
    err = triton_error(tc, {"q": q}, parameters={"contexts": "ctx-that-does-not-exist"})
    assert err.status() == "404"
    err = triton_error(tc, {"q": q, "k": k, "v": v}, request_compression_algorithm="gzip")
    assert err.status() == "415" and "Content-Encoding" in err.message()


@pytest.mark.parametrize(
    ("change", "status", "code", "words"),
    [
        (lambda h, b: ({**h, "inputs": h["inputs"][:2] + [{**h["inputs"][2], "shape": [20, 2, 15]}]}, b),
         400, "invalid_body", "v parameters.binary_data_size must be"),
        (lambda h, b: (h, b[:-4]), 400, "invalid_body", "sum of binary_data_size"),
        (lambda h, b: ({**h, "inputs": [{**h["inputs"][0], "name": "query"}] + h["inputs"][1:]}, b),
         422, "invalid_tensor", "query"),
        (lambda h, b: ({**h, "inputs": [{**h["inputs"][0], "datatype": "UINT8"}] + h["inputs"][1:]}, b),
         422, "invalid_tensor", "q datatype"),
        (lambda h, b: ({**h, "inputs": [{**h["inputs"][0], "shape": [4, 8]}] + h["inputs"][1:]}, b),
         422, "invalid_tensor", "q must be [n_q, h_q, d]"),
        (lambda h, b: ({**h, "parameters": {"window": "ten,"}}, b), 422, "invalid_option", "window"),
    ],
    ids=["size-vs-shape", "short-binary", "unknown-input", "bad-datatype", "wrong-rank", "bad-window"],
)
def test_malformed_binary_requests_get_the_contract_code_and_an_error_key(server, rng, change, status, code, words):
    q, k, v = inputs(rng, n_k=20)
    header = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "FP32",
                          "parameters": {"binary_data_size": a.nbytes}} for n, a in (("q", q), ("k", k), ("v", v))]}
    header, binary = change(header, q.tobytes() + k.tobytes() + v.tobytes())
    r = post(server, header, binary)
    assert r.status_code == status, r.text
    doc = r.json()
    assert doc["code"] == code and words in doc["detail"] and doc["error"] == doc["detail"]


def test_bad_framing_is_refused_before_the_body_is_used(server):
    r = httpx.post(server.url + INFER, content=b'{"inputs": []}', timeout=30,
                   headers={"Inference-Header-Content-Length": "99"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_body"
    r = httpx.post(server.url + INFER, content=b'{"inputs": [', timeout=30)
    assert r.status_code == 400 and "valid JSON" in r.json()["error"]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {65 * 2**20}\r\n"
                     f"Inference-Header-Content-Length: 10\r\n\r\n".encode())
        head = read_response(sock)
    assert head.startswith("HTTP/1.1 413") and '"error"' in head and "body_too_large" in head
    assert httpx.get(server.url + "/v2/health/live").json() == {"live": True}


@pytest.mark.parametrize("path", [INFER, "/v2/models/attention/versions/1/infer"])
def test_url_query_parameters_are_refused_not_ignored(server, path):
    body = {"inputs": [{"name": n, "shape": [2, 1, 1], "datatype": "FP32", "data": d}
                       for n, d in (("q", [1, 1]), ("k", [1, 5]), ("v", [10, 20]))]}
    r = httpx.post(server.url + path + "?causal=true", json=body, timeout=30)  # causal goes in "parameters"
    assert r.status_code == 422 and r.json()["code"] == "invalid_option", r.text
    assert "query parameters must be absent from a KServe infer request" in r.json()["detail"]
    assert "causal=true" in r.json()["detail"]
    assert httpx.post(server.url + path, json=body, timeout=30).status_code == 200

# -- the examples of docs/KSERVE.md ----------------------------------------------------------

def doc_block(lang: str, marker: str) -> str:
    [block] = [b for b in re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.DOTALL) if marker in b]
    return block


def test_doc_tritonclient_example_runs_and_prints_what_it_says(server):
    code = doc_block("python", "tritonclient.http").replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    expected = re.search(r"# (\(.*)$", code.strip().splitlines()[-1]).group(1).strip()
    assert run.stdout.strip() == expected


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_doc_curl_example_answers_what_it_says(server):
    command, expected = doc_block("bash", "curl").split("\n# ")
    got = json.loads(subprocess.run(["bash", "-c", command.replace("http://127.0.0.1:8000", server.url)],
                                    capture_output=True, text=True, check=True, timeout=60).stdout)
    want = json.loads(expected)
    assert {k: v for k, v in got.items() if k != "outputs"} == {k: v for k, v in want.items() if k != "outputs"}
    for g, w in zip(got["outputs"], want["outputs"], strict=True):
        assert {**g, "data": None} == {**w, "data": None}
        assert g["data"] == pytest.approx(w["data"], rel=1e-6)
