"""Kernels and shard workers: partial attention over one shard of keys -> State.

``partial_attention`` and ``attention`` take numpy (CPU backend, ``workers.cpu``)
or cupy arrays (GPU backend, ``workers.gpu``). Ray actors live in
``workers.actor`` and are not imported here, so library use needs no Ray.
"""

from workers.api import attention, partial_attention, partial_attention_resident, partial_attention_shard
from workers.dtypes import BFLOAT16, DTYPES, bfloat16_from_bits
from workers.layout import NaturalKV, ShardKV, ShardView, StreamingKV, StreamingView
from workers.options import AttentionOptions, CpuKernels, GpuKernels, KernelOptions

__all__ = [
    "BFLOAT16",
    "DTYPES",
    "AttentionOptions",
    "CpuKernels",
    "GpuKernels",
    "KernelOptions",
    "NaturalKV",
    "ShardKV",
    "ShardView",
    "StreamingKV",
    "StreamingView",
    "attention",
    "bfloat16_from_bits",
    "partial_attention",
    "partial_attention_resident",
    "partial_attention_shard",
]
