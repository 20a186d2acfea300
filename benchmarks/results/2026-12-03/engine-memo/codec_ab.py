"""Hot-loop cost of what a decode call encodes and decodes, this tree against another checkout, in turn.

    .venv/bin/python codec_ab.py BASE_CHECKOUT [ROUNDS]

Per tree (a process each, PYTHONPATH at the tree): encode q [1, 32, 128] float32 as safetensors (the
client), decode it as the route does into an AttentionRequest (the front end's parse, body already
read), encode the answer out [1, 32, 128] + lse [1, 32] (the front end), decode the answer (the client).
Medians of 5 x 5000 calls, microseconds.
"""
import json, os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
CHILD = r'''
import json, time
import numpy as np
from starlette.datastructures import QueryParams
from service.routes.attention import _decode
from service.wire.rules import DEFAULT_LIMITS
from service.wire.safetensors import decode_safetensors, encode_safetensors, to_bytes
rng = np.random.default_rng(1)
q = rng.standard_normal((1, 32, 128), dtype=np.float32)
out, lse = rng.standard_normal((1, 32, 128), dtype=np.float32), rng.standard_normal((1, 32), dtype=np.float32)
body = memoryview(bytearray(to_bytes(encode_safetensors({"q": q}))))
answer = to_bytes(encode_safetensors({"out": out, "lse": lse}))
qp = QueryParams("contexts=0123456789abcdef")
cases = {"encode q (client)": lambda: encode_safetensors({"q": q}),
         "parse q into a request (front end)": lambda: _decode("safetensors", body, qp, DEFAULT_LIMITS),
         "encode the answer (front end)": lambda: to_bytes(encode_safetensors({"out": out, "lse": lse})),
         "decode the answer (client)": lambda: decode_safetensors(answer, {"out", "lse"})}
res = {}
for name, f in cases.items():
    for _ in range(500): f()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(5000): f()
        ts.append((time.perf_counter() - t0) / 5000 * 1e6)
    res[name] = sorted(ts)[2]
print(json.dumps(res))
'''


def main() -> None:
    base = Path(sys.argv[1]).resolve()
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    got: dict[str, dict[str, list[float]]] = {"base": {}, "this": {}}
    for r in range(rounds):
        for name, tree in (("base", base), ("this", ROOT)):
            out = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree,
                                 capture_output=True, text=True, check=True)
            for case, us in json.loads(out.stdout).items():
                got[name].setdefault(case, []).append(us)
    print("| us per call (median of rounds) | base | this tree |")
    print("| --- | --- | --- |")
    for case in got["this"]:
        b, t = sorted(got["base"][case])[rounds // 2], sorted(got["this"][case])[rounds // 2]
        print(f"| {case} | {b:.1f} | {t:.1f} |")


if __name__ == "__main__":
    main()
