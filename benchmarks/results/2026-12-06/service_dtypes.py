"""Issue 48 point 3: decode over a 256K-key context through the service (2 workers, default auto kernel) against
the same fused kernel in process at 2 threads, bfloat16 and float16, on this host."""
import os, subprocess, sys, time, tempfile, statistics, numpy as np, httpx
from service.client import Client
from workers import BFLOAT16, StreamingKV, partial_attention_resident
from workers.options import AttentionOptions, KernelOptions
N, H_KV, H_Q, D = 262144, 8, 32, 128
rng = np.random.default_rng(1)
q32 = rng.standard_normal((1, H_Q, D), dtype=np.float32)
def med(f, n=15):
    f(); ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
res = {}
for name, dt in (("bfloat16", BFLOAT16), ("float16", np.float16)):
    k = rng.standard_normal((N, H_KV, D), dtype=np.float32).astype(dt); v = rng.standard_normal((N, H_KV, D), dtype=np.float32).astype(dt)
    view = StreamingKV.from_arrays(k, v, np.arange(N)).snapshot()
    q = q32.astype(dt)
    kern = KernelOptions(cpu_kernels="fused", threads=2)
    t = med(lambda: partial_attention_resident(q, view, q_pos=[N - 1], options=AttentionOptions(), kernel=kern))
    res[name] = {"inproc": (k.nbytes + v.nbytes) / t / 1e9}
    del view
    res[name]["kv"] = (k, v, q)
env = {**os.environ, "HOME": tempfile.mkdtemp()}
env.pop("SPLITKEY_CPU_KERNELS", None)
p = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", "8777", "--workers", "2"], env=env,
                     stdout=open("/tmp/svc_dtype.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
try:
    for _ in range(240):
        try:
            ws = httpx.get("http://127.0.0.1:8777/v1/cluster", timeout=2).json()["workers"]
            if ws and all(w["cpu_kernels"] == "fused" for w in ws): break
        except Exception: pass
        time.sleep(0.5)
    with Client("http://127.0.0.1:8777", timeout=300) as c:
        for name in ("bfloat16", "float16"):
            k, v, q = res[name].pop("kv")
            ctx = c.create_context(k, v)["id"]
            t = med(lambda: c.attention(q, contexts=[ctx], q_pos=np.array([N - 1])))
            res[name]["service"] = (k.nbytes + v.nbytes) / t / 1e9
            c.delete_context(ctx)
finally:
    os.killpg(p.pid, 15); p.wait(60)
print([l for l in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines() if l.startswith("Model name")])
for name, r in res.items():
    print(f"{name}: in-process fused 2 threads {r['inproc']:.2f} GB/s; service {r['service']:.2f} GB/s ({r['service'] / r['inproc']:.2f}x)")
print(f"float16 / bfloat16 time: in-process {res['bfloat16']['inproc'] / res['float16']['inproc']:.2f}x, service {res['bfloat16']['service'] / res['float16']['service']:.2f}x")
