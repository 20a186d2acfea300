"""Scratch: does the front end's per-call cost grow with what the kernel streamed between calls?

Run from the repository root: .venv/bin/python benchmarks/results/2026-12-03/cold-cache/cold.py
Raw pre-encoded requests (benchmarks/engine.py raw_block) over resident contexts of several sizes,
and over a small context with the client sweeping 32 MiB between calls (untimed)."""
import statistics, sys, tempfile
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
import numpy as np
from benchmarks import common
from benchmarks import engine as e
from service.client import Client

SIZES = [256, 4096]
CALLS = 200
sweep = np.ones(32 * 2**20 // 8)

def main():
    q = e.query(2)
    data = {n: e.keys(n, 1) for n in SIZES}
    views = {n: e.resident(*data[n]) for n in SIZES}
    with tempfile.TemporaryDirectory() as tmp, common.splitkey_server(Path(tmp), workers=2, cwd=ROOT) as url:
        with Client(url) as c:
            ids = {n: c.create_context(*data[n])["id"] for n in SIZES}
        blocks = {}
        for n in SIZES:
            blocks[n] = e.raw_block(url, e.attention_request(ids[n], q))[0]
        res = {k: ([], []) for k in [*SIZES, "256+sweep"]}
        kern = {n: [] for n in SIZES}
        for rnd in range(5):
            for n in SIZES:
                kern[n].append(e.inprocess(views[n], q, 30)[0])
                s, st = blocks[n](CALLS)
                res[n][0].extend(s); res[n][1].extend(st)
            # small context, the client sweeping 32 MiB before each call
            b = blocks[SIZES[0]]
            for _ in range(CALLS // 2):
                sweep.sum()
                s, st = b(1)
                res["256+sweep"][0].extend(s); res["256+sweep"][1].extend(st)
        for k, (s, st) in res.items():
            n = k if isinstance(k, int) else SIZES[0]
            kk = statistics.median(kern[n])
            stages = common.median_stages(st)
            print(f"{k}: p50 {statistics.median(s)*1e3:.3f} ms, kernel {kk*1e3:.3f}, beyond {(statistics.median(s)-kk)*1e3:.3f}; "
                  + ", ".join(f"{a} {b*1e3:.3f}" for a, b in sorted(stages.items())))

main()
