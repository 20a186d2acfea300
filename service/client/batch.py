"""Batch bodies on the client side (``POST /v1/attention/batch``; docs/API.md section 10): pure, no I/O.

An item is a mapping with ``q`` and any of ``k``, ``v``, ``q_pos``, ``k_pos``,
``alibi_slopes`` (arrays) and ``contexts``, ``scale``, ``causal``, ``window``,
``softcap`` (options), as the keyword arguments of ``Client.attention``, and
``append``: a mapping of ``k``, ``v`` and any of ``k_pos`` (arrays), ``after``,
``upload``, ``continues`` (options), keys appended to the item's one context
before it is answered (docs/API.md section 10). Its answer is ``(out, lse)``, or
the :class:`SplitkeyError` the server gave that item alone (``status``, ``code``,
``detail``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from service.client.errors import SplitkeyError
from service.client.options import context_ids, window_bounds, wire_tensors
from service.wire.safetensors import encode_safetensors, peek_safetensors_header, tensors_of
from service.wire.rules import DEFAULT_LIMITS

TENSORS = ("q", "k", "v", "q_pos", "k_pos", "alibi_slopes")
OPTIONS = ("contexts", "scale", "causal", "window", "softcap")
APPEND = "append"
APPEND_TENSORS = ("k", "v", "k_pos")
APPEND_OPTIONS = ("after", "upload", "continues")

#: One item's answer: ``(out [n_q, h_q, d_v], lse [n_q, h_q])`` or its error.
BatchAnswer = tuple[np.ndarray, np.ndarray] | SplitkeyError


def encode_batch(items: Sequence[Mapping[str, Any]]) -> list[bytes | memoryview]:
    """The safetensors body of ``items`` (tensors ``{i}.{name}``, options in ``__metadata__["items"]``)."""
    if isinstance(items, Mapping) or not len(items):
        raise ValueError(f"items must be a non-empty sequence of mappings, got {type(items).__name__} "
                         f"of {len(items)}")
    tensors: dict[str, np.ndarray] = {}
    options: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        unknown = sorted(set(item) - set(TENSORS) - set(OPTIONS) - {APPEND})
        if unknown:
            raise ValueError(f"items[{i}] keys must be among {', '.join(TENSORS + OPTIONS + (APPEND,))}, got {unknown}")
        if item.get("q") is None:
            raise ValueError(f"items[{i}] must have q, got none")
        tensors.update({f"{i}.{name}": np.asarray(item[name]) for name in TENSORS if item.get(name) is not None})
        opts: dict[str, Any] = {}
        for name in OPTIONS:
            value = item.get(name)
            if value is None:
                continue
            if name == "contexts":
                value = context_ids(value, f"items[{i}] contexts")
            elif name == "window":
                value = list(window_bounds(value, f"items[{i}] window"))
            elif name == "causal":
                if not isinstance(value, (bool, np.bool_)):  # "false" is truthy: never guess
                    raise ValueError(f"items[{i}] causal must be a bool, got {value!r}")
                value = bool(value)
            else:
                value = float(value)
            opts[name] = value
        if item.get(APPEND) is not None:
            opts[APPEND] = _append(i, item[APPEND], tensors)
        options.append(opts)
    return encode_safetensors(wire_tensors(tensors), {"items": json.dumps(options, separators=(",", ":"))})


def _append(i: int, append: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Item ``i``'s append: its tensors into ``tensors`` (``{i}.append.k``, ...), its options returned."""
    unknown = sorted(set(append) - set(APPEND_TENSORS) - set(APPEND_OPTIONS))
    if unknown:
        raise ValueError(f"items[{i}] append keys must be among {', '.join(APPEND_TENSORS + APPEND_OPTIONS)}, "
                         f"got {unknown}")
    tensors.update({f"{i}.{APPEND}.{name}": np.asarray(append[name]) for name in APPEND_TENSORS
                    if append.get(name) is not None})
    opts: dict[str, Any] = {}
    for name in APPEND_OPTIONS:
        value = append.get(name)
        if value is None:
            continue
        if name == "continues" and not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"items[{i}] append continues must be a bool, got {value!r}")
        opts[name] = bool(value) if name == "continues" else int(value) if name == "after" else str(value)
    return opts


def decode_batch(body: bytes, count: int) -> list[BatchAnswer]:
    """Each item's answer from a safetensors batch answer of ``count`` items."""
    mv = memoryview(body).cast("B")
    header = peek_safetensors_header(mv, len(mv), DEFAULT_LIMITS, _names(count))
    status = json.loads(header.metadata["items"])
    if type(status) is not list or len(status) != count:
        raise ValueError(f"the answer must hold {count} item statuses, got {status!r:.200}")
    arrays = tensors_of(mv, header)  # the header is checked once
    answers: list[BatchAnswer] = []
    for i, st in enumerate(status):
        if st.get("status") == 200:
            answers.append((np.array(arrays[f"{i}.out"]), np.array(arrays[f"{i}.lse"])))
        else:
            answers.append(SplitkeyError(int(st.get("status", 0)), str(st.get("code", "")), str(st.get("detail", ""))))
    return answers


def _names(count: int) -> list[str]:
    return [f"{i}.{name}" for i in range(count) for name in ("out", "lse")]
