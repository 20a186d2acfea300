# Scratch probe for docs/BENCHMARKS.md "Many contexts under load": CPU seconds of each process per request
# in a closed loop at concurrency 16 over 8 contexts of 4096 keys, per --context-shard-keys. Kept as provenance.
# usage: .venv/bin/python benchmarks/results/2026-12-05/midday/cpu_per_request.py 2048 4096
import sys, time, pathlib, tempfile, subprocess, os
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))
import numpy as np
from benchmarks import common
from benchmarks.shard_keys import closed_loop
from service.client import Client
TCK = os.sysconf("SC_CLK_TCK")
def cpu(pid):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / TCK
    except FileNotFoundError: return 0.0
def tree():
    out = subprocess.run("ps -eo pid,args", shell=True, capture_output=True, text=True).stdout.splitlines()[1:]
    res = {}
    for l in out:
        pid, args = l.strip().split(None, 1)
        for key in ("ShardWorker", "service.cli serve", "raylet", "gcs_server"):
            if key in args: res.setdefault(key, []).append(pid)
    return res
rng = np.random.default_rng(0)
ctx = [(rng.standard_normal((4096, 8, 128)).astype(np.float32), rng.standard_normal((4096, 8, 128)).astype(np.float32)) for _ in range(8)]
qs = [rng.standard_normal((1, 32, 128)).astype(np.float32) for _ in range(8)]
for sk in sys.argv[1:]:
    work = pathlib.Path(tempfile.mkdtemp(prefix="prof-"))
    with common.splitkey_server(work, workers=2, args=("--context-shard-keys", sk)) as url:
        with Client(url) as c:
            ids = [c.create_context(k, v)["id"] for k, v in ctx]
        closed_loop(url, ids, qs, 16, 3)
        t = tree(); me = os.getpid()
        b = {k: sum(cpu(p) for p in ps) for k, ps in t.items()}; bme = cpu(me)
        r = closed_loop(url, ids, qs, 16, 12)
        a = {k: sum(cpu(p) for p in ps) for k, ps in t.items()}; ame = cpu(me)
        n = r["calls"]
        print(sk, f"rps {r['rps']:.0f}", {k: f"{(a[k]-b[k])/n*1e3:.2f} ms/req" for k in a}, f"client {(ame-bme)/n*1e3:.2f} ms/req", flush=True)
