"""The attention function and the ``Cache`` of the transformers backend (package docstring: how to use them).

One context per (sequence, layer) holds that layer's keys and values of the sequence's real tokens;
pads never become keys. A layer's ``update`` keeps nothing: it hands the new keys to the attention
function that the model calls right after it, which sends them with every sequence's queries in
one batch request per layer and forward pass: each item appends its sequence's new keys (``after``
the keys its context holds) and is answered over them (docs/API.md section 10). Positions are the
model's own ``position_ids`` (those ``generate`` derives from the attention mask, so a left-padded
sequence starts at 0), and the service applies the causal mask, a layer's sliding window and its
softcap by them (docs/API.md section 3).

Axes: ``b`` sequences, ``n`` tokens of this forward pass (pads included), ``n_s`` the real ones of
sequence ``s``; ``h_q``, ``h_kv``, ``d``, ``d_v`` as in docs/API.md section 2.
"""

from __future__ import annotations

import contextvars
import secrets
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from service.client import Client, SplitkeyError

#: The name the attention function is registered under: ``model.set_attn_implementation(ATTENTION)``.
ATTENTION = "splitkey"

#: Failures of a call to the service, as the backend reports them.
CALL_ERRORS = (SplitkeyError, TimeoutError, OSError)

T = TypeVar("T")


class BackendError(RuntimeError):
    """A call to the service failed during a forward pass; no output was computed from it.

    ``layer`` is the model layer whose attention failed, the cause is ``__cause__`` (a
    :class:`service.client.SplitkeyError` with its status and code, a ``TimeoutError`` for a
    deadline, an ``OSError`` for a lost connection). The client has already sent what is safe to
    send again (429, 503, a lost connection, within the deadline). The pass may have stored part of
    its keys, so the cache refuses every later pass with this error: close it and start over.
    """

    def __init__(self, layer: int, what: str, cause: BaseException) -> None:
        super().__init__(f"splitkey attention of layer {layer}: {what} failed: {cause}")
        self.layer = layer


@dataclass
class _Session:
    """What the layers of one cache share: the client, the deadline of each call, every context made."""

    client: Client
    deadline: float | None
    contexts: list[str] = field(default_factory=list)
    #: Names this cache's appends (``upload``): with the layer and the pass, an append the service already
    #: stored when a batch is sent again is recognised and not stored twice (docs/API.md section 10).
    tag: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    failed: BackendError | None = None  #: the first failure; the cache serves no pass after it


def _delete_contexts(client: Client, contexts: list[str]) -> None:
    """Delete ``contexts``, forgetting each once deleted (one already gone is no error); a failure raises and
    leaves the rest listed, for the next ``close()``."""
    while contexts:
        try:
            client.delete_context(contexts[-1])
        except SplitkeyError as exc:
            if exc.status != 404:
                raise
        contexts.pop()


#: The layer whose ``update`` ran last in this thread, with the keys it returned: the model calls
#: its attention function right after (``splitkey_attention`` checks the keys are the same object).
_UPDATED: contextvars.ContextVar[tuple[SplitkeyLayer, torch.Tensor] | None] = contextvars.ContextVar(
    "splitkey_updated", default=None)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """``t`` as a CPU numpy array, without a copy where it can; bfloat16 as ml_dtypes' bfloat16 (sent as BF16)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.dtype("bfloat16"))
    return t.numpy()


#: Why a cache operation generate() may ask for is refused (:class:`SplitkeyLayer`).
UNSUPPORTED = ("SplitkeyCache does not support {}: the service holds each sequence's keys in contexts that only "
               "grow; generate greedily or by sampling (num_beams=1)")


class SplitkeyLayer(CacheLayerMixin):
    """One model layer's contexts: an id, keys held and tokens seen per sequence; no keys or values."""

    def __init__(self, session: _Session, index: int) -> None:
        super().__init__()
        self.session = session
        self.index = index
        self.context_ids: list[str] = []  #: one per sequence, made at the first forward pass
        self.lengths: list[int] = []  #: keys each context holds (its real tokens so far)
        self.seen = 0  #: tokens seen per sequence, pads included: what the model counts as the cache's length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand the new keys to the attention function unchanged; they are stored when it runs."""
        _UPDATED.set((self, key_states))
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    # What generate() asks of a cache for beam, contrastive and assisted search: the service holds each
    # sequence's keys in its own contexts, appended in order, so these are refused by name.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(UNSUPPORTED.format("beam search (num_beams > 1)"))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(UNSUPPORTED.format("cropping (assisted or speculative decoding)"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(UNSUPPORTED.format("repeating its sequences (contrastive search)"))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(UNSUPPORTED.format("selecting among its sequences (contrastive search)"))

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, real: torch.Tensor,
               positions: torch.Tensor, options: Mapping[str, Any]) -> torch.Tensor:
        """Append each sequence's real keys to its context and answer its real queries over it.

        ``query [b, h_q, n, d]``, ``key [b, h_kv, n, d]``, ``value [b, h_kv, n, d_v]``; ``real [b, n]``
        (bool) and ``positions [b, n]`` of the tokens. Returns ``out [b, n, h_q, d_v]`` in the query's
        dtype; a pad's row is 0.
        """
        if self.session.failed is not None:
            raise BackendError(self.index, "an earlier pass", self.session.failed) from self.session.failed
        try:
            return self._attend(query, key, value, real, positions, options)
        except BackendError as exc:
            self.session.failed = exc
            raise

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, real: torch.Tensor,
                positions: torch.Tensor, options: Mapping[str, Any]) -> torch.Tensor:
        b, h_q, n, _ = query.shape
        if not self.context_ids:
            self._create(b, key, value)
        elif len(self.context_ids) != b:
            raise ValueError(f"the batch must keep its {len(self.context_ids)} sequences, got {b}")
        items, rows = [], []
        for s in range(b):
            idx = real[s].nonzero().flatten()  # [n_s]
            if not len(idx):
                continue
            k_pos = _numpy(positions[s, idx].to(torch.int64))  # [n_s]
            append = {"k": _numpy(key[s][:, idx].transpose(0, 1)),  # [h_kv, n_s, d] -> [n_s, h_kv, d]
                      "v": _numpy(value[s][:, idx].transpose(0, 1)),  # [h_kv, n_s, d_v] -> [n_s, h_kv, d_v]
                      "k_pos": k_pos, "after": self.lengths[s], "upload": self._upload()}
            q = _numpy(query[s][:, idx].transpose(0, 1))  # [h_q, n_s, d] -> [n_s, h_q, d]
            items.append({"q": q, "q_pos": k_pos, "contexts": [self.context_ids[s]], "causal": True, "append": append,
                          **options})
            rows.append((s, idx))
        out = query.new_zeros((b, n, h_q, value.shape[-1]))  # [b, n, h_q, d_v]
        if items:
            answers = self._call("batch request", self.session.client.attention_batch, items,
                                 deadline=self.session.deadline)
            for (s, idx), answer in zip(rows, answers):
                if isinstance(answer, SplitkeyError):
                    raise BackendError(self.index, f"the item of sequence {s}", answer) from answer
                out[s, idx] = torch.from_numpy(answer[0]).to(query.dtype)  # [n_s, h_q, d_v]
                self.lengths[s] += len(idx)
        self.seen += n
        return out

    def _upload(self) -> str:
        """This layer and pass's append id: the cache's tag, the layer, the tokens seen before the pass."""
        return f"{self.session.tag}-{self.index}-{self.seen}"

    def _create(self, b: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """One empty context per sequence, of the keys' dtype and dims."""
        k = _numpy(key[0, :, :0].transpose(0, 1))  # [0, h_kv, d]
        v = _numpy(value[0, :, :0].transpose(0, 1))  # [0, h_kv, d_v]
        for _ in range(b):
            desc = self._call("create", self.session.client.create_context, k, v)
            self.session.contexts.append(desc["id"])
            self.context_ids.append(desc["id"])
            self.lengths.append(0)

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except CALL_ERRORS as exc:
            raise BackendError(self.index, f"the {what}", exc) from exc


class SplitkeyCache(Cache):
    """A model's KV cache held by a splitkey service: ``model.generate(..., past_key_values=cache)``.

    One :class:`SplitkeyLayer` per decoder layer of ``config``; the service holds the keys and
    values. ``deadline`` (seconds) bounds each query call, retries included. ``close()`` (or the
    end of a ``with`` block, or garbage collection) deletes every context the cache made. One
    cache serves one batch of sequences, used from one thread (as its ``client`` is).
    """

    def __init__(self, client: Client, config: PreTrainedConfig, *, deadline: float | None = 60.0) -> None:
        layers = config.get_text_config(decoder=True).num_hidden_layers
        self.session = _Session(client, deadline)
        super().__init__(layers=[SplitkeyLayer(self.session, i) for i in range(layers)])
        weakref.finalize(self, _delete_contexts, client, self.session.contexts)  # at garbage collection

    @property
    def context_ids(self) -> list[list[str]]:
        """The contexts, ``[layer][sequence]`` (empty before the first forward pass)."""
        return [layer.context_ids for layer in self.layers if isinstance(layer, SplitkeyLayer)]

    def close(self) -> None:
        """Delete the service's contexts of this cache (a context already gone is skipped); may be called again
        after a failure (the service unreachable, say) to delete those left."""
        _delete_contexts(self.session.client, self.session.contexts)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _real_tokens(attention_mask: torch.Tensor | None, b: int, n: int) -> torch.Tensor:
    """``[b, n]`` bool: which of this pass's tokens are real, from the 2D padding mask ``generate`` passes."""
    if attention_mask is None:
        return torch.ones((b, n), dtype=torch.bool)
    if attention_mask.ndim != 2 or attention_mask.shape[0] != b or attention_mask.shape[1] < n:
        raise ValueError(f"attention_mask must be the 2D padding mask [{b}, >= {n}], got {list(attention_mask.shape)}")
    return attention_mask[:, -n:].to("cpu") != 0


def _positions(position_ids: torch.Tensor | None, seen: int, b: int, n: int) -> torch.Tensor:
    """``[b, n]`` positions of this pass's tokens: the model's ``position_ids``, else ``seen, seen + 1, ...``."""
    if position_ids is None:
        return (torch.arange(n) + seen).expand(b, n)
    return position_ids.to("cpu").expand(b, n)


def splitkey_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       sliding_window: int | None = None, softcap: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function registered as :data:`ATTENTION`: ``(out [b, n, h_q, d_v], None)``.

    ``query [b, h_q, n, d]``, ``key``/``value [b, h_kv, n, d|d_v]`` are this pass's new tokens, as the
    :class:`SplitkeyLayer` updated just before returned them. Sliding windows follow transformers'
    masks (a query sees the ``sliding_window - 1`` keys before it and itself).
    """
    updated = _UPDATED.get()
    if updated is None or updated[1] is not key:
        raise ValueError("splitkey attention needs the model's cache to be a SplitkeyCache "
                         "(cache=SplitkeyCache(...) or past_key_values=, use_cache=True), got none for this layer")
    if dropout:
        raise ValueError(f"dropout must be 0 (splitkey attention is for inference), got {dropout}")
    layer = updated[0]
    _UPDATED.set(None)
    b, _, n, _ = query.shape
    options = {"scale": scaling,
               "window": None if sliding_window is None else (sliding_window - 1, 0),
               "softcap": softcap or None}
    real = _real_tokens(attention_mask, b, n)
    positions = _positions(kwargs.get("position_ids"), layer.seen, b, n)
    return layer.attend(query, key, value, real, positions, options), None


def padding_mask(batch_size: int, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered as :data:`ATTENTION`: the 2D padding mask as the model was given it.

    The service masks by positions (causal, sliding windows), so the attention function needs only
    which tokens are pads: ``[b, tokens so far]``, or None when there are none.
    """
    return attention_mask


def _register() -> None:
    AttentionInterface.register(ATTENTION, splitkey_attention)
    AttentionMaskInterface.register(ATTENTION, padding_mask)


_register()
