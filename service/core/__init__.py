"""The service's foundations: what every other part of ``service`` builds on.

``errors`` (every client-visible error and its status, one table), ``settings`` (deployment
settings) and ``limits`` (the bounds they set), ``deadline`` (a request's time budget),
``request_id``, ``metrics``, ``admission`` (slots and the in-flight body budget), ``drain``
(graceful shutdown) and ``listener`` (closing the listening socket without resets). Nothing
here imports another part of ``service``: the dependency test (tests/unit/test_dependencies.py)
holds it to that.
"""

#: The release: the package's version (pyproject.toml reads it from here), the app's, the build
#: metric's and KServe's server metadata over HTTP and gRPC.
VERSION = "0.1.0"
