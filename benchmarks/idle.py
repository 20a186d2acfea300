"""Work right after an idle pause (issue 17): how much slower the same in-process work runs after the
thread slept than back to back, on this machine.

Run from the repository root (``pip install -e '.[bench]'``)::

    .venv/bin/python benchmarks/idle.py --rounds 5 --out /tmp/idle.md --json /tmp/idle.json
    .venv/bin/python benchmarks/idle.py --quick

An engine's call reaches a worker that has been idle since its last one, and the front end and the
client wait idle while the worker computes; a benchmark loop that calls the kernel back to back
never idles. Each work below is timed right after each pause, one thread (BLAS too):

* **sgemm in cache**: ``[192, 192] @ [192, 192]`` float32 (440 KiB with its answer, within one
  core's L2), four times in a row, each timed: whether the slowdown fades within a millisecond;
* **decode kernel**: ``partial_attention_resident`` over 512 and 4096 resident keys (decode shape
  ``h_q=32, h_kv=8, d=128`` float32, 4 and 32 MiB of K+V), what a worker runs per call.

Pauses: none (back to back), ``time.sleep`` of 1, 3 and 20 ms, and 3 ms of spinning (the thread
stays on its core, busy). Rounds take the pauses in turn; medians over rounds of per-round medians.
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

from benchmarks import common
from workers import StreamingKV, partial_attention_resident
from workers.options import AttentionOptions, KernelOptions

HEADS = {"h_q": 32, "h_kv": 8, "d": 128}
#: sgemm's side: three [192, 192] float32 matrices take 432 KiB, inside a 512 KiB L2.
GEMM_N = 192
#: The sgemm is timed this many times in a row after each pause.
GEMM_PIECES = 4


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


#: name -> what runs before each timed work (none: back to back).
PAUSES: dict[str, Callable[[], object]] = {
    "back to back": lambda: None,
    "sleep 1 ms": lambda: time.sleep(0.001),
    "sleep 3 ms": lambda: time.sleep(0.003),
    "sleep 20 ms": lambda: time.sleep(0.020),
    "spin 3 ms": lambda: spin(0.003),
}


def decode_call(n_k: int) -> Callable[[], Any]:
    """One worker's decode call over ``n_k`` resident keys, as a closure."""
    rng = np.random.default_rng(n_k)
    shape = (n_k, HEADS["h_kv"], HEADS["d"])
    k, v = rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)
    view = StreamingKV.from_arrays(k, v, np.arange(n_k)).snapshot()
    q = rng.standard_normal((1, HEADS["h_q"], HEADS["d"]), dtype=np.float32)
    q_pos, options, kernel = np.array([n_k]), AttentionOptions(), KernelOptions(threads=1)
    return lambda: partial_attention_resident(q, view, q_pos=q_pos, options=options, kernel=kernel)


def gemm_pieces() -> Callable[[], list[float]]:
    a = np.random.default_rng(0).standard_normal((GEMM_N, GEMM_N), dtype=np.float32)
    out = np.empty_like(a)

    def run() -> list[float]:
        t = [time.perf_counter()]
        for _ in range(GEMM_PIECES):
            np.matmul(a, a, out=out)
            t.append(time.perf_counter())
        return [b - a for a, b in zip(t, t[1:])]
    return run


def measure(works: dict[str, Callable[[], Any]], calls: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per work and pause, per round: the median seconds of ``calls`` timed works, each after its pause
    (sgemm: one entry per piece, "sgemm piece i")."""
    got: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for pause_name, pause in PAUSES.items():
            for work_name, work in works.items():
                samples: list[Any] = []
                for _ in range(calls):
                    pause()
                    t0 = time.perf_counter()
                    result = work()
                    samples.append(result if work_name == "sgemm" else time.perf_counter() - t0)
                if work_name == "sgemm":
                    for i in range(GEMM_PIECES):
                        got.setdefault(f"sgemm piece {i + 1}", {}).setdefault(pause_name, []).append(
                            statistics.median(s[i] for s in samples))
                else:
                    got.setdefault(work_name, {}).setdefault(pause_name, []).append(statistics.median(samples))
    return got


def report(args: argparse.Namespace, got: dict[str, dict[str, list[float]]]) -> str:
    med = {work: {p: statistics.median(v) for p, v in by.items()} for work, by in got.items()}
    rows = [[work] + [f"{med[work][p] * 1e3:.3f} ({med[work][p] / med[work]['back to back']:.2f}x)" for p in PAUSES]
            for work in med]
    return "\n".join([
        f"### Work after an idle pause ({datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')})",
        "", f"Command: `.venv/bin/python benchmarks/idle.py {' '.join(args.argv)}`", "",
        *common.machine_lines(), "",
        f"ms per work (its ratio to back to back), medians over {args.rounds} rounds of {args.calls} calls each; "
        f"one thread. sgemm: [{GEMM_N}, {GEMM_N}] float32 squared in cache, the {GEMM_PIECES} pieces timed one "
        "after another after each pause; decode: one worker's call over that many resident keys.", "",
        common.markdown_table(["work", *PAUSES], rows), ""])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=common.positive, default=5)
    p.add_argument("--calls", type=common.positive, default=60)
    p.add_argument("--n-k", type=common.parse_keys, default=[512, 4096], help="decode kernels' key counts")
    p.add_argument("--quick", action="store_true", help="2 rounds of 10 calls")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.rounds, args.calls = 2, 10
    works: dict[str, Callable[[], Any]] = {"sgemm": gemm_pieces()}
    works.update({f"decode, {n} keys": decode_call(n) for n in args.n_k})
    with common.blas_threads(1):
        for work in works.values():  # warm: first calls allocate and page in
            for _ in range(5):
                work()
        got = measure(works, args.calls, args.rounds)
    common.emit_report(report(args, got), args.out)
    if args.json:
        common.write_json(args.json, {"argv": args.argv, "rounds": got})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
