"""attention.cu compiles for sm_80 and sm_90 (nvcc, NVRTC) and its layout matches the launcher's.

No GPU needed: nvcc --ptx and NVRTC only compile, and the shared-memory check
runs a host program. Each test skips with the reason when its tool is missing.
"""

import shutil
import subprocess

import pytest
from kept_build import kept_build

from workers.gpu.launch import NVRTC_OPTIONS, SOURCE_PATH, KernelKey

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH (CUDA toolkit not installed)")

#: One instantiation of every code path: formats, decode/prefill, natural/d-major, mma or not.
KEYS = [
    KernelKey(fmt=0, d=128, d_v=128, rows=4, dmajor=False, mma=False),
    KernelKey(fmt=1, d=128, d_v=128, rows=4, dmajor=False, mma=False),
    KernelKey(fmt=1, d=64, d_v=32, rows=32, dmajor=True, mma=False),
    KernelKey(fmt=2, d=128, d_v=64, rows=2, dmajor=False, mma=False),
    KernelKey(fmt=0, d=128, d_v=128, rows=64, dmajor=False, mma=True),
    KernelKey(fmt=1, d=128, d_v=128, rows=64, dmajor=True, mma=True),
    KernelKey(fmt=0, d=24, d_v=16, rows=64, dmajor=False, mma=False),
    KernelKey(fmt=2, d=256, d_v=256, rows=64, dmajor=True, mma=False),
]


def instantiations() -> str:
    refs = ",\n  ".join(f"(void*)&{key.name()}" for key in KEYS)
    return f'#include "{SOURCE_PATH}"\nvoid* sk_instances[] = {{\n  {refs},\n  (void*)&combine_chunks}};\n'


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile_to_ptx_with_nvcc(tmp_path, arch, pytestconfig):
    src = tmp_path / "instances.cu"
    src.write_text(instantiations())
    ptx = tmp_path / "instances.ptx"
    def build() -> None:
        done = subprocess.run([NVCC, "--ptx", f"-arch={arch}", "-o", str(ptx), str(src)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]

    # Kept in pytest's cache under the hash of the sources and the command (3-4 s per arch here).
    ptx = kept_build(pytestconfig, "nvcc-ptx", [instantiations(), arch, str(NVCC)], SOURCE_PATH.parent, ptx, build)
    text = ptx.read_text()
    assert text.count(".entry ") == len(KEYS) + 1
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text


@needs_nvcc
@pytest.mark.slow
def test_shared_memory_layout_of_the_kernel_matches_the_launcher(tmp_path):
    # The kernel traps when launched with less than Layout<...>::BYTES; the launcher
    # asks for KernelKey.shared_bytes(): a host program prints the former.
    lines = [f'#include "{SOURCE_PATH}"', "#include <cstdio>", "int main() {"]
    for key in KEYS:
        lines.append(f'  printf("%u\\n", Layout<{key.fmt}, {key.d}, {key.d_v}, {key.rows}, {int(key.dmajor)}, '
                     f'{int(key.mma)}>::BYTES);')
    lines += ["  return 0;", "}"]
    src, exe = tmp_path / "layout.cu", tmp_path / "layout"
    src.write_text("\n".join(lines) + "\n")
    done = subprocess.run([NVCC, "-arch=sm_80", "-o", str(exe), str(src)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    printed = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert [int(x) for x in printed] == [key.shared_bytes() for key in KEYS]


def nvrtc_unavailable() -> str | None:
    """Why NVRTC cannot be called here, or None. Never raises."""
    try:
        from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415 - optional, tests only

        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - any failure means "skip", with the reason
        return f"NVRTC unavailable ({type(exc).__name__}: {exc}); pip install cupy-cuda13x nvidia-cuda-nvrtc"
    return None


@pytest.mark.slow
@pytest.mark.skipif(nvrtc_unavailable() is not None, reason=nvrtc_unavailable() or "")
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_kernels_compile_with_nvrtc_as_cupy_will_compile_them(arch):
    from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415

    prog = nvrtc.createProgram(SOURCE_PATH.read_text(), "attention.cu", [], [])
    try:
        for key in KEYS:
            nvrtc.addNameExpression(prog, key.name())
        try:
            nvrtc.compileProgram(prog, [*NVRTC_OPTIONS, f"-arch={arch}"])
        except Exception as exc:  # noqa: BLE001 - show the compiler's log
            pytest.fail(f"NVRTC failed: {exc}\n{nvrtc.getProgramLog(prog)[-4000:]}")
        lowered = [nvrtc.getLoweredName(prog, key.name()) for key in KEYS]
        assert all(name.startswith("_Z13attend_chunks") for name in lowered)
        assert len(set(lowered)) == len(KEYS)
        assert len(nvrtc.getPTX(prog)) > 0
    finally:
        nvrtc.destroyProgram(prog)
