# Scratch closed-loop probe used for docs/BENCHMARKS.md "Contexts over both workers": kept as provenance.
# usage: .venv/bin/python benchmarks/results/2026-12-05/morning/tput.py
import sys, time, statistics, pathlib, tempfile, threading
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))
import numpy as np
from benchmarks import common
from service.client import Client

n_k = 4096
rng = np.random.default_rng(0)
k = rng.standard_normal((n_k, 8, 128)).astype(np.float32)
v = rng.standard_normal((n_k, 8, 128)).astype(np.float32)
qs = [rng.standard_normal((1, 32, 128)).astype(np.float32) for _ in range(8)]

def run(url, cid, conc, calls):
    lat = []
    def worker(i):
        with Client(url) as c:
            for j in range(calls):
                t0 = time.perf_counter(); c.attention(qs[i % 8], contexts=[cid]); lat.append(time.perf_counter() - t0)
    ths = [threading.Thread(target=worker, args=(i,)) for i in range(conc)]
    t0 = time.perf_counter()
    for t in ths: t.start()
    for t in ths: t.join()
    wall = time.perf_counter() - t0
    return conc * calls / wall, statistics.median(lat)

res = {}
for rnd in range(2):
    for keys in ("4096", "2048"):
        work = pathlib.Path(tempfile.mkdtemp(prefix="tput-"))
        with common.splitkey_server(work, workers=2, args=("--context-shard-keys", keys)) as url:
            with Client(url) as c:
                cid = c.create_context(k, v)["id"]
                for _ in range(10): c.attention(qs[0], contexts=[cid])
            for conc in (1, 4, 16):
                rps, p50 = run(url, cid, conc, max(40, 160 // conc))
                res.setdefault((keys, conc), []).append((rps, p50))
                print(f"round {rnd} shard_keys {keys} conc {conc}: {rps:.0f} req/s, p50 {p50*1e3:.2f} ms", flush=True)
