"""Uploads of one 256K-key bfloat16 context (1 GiB of K+V) to one fresh server, the third under
``perf record -a -g`` (2026-12-08 NOTES.md, "Where a warm upload's CPU goes").

    SPLITKEY_CPU_KERNELS=numpy .venv/bin/python benchmarks/results/2026-12-08/upload_perf.py [ROUNDS [PERF_DATA]]

ROUNDS: uploads (default 3); PERF_DATA: where perf writes the third upload's samples (none: no
perf). Prints each upload's rate and the machine's busy share, and the processes' ids so that
``perf script -F pid,...`` can be grouped by process.
"""
import os
import pathlib
import subprocess
import sys
import tempfile
import time

TREE = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(TREE))

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from service.client import Client  # noqa: E402
from workers import DTYPES  # noqa: E402


def cpu() -> tuple[int, int]:
    """(all jiffies, idle jiffies) of the machine."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(f), f[3] + f[4]


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
perf_data = sys.argv[2] if len(sys.argv) > 2 else None
n_k = 256 * 1024
k = np.random.default_rng(0).standard_normal((n_k, 8, 128), dtype=np.float32).astype(DTYPES["bfloat16"])
v = k.copy()  # [n_k, h_kv, d]
with tempfile.TemporaryDirectory() as wd:
    with common.splitkey_server(pathlib.Path(wd), workers=2, args=("--worker-memory-bytes", str(6 * 2**30)),
                                cwd=TREE) as url, Client(url) as c:
        print("client pid", os.getpid(), flush=True)
        subprocess.run("ps -eo pid,args | grep -E 'splitkey serve|ray::' | grep -v grep | cut -c1-100", shell=True)
        for i in range(rounds):
            perf = None
            if i == 2 and perf_data:
                perf = subprocess.Popen(["perf", "record", "-a", "-g", "-F", "999", "-o", perf_data],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)
            t0, a = time.perf_counter(), cpu()
            desc = c.create_context(k, v)
            dt, b = time.perf_counter() - t0, cpu()
            if perf is not None:
                perf.send_signal(2)
                perf.wait()
            print(f"upload {2 * k.nbytes / dt / 1e9:.3f} GB/s in {dt:.2f} s, "
                  f"machine busy {1 - (b[1] - a[1]) / (b[0] - a[0]):.0%}", flush=True)
            c.delete_context(desc["id"])
