"""A Hugging Face transformers backend: a model's attention runs over splitkey contexts (docs/ENGINE.md).

Needs the ``hf`` extra (``pip install 'splitkey[hf]'``: torch and transformers); imports only the
public client (``service.client``) of this project. Importing it registers the attention function
under :data:`ATTENTION` with ``transformers.AttentionInterface``::

    from service.client import Client
    from service.hf import ATTENTION, SplitkeyCache

    model.set_attn_implementation(ATTENTION)
    with Client(url) as client, SplitkeyCache(client, model.config) as cache:
        tokens = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
"""

from service.hf.backend import ATTENTION, BackendError, SplitkeyCache, SplitkeyLayer, splitkey_attention

__all__ = ["ATTENTION", "BackendError", "SplitkeyCache", "SplitkeyLayer", "splitkey_attention"]
