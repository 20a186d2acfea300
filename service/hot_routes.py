"""Direct dispatch of the hot routes: the request-only endpoints an engine calls at every decode step.

FastAPI's dispatch (its middleware stack, route matching over every route, dependency
solving, the exception middleware) costs about 100 us per request in a hot loop here and
several times that inside the server on a small machine, where an engine pays it layers x
steps times (docs/ENGINE.md, "What a call costs"). :class:`HotRoutes` sits just inside
:class:`service.middleware.ServiceMiddleware` (so request ids, auth, admission, draining
and accounting are unchanged) and calls the endpoints of ``POST /v1/attention``,
``POST /v1/attention/batch`` and KServe's ``infer`` itself, with a Starlette ``Request``,
exactly as FastAPI would call them: they take the request alone and return a ``Response``.
Their exceptions go through the app's own handler table (``service.app``), looked up along
the exception's class hierarchy as Starlette does; one with no handler propagates to
``ServiceMiddleware``, which answers 500. FastAPI still declares these routes (the
OpenAPI schema) and serves everything else: other methods (405), other paths, a trailing
slash.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

#: An endpoint that takes the request alone and returns its response.
Endpoint = Callable[[Request], Awaitable[Response]]
#: An exception handler as FastAPI registers it.
Handler = Callable[[Request, Any], Awaitable[Response]]


class HotRoutes:
    """ASGI middleware: ``(method, path)`` in ``routes`` is answered here, anything else by ``app``."""

    def __init__(self, app: Any, *, routes: Mapping[tuple[str, str], Endpoint],
                 handlers: Mapping[type[Exception], Handler]) -> None:
        self.app = app
        self.routes = dict(routes)
        self.handlers = dict(handlers)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        endpoint = None
        if scope["type"] == "http":
            # The path the app's routes match: without the ``root_path`` a mount or proxy put before it.
            path: str = scope["path"]
            root: str = scope.get("root_path", "")
            if root and path.startswith(root) and path[len(root):len(root) + 1] == "/":
                path = path[len(root):]
            endpoint = self.routes.get((scope.get("method", ""), path))
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as exc:
            # The most specific registered class, as Starlette looks it up.
            handler = next((self.handlers[cls] for cls in type(exc).__mro__ if cls in self.handlers), None)
            if handler is None:
                raise  # ServiceMiddleware logs it and answers 500, as for any route
            response = await handler(request, exc)
        await response(scope, receive, send)
