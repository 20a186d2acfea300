"""Three uploads of one 512K-key bfloat16 context (2 GiB of K+V) to one fresh server, with the
machine's busy share during each (2026-12-07 NOTES.md, "Uploads: the key transpose").

    SPLITKEY_CPU_KERNELS=numpy .venv/bin/python benchmarks/results/2026-12-07/upload_warm.py [TREE]

TREE: a checkout whose server runs (default: this one).
"""
import pathlib
import sys
import tempfile
import time

TREE = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[3]).resolve()
sys.path.insert(0, str(TREE))

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from service.client import Client  # noqa: E402
from workers import DTYPES  # noqa: E402


def cpu() -> tuple[int, int]:
    """(all jiffies, idle jiffies) of the machine."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(f), f[3] + f[4]


n_k = 512 * 1024
k = np.random.default_rng(0).standard_normal((n_k, 8, 128), dtype=np.float32).astype(DTYPES["bfloat16"])
v = k.copy()  # [n_k, h_kv, d]
with tempfile.TemporaryDirectory() as wd:
    with common.splitkey_server(pathlib.Path(wd), workers=2, args=("--worker-memory-bytes", str(6 * 2**30)),
                                cwd=TREE) as url, Client(url) as c:
        for _ in range(3):
            t0, a = time.perf_counter(), cpu()
            desc = c.create_context(k, v)
            dt, b = time.perf_counter() - t0, cpu()
            print(f"upload {2 * k.nbytes / dt / 1e9:.3f} GB/s, machine busy {1 - (b[1] - a[1]) / (b[0] - a[0]):.0%}")
            c.delete_context(desc["id"])
