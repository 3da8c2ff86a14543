"""The dashboard's client of the processors' views (``adapters/processors_web.py``) against a
real local HTTP server: a worker's 503 is an answer with its reason, everything else that
is not a session page is a TransportError naming the URL, and a session id is quoted."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from pipeline.adapters.processors_web import ProcessorsWeb
from pipeline.core.errors import TransportError

PAGE = {"session": "s/1", "nextSeq": 4, "nodes": [[0, 1]], "messages": [{"role": "user"}],
        "partition": 2, "fromOffset": 17}


@pytest.fixture
async def server() -> AsyncIterator[str]:
    async def page(request: web.Request) -> web.Response:
        session = request.match_info["session"]
        if session == "s/1":
            return web.json_response(PAGE)
        if session == "recovering":
            return web.json_response({"error": "the worker is recovering its tables"},
                                     status=503)
        if session == "text":
            return web.Response(text="not json")
        return web.json_response({"error": "boom"}, status=500)

    app = web.Application()
    app.router.add_get("/sessions/{session}/page", page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


async def test_a_page_a_refusal_and_the_errors(server: str) -> None:
    client = ProcessorsWeb(server)
    try:
        assert await client.session_page("s/1") == (PAGE, "")   # the id quoted: one segment
        assert await client.session_page("recovering") == (
            None, "the worker is recovering its tables")
        with pytest.raises(TransportError, match="answered 500 for a session page: boom"):
            await client.session_page("other")
        with pytest.raises(TransportError, match="not JSON"):
            await client.session_page("text")
    finally:
        await client.close()


async def test_an_unreachable_worker_is_a_transport_error() -> None:
    client = ProcessorsWeb("http://127.0.0.1:9")
    try:
        with pytest.raises(TransportError, match=r"processors at http://127\.0\.0\.1:9 did "
                                                 r"not answer"):
            await client.session_page("s")
    finally:
        await client.close()


async def test_a_password_in_the_url_never_reaches_a_message() -> None:
    client = ProcessorsWeb("http://dash:s3cret-pw@127.0.0.1:9/")
    try:
        with pytest.raises(TransportError) as caught:
            await client.session_page("s")
        assert "s3cret-pw" not in str(caught.value) and "dash" not in str(caught.value)
    finally:
        await client.close()
