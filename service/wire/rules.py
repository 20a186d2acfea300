"""The rules every body format shares: limits, the named tensors, body kinds, and options.

A request is a set of named tensors plus options. Each format (JSON, safetensors,
the Open Inference Protocol) reads them its own way; ``service.wire.request``
turns them into one typed request, checking every rule once. Sizes are checked
against :class:`Limits` before anything is allocated (docs/API.md section 8).

Options: JSON bodies carry them as fields, binary bodies as URL query parameters
(``scale=0.125``, ``causal=true``, ``window=LEFT,RIGHT``, ``contexts=ID1,ID2``;
docs/API.md section 6), the Open Inference Protocol as request parameters. Each
form is read into JSON-typed values, and :func:`check_options` checks those values
once and builds the request's :class:`workers.options.AttentionOptions` (the only
place a request builds it).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from service.core.errors import BodyTooLarge, InvalidOption, InvalidTensor, client_input
from service.core.limits import DEFAULT_LIMITS, Limits
from workers.options import MAX_WINDOW, AttentionOptions



#: Largest key count an option may name (``expected_length``, ``after``): far beyond any
#: memory (docs/API.md section 8), and within int64 with room for a sum of two.
MAX_KEYS = 2**62


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
    "context", tensors=frozenset({"k", "v", "k_pos"}), options=frozenset({"replicas", "shards", "expected_length"}),
    required=frozenset({"k", "v"}),
)
CONTEXT_APPEND = BodyKind(
    "append", tensors=frozenset({"k", "v", "k_pos"}), options=frozenset({"after", "upload", "continues"}),
    required=frozenset({"k", "v"}),
)

#: Context ids: URL-unreserved characters only, so they travel unescaped in paths and in
#: ``contexts=ID1,ID2`` (no commas).
CONTEXT_ID = re.compile(r"[A-Za-z0-9._~-]+")
#: Upload ids (``upload``): chosen by the client, 1 to 64 URL-safe characters.
UPLOAD_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_context_id(value: Any, limits: Limits) -> bool:
    """A string a context id can be: 1 to ``max_context_id_chars`` URL-unreserved characters."""
    return type(value) is str and len(value) <= limits.max_context_id_chars and CONTEXT_ID.fullmatch(value) is not None


def show(value: Any, limit: int = 60) -> str:
    """A short rendering of a client value for "got ..." (JSON where possible)."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):  # not JSON, or an int too long to print
        text = f"a {type(value).__name__}"
    except RecursionError:  # nested nearly as deep as the parser allows: deeper than printing goes
        text = f"a {type(value).__name__} nested too deeply to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_extent(name: str, shape: list[int] | tuple[int, ...], limits: Limits) -> int:
    """The element count of ``shape``, refused (413) past ``max_elements``; so is any one dimension
    past it when another is 0 (an empty tensor may not declare an absurd shape either)."""
    count = math.prod(shape)
    if count > limits.max_elements:
        raise BodyTooLarge(f"{name} must have at most {limits.max_elements} elements, got {count}")
    if any(n > limits.max_elements for n in shape):
        raise BodyTooLarge(f"{name} must have every dimension at most {limits.max_elements}, got shape "
                           f"{show(list(shape))}")
    return count


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


# -- options ---------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class RequestOptions:
    """The options of one request, checked; unused ones keep their defaults."""

    attention: AttentionOptions = field(default_factory=AttentionOptions)  #: with alibi_slopes when sent
    contexts: tuple[str, ...] = ()  #: ids of stored contexts whose keys join the inline ones
    replicas: int | None = None  #: copies of each shard of a new context (None: the default)
    shards: int | None = None  #: shards a new context is cut into (None: the default)
    expected_length: int | None = None  #: keys a new context will hold once every chunk is appended (None: this body's)
    after: int | None = None  #: append only if the context holds exactly this many keys (None: whatever it holds)
    upload: str | None = None  #: append: the id of the chunked upload this append belongs to (docs/CONTEXTS.md)
    continues: bool = False  #: append: refused unless the context's last append was this upload's


def _number(name: str, value: Any) -> Any:
    if type(value) not in (int, float):
        raise InvalidOption(f"{name} must be a number, got {show(value)}")
    return value  # finite and in range: AttentionOptions


def _count(name: str, value: Any, most: int) -> int:
    if type(value) is not int or not 1 <= value <= most:
        raise InvalidOption(f"{name} must be an int in [1, {most}], got {show(value)}")
    return value


def _keys(name: str, value: Any, least: int) -> int:
    if type(value) is not int or not least <= value <= MAX_KEYS:
        raise InvalidOption(f"{name} must be an int in [{least}, 2**62], got {show(value)}")
    return value


def _window(value: Any) -> Any:
    """Checked here, bounds too, so that the detail quotes the client's JSON (``null``); AttentionOptions
    checks the same again for the library's callers."""
    if type(value) not in (list, tuple) or len(value) != 2 or \
            any(b is not None and (type(b) is not int or not 0 <= b <= MAX_WINDOW) for b in value):
        raise InvalidOption(f"window must be [left, right], each null or an int in [0, 2**62], got {show(value)}")
    return value


def _contexts(value: Any, limits: Limits) -> tuple[str, ...]:
    if type(value) is not list or not 1 <= len(value) <= limits.max_contexts:
        raise InvalidOption(f"contexts must be a list of 1 to {limits.max_contexts} ids, got {show(value)}")
    for i, cid in enumerate(value):
        if not is_context_id(cid, limits):
            raise InvalidOption(f"contexts[{i}] must be an id of 1 to {limits.max_context_id_chars} characters "
                                f"A-Z a-z 0-9 . _ ~ -, got {show(cid)}")
        if cid in value[:i]:
            raise InvalidOption(f"contexts must not repeat an id, got {show(cid)} twice")
    return tuple(value)


def _upload(given: Mapping[str, Any]) -> tuple[str | None, bool]:
    """``upload`` and ``continues``: an upload id goes with ``after``; ``continues`` with an upload id."""
    upload, continues = given.get("upload"), given.get("continues", False)
    if upload is not None and (type(upload) is not str or not UPLOAD_ID.fullmatch(upload)):
        raise InvalidOption(f"upload must be 1 to 64 characters A-Z a-z 0-9 _ -, got {show(upload)}")
    if type(continues) is not bool:
        raise InvalidOption(f"continues must be true or false, got {show(continues)}")
    if upload is not None and "after" not in given:
        raise InvalidOption(f"upload must come with after (the context's length before this chunk), got upload "
                            f"{show(upload)} without after")
    if continues and upload is None:
        raise InvalidOption("continues must come with upload (the id of the upload it continues), got continues "
                            "without upload")
    return upload, continues


def check_options(raw: Mapping[str, Any], kind: BodyKind, limits: Limits = DEFAULT_LIMITS,
                  alibi_slopes: Any = None) -> RequestOptions:
    """Check JSON-typed option values of a ``kind`` request; ``None`` means "not given".

    ``alibi_slopes`` (a tensor of the same request) joins the attention options;
    its shape is checked with the other tensors.
    """
    for name in raw:
        if name not in kind.options:
            raise InvalidOption(f"{name} is not an option of {kind.name} requests; "
                                f"options must be among {sorted_names(kind.options)}, got {name!r}")
    given = {name: value for name, value in raw.items() if value is not None}
    if "causal" in given and type(given["causal"]) is not bool:
        raise InvalidOption(f"causal must be true or false, got {show(given['causal'])}")
    with client_input():
        attention = AttentionOptions(
            scale=_number("scale", given["scale"]) if "scale" in given else None,
            causal=given.get("causal", False),
            window=_window(given["window"]) if "window" in given else None,
            softcap=_number("softcap", given["softcap"]) if "softcap" in given else None,
            alibi_slopes=alibi_slopes,  # a tensor: checked with the others (service.wire.request)
        )
    upload, continues = _upload(given)
    return RequestOptions(
        attention=attention,
        contexts=_contexts(given["contexts"], limits) if "contexts" in given else (),
        replicas=_count("replicas", given["replicas"], limits.max_replicas) if "replicas" in given else None,
        shards=_count("shards", given["shards"], limits.max_shards) if "shards" in given else None,
        expected_length=_keys("expected_length", given["expected_length"], 1) if "expected_length" in given else None,
        after=_keys("after", given["after"], 0) if "after" in given else None,
        upload=upload,
        continues=continues,
    )


# -- options as URL query parameters ---------------------------------------------------------

#: A JSON number: no "nan", "inf", "0x10", "1_000", "+1", ".5" or surrounding spaces.
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]{0,40})(?:\.[0-9]{1,40})?(?:[eE][+-]?[0-9]{1,4})?")
_BOUND = re.compile(r"(?:0|[1-9][0-9]{0,20})?")
_COUNT = re.compile(r"[1-9][0-9]{0,9}")
_KEYS = re.compile(r"0|[1-9][0-9]{0,18}")


#: The request header by which a client shortens a query's deadline (docs/API.md section 6.6, "Deadline").
TIMEOUT_HEADER = "X-Request-Timeout"


def timeout_header(text: str | None) -> float | None:
    """The seconds an ``X-Request-Timeout`` header gives (None: no header), or 422 naming it.

    JSON-number text, finite and > 0: ``0.25``, ``2``, ``1e-3``; no ``inf``, ``nan`` or units.
    """
    if text is None:
        return None
    seconds = float(text) if _NUMBER.fullmatch(text) else math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidOption(f"{TIMEOUT_HEADER} must be a number of seconds > 0, got {show(text)}")
    return seconds


def query_value(name: str, text: str) -> Any:
    """One option's query text as its JSON value (``window=128,`` -> ``[128, None]``), or 422."""
    if name in ("scale", "softcap"):
        if not _NUMBER.fullmatch(text):
            raise InvalidOption(f"{name} must be a number, got {show(text)}")
        return float(text)
    if name in ("causal", "continues"):
        if text not in ("true", "false"):
            raise InvalidOption(f"{name} must be true or false, got {show(text)}")
        return text == "true"
    if name == "upload":
        return text  # checked with the JSON value: check_options
    if name == "window":
        sides = text.split(",")
        if len(sides) != 2 or not all(_BOUND.fullmatch(s) for s in sides):
            raise InvalidOption("window must be LEFT,RIGHT with each side empty (unbounded) "
                                f"or an int >= 0, got {show(text)}")
        return [int(s) if s else None for s in sides]
    if name == "contexts":
        return text.split(",")
    if name in ("expected_length", "after"):
        if not _KEYS.fullmatch(text):
            raise InvalidOption(f"{name} must be an int >= {0 if name == 'after' else 1} in decimal, got {show(text)}")
        return int(text)  # range: check_options
    if not _COUNT.fullmatch(text):  # replicas, shards
        raise InvalidOption(f"{name} must be an int >= 1, got {show(text)}")
    return int(text)


def _query_items(params: Mapping[str, str] | Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    multi = getattr(params, "multi_items", None)
    if multi is not None:  # Starlette's QueryParams keeps repeated keys
        return list(multi())
    if isinstance(params, Mapping):
        return list(params.items())
    return list(params)


def refuse_query(params: Mapping[str, str] | Iterable[tuple[str, str]], where: str) -> None:
    """Refuse URL query parameters on a request whose options travel in its body (a JSON body, a
    batch): ignoring one would answer a question the client did not ask (docs/API.md section 6.3)."""
    items = _query_items(params)
    if items:
        name, text = items[0]
        raise InvalidOption(f"query parameters must be absent from {where} (its options travel in the body), "
                            f"got {show(f'{name}={text}')}")


def parse_query_options(params: Mapping[str, str] | Iterable[tuple[str, str]], kind: BodyKind = ATTENTION,
                        limits: Limits = DEFAULT_LIMITS, alibi_slopes: Any = None) -> RequestOptions:
    """Options of a binary body from URL query parameters, each at most once, checked as :func:`check_options`."""
    raw: dict[str, Any] = {}
    for name, text in _query_items(params):
        if name not in kind.options:
            raise InvalidOption(f"query parameters of {kind.name} requests must be among "
                                f"{sorted_names(kind.options)}, got {show(name)}")
        if name in raw:
            raise InvalidOption(f"{name} must be given once, got it twice")
        raw[name] = query_value(name, text)
    return check_options(raw, kind, limits, alibi_slopes)
