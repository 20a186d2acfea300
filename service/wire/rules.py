"""What every body format shares: size limits, the named tensors, the kinds of body.

A request is a set of named tensors plus options. Each format (JSON, safetensors,
the Open Inference Protocol) reads them its own way; ``service.wire.request``
turns them into one typed request, checking every rule once. Sizes are checked
against :class:`Limits` before anything is allocated (docs/API.md section 8).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from service.errors import InvalidTensor


@dataclass(frozen=True)
class Limits:
    """Bounds checked before anything is allocated for a request (built once, from the settings)."""

    max_body_bytes: int = 2 * 2**30  #: a whole binary body
    max_json_body_bytes: int = 64 * 2**20  #: a whole JSON body (parsing costs ~10x its size)
    max_header_bytes: int = 2**20  #: the JSON header of a safetensors body
    max_elements: int = 2**28  #: elements of one tensor
    max_dims: int = 3  #: dims of one tensor (tensors with a rule in TENSOR_RULES have their own rank)
    max_contexts: int = 64  #: context ids in one attention request
    max_context_id_chars: int = 128  #: characters of one context id
    max_shards: int = 1024  #: shards of one context
    max_replicas: int = 8  #: replicas of one context

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{f.name} must be an int >= 1, got {value!r}")


#: The limits used when a caller gives none.
DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class TensorRule:
    """The rank, element kind (``"float"`` or ``"int"``) and layout of one named tensor."""

    rank: int
    kind: str
    layout: str


#: The named tensors (docs/API.md section 2).
TENSOR_RULES: Mapping[str, TensorRule] = {
    "q": TensorRule(3, "float", "[n_q, h_q, d]"),
    "k": TensorRule(3, "float", "[n_k, h_kv, d]"),
    "v": TensorRule(3, "float", "[n_k, h_kv, d_v]"),
    "q_pos": TensorRule(1, "int", "[n_q]"),
    "k_pos": TensorRule(1, "int", "[n_k]"),
    "alibi_slopes": TensorRule(1, "float", "[h_q]"),
}


@dataclass(frozen=True)
class BodyKind:
    """Which tensors and options one endpoint's body may carry, and which tensors it must."""

    name: str
    tensors: frozenset[str]
    options: frozenset[str]
    required: frozenset[str]


ATTENTION = BodyKind(
    "attention",
    tensors=frozenset({"q", "k", "v", "q_pos", "k_pos", "alibi_slopes"}),
    options=frozenset({"scale", "causal", "window", "softcap", "contexts"}),
    required=frozenset({"q"}),
)
CONTEXT_CREATE = BodyKind(
    "context", tensors=frozenset({"k", "v", "k_pos"}), options=frozenset({"replicas", "shards"}),
    required=frozenset({"k", "v"}),
)
CONTEXT_APPEND = BodyKind(
    "append", tensors=frozenset({"k", "v", "k_pos"}), options=frozenset(), required=frozenset({"k", "v"}),
)

#: Context ids: URL-unreserved characters only, so they travel unescaped in paths and in
#: ``contexts=ID1,ID2`` (no commas).
CONTEXT_ID = re.compile(r"[A-Za-z0-9._~-]+")


def is_context_id(value: Any, limits: Limits) -> bool:
    """A string a context id can be: 1 to ``max_context_id_chars`` URL-unreserved characters."""
    return type(value) is str and len(value) <= limits.max_context_id_chars and CONTEXT_ID.fullmatch(value) is not None


def show(value: Any, limit: int = 60) -> str:
    """A short rendering of a client value for "got ..." (JSON where possible)."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):  # not JSON, or an int too long to print
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sorted_names(names: Iterable[str]) -> str:
    return ", ".join(sorted(names)) or "(none)"


def check_present(names: Iterable[str], contexts: Iterable[str], kind: BodyKind) -> None:
    """The tensors ``kind`` requires are there; attention has keys (inline k and v, or contexts)."""
    names = set(names)
    for name in sorted(kind.required):
        if name not in names:
            raise InvalidTensor(f"{name} is required in {kind.name} requests, got no tensor {name}")
    if kind is ATTENTION:
        if ("k" in names) != ("v" in names):
            given, missing = ("k", "v") if "k" in names else ("v", "k")
            raise InvalidTensor(f"{missing} must be given with {given}, got {given} alone")
        if "k" not in names and not tuple(contexts):
            raise InvalidTensor("k and v must be given when no contexts are, got neither")
