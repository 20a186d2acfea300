"""GPU: the generic and fused paths against the float64 reference, over dtypes and options.

Skipped as a whole, with the reason, without cupy or a CUDA device. Run on a GPU
machine with ``python -m pytest -m gpu tests/unit/test_workers_gpu_kernels.py`` (or
benchmarks/gpu.sh, which also records the results).
"""

import numpy as np
import pytest
from reference import assert_close_to_reference

from merge import finalize, merge_all
from workers import BFLOAT16, partial_attention
from workers.gpu import backend as gpu
from workers.layout import NaturalKV, StreamingKV
from workers.options import AttentionOptions, GpuKernels, KernelOptions
from workers.problem import check_problem

REASON = gpu.unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"GPU tests need a GPU: {REASON}")]

FUSED_DTYPES = [np.float16, BFLOAT16, np.float32]
DTYPES = [*FUSED_DTYPES, np.float64]
ATTN = ("scale", "causal", "window", "softcap", "alibi_slopes")

#: (n_q, h_q, h_kv, d, d_v, n_k, options): decode and prefill shapes, every option.
CASES = {
    "decode-gqa-causal": (1, 32, 8, 128, 128, 3000, {"causal": True}),
    "decode-mqa-window-alibi": (2, 16, 1, 64, 64, 2000,
                                {"window": (300, 0), "alibi_slopes": np.linspace(0.01, 0.2, 16)}),
    "decode-mha-softcap-scale-positions": (1, 4, 4, 64, 32, 1500, {"softcap": 20.0, "scale": 0.1, "positions": True}),
    "prefill-gqa-causal": (200, 8, 2, 128, 128, 700, {"causal": True}),
    "prefill-window-alibi-positions": (100, 4, 4, 64, 64, 500,
                                       {"window": (60, 8), "alibi_slopes": np.linspace(0.05, 0.3, 4),
                                        "positions": True}),
}


def fused(q, kv, problem, kopts):
    """The fused kernels only, no generic fallback: raises FusedUnsupported when they cannot run it."""
    plan, key = gpu.fused_choice(q, kv, problem, kopts)
    return gpu.launch_fused(q, kv, problem, plan, key)


def to_device(x):
    """numpy -> cupy; bfloat16 travels as its uint16 bits and is viewed back."""
    cp = gpu.cupy
    if x.dtype == BFLOAT16:
        return cp.asarray(x.view(np.uint16)).view(BFLOAT16)
    return cp.asarray(x)


def make(rng, name, dtype):
    n_q, h_q, h_kv, d, d_v, n_k, opts = CASES[name]
    opts = dict(opts)
    q = rng.standard_normal((n_q, h_q, d)).astype(dtype)
    k = rng.standard_normal((n_k, h_kv, d)).astype(dtype)
    v = rng.standard_normal((n_k, h_kv, d_v)).astype(dtype)
    if opts.pop("positions", False):
        opts["k_pos"] = np.sort(rng.permutation(3 * n_k)[:n_k]).astype(np.int64)
        opts["q_pos"] = rng.integers(0, 3 * n_k, n_q).astype(np.int64)
    return q, k, v, opts


def device_problem(q, k, v, opts):
    qd, kd, vd = to_device(q), to_device(k), to_device(v)
    attn = AttentionOptions(**{key: opts[key] for key in ATTN if key in opts})
    return qd, kd, vd, check_problem(qd, kd, vd, opts.get("q_pos"), opts.get("k_pos"), attn)


def host_result(state):
    out, lse = finalize(state)
    return out.get(), lse.get()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("name", CASES)
def test_generic_gpu_path_matches_reference(rng, name, dtype):
    q, k, v, opts = make(rng, name, dtype)
    qd, kd, vd, _ = device_problem(q, k, v, opts)
    state = partial_attention(qd, kd, vd, **opts)  # cupy arrays: workers.api sends them to workers.gpu
    assert isinstance(state.m, gpu.cupy.ndarray)
    out, lse = host_result(state)
    assert_close_to_reference(out, lse, q, k, v, **opts)


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("name", CASES)
def test_fused_kernels_match_reference(rng, name, dtype):
    q, k, v, opts = make(rng, name, dtype)
    qd, kd, vd, problem = device_problem(q, k, v, opts)
    state = fused(qd, NaturalKV(kd, vd, problem.k_pos), problem, KernelOptions())  # raises if not fused
    out, lse = host_result(state)
    assert_close_to_reference(out, lse, q, k, v, **opts)


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("name", ["decode-gqa-causal", "prefill-window-alibi-positions"])
def test_fused_kernels_on_resident_d_major_keys_match_reference(rng, name, dtype):
    q, k, v, opts = make(rng, name, dtype)
    k_pos = opts.setdefault("k_pos", np.arange(k.shape[0]))
    opts.setdefault("q_pos", np.arange(k.shape[0] - q.shape[0], k.shape[0]))
    qd, kd, vd, problem = device_problem(q, k, v, opts)
    view = StreamingKV.from_arrays(kd, vd, gpu.cupy.asarray(k_pos)).snapshot()
    out, lse = host_result(fused(qd, view, problem, KernelOptions()))
    assert_close_to_reference(out, lse, q, k, v, **opts)


def test_fused_decode_over_many_chunks_some_fully_masked_matches_reference(rng):
    q, k, v, _ = make(rng, "decode-gqa-causal", BFLOAT16)
    opts = {"window": (500, 0), "q_pos": np.array([1200])}
    qd, kd, vd, problem = device_problem(q, k, v, opts)
    state = fused(qd, NaturalKV(kd, vd, problem.k_pos), problem, KernelOptions(block_size=64))
    out, lse = host_result(state)
    assert_close_to_reference(out, lse, q, k, v, **opts)


def test_fused_kernels_with_unaligned_rows_use_scalar_loads_and_match_reference(rng):
    q = rng.standard_normal((1, 8, 64)).astype(np.float16)
    k_pad = rng.standard_normal((999, 2, 68)).astype(np.float16)  # row stride 68: no whole 16-byte vectors
    v_pad = rng.standard_normal((999, 2, 68)).astype(np.float16)
    k, v = k_pad[:, :, :64], v_pad[:, :, :64]
    qd, kd, vd = to_device(q), to_device(k_pad)[:, :, :64], to_device(v_pad)[:, :, :64]
    problem = check_problem(qd, kd, vd, None, None, AttentionOptions())
    out, lse = host_result(fused(qd, NaturalKV(kd, vd, problem.k_pos), problem, KernelOptions()))
    assert_close_to_reference(out, lse, q, k, v)


def test_fused_option_runs_float64_on_the_generic_path(rng):
    q, k, v, opts = make(rng, "decode-mqa-window-alibi", np.float64)
    qd, kd, vd, problem = device_problem(q, k, v, opts)
    state = gpu.run_gpu(qd, NaturalKV(kd, vd, problem.k_pos), problem, KernelOptions(gpu_kernels=GpuKernels.FUSED))
    assert state.dtype == np.float64
    out, lse = host_result(state)
    assert_close_to_reference(out, lse, q, k, v, **opts)


def test_empty_shard_on_the_gpu_is_the_empty_state(rng):
    q, k, v, _ = make(rng, "decode-gqa-causal", np.float16)
    qd, kd, vd, problem = device_problem(q, k[:0], v[:0], {})
    for kernels in GpuKernels:
        state = gpu.run_gpu(qd, NaturalKV(kd, vd, problem.k_pos), problem, KernelOptions(gpu_kernels=kernels))
        assert bool(gpu.cupy.all(gpu.cupy.isneginf(state.m))) and int(gpu.cupy.count_nonzero(state.l)) == 0


def test_gpu_shard_states_merge_with_cpu_shard_states(rng):
    q, k, v, _ = make(rng, "decode-gqa-causal", BFLOAT16)
    n_k = k.shape[0]
    k_pos, q_pos = np.arange(n_k), np.array([n_k - 1])
    half = n_k // 2
    qd, kd, vd, problem = device_problem(q, k[half:], v[half:], {"causal": True, "k_pos": k_pos[half:],
                                                                 "q_pos": q_pos})
    gpu_state = gpu.run_gpu(qd, NaturalKV(kd, vd, problem.k_pos), problem, KernelOptions(gpu_kernels=GpuKernels.FUSED))
    cpu_state = partial_attention(q, k[:half], v[:half], causal=True, k_pos=k_pos[:half], q_pos=q_pos)
    host = type(cpu_state)(m=gpu_state.m.get(), l=gpu_state.l.get(), acc=gpu_state.acc.get())
    out, lse = finalize(merge_all([cpu_state, host]))
    assert_close_to_reference(out, lse, q, k, v, causal=True)
