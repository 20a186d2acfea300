"""The fused CPU kernel's parts in cache, one thread, beside sgemm (issue 16): where a block's time goes.

Run from the repository root (``pip install -e '.[bench]'``)::

    .venv/bin/python benchmarks/kernel_parts.py --repeat 5 --out /tmp/parts.md --json /tmp/parts.json
    .venv/bin/python benchmarks/kernel_parts.py --quick

``benchmarks/kernel.py`` measures the whole kernel against the memory bandwidth; this script
takes one resident block apart, the unit the kernel repeats (``workers/fused_kernels.py``: one
kv head, ``--block`` keys, decode's g = 4 query rows, ``d = d_v = 128``), with its keys and values
in cache, so that what it shows is the rate of the instructions, not of the memory:

* **scores**: ``s = q k`` over d-major keys, by the register-tile micro-kernel
  (``workers.fused_micro.scores_dmajor_f32``) and by the vectorised loop
  (``workers.fused_kernels._scores_dmajor``);
* **softmax**: the online-softmax update of the four rows (``_softmax``: maxima, ``exp``, sums,
  the rescale of ``acc``);
* **p @ v**: the micro-kernel (``workers.fused_micro.pv_f32``) and the loop (``_pv``).

Each product is reported in GFLOP/s (2 flop per multiply-add) and as a share of sgemm at one
BLAS thread, timed in the same run (the core's multiply-add rate as BLAS reaches it); "block"
adds the parts the resident kernel runs for that dtype (as ``workers.fused_kernels`` picks them) and gives
the K+V bytes a second one core could stream if memory cost nothing: the in-cache roof of the
kernel as built, to set beside the GEMV bandwidth of ``benchmarks/kernel.py``. Medians of
``--repeat`` timed batches of ``--calls`` calls, the variants interleaved.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see benchmarks/service.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

#: Decode's tile: g = 4 query rows of one kv head (h_q = 32 over h_kv = 8), d = d_v = 128.
ROWS, D, D_V = 4, 128, 128
DTYPES = ("float32", "bfloat16", "float16")


def harnesses() -> dict[str, Callable[..., None]]:
    """The compiled loops that call each part ``n`` times (numba; compiled on first call)."""
    import numba

    import workers.fused_kernels as fk
    from workers.fused_micro import pv_f32, scores_dmajor_f32

    fm = fk.FASTMATH

    @numba.njit(nogil=True)
    def scores_micro(n: int, q: Any, kind: Any, k: Any, s: Any, nb: int, s_: Any, acc: Any, v: Any, vw: Any) -> None:
        for _ in range(n):
            scores_dmajor_f32(q, kind, q.shape[1], k, 0, nb, s, nb)

    @numba.njit(nogil=True, fastmath=fm)
    def scores_loop(n: int, q: Any, kind: Any, k: Any, s: Any, nb: int, s_: Any, acc: Any, v: Any, vw: Any) -> None:
        for _ in range(n):
            fk._scores_dmajor(q, kind, q.shape[1], k, 0, nb, s, nb)

    @numba.njit(nogil=True, fastmath=fm)
    def softmax(n: int, q: Any, kind: Any, k: Any, s: Any, nb: int, s_: Any, acc: Any, v: Any, vw: Any) -> None:
        m = np.empty(s.shape[0], dtype=np.float32)
        l_ = np.empty(s.shape[0], dtype=np.float32)
        for _ in range(n):
            for r in range(s.shape[0]):
                s_[r, :nb] = s[r, :nb]  # fresh scores each time: the update overwrites them with p
                m[r], l_[r] = -np.inf, 0
                fk._softmax(s_, r, nb, m, l_, acc, acc.shape[1], np.float32(0))

    @numba.njit(nogil=True)
    def pv_micro(n: int, q: Any, kind: Any, k: Any, s: Any, nb: int, s_: Any, acc: Any, v: Any, vw: Any) -> None:
        for _ in range(n):
            pv_f32(s, kind, nb, v, 0, acc.shape[1], acc, acc.shape[1])

    @numba.njit(nogil=True, fastmath=fm)
    def pv_loop(n: int, q: Any, kind: Any, k: Any, s: Any, nb: int, s_: Any, acc: Any, v: Any, vw: Any) -> None:
        for _ in range(n):
            fk._pv(s, kind, nb, v, 0, acc.shape[1], acc, acc.shape[1], vw)

    return {"scores micro": scores_micro, "scores loop": scores_loop, "softmax": softmax,
            "p @ v micro": pv_micro, "p @ v loop": pv_loop}


def operands(dtype: str, nb: int) -> tuple[Any, ...]:
    """One block's operands, keys and values stored as the kernel reads them (16-bit as bits)."""
    from workers.dtypes import dtype_of
    from workers.fused import _kernel_dtype

    dt = dtype_of(dtype)
    bits = _kernel_dtype(dt)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((ROWS, D), dtype=np.float32) / np.float32(np.sqrt(D))  # [R, d], scaled
    k = rng.standard_normal(D * nb, dtype=np.float32).astype(dt).view(bits)  # [d, nb] flat: d-major runs
    v = rng.standard_normal(nb * D_V, dtype=np.float32).astype(dt).view(bits)  # [nb, d_v] flat
    s = (rng.standard_normal((ROWS, nb)) * 0.1).astype(np.float32)  # [R, B] scores (p for p @ v)
    kind = np.ones(ROWS, dtype=np.int64)  # every row sees every key
    acc = np.zeros((ROWS, D_V), dtype=np.float32)
    vw = np.empty((4, D_V), dtype=np.float32)  # the loop's widening scratch
    return q, kind, k, s, nb, np.empty_like(s), acc, v, vw


def kernel_uses(dtype: str) -> tuple[str, str]:
    """The scores and p @ v variants the resident kernel compiles in for ``dtype``, asked of the
    kernel's own choices (``workers.fused_kernels._dense_choice`` and ``_pv_choice``)."""
    from numba import from_dtype
    from numba.core import types

    import workers.fused_kernels as fk
    from workers.dtypes import dtype_of
    from workers.fused import _kernel_dtype

    rows = types.Array(types.float32, 2, "C")  # q [R, d], s [R, B], acc [R, d_v]
    flat = types.Array(from_dtype(_kernel_dtype(dtype_of(dtype))), 1, "C")  # keys and values as read
    scores = "scores micro" if fk._dense_choice(rows, rows, flat) else "scores loop"
    pv = "p @ v micro" if fk._pv_choice(rows, rows, flat, True).__name__ == "micro" else "p @ v loop"
    return scores, pv


def sgemm_gflops(repeat: int) -> float:
    """sgemm at one BLAS thread, GFLOP/s: the best of ``repeat`` [1024, 1024] products."""
    a = np.random.default_rng(1).standard_normal((1024, 1024), dtype=np.float32)
    out = np.empty_like(a)
    with common.blas_threads(1):
        np.matmul(a, a, out=out)
        best = min(_timed(lambda: np.matmul(a, a, out=out)) for _ in range(repeat))
    return 2.0 * 1024**3 / best / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(dtypes: Sequence[str], nb: int, calls: int, repeat: int) -> dict[str, dict[str, list[float]]]:
    """``{dtype: {part: seconds per call, one per round}}``, the parts interleaved in each round."""
    parts = harnesses()
    args = {dt: operands(dt, nb) for dt in dtypes}
    for dt in dtypes:  # compile, page in, warm the caches
        for fn in parts.values():
            fn(2, *args[dt])
    got: dict[str, dict[str, list[float]]] = {dt: {name: [] for name in parts} for dt in dtypes}
    for _ in range(repeat):
        for dt in dtypes:
            for name, fn in parts.items():
                fn(1, *args[dt])
                got[dt][name].append(_timed(lambda: fn(calls, *args[dt])) / calls)  # noqa: B023 - called at once
    return got


def report(args: argparse.Namespace, got: dict[str, dict[str, list[float]]], sgemm: float) -> str:
    nb = args.block
    flop = {"scores": 2.0 * ROWS * D * nb, "p @ v": 2.0 * ROWS * nb * D_V}
    rows = []
    for dt, by in got.items():
        med = {name: statistics.median(v) for name, v in by.items()}
        itemsize = 4 if dt == "float32" else 2
        for name, sec in med.items():
            work = flop.get(name.rsplit(" ", 1)[0]) if name != "softmax" else None
            rate = f"{work / sec / 1e9:.1f}" if work else "-"
            share = f"{work / sec / 1e9 / sgemm:.0%}" if work else "-"
            rows.append([dt, name, f"{sec * 1e6:.1f}", rate, share, "-"])
        uses = (*kernel_uses(dt), "softmax")
        block_s = sum(med[u] for u in uses)
        kv = float(nb * (D + D_V) * itemsize)  # K [d, nb] and V [nb, d_v] of the block, bytes
        total = flop["scores"] + flop["p @ v"]
        rows.append([dt, "block: " + " + ".join(uses), f"{block_s * 1e6:.1f}", f"{total / block_s / 1e9:.1f}",
                     f"{total / block_s / 1e9 / sgemm:.0%}", f"{kv / block_s / 1e9:.1f}"])
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return "\n".join([
        f"### The fused kernel's parts in cache ({stamp})", "",
        f"Command: `.venv/bin/python benchmarks/kernel_parts.py {' '.join(args.argv)}`", "",
        *common.machine_lines(), "",
        f"One resident block: {ROWS} query rows of one kv head, {nb} keys, d = d_v = {D}, keys d-major, in cache; "
        f"one thread. sgemm at one BLAS thread in this run: {sgemm:.1f} GFLOP/s. Medians over {args.repeat} "
        f"rounds of {args.calls} calls. \"/ sgemm\": the part's multiply-add rate as a share of sgemm's; "
        "\"block\": the parts the resident kernel runs for that dtype, and the K+V GB/s one core would stream at that rate "
        "if memory cost nothing.", "",
        common.markdown_table(["K and V", "part", "us per block", "GFLOP/s", "/ sgemm", "K+V GB/s in cache"], rows),
        ""])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=common.positive, default=5, help="interleaved rounds (the median is reported)")
    p.add_argument("--calls", type=common.positive, default=200, help="calls per timed batch")
    p.add_argument("--block", type=common.positive, default=1024, help="keys per block (the kernel's resident block)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="K/V dtypes, comma-separated")
    p.add_argument("--quick", action="store_true", help="2 rounds of 5 calls over 64-key blocks")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        p.error(f"--dtypes must name some of {', '.join(DTYPES)}, got {args.dtypes!r}")
    if args.quick:
        args.repeat, args.calls, args.block = 2, 5, 64
    import numba

    numba.set_num_threads(1)
    sgemm = sgemm_gflops(args.repeat)
    got = measure(dtypes, args.block, args.calls, args.repeat)
    common.emit_report(report(args, got, sgemm), args.out)
    if args.json:
        common.write_json(args.json, {"argv": args.argv, "sgemm_gflops": sgemm, "seconds": got})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
