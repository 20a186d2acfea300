"""The front end's whole Python path for a decode query (compute stubbed), in one checkout, in process.

    cd TREE && /work/main/.venv/bin/python front_end_ab.py TREE     # prints the median us (5 x 3000 requests)

Run once per checkout, the checkouts in turn (front_end_ab.txt: f2553c1, 2570e98 and 91c64a2, four rounds);
benchmarks/dispatch.py now has the same measurement as its last column.
"""
import asyncio, time, statistics, sys, types, json
tree = sys.argv[1]
sys.path.insert(0, tree)
import numpy as np
from benchmarks.dispatch import scope as base_scope
from service.app import create_app
from service.settings import ServiceSettings
from service.wire.safetensors import encode_safetensors, to_bytes
q = np.random.default_rng(1).standard_normal((1, 32, 128), dtype=np.float32)
body = to_bytes(encode_safetensors({"q": q}))
out = np.zeros((1, 32, 128), np.float32); lse = np.zeros((1, 32), np.float32)
class FakeAttention:
    async def attention(self, req, timings):
        timings.add("compute", 0.0)
        return out, lse
def scope():
    s = base_scope("POST", "/v1/attention")
    s["query_string"] = b"contexts=0123456789abcdef"
    s["headers"] = [(b"host", b"splitkey"), (b"content-type", b"application/octet-stream"),
                    (b"content-length", str(len(body)).encode()), (b"accept", b"application/octet-stream, application/json")]
    return s
async def receive():
    return {"type": "http.request", "body": body, "more_body": False}
async def main():
    app = create_app(ServiceSettings())
    async def send(m): pass
    await app(base_scope("GET", "/healthz"), receive, send)
    app.state.splitkey.runtime = types.SimpleNamespace(attention=FakeAttention())
    res = []
    for rep in range(5):
        ts = []
        for _ in range(3000):
            t0 = time.perf_counter(); await app(scope(), receive, send); ts.append(time.perf_counter() - t0)
        res.append(statistics.median(ts) * 1e6)
    print(json.dumps(sorted(res)[2]))
asyncio.run(main())
