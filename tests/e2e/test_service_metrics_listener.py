"""``--metrics-port``: /metrics on a listener of its own, without the API key (service.metrics_listener);
over real loopback sockets, in process (no Ray: the lifespan does not run here)."""

from __future__ import annotations

import asyncio
import pathlib

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service import metrics_listener
from service.app import create_app
from service.core.settings import ServiceSettings


def key_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "key"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    return path


def test_the_metrics_port_serves_metrics_without_the_key_the_api_port_asks_for(tmp_path):
    app = create_app(ServiceSettings(api_key_file=key_file(tmp_path), metrics_port=0))
    state = app.state.splitkey

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as api:
            assert (await api.get("/metrics")).status_code == 401
        server = await metrics_listener.start(state, state.settings.metrics_host, 0)
        host, port = server.sockets[0].getsockname()[:2]
        try:
            assert host == "127.0.0.1"  # loopback unless told otherwise
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as c:
                r = await c.get("/metrics")
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
                names = {f.name for f in text_string_to_metric_families(r.text)}
                assert {"splitkey_build_info", "splitkey_requests", "splitkey_repair_rounds"} <= names
                head = await c.head("/metrics")
                assert head.status_code == 200 and head.content == b""
                assert (await c.get("/v1/cluster")).status_code == 404
                post = await c.post("/metrics")
                assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_a_connection_that_sends_no_request_is_closed_without_an_answer():
    app = create_app(ServiceSettings(metrics_port=0))
    state = app.state.splitkey

    async def main() -> bytes:
        server = await metrics_listener.start(state, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            writer.write_eof()
            data = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return data
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) == b""
