"""Fuzzing the HTTP API (issue 12, item 6): every malformed request is a 4xx JSON error, the
server stays healthy, and a stored context is left exactly as it was.

One real server (embedded Ray, one worker) with a small body limit holds a context created
before any fuzzing (the canary). Four kinds of tests run against it:

* schemathesis over every operation of ``/openapi.json`` (positive and negative data,
  plus its coverage cases: unsupported methods, missing bodies, boundary values);
* hypothesis strategies for the two binary wire formats (safetensors bodies, KServe
  requests with the binary tensor extension), drawn mostly well framed with dtypes,
  shapes, offsets, sizes and values pushed to their edges;
* a hand-built corpus (tests/fuzz_corpus.py) of malformed safetensors, JSON, KServe and
  context bodies, each with the status and code the contract promises; raw sockets for
  what httpx will not send (chunked bodies over the limit, bogus framing);
* one test per bug the fuzzing found, so that each shows up by name until it is fixed.

After each test: ``/healthz`` and ``/readyz`` answer 200, the canary's description and a
fixed query over it are bitwise what they were, and (for the corpus) no context appeared.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
import schemathesis
from fuzz_corpus import (
    ATTENTION,
    CONTEXTS,
    INFER,
    JSON,
    OCTET,
    Probe,
    answer_problem,
    chunked,
    context_probes,
    deep_value_probes,
    encoded_v1_probes,
    error_code,
    json_probes,
    kserve_probes,
    kserve_requests,
    kserve_timeout_probes,
    raw_exchange,
    safetensors_probes,
    safetensors_requests,
    st_body,
    st_layout,
    zero_element_probes,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, CheckContext
from schemathesis.checks import load_all_checks
from schemathesis.core.result import Err
from schemathesis.core.transport import Response
from schemathesis.pytest.lazy import get_all_tests
from server import Server

from service.wire.safetensors import encode_safetensors, to_bytes

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

T = TypeVar("T")

#: The fuzzed server's body limit: small, so that bodies over it are cheap to send (>= 1 MiB + 8 so
#: a safetensors header over its own 1 MiB limit still fits in a body).
MAX_BODY = 2 * 2**20 + 4096
#: Fixed seed: the same requests on every run (CI reproduces what a developer saw).
SEED = 20240612
#: Examples per operation and generation mode in schemathesis' fuzzing phase, and per structured fuzzer.
SCHEMA_EXAMPLES = 40
STRUCTURED_EXAMPLES = 500
#: What the canary query asks: n_q 2, h_q 4 over the canary's [n_k, 2, 8] keys.
CANARY_QUERY = np.linspace(-1, 1, 2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8)


# -- the server and its canary context --------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One worker, a 2 MiB body limit (JSON limit too), a 64 MiB memory budget so fuzzed context
    sizes hit 507 rather than the machine's memory, small context shards so creates stay cheap."""
    srv = Server(tmp_path_factory.mktemp("fuzz-home"),
                 args=("--workers", "1", "--max-body-bytes", str(MAX_BODY), "--worker-memory-bytes", str(64 * 2**20),
                       "--request-timeout", "30"),
                 env={"SPLITKEY_CONTEXT_SHARD_KEYS": "16", "SPLITKEY_MIN_SHARD_KEYS": "64"})
    srv.start()
    yield srv
    srv.stop()


@dataclass(frozen=True)
class Canary:
    """A stored context and what it looked like before any fuzzing."""

    id: str
    description: dict[str, Any]
    answer: bytes  # the safetensors answer (out, lse) of CANARY_QUERY over it


def canary_answer(client: httpx.Client, ctx: str) -> bytes:
    r = client.post(ATTENTION, params={"contexts": ctx}, headers=OCTET,
                    content=to_bytes(encode_safetensors({"q": CANARY_QUERY})))
    assert r.status_code == 200, r.text
    return r.content


@pytest.fixture(scope="module")
def canary(fuzz_server: Server) -> Canary:
    """Created (JSON) and appended to (safetensors) once, so it has two committed writes."""
    rng = np.random.default_rng(SEED)
    k, v = (rng.standard_normal((48, 2, 8)).astype(np.float32) for _ in range(2))
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as c:
        r = c.post(CONTEXTS, json={"k": k[:32].tolist(), "v": v[:32].tolist()})
        assert r.status_code == 201, r.text
        ctx = r.json()["id"]
        r = c.post(f"{CONTEXTS}/{ctx}/append", params={"after": "32"}, headers=OCTET,
                   content=to_bytes(encode_safetensors({"k": k[32:], "v": v[32:]})))
        assert r.status_code == 200 and r.json()["length"] == 48, r.text
        return Canary(ctx, c.get(f"{CONTEXTS}/{ctx}").json(), canary_answer(c, ctx))


def context_ids(client: httpx.Client) -> list[str]:
    r = client.get(CONTEXTS)
    assert r.status_code == 200, r.text
    return sorted(c["id"] for c in r.json()["contexts"])


def assert_unharmed(server: Server, canary: Canary, contexts: Sequence[str] | None = None) -> None:
    """The process runs, both probes answer 200, the canary is bitwise as it was, and (if given) the
    stored contexts are exactly ``contexts``."""
    assert server.proc is not None and server.proc.poll() is None, f"the server exited:\n{server.log()[-4000:]}"
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.get("/healthz")
        assert (r.status_code, r.json()) == (200, {"status": "ok"}), r.text
        r = c.get("/readyz")
        assert r.status_code == 200 and r.json()["ready"] is True, r.text
        assert c.get(f"{CONTEXTS}/{canary.id}").json() == canary.description
        assert canary_answer(c, canary.id) == canary.answer, "the canary context answers differently"
        if contexts is not None:
            assert context_ids(c) == sorted(contexts)


def delete_contexts_but(client: httpx.Client, keep: Sequence[str]) -> None:
    """Remove the contexts a fuzzer legitimately created (a valid create is a success, not a failure)."""
    for ctx in context_ids(client):
        if ctx not in keep:
            assert client.delete(f"{CONTEXTS}/{ctx}").status_code == 200


# -- sending probes ---------------------------------------------------------------------------

def report(what: str, status: int | str, content_type: str | None, body: bytes, problem: str) -> str:
    return f"{what}\n    -> {status} {content_type} {body[:300]!r}\n    ({problem})"


def request_once(client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request; sent again on a fresh connection if the pooled one was dropped, so that a
    connection closed after the previous request's answer is not blamed on this request."""
    try:
        return client.request(method, path, **kwargs)
    except httpx.TransportError:
        with httpx.Client(base_url=client.base_url, timeout=client.timeout) as fresh:
            return fresh.request(method, path, **kwargs)


def run_probes(server: Server, probes: Sequence[Probe], ctx: str) -> list[str]:
    """Send each probe; the failures, each with its request and answer (empty when all passed)."""
    failures = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for p in probes:
            params = [(k, v.format(ctx=ctx)) for k, v in p.params]
            path = p.path.format(ctx=ctx)
            try:
                r = request_once(client, p.method, path, content=p.body, headers=dict(p.headers), params=params)
            except httpx.HTTPError as exc:
                failures.append(report(p.describe(ctx), "no answer", None, b"", repr(exc)))
                continue
            content_type = r.headers.get("content-type")
            problem = answer_problem(path, r.status_code, content_type, r.content)
            if problem is None and r.status_code not in p.statuses():
                problem = f"status must be {' or '.join(map(str, p.statuses()))}"
            if problem is None and p.code is not None and error_code(r.content) != p.code:
                problem = f"code must be {p.code}"
            if problem is not None:
                failures.append(report(p.describe(ctx), r.status_code, content_type, r.content, problem))
    return failures


def failed(failures: Sequence[str], total: int) -> str:
    return f"{len(failures)} of {total} requests got a wrong answer:\n" + "\n".join(failures)


def check_corpus(server: Server, canary: Canary, probes: Sequence[Probe]) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        before = context_ids(c)
    failures = run_probes(server, probes, canary.id)
    assert not failures, failed(failures, len(probes))
    assert_unharmed(server, canary, before)


# -- the corpus -------------------------------------------------------------------------------

def test_malformed_safetensors_bodies_get_4xx_json_and_change_nothing(fuzz_server: Server, canary: Canary) -> None:
    check_corpus(fuzz_server, canary, safetensors_probes())


def test_malformed_json_bodies_get_4xx_json_and_change_nothing(fuzz_server: Server, canary: Canary) -> None:
    check_corpus(fuzz_server, canary, json_probes())


def test_malformed_kserve_requests_get_4xx_json_and_change_nothing(fuzz_server: Server, canary: Canary) -> None:
    check_corpus(fuzz_server, canary, kserve_probes())


def test_malformed_context_writes_and_near_miss_ids_leave_the_stored_context_as_it_was(
        fuzz_server: Server, canary: Canary) -> None:
    check_corpus(fuzz_server, canary, context_probes(canary.id))


def test_bodies_over_the_limit_get_413_json_whether_declared_or_chunked(fuzz_server: Server, canary: Canary) -> None:
    """A Content-Length over the limit is refused before the body is read (none is sent); a chunked
    body (no Content-Length) as soon as it passes the limit (docs/API.md sections 7-8)."""
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
        before = context_ids(c)
    targets = [(ATTENTION, JSON), (ATTENTION, OCTET), (CONTEXTS, JSON), (CONTEXTS, OCTET),
               (f"{CONTEXTS}/{canary.id}/append", JSON), (f"{CONTEXTS}/{canary.id}/append", OCTET), (INFER, JSON),
               (INFER, {**OCTET, "Inference-Header-Content-Length": "64"})]
    over = b'{"q": [' + b"1.0, " * ((MAX_BODY + 65536) // 5) + b"1.0]}"
    failures = []
    for path, headers in targets:
        fields = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        for how, head, chunks in (
                ("Content-Length", f"POST {path} HTTP/1.1\r\nHost: x\r\n{fields}Content-Length: {MAX_BODY + 1}\r\n\r\n",
                 []),
                ("Content-Length 2**62", f"POST {path} HTTP/1.1\r\nHost: x\r\n{fields}Content-Length: {2**62}\r\n\r\n",
                 []),
                ("chunked", f"POST {path} HTTP/1.1\r\nHost: x\r\n{fields}Transfer-Encoding: chunked\r\n\r\n",
                 chunked(over))):
            answer = raw_exchange(fuzz_server.port, head.encode(), chunks)
            problem = answer_problem(path, answer.status, answer.content_type, answer.body)
            if problem is None and (answer.status, error_code(answer.body)) != (413, "body_too_large"):
                problem = "must be 413 body_too_large"
            if problem is not None:
                failures.append(report(f"{how} over the limit: {head!r}", answer.status, answer.content_type,
                                       answer.body, problem))
    assert not failures, failed(failures, 3 * len(targets))
    assert_unharmed(fuzz_server, canary, before)


# -- structured fuzzing of the binary formats ---------------------------------------------------

STRUCTURED = settings(max_examples=STRUCTURED_EXAMPLES, derandomize=True, database=None, deadline=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def fuzz_requests(server: Server, strategy: st.SearchStrategy[T],
                  send: Callable[[httpx.Client, T], tuple[str, httpx.Response]]) -> tuple[list[str], int]:
    """Draw STRUCTURED_EXAMPLES requests and send them: ``(failures, count)``, the answers that break
    :func:`answer_problem` deduplicated by path, status and the start of the answer (at most 20 kept),
    and how many answers broke it in all. Nothing is raised inside hypothesis: no shrinking, each
    failure is reported as drawn, and the fuzzing goes on to the end."""
    failures: dict[tuple[str, int | str, str], str] = {}
    count = 0
    with httpx.Client(base_url=server.url, timeout=30) as client:
        @STRUCTURED
        @given(drawn=strategy)
        def run(drawn: T) -> None:
            nonlocal count
            try:
                what, r = send(client, drawn)
            except httpx.HTTPError as exc:
                count += 1
                failures.setdefault(("", "no answer", repr(exc)[:40]),
                                    report(repr(drawn)[:600], "no answer", None, b"", repr(exc)))
                return
            problem = answer_problem(r.request.url.path, r.status_code, r.headers.get("content-type"), r.content)
            if problem is not None:
                count += 1
                if len(failures) < 20:
                    failures.setdefault((r.request.url.path, r.status_code, r.text[:40]),
                                        report(what, r.status_code, r.headers.get("content-type"), r.content, problem))

        run()
    return list(failures.values()), count


def fuzz_failed(failures: Sequence[str], count: int) -> str:
    return (f"{count} of {STRUCTURED_EXAMPLES} drawn requests got a wrong answer; the distinct ones:\n"
            + "\n".join(failures))


def test_structured_safetensors_fuzzing_gets_success_or_json_4xx_and_leaves_the_context(
        fuzz_server: Server, canary: Canary) -> None:
    """Bodies on /v1/attention, /v1/contexts and appends to a scratch context (never the canary: a
    drawn body may be valid)."""
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
        before = context_ids(c)
        header, data = st_layout({"k": np.zeros((2, 2, 8), np.float32), "v": np.zeros((2, 2, 8), np.float32)})
        r = c.post(CONTEXTS, content=st_body(header, data), headers=OCTET)
        assert r.status_code == 201, r.text
        scratch = r.json()["id"]
    paths = [ATTENTION, CONTEXTS, f"{CONTEXTS}/{scratch}/append"]

    def send(client: httpx.Client, drawn: tuple[tuple[bytes, list[tuple[str, str]]], int]
             ) -> tuple[str, httpx.Response]:
        (body, params), target = drawn
        params = [(k, v.replace("{ctx}", canary.id)) for k, v in params]
        what = f"POST {paths[target]} params={params} body[:240]={body[:240]!r} ({len(body)} bytes)"
        return what, request_once(client, "POST", paths[target], content=body, params=params, headers=OCTET)

    try:
        failures, count = fuzz_requests(fuzz_server, st.tuples(safetensors_requests(), st.integers(0, 2)), send)
    finally:
        with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
            delete_contexts_but(c, before)
    assert not failures, fuzz_failed(failures, count)
    assert_unharmed(fuzz_server, canary, before)


def test_structured_kserve_fuzzing_gets_success_or_json_4xx(fuzz_server: Server, canary: Canary) -> None:
    def send(client: httpx.Client, drawn: tuple[bytes, dict[str, str]]) -> tuple[str, httpx.Response]:
        body, headers = drawn
        body = body.replace(b"{ctx}", canary.id.encode())
        return f"POST {INFER} headers={headers} body[:400]={body[:400]!r} ({len(body)} bytes)", \
            request_once(client, "POST", INFER, content=body, headers=headers)

    with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
        before = context_ids(c)
    failures, count = fuzz_requests(fuzz_server, kserve_requests(), send)
    assert not failures, fuzz_failed(failures, count)
    assert_unharmed(fuzz_server, canary, before)


# -- schemathesis over /openapi.json ------------------------------------------------------------

#: The request body of POST /v2/models/attention[/versions/1]/infer, from docs/KSERVE.md. The served
#: schema documents none for those routes, so without this schemathesis would only ever send it an empty body.
KSERVE_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string", "maxLength": 256},
        "inputs": {"type": "array", "maxItems": 6, "items": {
            "type": "object",
            "required": ["name", "shape", "datatype", "data"],
            "additionalProperties": False,
            "properties": {
                "name": {"enum": ["q", "k", "v", "q_pos", "k_pos", "alibi_slopes"]},
                "shape": {"type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0}},
                "datatype": {"enum": ["FP16", "BF16", "FP32", "FP64", "INT32", "INT64"]},
                "data": {"type": "array", "maxItems": 64, "items": {"type": "number"}},
            }}},
        "outputs": {"type": "array", "items": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"name": {"enum": ["out", "lse"]},
                           "parameters": {"type": "object", "additionalProperties": False,
                                          "properties": {"binary_data": {"type": "boolean"}}}}}},
        "parameters": {"type": "object", "additionalProperties": False, "properties": {
            "scale": {"type": "number", "exclusiveMinimum": 0}, "causal": {"type": "boolean"},
            "softcap": {"type": "number", "minimum": 0}, "window": {"type": "string"},
            "contexts": {"type": "string"}, "binary_data_output": {"type": "boolean"},
            "timeout": {"type": "integer", "minimum": 0}, "priority": {"type": "integer", "minimum": 0}}},
    },
}


def load_schema(server: Server) -> schemathesis.BaseSchema:
    """The server's own /openapi.json, plus the KServe request body above; seeded and bounded."""
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    for path in (INFER, INFER.replace("/infer", "/versions/1/infer")):
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": KSERVE_REQUEST}}}
    config = schemathesis.Config.from_dict({
        "seed": SEED, "base-url": server.url, "request-timeout": 30,
        "generation": {"max-examples": SCHEMA_EXAMPLES, "deterministic": True},
    })
    return schemathesis.openapi.from_dict(doc, config=config)


def answers_with_success_or_a_json_error(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """docs/API.md section 7 as a schemathesis check (see :func:`fuzz_corpus.answer_problem`)."""
    content_type = response.headers.get("content-type", [None])[0]
    path = urllib.parse.urlsplit(response.request.url).path
    problem = answer_problem(path, response.status_code, content_type, response.content)
    assert problem is None, problem
    return None


#: The checks the fuzzing runs. The requirement is "no 5xx, every 4xx a JSON error of the contract";
#: schemathesis' own response checks assume more than this API promises, so they are left out:
#: status_code_conformance and response_schema_conformance would fail the 404 and 405 answers for a
#: path or method no route takes (no operation documents them), and a 422 of any route that has
#: a path parameter (FastAPI documents its own validation-error schema there); positive_data_acceptance
#: would fail every body that fits the JSON schema but not the tensor rules (shapes that fit
#: together), which no JSON schema can express. Kept: negative_data_rejection (a body the schema
#: refuses must not be accepted) and unsupported_method (405 with Allow for a method a path lacks).
CHECKS = [answers_with_success_or_a_json_error, schemathesis.checks.negative_data_rejection,
          schemathesis.checks.unsupported_method]
#: Operations that could change the canary if they misbehaved: after each of their cases it is checked.
WRITES = {("POST", "/v1/contexts/{ctx_id}/append"), ("DELETE", "/v1/contexts/{ctx_id}")}


def test_every_route_answers_fuzzed_requests_with_json_4xx_or_success(fuzz_server: Server, canary: Canary) -> None:
    """Every operation of /openapi.json through schemathesis' phases (coverage cases, then
    SCHEMA_EXAMPLES fuzzed examples): after each case the server is alive, and after each write
    the canary is unchanged.

    The operations run through ``schemathesis.pytest.lazy.get_all_tests``, the engine behind
    ``@schema.parametrize()``: the schema exists only once the server runs, and the lazy
    ``from_fixture`` wrapper reads pytest's private ``Function._nodeid``, gone in pytest 9.
    """
    client = httpx.Client(base_url=fuzz_server.url, timeout=30)
    before = context_ids(client)

    def check_case(case: Case) -> None:
        case.call_and_validate(checks=CHECKS)
        r = client.get("/healthz")
        assert r.status_code == 200, f"unhealthy after {case.as_curl_command()}: {r.status_code} {r.text}"
        if (case.method.upper(), case.path) in WRITES:
            assert client.get(f"{CONTEXTS}/{canary.id}").json() == canary.description, case.as_curl_command()
            assert canary_answer(client, canary.id) == canary.answer, case.as_curl_command()

    load_all_checks()
    failures, operations = [], 0
    try:
        for result in get_all_tests(schema=load_schema(fuzz_server), test_func=check_case, settings=None,
                                    given_kwargs=None):
            if isinstance(result, Err):
                failures.append(f"schema error: {result.err()}")
                continue
            operation, run = result.ok()
            operations += 1
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - every operation runs; all failures are reported together
                failures.append(f"{operation.label}: {type(exc).__name__}: {exc}")
    finally:
        delete_contexts_but(client, before)
        client.close()
    assert operations >= 17, f"only {operations} operations in /openapi.json"
    assert not failures, f"{len(failures)} of {operations} operations failed:\n" + "\n".join(failures)
    assert_unharmed(fuzz_server, canary, before)


# -- what the fuzzing found: one test per bug ----------------------------------------------------

def test_zero_element_tensors_with_huge_dims_get_4xx_json(fuzz_server: Server, canary: Canary) -> None:
    """A dim of 0 makes every byte count 0, so a header like ``q: [0, 2**40, 2**40]`` passes the size
    checks; building the array must not then fail with a 500 (numpy cannot hold such a shape)."""
    probes = [Probe(p.name, p.method, p.path, p.body, p.headers, p.params, (400, 413, 422))
              for p in zero_element_probes()]
    check_corpus(fuzz_server, canary, probes)


def test_kserve_timeout_beyond_float_range_gets_422(fuzz_server: Server, canary: Canary) -> None:
    """``timeout`` is an int of microseconds; one too large for a float must be refused, not a 500."""
    check_corpus(fuzz_server, canary, kserve_timeout_probes())


def test_values_nested_just_under_the_json_depth_limit_get_4xx_json(fuzz_server: Server, canary: Canary) -> None:
    """A value nested as deep as the parser still takes, in a field whose error detail quotes the value:
    quoting it back must not overflow the stack (a 500, or the connection dropped)."""
    check_corpus(fuzz_server, canary, deep_value_probes(canary.id, range(925, 995)))


def test_unparseable_http_framing_gets_a_json_400(fuzz_server: Server, canary: Canary) -> None:
    """docs/API.md section 7: a Content-Length that is not an integer is 400 invalid_body, in JSON like
    every error. Sent over a raw socket, as no client library will send these."""
    body = b'{"q": [[[1.0]]], "k": [[[1.0]]], "v": [[[1.0]]]}'
    start = f"POST {ATTENTION} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    heads = {
        "Content-Length not a number": f"{start}Content-Length: abc\r\n\r\n",
        "Content-Length negative": f"{start}Content-Length: -5\r\n\r\n",
        "Content-Length with a fraction": f"{start}Content-Length: 48.0\r\n\r\n",
        "two different Content-Lengths": f"{start}Content-Length: 48\r\nContent-Length: 47\r\n\r\n",
        "Content-Length and chunked": f"{start}Content-Length: 48\r\nTransfer-Encoding: chunked\r\n\r\n",
        "a chunk size that is not hex": f"{start}Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    }
    failures = []
    for name, head in heads.items():
        answer = raw_exchange(fuzz_server.port, head.encode() + body)
        problem = answer_problem(ATTENTION, answer.status, answer.content_type, answer.body)
        if problem is None and (answer.status, error_code(answer.body)) != (400, "invalid_body"):
            problem = "must be 400 invalid_body"
        if problem is not None:
            failures.append(report(f"{name}: {head!r} + body", answer.status, answer.content_type, answer.body,
                                   problem))
    assert not failures, failed(failures, len(heads))
    assert_unharmed(fuzz_server, canary)


def test_a_transfer_coding_other_than_chunked_gets_415_on_every_body_route(fuzz_server: Server, canary: Canary) -> None:
    """``Transfer-Encoding: gzip, chunked``: the parser frames the body by its last coding and leaves the
    gzip undone, so the body would reach the decoders still compressed. 415, as a Content-Encoding
    (docs/API.md section 7; RFC 9112 says 501, but no client mistake gets a 5xx here). Chunked alone,
    in any case, is served."""
    import gzip

    body = b'{"q": [[[1.0]]], "k": [[[1.0]]], "v": [[[2.0]]]}'
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
        before = context_ids(c)
    failures = []
    targets = [ATTENTION, CONTEXTS, f"{CONTEXTS}/{canary.id}/append", INFER, f"{ATTENTION}/batch"]
    for path in targets:
        for coding, sent in (("gzip, chunked", gzip.compress(body)), ("deflate, chunked", body),
                             ("x-custom, Chunked", body)):
            head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Transfer-Encoding: {coding}\r\n\r\n")
            answer = raw_exchange(fuzz_server.port, head.encode(), chunked(sent))
            problem = answer_problem(path, answer.status, answer.content_type, answer.body)
            if problem is None and (answer.status, error_code(answer.body)) != (415, "unsupported_media_type"):
                problem = "must be 415 unsupported_media_type"
            if problem is not None:
                failures.append(report(f"{coding} to {path}", answer.status, answer.content_type, answer.body,
                                       problem))
    head = (f"POST {ATTENTION} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: Chunked\r\n\r\n")
    answer = raw_exchange(fuzz_server.port, head.encode(), chunked(body))
    assert answer.status == 200, answer.body[:300]
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
        delete_contexts_but(c, before)
    assert not failures, failed(failures, 3 * len(targets))
    assert_unharmed(fuzz_server, canary, before)


def test_v1_bodies_declaring_a_content_encoding_are_refused_like_kserve(fuzz_server: Server, canary: Canary) -> None:
    """A body sent with ``Content-Encoding: gzip`` that is not gzip: the KServe route refuses any
    encoding with 415 (docs/KSERVE.md); the /v1 routes must not serve it as if the header were absent."""
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
        before = context_ids(c)
    try:
        failures = run_probes(fuzz_server, encoded_v1_probes(), canary.id)
    finally:
        with httpx.Client(base_url=fuzz_server.url, timeout=30) as c:
            delete_contexts_but(c, before)
    assert not failures, failed(failures, len(encoded_v1_probes()))
    assert_unharmed(fuzz_server, canary, before)
