"""Client-side code: the Python client and the load generator (docs/SERVICE.md).

Imports only ``service.wire`` (the body formats) from the service: no Ray, no
FastAPI, nothing of the server.
"""

from service.client.aio import AsyncClient
from service.client.errors import SplitkeyError, UploadError
from service.client.sync import Client

__all__ = ["AsyncClient", "Client", "SplitkeyError", "UploadError"]
