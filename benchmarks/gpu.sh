#!/usr/bin/env bash
# One prepared GPU check (docs/GPU.md, "Running on a GPU"): what is installed, the
# GPU tests, then the benchmark; under 5 minutes on an H200, no internet needed.
#   bash benchmarks/gpu.sh [OUT_DIR]      (default: $OUT, else ./gpu-results)
# Writes env.txt, gpu_tests.txt, gpu_bench.log, gpu_bench.json and gpu_bench.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu-results}}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

echo "## environment"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || echo "nvidia-smi: not found"
  nvcc --version | tail -n 2 || echo "nvcc: not found"
  "$PY" - <<'PYEOF'
import importlib
for name in ("numpy", "ml_dtypes", "cupy", "torch", "pytest", "pytest_timeout"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "(no version)"))
    except Exception as exc:
        print(f"{name}: MISSING ({type(exc).__name__}: {exc})")
try:
    import torch
    print("torch cuda:", torch.cuda.is_available(), "flash sdp enabled:", torch.backends.cuda.flash_sdp_enabled())
except Exception as exc:
    print("torch:", exc)
from workers.gpu import backend as gpu
print("workers.gpu.backend:", gpu.unavailable_reason() or "available")
PYEOF
} 2>&1 | tee "$OUT_DIR/env.txt"

echo "## GPU tests"
timeout 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider -o addopts="--import-mode=importlib" -rs tests/unit/test_workers_gpu_kernels.py tests/unit/test_workers_gpu_worker.py 2>&1 | tee "$OUT_DIR/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}

echo "## benchmark"
timeout 150 "$PY" benchmarks/gpu.py --out "$OUT_DIR" --budget-seconds 110 2>&1 | tee "$OUT_DIR/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu tests exit $tests_rc, benchmark exit $bench_rc; results in $OUT_DIR"
exit $(( tests_rc != 0 || bench_rc != 0 ))
