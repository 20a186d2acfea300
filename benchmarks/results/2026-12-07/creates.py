"""What noting a create's holders costs: create and decode latency before and after (2026-12-07).

A create now tells its holders the committed record before it answers (docs/CONTEXTS.md, "Resolving a
query"): one more round trip, in parallel over the holders. This probe times, from one client in turn,
a create of a 16-key context (h_kv=8, d=128, float32; replicas 1 and 2, each deleted untimed after)
and a decode query (n_q=1, h_q=32) over a 4096-key context from the front end's record cache, against
a server of an earlier checkout and then of this tree, one server at a time, on the same machine:

    git archive 6d454e6 | tar -x -C /tmp/before
    .venv/bin/python benchmarks/results/2026-12-07/creates.py --baseline /tmp/before --rounds 300
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks import common
from benchmarks.service import TimedClient

KINDS = ("create r1", "create r2", "decode")


def run(url: str, rounds: int, warmup: int) -> dict[str, list[float]]:
    rng = np.random.default_rng(7)
    k16 = rng.standard_normal((16, 8, 128), dtype=np.float32)
    big = rng.standard_normal((4096, 8, 128), dtype=np.float32)
    q = rng.standard_normal((1, 32, 128), dtype=np.float32)
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with TimedClient(url) as c:
        decode_id = c.create_context(big, big)["id"]
        for i in range(warmup + rounds):
            for kind in KINDS:
                t0 = time.perf_counter()
                if kind == "decode":
                    c.attention(q, contexts=[decode_id])
                    made = None
                else:
                    made = c.create_context(k16, k16, replicas=1 if kind == "create r1" else 2)["id"]
                dt = time.perf_counter() - t0
                if made is not None:
                    c.delete_context(made)
                if i >= warmup:
                    seconds[kind].append(dt)
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    print(f"host: {common.cpu_model()}, load before: {common.load_average()}")
    rows = []
    for name, cwd in (("before", args.baseline.resolve()), ("after", common.ROOT)):
        with tempfile.TemporaryDirectory(prefix="splitkey-creates-") as tmp, \
                common.splitkey_server(Path(tmp), workers=2, cwd=cwd) as url:
            got = run(url, args.rounds, args.warmup)
        for kind in KINDS:
            s = got[kind]
            rows.append([name, kind, len(s), common.ms(float(np.percentile(s, 50))),
                         common.ms(float(np.percentile(s, 90))), common.ms(float(np.percentile(s, 99)))])
    print(common.markdown_table(["server", "request", "n", "p50 ms", "p90 ms", "p99 ms"], rows))
    print(f"load after: {common.load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
