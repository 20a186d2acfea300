"""What travels over HTTP: body formats, request rules, the typed requests, content negotiation.

Imports neither Ray nor the worker pool (``tests/test_dependencies.py`` checks it):
everything here is pure, testable on bytes.

* ``rules``: limits, the named tensors, body kinds, required tensors;
* ``options``: options from JSON values or URL query text, checked into ``RequestOptions``;
* ``request``: the typed ``AttentionRequest`` and ``ContextWrite``, every tensor rule checked once;
* ``json_codec``, ``safetensors``, ``kserve``: the three formats (decode and encode);
* ``jsonio``: strict JSON text and the JSON number codec the JSON formats share;
* ``dtypes``: the wire codes of each dtype, raw little-endian bytes;
* ``negotiation``: Content-Type and Accept; ``body``: reading a body within its limit;
* ``decode``: a ``/v1`` body to its typed request.
"""
