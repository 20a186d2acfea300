"""Prefill over resident keys: the NumPy kernel, the fused kernel (row tiles) and torch SDPA, side by side.

A dated probe beside ``benchmarks/kernel.py`` (whose prefill table is float32 at n_q=256 only): n_q
256 and 2048 over 32K keys, h_q=32, h_kv=8, d=128, K and V float32 or bfloat16 (SDPA gets the same
dtype: its bfloat16 path may use the host's AMX tiles). Interleaved rounds, wall-clock medians, the
same thread count for everyone; every output checked against the NumPy kernel's.

    .venv/bin/python benchmarks/results/2026-12-07/prefill.py --threads 2 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks import kernel as K  # noqa: E402
from benchmarks.common import blas_threads, cpu_model  # noqa: E402
from workers.dtypes import dtype_of  # noqa: E402
from workers.options import CpuKernels  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--n-q", default="256,2048")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--numpy-up-to", type=int, default=256, help="largest n_q the NumPy kernel is timed at")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    h_q, h_kv, d, n_k = K.HEADS["h_q"], K.HEADS["h_kv"], K.HEADS["d"], 32 * 1024
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; threads {args.threads}; median of {args.repeat}")
    print("| K, V | n_q | NumPy GF/s | fused GF/s | SDPA GF/s | fused / SDPA | fused / NumPy | max diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.dtypes.split(","):
        dt = dtype_of(name)
        view, _ = K.resident_kv(n_k, h_kv, d, d, K.SEED, None, dt)
        tdt = torch.float32 if name == "float32" else torch.bfloat16
        k_sdpa = torch.from_numpy(np.ascontiguousarray(view.kt.astype(np.float32).transpose(0, 2, 1)))[None].to(tdt)
        v_sdpa = torch.from_numpy(view.v.astype(np.float32))[None].to(tdt)  # [1, h_kv, n_k, d]
        for n_q in (int(x) for x in args.n_q.split(",")):
            q = K.queries(n_q, h_q, d, K.SEED)
            fns = {"fused": lambda: K.ours_resident(q, view, True, args.threads, CpuKernels.FUSED)}
            if n_q <= args.numpy_up_to:
                fns["numpy"] = lambda: K.ours_resident(q, view, True, args.threads)

            def sdpa() -> tuple:
                qt = torch.from_numpy(np.ascontiguousarray(q.transpose(1, 0, 2)))[None].to(tdt)  # [1, h_q, n_q, d]
                mask = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
                with torch.inference_mode():
                    out = torch.nn.functional.scaled_dot_product_attention(qt, k_sdpa, v_sdpa, attn_mask=mask,
                                                                           enable_gqa=True)
                return out[0].permute(1, 0, 2).float().numpy(), None

            fns["sdpa"] = sdpa
            seconds: dict[str, list[float]] = {k: [] for k in fns}
            outs = {}
            with blas_threads(1):
                for _ in range(args.repeat):
                    for key, fn in fns.items():
                        outs[key] = fn()
                        t0 = time.perf_counter()
                        fn()
                        seconds[key].append(time.perf_counter() - t0)
            flops = 4.0 * n_q * h_q * n_k * d
            rate = {k: flops / statistics.median(v) / 1e9 for k, v in seconds.items()}
            diff = max(float(np.max(np.abs(outs[k][0] - outs["fused"][0]))) for k in outs)
            numpy_rate = f"{rate['numpy']:.1f}" if "numpy" in rate else "-"
            vs_numpy = f"{rate['fused'] / rate['numpy']:.2f}" if "numpy" in rate else "-"
            print(f"| {name} | {n_q} | {numpy_rate} | {rate['fused']:.1f} | {rate['sdpa']:.1f} "
                  f"| {rate['fused'] / rate['sdpa']:.2f} | {vs_numpy} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
