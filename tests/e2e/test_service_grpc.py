"""The KServe v2 gRPC protocol end to end: `splitkey serve --grpc-port` with the real tritonclient.grpc."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from reference import assert_close_to_reference
from server import Server
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from service.client import Client
from service.core import VERSION
from workers import BFLOAT16

pytestmark = pytest.mark.ray

KEY = "grpc-test-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def grpc_server(tmp_path_factory):
    """A server with the gRPC port open and a key set (so auth is tested on both transports)."""
    home = tmp_path_factory.mktemp("grpc-server")
    key_file = home / "key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    srv = Server(home, args=("--workers", "2", "--api-key-file", str(key_file)), grpc=True,
                 env={"SPLITKEY_CONTEXT_SHARD_KEYS": "128"})
    srv.start(api_key=KEY)
    srv.grpc = f"127.0.0.1:{srv.grpc_port}"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tc(grpc_server):
    client = triton.InferenceServerClient(grpc_server.grpc)
    yield client
    client.close()


def infer_inputs(**tensors):
    out = []
    for name, a in tensors.items():
        t = triton.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def infer(tc, parameters=None, headers=AUTH, **tensors):
    outputs = [triton.InferRequestedOutput(n) for n in ("out", "lse")]
    result = tc.infer("attention", infer_inputs(**tensors), outputs=outputs, parameters=parameters, headers=headers)
    return result.as_numpy("out"), result.as_numpy("lse")


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64], ids=lambda t: np.dtype(t).name)
def test_grpc_answers_are_exact_and_bitwise_the_http_answers(grpc_server, tc, rng, dtype):
    q = rng.standard_normal((3, 8, 16)).astype(dtype)
    k = rng.standard_normal((300, 2, 16)).astype(dtype)
    v = rng.standard_normal((300, 2, 8)).astype(dtype)
    with Client(grpc_server.url, api_key=KEY) as c:
        ctx = c.create_context(k[:200], v[:200])["id"]
        want = c.attention(q, k[200:], v[200:], contexts=[ctx], causal=True, window=(50, None))
        out, lse = infer(tc, parameters={"contexts": ctx, "causal": True, "window": "50,"}, q=q, k=k[200:], v=v[200:])
        c.delete_context(ctx)
    assert np.array_equal(out, want[0]) and np.array_equal(lse, want[1])
    assert_close_to_reference(out, lse, q, k, v, causal=True, window=(50, None))
    out, lse = infer(tc, q=q, k=k, v=v, q_pos=np.arange(297, 300))
    assert_close_to_reference(out, lse, q, k, v, q_pos=np.arange(297, 300))


def test_grpc_health_is_open_and_metadata_describes_the_model(tc):
    assert tc.is_server_live() and tc.is_server_ready()
    assert tc.is_model_ready("attention", headers=AUTH) and tc.is_model_ready("attention", "1", headers=AUTH)
    assert not tc.is_model_ready("other", headers=AUTH) and not tc.is_model_ready("attention", "2", headers=AUTH)
    meta = tc.get_model_metadata("attention", headers=AUTH, as_json=True)
    assert meta["name"] == "attention" and [t["name"] for t in meta["inputs"]][:3] == ["q", "k", "v"]
    # The same as GET /v2 (test_service_kserve.py): the release, and the extensions over gRPC too.
    assert tc.get_server_metadata(headers=AUTH, as_json=True) == {"name": "splitkey", "version": VERSION,
                                                                  "extensions": ["binary_tensor_data"]}


def test_grpc_metadata_of_another_model_version_is_not_found(tc):
    with pytest.raises(InferenceServerException) as info:
        tc.get_model_metadata("attention", "2", headers=AUTH)
    assert info.value.status() == "StatusCode.NOT_FOUND" and "'2'" in info.value.message()


@pytest.mark.parametrize("rpc", ["ModelMetadata", "ModelReady", "ServerMetadata"])
@pytest.mark.parametrize("token", [None, "wrong-key"])
def test_grpc_metadata_without_the_key_is_unauthenticated_as_over_http(grpc_server, rpc, token):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = {"ModelMetadata": service_pb2.ModelMetadataRequest(name="attention"),
               "ModelReady": service_pb2.ModelReadyRequest(name="attention"),
               "ServerMetadata": service_pb2.ServerMetadataRequest()}[rpc]
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(grpc_server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, rpc)(request, metadata=metadata)
    err = info.value
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "Authorization" in err.details()
    assert dict(err.trailing_metadata())["splitkey-code"] == "unauthorized" and "service." not in err.details()
    assert httpx.get(grpc_server.url + {"ModelMetadata": "/v2/models/attention", "ModelReady": "/v2/models/attention/ready",
                                        "ServerMetadata": "/v2"}[rpc], timeout=10).status_code == 401


def test_a_grpc_call_without_the_key_is_refused_before_its_message_is_read(grpc_server):
    """A 256 MB ModelInfer without the key: UNAUTHENTICATED, and the server never holds the message
    (gRPC read a unary call's whole message before the method ran, where the key was checked)."""
    import threading

    import grpc
    import psutil

    front_end = psutil.Process(grpc_server.proc.pid)
    before, peak, done = front_end.memory_info().rss, [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], front_end.memory_info().rss)
            done.wait(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelInferRequest(model_name="attention",
                                            raw_input_contents=[b"\x00" * (256 * 2**20)]).SerializeToString()
    try:
        with grpc.insecure_channel(grpc_server.grpc, options=[("grpc.max_send_message_length", -1)]) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            for metadata in ((), (("authorization", "Bearer wrong-key"),)):
                with pytest.raises(grpc.RpcError) as info:
                    call(message, metadata=metadata, timeout=60)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
                assert "Authorization" in info.value.details()
                assert dict(info.value.trailing_metadata())["splitkey-code"] == "unauthorized"
    finally:
        done.set()
        watcher.join()
    assert peak[0] - before < 64 * 2**20, (before, peak[0])  # it held 1.6 GB after two such calls before
    metrics = httpx.get(grpc_server.url + "/metrics", headers=AUTH, timeout=10).text
    assert 'splitkey_requests_total{code="401",route="grpc:ModelInfer"}' in metrics


@pytest.mark.parametrize("case, status, word", [
    ("no_key", "StatusCode.UNAUTHENTICATED", ""),
    ("unknown_context", "StatusCode.NOT_FOUND", "ctx_nope"),
    ("bad_shape", "StatusCode.INVALID_ARGUMENT", "q"),
    ("bad_option", "StatusCode.INVALID_ARGUMENT", "causal"),
    ("typed_contents", "StatusCode.INVALID_ARGUMENT", "inputs[0] (q) must travel in raw_input_contents"),
    ("class_count", "StatusCode.INVALID_ARGUMENT", "classification"),  # refused as over HTTP, not ignored
    ("other_model", "StatusCode.NOT_FOUND", "model_name must be attention"),
    ("other_version", "StatusCode.NOT_FOUND", 'version "2"'),
])
def test_grpc_errors_have_the_status_and_message_and_the_server_stays_up(grpc_server, tc, rng, case, status, word):
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    k = rng.standard_normal((10, 2, 16)).astype(np.float32)
    calls = {
        "no_key": lambda: infer(tc, headers={}, q=q, k=k, v=k),
        "unknown_context": lambda: infer(tc, parameters={"contexts": "ctx_nope"}, q=q),
        "bad_shape": lambda: infer(tc, q=q[0], k=k, v=k),
        "bad_option": lambda: infer(tc, parameters={"causal": "maybe"}, q=q, k=k, v=k),
        "typed_contents": lambda: tc.infer("attention", [_typed_input(q)], headers=AUTH),
        "class_count": lambda: tc.infer("attention", infer_inputs(q=q, k=k, v=k), headers=AUTH,
                                        outputs=[triton.InferRequestedOutput("out", class_count=2)]),
        "other_model": lambda: tc.infer("other", infer_inputs(q=q, k=k, v=k), headers=AUTH),
        "other_version": lambda: tc.infer("attention", infer_inputs(q=q, k=k, v=k), model_version="2", headers=AUTH),
    }
    with pytest.raises(InferenceServerException) as info:
        calls[case]()
    assert info.value.status() == status, info.value
    assert word in info.value.message()
    out, _ = infer(tc, q=q, k=k, v=k)  # answered after the error
    assert out.shape == (1, 4, 16)



def test_a_grpc_call_past_its_timeout_parameter_is_told_that_limit(grpc_server, tc, rng):
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2000, 2, 16)).astype(np.float32)
    with pytest.raises(InferenceServerException) as info:
        tc.infer("attention", infer_inputs(q=q, k=k, v=k), headers=AUTH, timeout=1)  # one microsecond
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED", info.value
    assert "within its KServe timeout parameter of 1e-06 s" in info.value.message()

def _typed_input(q):
    t = triton.InferInput("q", list(q.shape), "FP32")
    t._get_tensor().contents.fp32_contents.extend(q.reshape(-1).tolist())
    return t


def test_grpc_requests_are_counted_with_the_http_ones(grpc_server, tc, rng):
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    infer(tc, q=q, k=q.reshape(4, 1, 16)[:, :, :], v=q.reshape(4, 1, 16))
    text = httpx.get(grpc_server.url + "/metrics", headers=AUTH, timeout=10).text
    assert 'splitkey_requests_total{code="200",route="grpc:ModelInfer"}' in text


def test_grpc_error_names_its_contract_code_and_request_id_in_trailing_metadata(grpc_server, rng):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name="attention")
    q = req.inputs.add()
    q.name, q.datatype = "q", "FP32"
    q.shape.extend([1, 4, 16])
    req.raw_input_contents.append(np.ones((1, 4, 16), np.float32).tobytes())
    req.parameters["contexts"].string_param = "ctx_missing"
    with grpc.insecure_channel(grpc_server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(req, metadata=(("authorization", f"Bearer {KEY}"), ("x-request-id", "grpc-rid-1")))
    err = info.value
    trailing = dict(err.trailing_metadata())
    assert err.code() == grpc.StatusCode.NOT_FOUND and "ctx_missing" in err.details()
    assert trailing["splitkey-code"] == "context_not_found" and trailing["x-request-id"] == "grpc-rid-1"


def test_grpc_calls_for_a_model_not_served_name_route_not_found_as_http_does(grpc_server):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    auth = (("authorization", f"Bearer {KEY}"),)
    calls = [("ModelInfer", service_pb2.ModelInferRequest(model_name="other")),
             ("ModelInfer", service_pb2.ModelInferRequest(model_name="attention", model_version="2")),
             ("ModelMetadata", service_pb2.ModelMetadataRequest(name="attention", version="2")),
             ("ModelMetadata", service_pb2.ModelMetadataRequest(name="other"))]
    with grpc.insecure_channel(grpc_server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for rpc, request in calls:
            with pytest.raises(grpc.RpcError) as info:
                getattr(stub, rpc)(request, metadata=auth)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, (rpc, request)
            assert dict(info.value.trailing_metadata())["splitkey-code"] == "route_not_found", (rpc, request)


def test_grpc_answers_larger_than_the_request_limit_are_sent(tmp_path, rng):
    """The send limit is the message's, not the request body's: a small q over long value rows."""
    srv = Server(tmp_path, args=("--workers", "1", "--max-body-bytes", str(2**20)), grpc=True)
    srv.start()
    client = triton.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
    try:
        q = rng.standard_normal((1024, 1, 4)).astype(np.float32)  # 16 KiB
        k = rng.standard_normal((3, 1, 4)).astype(np.float32)
        v = rng.standard_normal((3, 1, 1024)).astype(np.float32)
        result = client.infer("attention", infer_inputs(q=q, k=k, v=v),
                              outputs=[triton.InferRequestedOutput(n) for n in ("out", "lse")])
        out, lse = result.as_numpy("out"), result.as_numpy("lse")  # out: 4 MiB, over the 1 MiB request limit
        assert out.shape == (1024, 1, 1024)
        assert_close_to_reference(out, lse, q, k, v)
        codes = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'splitkey_requests_total{code="200",route="grpc:ModelInfer"} 1.0' in codes
    finally:
        client.close()
        srv.stop()


@pytest.mark.parametrize("token", [None, KEY])
def test_grpc_rpcs_not_served_are_unimplemented_behind_the_key(grpc_server, token):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(grpc_server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for rpc, request in (("ModelConfig", service_pb2.ModelConfigRequest(name="attention")),
                             ("RepositoryIndex", service_pb2.RepositoryIndexRequest())):
            with pytest.raises(grpc.RpcError) as info:
                getattr(stub, rpc)(request, metadata=metadata)
            if token is None:
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            else:
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert f"{rpc} is not served" in info.value.details()


def test_doc_grpc_example_runs_and_prints_what_it_says(grpc_server):
    """docs/KSERVE.md's gRPC block, as a user would run it (its ports and key replaced)."""
    import pathlib
    import re
    import subprocess
    import sys

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "KSERVE.md").read_text()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.DOTALL) if "tritonclient.grpc" in b]
    code = (code.replace("127.0.0.1:8001", grpc_server.grpc).replace("127.0.0.1:8000", f"127.0.0.1:{grpc_server.port}")
            .replace('"KEY"', repr(KEY)).replace("Bearer KEY", f"Bearer {KEY}"))
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == re.search(r"# (\(.*)$", code.strip().splitlines()[-1]).group(1).strip()


def test_a_model_infer_that_is_not_protobuf_is_invalid_argument_with_its_code_and_counted(grpc_server):
    """Issue 50, finding 6: bytes that do not parse as a ModelInferRequest got UNKNOWN with a Python class
    name, no splitkey-code, and were not counted in the metrics."""
    import grpc

    def counted() -> float:
        text = httpx.get(grpc_server.url + "/metrics", headers=AUTH, timeout=30).text
        lines = [line for line in text.splitlines()
                 if line.startswith("splitkey_requests_total{") and 'route="grpc:ModelInfer"' in line
                 and 'code="400"' in line]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    before = counted()
    with grpc.insecure_channel(grpc_server.grpc) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff not a protobuf message", metadata=tuple(AUTH.items()), timeout=30)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details() == "the request must be a ModelInferRequest message, got 27 bytes that do not parse as one"
    assert dict(err.trailing_metadata())["splitkey-code"] == "invalid_body"
    assert counted() == before + 1
