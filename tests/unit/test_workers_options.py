"""Typed options: AttentionOptions and KernelOptions check and normalise what they hold."""

import pytest

from workers.options import GpuKernels, KernelOptions, gpu_kernels_of


def test_kernels_option_parses_values_and_rejects_others():
    assert gpu_kernels_of("fused") is GpuKernels.FUSED
    assert gpu_kernels_of(GpuKernels.GENERIC) is GpuKernels.GENERIC
    assert KernelOptions(gpu_kernels="fused").gpu_kernels is GpuKernels.FUSED
    with pytest.raises(ValueError, match="gpu_kernels must be one of 'generic', 'fused', got 'cuda'"):
        gpu_kernels_of("cuda")
