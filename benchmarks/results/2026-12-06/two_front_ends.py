"""Issue 47 point 5: uploads through two front ends of one 3-node local cluster at once, against one alone."""
import threading, time, numpy as np, subprocess
from service.client import Client
from workers import BFLOAT16
N, H, D = 131072, 8, 128  # 128K keys of bf16 decode shape: 512 MiB of K+V per upload
rng = np.random.default_rng(0)
k = rng.standard_normal((N, H, D), dtype=np.float32).astype(BFLOAT16)
v = rng.standard_normal((N, H, D), dtype=np.float32).astype(BFLOAT16)
gib = (k.nbytes + v.nbytes) / 1e9
def upload(url, out, key):
    with Client(url, timeout=600) as c:
        t = time.perf_counter(); ctx = c.create_context(k, v)["id"]; out[key] = time.perf_counter() - t
        c.delete_context(ctx)
res = {}
for rnd in range(2):
    upload("http://127.0.0.1:8601", res, f"alone{rnd}")
    ts = [threading.Thread(target=upload, args=(u, res, f"{u[-4:]}-{rnd}")) for u in ("http://127.0.0.1:8601", "http://127.0.0.1:8602")]
    t0 = time.perf_counter(); [t.start() for t in ts]; [t.join() for t in ts]; res[f"both{rnd}"] = time.perf_counter() - t0
cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
print([l for l in cpu.splitlines() if l.startswith(("Model name", "CPU(s):"))])
for rnd in range(2):
    a = gib / res[f"alone{rnd}"]; b1 = gib / res[f"8601-{rnd}"]; b2 = gib / res[f"8602-{rnd}"]; agg = 2 * gib / res[f"both{rnd}"]
    print(f"round {rnd}: alone {a:.3f} GB/s; together fe1 {b1:.3f}, fe2 {b2:.3f}, aggregate {agg:.3f} GB/s ({agg / a:.2f}x alone)")
