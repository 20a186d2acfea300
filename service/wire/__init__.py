"""What travels over HTTP: body formats, request rules, the typed requests, content negotiation.

Imports neither Ray nor the worker pool (``tests/unit/test_dependencies.py`` checks it):
everything here is pure, testable on bytes.

* ``rules``: limits, the named tensors, body kinds, required tensors, and the options,
  checked into one ``RequestOptions``;
* ``request``: the typed ``AttentionRequest`` and ``ContextWrite``, every tensor rule checked once;
* ``json_codec``, ``safetensors``, ``kserve``: the three formats (decode and encode);
* ``values``: the wire codes of each dtype and raw bytes; strict JSON text and the JSON
  number codec the JSON formats share;
* ``negotiation``: Content-Type and Accept; ``body``: reading a body within its limit.
"""
