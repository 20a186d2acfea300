import os, subprocess, sys, time, tempfile, httpx, re
def run(kernels, cache):
    env = {**os.environ, "NUMBA_CACHE_DIR": cache, "SPLITKEY_CPU_KERNELS": kernels, "HOME": tempfile.mkdtemp()}
    log = open(tempfile.mktemp(), "w")
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", "8765", "--workers", "2"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ready = fused = None
    try:
        while time.monotonic() - t0 < 900:
            try:
                if ready is None and httpx.get("http://127.0.0.1:8765/readyz", timeout=2).status_code == 200:
                    ready = time.monotonic() - t0
                if ready is not None:
                    ws = httpx.get("http://127.0.0.1:8765/v1/cluster", timeout=5).json()["workers"]
                    if all(w["cpu_kernels"] == "fused" for w in ws):
                        fused = time.monotonic() - t0; break
                    if kernels == "numpy": break
            except Exception:
                pass
            time.sleep(0.25)
    finally:
        os.killpg(p.pid, 15); p.wait(60)
    return ready, fused
for kernels, cache in [("numpy", tempfile.mkdtemp()), ("auto", tempfile.mkdtemp()), ("auto", None)]:
    c = cache or "/tmp/warmcache"
    if cache is None:
        subprocess.run([sys.executable, "-m", "service.cli", "warm"], env={**os.environ, "NUMBA_CACHE_DIR": c}, check=True, capture_output=True)
    r, f = run(kernels, c)
    print(f"{kernels:6s} cache={'warm' if cache is None else 'cold'}: ready {r:.1f} s, all fused {f if f is None else round(f,1)} s", flush=True)
