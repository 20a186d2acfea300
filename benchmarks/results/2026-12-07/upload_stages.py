"""Chunks appended one at a time (pipeline 1) to a 512K-key bfloat16 context: each chunk's Server-Timing
stages, median ms (2026-12-07 NOTES.md, "Uploads: ... what bounds a warm upload").

    SPLITKEY_CPU_KERNELS=numpy .venv/bin/python benchmarks/results/2026-12-07/upload_stages.py
"""
import pathlib, statistics, sys, tempfile, time
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
import numpy as np
from benchmarks import common
from benchmarks.service import TimedClient
from workers import DTYPES
n_k = 512 * 1024
k = np.random.default_rng(0).standard_normal((n_k, 8, 128), dtype=np.float32).astype(DTYPES["bfloat16"]); v = k.copy()
with tempfile.TemporaryDirectory() as wd:
    with common.splitkey_server(pathlib.Path(wd), workers=2, args=("--worker-memory-bytes", str(6 * 2**30))) as url, \
            TimedClient(url) as c:
        for rnd in range(1):
            for size in (4096, 32768):
                d = c.create_context(k[:size], v[:size], expected_length=n_k)
                rows = []
                t0 = time.perf_counter()
                for lo in range(size, n_k, size):
                    c.append(d["id"], k[lo:lo + size], v[lo:lo + size], chunk_keys=size, pipeline=1)
                    rows.append(c.last_stages())
                dt = time.perf_counter() - t0
                c.delete_context(d["id"])
                mb = size * 8 * 128 * 2 * 2 / 2**20
                med = {s: statistics.median(r.get(s, 0.0) for r in rows) for s in rows[0]}
                print(f"round {rnd} chunk {size} keys ({mb:.0f} MiB): {2 * (n_k - size) * 8 * 128 * 2 / dt / 1e9:.3f} GB/s serial; "
                      + ", ".join(f"{s} {m * 1e3:.1f}" for s, m in med.items()))
