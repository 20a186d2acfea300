"""The launcher's CPU side: kernel choice, arguments against the .cu signatures, availability."""

import re

import numpy as np
import pytest

from workers import BFLOAT16
from workers.gpu import backend as gpu
from workers.gpu.launch import (
    ATTEND_PARAMS,
    COMBINE_PARAMS,
    FORMATS,
    SOURCE_PATH,
    DeviceLimits,
    FusedUnsupported,
    KernelKey,
    choose_fused,
    pack,
)
from workers.gpu.plan import KEY_TILE, THREADS
from workers.options import KernelOptions
from workers.plan import BLOCK_GRANULE, MIN_BLOCK

SOURCE = SOURCE_PATH.read_text()
H200 = DeviceLimits(sm_count=132, max_shared_bytes=227 * 1024, compute_capability=90)


def declared_params(kernel: str) -> list[tuple[str, str]]:
    """(name, kind) of each parameter of ``kernel`` in attention.cu; kind as in ATTEND_PARAMS."""
    match = re.search(rf"\b{kernel}\((.*?)\)\s*\{{", SOURCE, re.DOTALL)
    assert match, f"{kernel} not found in {SOURCE_PATH}"
    params = []
    for decl in match.group(1).split(","):
        words = decl.replace("*", " * ").split()
        name, ctype = words[-1], words[:-1]
        kind = "ptr" if "*" in ctype else {"i64": "i64", "int": "int", "float": "float"}[ctype[-1]]
        params.append((name, kind))
    return params


@pytest.mark.parametrize(("kernel", "params"), [("attend_chunks", ATTEND_PARAMS), ("combine_chunks", COMBINE_PARAMS)])
def test_launcher_arguments_match_the_kernel_signature(kernel, params):
    assert declared_params(kernel) == list(params)


def test_python_constants_match_the_kernel_source():
    assert re.search(rf"constexpr int THREADS = {THREADS};", SOURCE)
    assert re.search(rf"constexpr int KEY_TILE = {KEY_TILE};", SOURCE)
    enum = dict(re.findall(r"FMT_(\w+) = (\d)", SOURCE))
    assert {"F16": FORMATS[np.dtype(np.float16)], "BF16": FORMATS[BFLOAT16],
            "F32": FORMATS[np.dtype(np.float32)]} == {k: int(v) for k, v in enum.items()}


def test_pack_gives_every_scalar_the_numpy_type_of_its_c_type():
    arr = np.zeros(4, dtype=np.float32)
    values = {name: (arr if kind == "ptr" else 3) for name, kind in ATTEND_PARAMS}
    values["factor"] = 0.125
    args = pack(ATTEND_PARAMS, values)
    want = {"ptr": np.ndarray, "int": np.int32, "i64": np.int64, "float": np.float32}
    assert [type(a) for a in args] == [want[kind] for _, kind in ATTEND_PARAMS]
    assert args[[n for n, _ in ATTEND_PARAMS].index("factor")] == np.float32(0.125)


@pytest.mark.parametrize(("change", "message"), [
    ({"n_q": 2**31}, "n_q must fit a C int, got 2147483648"),
    ({"n_k": 1.5}, "n_k must be an integer, got 1.5"),
    ({"factor": "x"}, "factor must be a real number, got 'x'"),
    ({"q": 7}, "q must be a device array, got int"),
])
def test_pack_rejects_values_the_kernel_cannot_take(change, message):
    values = {name: (np.zeros(1) if kind == "ptr" else 1) for name, kind in ATTEND_PARAMS}
    values.update(change)
    with pytest.raises(ValueError) as err:
        pack(ATTEND_PARAMS, values)
    assert str(err.value) == message


def test_pack_rejects_missing_and_extra_arguments():
    values = {name: 1 for name, _ in COMBINE_PARAMS if name != "g"}
    values["gg"] = 1
    with pytest.raises(ValueError, match=r"missing \['g'\], extra \['gg'\]"):
        pack(COMBINE_PARAMS, values)


def test_decode_of_bfloat16_uses_the_decode_kernel_on_cuda_cores():
    plan, key = choose_fused((BFLOAT16,) * 3, 128, 128, 4, 8, 1 << 20, False, True, H200)
    assert plan.kernel == "decode"
    assert key == KernelKey(fmt=1, d=128, d_v=128, rows=4, dmajor=False, mma=False)
    assert key.name() == "attend_chunks<1, 128, 128, 4, 0, 0>"


@pytest.mark.parametrize(("dtype", "d", "mma"), [(np.float16, 128, True), (BFLOAT16, 64, True),
                                                 (np.float16, 24, False), (np.float32, 128, False)])
def test_prefill_uses_tensor_cores_for_16_bit_inputs_with_d_a_multiple_of_16(dtype, d, mma):
    plan, key = choose_fused((dtype,) * 3, d, 64, 2048 * 4, 8, 32768, True, True, H200)
    assert plan.kernel == "prefill" and key.rows == 64 and key.mma is mma and key.dmajor


@pytest.mark.parametrize(("args", "reason"), [
    (((np.float64,) * 3, 64, 64, 4, 2, 100, False, True, H200), "got float64, float64, float64"),
    (((np.float16, np.float16, np.float32), 64, 64, 4, 2, 100, False, True, H200), "one dtype"),
    (((np.float16,) * 3, 20, 64, 4, 2, 100, False, True, H200), "d a multiple of 8 up to 256 for float16, got 20"),
    (((np.float32,) * 3, 64, 512, 4, 2, 100, False, True, H200), "d_v a multiple of 4 up to 256"),
    (((np.float16,) * 3, 64, 64, 4, 2, 100, False, False, H200), "unit stride"),
    (((np.float16,) * 3, 64, 64, 4, 2, 100, False, True, DeviceLimits(80, 64 * 1024, 75)), "capability >= 80"),
    (((np.float32,) * 3, 256, 256, 4096, 2, 100, False, True, DeviceLimits(108, 160 * 1024, 80)),
     "bytes of shared memory per block, the device allows 163840"),
])
def test_fused_choice_says_why_a_problem_cannot_run_fused(args, reason):
    with pytest.raises(FusedUnsupported, match=re.escape(reason)):
        choose_fused(*args)


def test_shared_bytes_grow_with_head_dims_and_rows():
    small = KernelKey(fmt=1, d=64, d_v=64, rows=4, dmajor=False, mma=False)
    assert small.shared_bytes() % 16 == 0
    assert KernelKey(1, 128, 64, 4, False, False).shared_bytes() > small.shared_bytes()
    assert KernelKey(1, 64, 64, 32, False, False).shared_bytes() > small.shared_bytes()
    assert KernelKey(2, 64, 64, 4, False, False).shared_bytes() > small.shared_bytes()


def test_the_unavailable_reason_is_none_or_says_why():
    reason = gpu.unavailable_reason()
    assert reason is None or reason.startswith(("cupy not installed", "cupy failed", "no CUDA device"))


def test_an_unknown_gpu_kernels_option_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="gpu_kernels must be one of 'generic', 'fused', got 'triton'"):
        KernelOptions(gpu_kernels="triton")


@pytest.mark.parametrize("n_rows", [1, 4, 8192, 10**6])
def test_generic_tiles_fit_the_scratch_budget(n_rows):
    row_tile, block = gpu.generic_tiles(8, n_rows, 128, 128, 4, KernelOptions())
    assert 1 <= row_tile <= n_rows and block % BLOCK_GRANULE == 0 and block >= MIN_BLOCK
    assert 8 * row_tile * block * 4 * 3 <= gpu.GPU_SCRATCH_BYTES or block == MIN_BLOCK
    assert gpu.generic_tiles(8, n_rows, 128, 128, 4, KernelOptions(block_size=100))[1] == 100
