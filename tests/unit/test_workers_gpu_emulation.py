"""The fused kernels of attention.cu, run on CPU threads, against the float64 reference.

workers/gpu/kernels/cpu_emulation.hpp turns every CUDA thread into a std::thread
(barriers for __syncthreads, per-warp buffers for shuffles and mma.sync), and
g++ compiles it with attention.cu into a shared library. A stand-in for cupy's
RawModule hands that library to the real ``Launcher``, so the whole fused path
of ``workers.gpu.backend.launch_fused`` (strides, positions, argument packing, chunk
kernel, combine) runs here on numpy arrays. What only a GPU can show (timing,
the hardware's mma fragment layout) is in tests/unit/test_workers_gpu_kernels.py.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from kept_build import kept_build
from reference import assert_close_to_reference

from merge import finalize
from workers import BFLOAT16
from workers.gpu.backend import launch_fused
from workers.gpu.launch import DEFAULT_SHARED_BYTES, SOURCE_PATH, DeviceLimits, KernelKey, Launcher, choose_fused
from workers.layout import NaturalKV, StreamingKV
from workers.options import AttentionOptions
from workers.problem import check_problem

CXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="g++ not found: the CPU emulation of the kernels needs C++20")

#: An emulated device: few multiprocessors, so that small problems still split into chunks.
LIMITS = DeviceLimits(sm_count=2, max_shared_bytes=227 * 1024, compute_capability=90)


def case(name, dtype, n_q, h_q, h_kv, d, d_v, n_k, *, layout="natural", chunk=None, positions=False,
         pad_k=0, **opts):
    return pytest.param(dict(dtype=dtype, n_q=n_q, h_q=h_q, h_kv=h_kv, d=d, d_v=d_v, n_k=n_k, layout=layout,
                             chunk=chunk, positions=positions, pad_k=pad_k, opts=opts), id=name)


CASES = [
    case("decode-f16-gqa-causal", np.float16, 1, 8, 2, 64, 64, 300, causal=True),
    case("decode-bf16-mha-window-alibi-positions-chunks", BFLOAT16, 2, 4, 4, 32, 48, 333, chunk=64,
         positions=True, window=(40, 3), alibi_slopes=np.linspace(0.05, 0.4, 4)),
    case("decode-f32-mqa-softcap-scale", np.float32, 3, 8, 1, 64, 32, 260, chunk=128, softcap=4.0, scale=0.3),
    case("decode-bf16-resident-dmajor-tail", BFLOAT16, 1, 4, 2, 64, 64, 203, layout="resident", chunk=64,
         positions=True, causal=True),
    case("decode-f16-unaligned-rows-scalar-loads", np.float16, 2, 4, 2, 16, 16, 150, pad_k=4, chunk=64),
    case("decode-f32-d256-large-shared", np.float32, 1, 2, 1, 256, 256, 70),
    case("decode-f16-fully-masked-rows", np.float16, 2, 2, 1, 16, 8, 130, positions=True, window=(0, 0), chunk=64),
    case("decode-f16-causal-later-chunks-fully-masked", np.float16, 1, 2, 1, 16, 16, 256, chunk=64, causal=True,
         q_pos=np.array([10]), k_pos=np.arange(256)),
    case("prefill-bf16-mma-causal", BFLOAT16, 20, 4, 1, 32, 16, 150, causal=True),
    case("prefill-f16-mma-resident-window-alibi", np.float16, 40, 2, 2, 64, 32, 130, layout="resident",
         chunk=64, positions=True, window=(50, 10), alibi_slopes=np.array([0.1, 0.3])),
    case("prefill-f32-fma-softcap", np.float32, 33, 2, 1, 16, 8, 100, softcap=2.5),
    case("prefill-f16-fma-d24", np.float16, 36, 1, 1, 24, 16, 90, causal=True, chunk=64),
]


def make_inputs(c, rng):
    q = rng.standard_normal((c["n_q"], c["h_q"], c["d"])).astype(c["dtype"])
    k_full = rng.standard_normal((c["n_k"], c["h_kv"], c["d"] + c["pad_k"])).astype(c["dtype"])
    k = k_full[:, :, : c["d"]]  # pad_k > 0: a row stride that is no multiple of a 16-byte vector
    v_full = rng.standard_normal((c["n_k"], c["h_kv"], c["d_v"] + c["pad_k"])).astype(c["dtype"])
    v = v_full[:, :, : c["d_v"]]  # likewise for values
    opts = dict(c["opts"])
    if "q_pos" not in opts and (c["positions"] or c["layout"] == "resident"):
        opts["k_pos"] = np.sort(rng.permutation(3 * c["n_k"])[: c["n_k"]]).astype(np.int64)
        opts["q_pos"] = rng.integers(0, 3 * c["n_k"], c["n_q"]).astype(np.int64)
        if "window" in opts and opts["window"] == (0, 0):
            opts["q_pos"][0] = 10 * c["n_k"]  # no key at this position: the row sees nothing
    return q, k, v, opts


def plan_case(c, rng):
    q, k, v, opts = make_inputs(c, rng)
    attn = {key: opts[key] for key in ("scale", "causal", "window", "softcap", "alibi_slopes") if key in opts}
    problem = check_problem(q, k, v, opts.get("q_pos"), opts.get("k_pos"), AttentionOptions(**attn))
    if c["layout"] == "resident":
        kv = StreamingKV.from_arrays(np.ascontiguousarray(k), np.ascontiguousarray(v), opts["k_pos"]).snapshot()
    else:
        kv = NaturalKV(k, v, problem.k_pos)
    unit_last = k.strides[2] == k.itemsize and v.strides[2] == v.itemsize
    plan, key = choose_fused((q.dtype, k.dtype, v.dtype), c["d"], c["d_v"], c["n_q"] * (c["h_q"] // c["h_kv"]),
                             c["h_kv"], c["n_k"], c["layout"] == "resident", unit_last, LIMITS, chunk_keys=c["chunk"])
    return q, k, v, opts, problem, kv, plan, key


class EmulatedKernel:
    """A RawKernel stand-in: calls the emulated launch with cuLaunchKernel-style arguments."""

    def __init__(self, fn):
        self.fn = fn
        self.max_dynamic_shared_size_bytes = DEFAULT_SHARED_BYTES

    def __call__(self, grid, block, args, shared_mem=0):
        # A launch asking for more than the kernel's limit fails on a GPU; fail here too.
        assert shared_mem <= self.max_dynamic_shared_size_bytes, "dynamic shared memory above the kernel's limit"
        keep = []
        for a in args:
            if isinstance(a, np.ndarray):
                keep.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, np.int32):
                keep.append(ctypes.c_int32(int(a)))
            elif isinstance(a, np.int64):
                keep.append(ctypes.c_int64(int(a)))
            elif isinstance(a, np.float32):
                keep.append(ctypes.c_float(float(a)))
            else:
                raise TypeError(f"kernel argument of unexpected type {type(a).__name__}")
        argv = (ctypes.c_void_p * len(keep))(*[ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in keep])
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        self.fn(argv, gx, gy, gz, block[0], shared_mem)


class EmulatedCupy:
    """The part of cupy that ``Launcher`` uses: RawModule over the emulation library."""

    def __init__(self, lib, symbols):
        self.lib, self.symbols = lib, symbols

    def RawModule(self, code, options, name_expressions=()):  # noqa: N802 - cupy's name
        assert code == SOURCE_PATH.read_text()
        return self

    def get_function(self, name):
        fn = getattr(self.lib, self.symbols[name])
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 5
        return EmulatedKernel(fn)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory, pytestconfig):
    """Build one library with every kernel the cases use; return a Launcher over it.

    The library is kept in pytest's cache folder under the hash of everything that goes into it (the
    sources of workers/gpu/kernels, the instances, the command): a later run that changed none of it
    loads it instead of compiling again (2-3 s here); without the cache plugin it is built each run."""
    keys = sorted({plan_case(p.values[0], np.random.default_rng(0))[-1] for p in CASES}, key=KernelKey.name)
    symbols = {"combine_chunks": "sk_combine"}
    lines = ['#include "cpu_emulation.hpp"', '#include "attention.cu"',
             'extern "C" void sk_combine(void** a, unsigned x, unsigned y, unsigned z, unsigned b, unsigned s) '
             '{ sk_emu::launch([&] { sk_emu::call(&combine_chunks, a); }, x, y, z, b, s); }']
    for i, key in enumerate(keys):
        symbols[key.name()] = f"sk_attend_{i}"
        lines.append(f'extern "C" void sk_attend_{i}(void** a, unsigned x, unsigned y, unsigned z, unsigned b, '
                     f'unsigned s) {{ sk_emu::launch([&] {{ sk_emu::call(&{key.name()}, a); }}, x, y, z, b, s); }}')
    out = tmp_path_factory.mktemp("emulation")
    src, lib = out / "emulation.cpp", out / "emulation.so"
    src.write_text("\n".join(lines) + "\n")
    flags = ["-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing", "-Wno-unknown-pragmas"]

    def build() -> None:
        cmd = [CXX, *flags, f"-I{SOURCE_PATH.parent}", str(src), "-o", str(lib)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]

    lib = kept_build(pytestconfig, "gpu-emulation", [*lines, *flags, CXX], SOURCE_PATH.parent, lib, build)
    return Launcher(EmulatedCupy(ctypes.CDLL(str(lib)), symbols))


@pytest.mark.parametrize("c", CASES)
def test_emulated_fused_kernels_match_reference(emulated, c, rng):
    q, k, v, opts, problem, kv, plan, key = plan_case(c, rng)
    state = launch_fused(q, kv, problem, plan, key, xp=np, launcher=emulated)
    out, lse = finalize(state)
    assert out.dtype == np.float32 and out.shape == (c["n_q"], c["h_q"], c["d_v"])
    assert_close_to_reference(out, lse, q, k, v, **opts)


def test_emulated_cases_cover_both_kernels_layouts_and_many_chunks():
    plans = [plan_case(p.values[0], np.random.default_rng(0)) for p in CASES]
    keys = {key for *_, key in plans}
    assert {key.mma for key in keys} == {True, False}
    assert {key.dmajor for key in keys} == {True, False}
    assert {key.fmt for key in keys} == {0, 1, 2}
    assert {plan.kernel for *_, plan, _ in plans} == {"decode", "prefill"}
    assert max(plan.n_chunks for *_, plan, _ in plans) >= 5
    assert any(key.shared_bytes() > DEFAULT_SHARED_BYTES for key in keys)
