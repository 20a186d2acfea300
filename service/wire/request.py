"""The typed requests the service works on, each checked once where it enters.

A format decoder (``json_codec``, ``safetensors``, ``kserve``) reads a body into
:class:`Decoded` (named tensors, checked options); :func:`attention_request` and
:func:`context_write` then check every tensor rule once, through the same rule
functions as the library (``workers.problem``; their typed errors are answered
through the one table, ``service.core.errors.client_input``), and
return the object that travels on: arrays, a frozen ``AttentionOptions`` and
positions. What needs the cluster (the shapes of stored contexts, default
positions after them) is checked by the service once the contexts are resolved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from service.core.errors import InvalidOption, InvalidTensor, client_input
from service.wire.rules import RequestOptions
from workers.dtypes import BFLOAT16, FLOAT16
from workers.options import AttentionOptions
from workers.problem import KVDims, check_alibi, check_heads, check_kv, check_positions, check_q

#: Elements checked for finiteness at a time (bounds the temporary bool array).
FINITE_CHUNK = 1 << 20
#: The exponent bits of each 16-bit float dtype: all ones in a NaN or an infinity.
NONFINITE_EXPONENT = {FLOAT16: np.uint16(0x7C00), BFLOAT16: np.uint16(0x7F80)}


@dataclass(frozen=True, eq=False)
class Decoded:
    """A body as one format read it: named tensors (present as the kind requires) and checked options."""

    tensors: Mapping[str, np.ndarray]  #: views of the body where the format allows
    options: RequestOptions


@dataclass(frozen=True, eq=False)
class InlineKV:
    """Keys and values sent with a request."""

    k: np.ndarray  # [n_k, h_kv, d]
    v: np.ndarray  # [n_k, h_kv, d_v]
    k_pos: np.ndarray | None  # [n_k] int64; None: they continue after the keys before them
    dims: KVDims


@dataclass(frozen=True, eq=False)
class AttentionRequest:
    """``q`` over inline keys and/or stored contexts, checked as far as it can be without the cluster."""

    q: np.ndarray  # [n_q, h_q, d]
    q_pos: np.ndarray | None  # [n_q] int64; None: the n_q positions ending where the keys end
    kv: InlineKV | None
    options: AttentionOptions
    contexts: tuple[str, ...]
    n_q: int
    h_q: int
    d: int


@dataclass(frozen=True, eq=False)
class ContextWrite:
    """Keys and values to store (a new context) or to append to one."""

    kv: InlineKV
    replicas: int | None
    shards: int | None
    expected_length: int | None = None  #: create: keys the context will hold in all (at least these)
    after: int | None = None  #: append: the context's committed length this append must follow
    upload: str | None = None  #: append: the id of the chunked upload it belongs to
    continues: bool = False  #: append: refused unless the context's last append was this upload's


def check_finite(name: str, x: np.ndarray) -> None:
    """Refuse NaN and infinities in a float tensor (checked in chunks, no full-size temporary).

    16-bit floats are checked on their bits: a value is NaN or infinite exactly when
    its exponent bits are all ones (:data:`NONFINITE_EXPONENT`). NumPy's ``isfinite``
    does not know bfloat16 (its dtype kind is not ``"f"``) and runs float16 at about
    1.4 GB/s; integer masks run at memory speed.
    """
    dt = np.dtype(x.dtype)
    flat = x.reshape(-1)
    mask = NONFINITE_EXPONENT.get(dt)
    if mask is not None:
        bits = flat.view(np.uint16)
        for start in range(0, bits.shape[0], FINITE_CHUNK):
            if (bits[start:start + FINITE_CHUNK] & mask == mask).any():
                raise InvalidTensor(f"{name} must be finite, got NaN or infinity")
        return
    if dt.kind != "f":
        return
    for start in range(0, flat.shape[0], FINITE_CHUNK):
        if not np.isfinite(flat[start:start + FINITE_CHUNK]).all():
            raise InvalidTensor(f"{name} must be finite, got NaN or infinity")


def _positions(name: str, pos: np.ndarray | None, n: int) -> np.ndarray | None:
    return None if pos is None else check_positions(name, pos, n)


def _inline(tensors: Mapping[str, np.ndarray]) -> InlineKV:
    k, v = tensors["k"], tensors["v"]
    dims = check_kv(k, v)
    check_finite("k", k)
    check_finite("v", v)
    return InlineKV(k=k, v=v, k_pos=_positions("k_pos", tensors.get("k_pos"), dims.n_k), dims=dims)


def attention_request(decoded: Decoded) -> AttentionRequest:
    """Check the tensors of an attention request against each other and its options."""
    t, options = decoded.tensors, decoded.options
    q = t["q"]
    with client_input():
        n_q, h_q, d = check_q(q)
        check_finite("q", q)
        kv = _inline(t) if "k" in t else None
        if kv is not None:
            check_heads(h_q, d, kv.dims)
        check_alibi(options.attention.alibi_slopes, h_q)
        q_pos = _positions("q_pos", t.get("q_pos"), n_q)
    return AttentionRequest(q=q, q_pos=q_pos, kv=kv, options=options.attention,
                            contexts=options.contexts, n_q=n_q, h_q=h_q, d=d)


def context_write(decoded: Decoded) -> ContextWrite:
    """Check the keys and values of a context create or append; a context holds one dtype."""
    with client_input():
        kv = _inline(decoded.tensors)
    if kv.k.dtype != kv.v.dtype:
        raise InvalidTensor(f"v must have k's dtype {kv.k.dtype}, got {kv.v.dtype}")
    options = decoded.options
    if options.expected_length is not None and options.expected_length < kv.dims.n_k:
        raise InvalidOption(f"expected_length must be at least the {kv.dims.n_k} keys of this body, "
                            f"got {options.expected_length}")
    return ContextWrite(kv=kv, replicas=options.replicas, shards=options.shards,
                        expected_length=options.expected_length, after=options.after, upload=options.upload,
                        continues=options.continues)
