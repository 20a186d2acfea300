"""Side by side: this tree's Client against another checkout's, on one server, calls of each in turn.

    .venv/bin/python ab_client.py BASE_CHECKOUT [ROUNDS] [CALLS]

Starts ``splitkey serve --workers 2`` (this tree) with one 4096-key context (decode shape, float32),
then alternates processes: ``Client.attention`` from BASE_CHECKOUT's ``service`` package, then from this
tree's, ROUNDS times, CALLS sequential calls each (after 20 unmeasured). The server, the context and
the query are the same for both, so the difference of their p50s is the client library's.
"""
import json, os, statistics, subprocess, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
import numpy as np
from benchmarks import common
from service.client import Client

CHILD = r'''
import json, sys, time
import numpy as np
from service.client import Client
url, ctx, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
q = np.random.default_rng(2).standard_normal((1, 32, 128), dtype=np.float32)
with Client(url) as c:
    for _ in range(20):
        c.attention(q, contexts=[ctx])
    out = []
    for _ in range(calls):
        t0 = time.perf_counter(); c.attention(q, contexts=[ctx]); out.append(time.perf_counter() - t0)
print(json.dumps(out))
'''


def main() -> None:
    base = Path(sys.argv[1]).resolve()
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 300
    rng = np.random.default_rng(1)
    k = rng.standard_normal((4096, 8, 128), dtype=np.float32)
    v = rng.standard_normal((4096, 8, 128), dtype=np.float32)
    res: dict[str, list[float]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp, common.splitkey_server(Path(tmp), workers=2) as url:
        with Client(url) as c:
            ctx = c.create_context(k, v)["id"]
        for r in range(rounds):
            for name, tree in ((("base", base), ("this", ROOT)) if r % 2 == 0 else (("this", ROOT), ("base", base))):
                env = {**os.environ, "PYTHONPATH": str(tree)}
                out = subprocess.run([sys.executable, "-c", CHILD, url, ctx, str(calls)], env=env, cwd=tree,
                                     capture_output=True, text=True, check=True)
                p50 = statistics.median(json.loads(out.stdout)) * 1e3
                res[name].append(p50)
                print(f"round {r + 1} {name}: p50 {p50:.3f} ms", flush=True)
    diffs = [b - t for b, t in zip(res["base"], res["this"])]
    print(json.dumps({"base_p50_ms": res["base"], "this_p50_ms": res["this"], "base_minus_this_ms": diffs,
                      "median_saving_ms": statistics.median(diffs)}))


if __name__ == "__main__":
    main()
