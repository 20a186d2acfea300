"""The generic GPU path's own code (row tiles, bfloat16 bits, positions) run on numpy.

``workers.gpu.backend.run_generic`` is array-module neutral; with ``xp=numpy`` it runs
here exactly as it does on cupy, minus the device.
"""

import numpy as np
import pytest
from reference import assert_close_to_reference

from merge import finalize
from workers import BFLOAT16
from workers.gpu import backend as gpu
from workers.layout import NaturalKV, StreamingKV
from workers.options import AttentionOptions, KernelOptions
from workers.problem import check_problem

DTYPES = [np.float16, BFLOAT16, np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("resident", [False, True], ids=["natural", "resident"])
@pytest.mark.parametrize("opts", [
    {},
    {"causal": True, "alibi_slopes": np.linspace(0.05, 0.3, 8)},
    {"window": (40, 2), "softcap": 5.0, "scale": 0.2},
], ids=["plain", "causal-alibi", "window-softcap-scale"])
def test_generic_path_on_numpy_matches_reference(rng, dtype, resident, opts, monkeypatch):
    # A small scratch budget forces several row tiles and blocks.
    monkeypatch.setattr(gpu, "GPU_SCRATCH_BYTES", 16 * 1024)
    q = rng.standard_normal((9, 8, 16)).astype(dtype)
    k = rng.standard_normal((300, 2, 16)).astype(dtype)
    v = rng.standard_normal((300, 2, 24)).astype(dtype)
    q_pos = rng.integers(0, 600, 9)
    k_pos = np.sort(rng.permutation(600)[:300]).astype(np.int64)
    problem = check_problem(q, k, v, q_pos, k_pos, AttentionOptions(**opts))
    kv = StreamingKV.from_arrays(k, v, k_pos).snapshot() if resident else NaturalKV(k, v, problem.k_pos)
    row_tile, _ = gpu.generic_tiles(2, 9 * 4, 16, 24, problem.acc_dtype.itemsize, KernelOptions())
    assert row_tile < 9 * 4
    out, lse = finalize(gpu.run_generic(q, kv, problem, KernelOptions(), xp=np))
    assert out.dtype == problem.acc_dtype
    assert_close_to_reference(out, lse, q, k, v, q_pos=q_pos, k_pos=k_pos, **opts)


def test_generic_path_widens_bfloat16_by_its_bits():
    # bfloat16 values that a float16 detour would round or overflow.
    k = np.array([[[3.0e38, 1.5e-38]]], dtype=np.float32).astype(BFLOAT16)  # [1, 1, 2]
    bits = k.view(np.uint16)
    wide = gpu._bits_to_float(bits, np.float32, np)
    assert np.array_equal(wide, k.astype(np.float32))


def test_generic_path_with_default_positions_matches_reference(rng):
    q = rng.standard_normal((3, 4, 8)).astype(BFLOAT16)
    k = rng.standard_normal((100, 4, 8)).astype(BFLOAT16)
    v = rng.standard_normal((100, 4, 8)).astype(BFLOAT16)
    problem = check_problem(q, k, v, None, None, AttentionOptions(causal=True))
    out, lse = finalize(gpu.run_generic(q, NaturalKV(k, v, problem.k_pos), problem, KernelOptions(block_size=7),
                                        xp=np))
    assert_close_to_reference(out, lse, q, k, v, causal=True)
