"""What ``--persist-dir`` costs (issue 11): upload throughput with and without it, and restart time per GiB.

Run from the repository root::

    .venv/bin/python benchmarks/persist.py --rounds 3 --out /tmp/persist.md
    .venv/bin/python benchmarks/persist.py --quick        # smoke run, a small context

Each round, side by side on the same machine:

1. ``splitkey serve --workers 2`` without ``--persist-dir``: upload one context
   (default 256K keys of ``h_kv=8, d=128``, bfloat16: 1 GiB of K+V) with the client;
2. the same with ``--persist-dir`` on a fresh folder: the same upload (every chunk
   durable on disk before it is acknowledged);
3. stop that server and start it again on the same folder: seconds from the start of
   ``splitkey serve`` until the context answers a query; and, beside it, the same start
   on an empty folder until ``/readyz`` answers. Their difference per GiB is the cost of
   loading what is stored.

Medians over rounds; the folder is under ``--dir`` (default the system's temporary
folder, which is the local disk here).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common
from service.client import Client
from workers import DTYPES

HEADS = {"h_kv": 8, "d": 128}


def context(n: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (n, HEADS["h_kv"], HEADS["d"])
    return (rng.standard_normal(shape, dtype=np.float32).astype(DTYPES[dtype]),
            rng.standard_normal(shape, dtype=np.float32).astype(DTYPES[dtype]))


def upload_gbps(url: str, k: np.ndarray, v: np.ndarray) -> tuple[float, str]:
    with Client(url) as c:
        t0 = time.perf_counter()
        ctx = c.create_context(k, v)["id"]
        seconds = time.perf_counter() - t0
    return (k.nbytes + v.nbytes) / seconds / 1e9, ctx


def restart_seconds(workdir: Path, store: Path, ctx: str | None, q: np.ndarray) -> float:
    """From starting ``splitkey serve`` on ``store`` to the context answering a query (None: to ``/readyz``)."""
    port = common.free_port()
    home = workdir / f"home-{port}"
    home.mkdir()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--workers", "2",
           "--persist-dir", str(store)]
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with common.served(cmd, {**os.environ, "HOME": str(home)}, url + "/readyz", workdir / f"serve-{port}.log"):
        if ctx is not None:
            with Client(url) as c:
                c.attention(q, contexts=[ctx])
        return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-k", type=common.parse_keys, default=[256 * common.KIB])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--rounds", type=common.positive, default=3)
    p.add_argument("--dir", default=None, help="where the persisted contexts go (default: a temporary folder)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    n = 16 * common.KIB if args.quick else args.n_k[0]
    rounds = 1 if args.quick else args.rounds
    common.raise_on_sigterm()
    notes = [common.wait_for_quiet(not args.no_wait and not args.quick)]
    k, v = context(n, args.dtype, 0)
    q = np.random.default_rng(1).standard_normal((1, 32, HEADS["d"]), dtype=np.float32).astype(DTYPES[args.dtype])
    gib = (k.nbytes + v.nbytes) / 2**30
    plain, durable, restart, empty = [], [], [], []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        for r in range(rounds):
            with common.splitkey_server(work / f"plain-{r}") as url:
                plain.append(upload_gbps(url, k, v)[0])
            store = work / f"store-{r}"
            with common.splitkey_server(work / f"durable-{r}", args=("--persist-dir", str(store))) as url:
                rate, ctx = upload_gbps(url, k, v)
                durable.append(rate)
            restart.append(restart_seconds(work, store, ctx, q))
            empty.append(restart_seconds(work, work / f"empty-{r}", None, q))  # the same start, nothing to load
            disk = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
            shutil.rmtree(store)
    med = statistics.median
    lines = [
        f"### Persisted contexts, {datetime.date.today().isoformat()}", "",
        f"Command: `.venv/bin/python benchmarks/persist.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        *common.machine_lines(),
        (f"- context: {n} keys of h_kv={HEADS['h_kv']}, d={HEADS['d']}, {args.dtype} ({gib:.2f} GiB of K+V, "
         f"{disk / 2**30:.2f} GiB on disk); {rounds} round(s); 2 workers"),
        notes[0], f"- whole run: {time.monotonic() - t_start:.0f} s", "",
        common.markdown_table(["round", "upload GB/s, memory only", "upload GB/s, --persist-dir", "ratio",
                               "restart s", "start s, empty folder", "load s per GiB"],
                              [[r + 1, f"{a:.3f}", f"{b:.3f}", f"{b / a:.2f}", f"{s:.1f}", f"{e:.1f}",
                                f"{(s - e) / gib:.1f}"]
                               for r, (a, b, s, e) in enumerate(zip(plain, durable, restart, empty))]
                              + [["median", f"{med(plain):.3f}", f"{med(durable):.3f}",
                                  f"{med(durable) / med(plain):.2f}", f"{med(restart):.1f}", f"{med(empty):.1f}",
                                  f"{(med(restart) - med(empty)) / gib:.1f}"]]),
    ]
    common.emit_report("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
