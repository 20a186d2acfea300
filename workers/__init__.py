"""Kernels and shard workers: partial attention over one shard of keys -> State.

``partial_attention`` and ``attention`` take numpy (CPU kernel) or cupy arrays
(GPU path, ``workers.gpu``). Ray actors live in ``workers.actor`` and are not
imported here, so library use needs no Ray.
"""

from workers.api import attention, partial_attention, partial_attention_resident
from workers.dtypes import BFLOAT16, bfloat16_from_bits, bfloat16_to_float32
from workers.layout import NaturalKV, StreamingKV, StreamingView
from workers.options import AttentionOptions, KernelOptions

__all__ = [
    "BFLOAT16",
    "AttentionOptions",
    "KernelOptions",
    "NaturalKV",
    "StreamingKV",
    "StreamingView",
    "attention",
    "bfloat16_from_bits",
    "bfloat16_to_float32",
    "partial_attention",
    "partial_attention_resident",
]
