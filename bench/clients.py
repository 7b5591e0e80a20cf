"""The measurement behind tool-proxy's upstream client: httpx or aiohttp.

A minimal starlette app, served by uvicorn (uvloop, httptools, one worker), that forwards
every request to an upstream with one shared client. ``bench/run.py`` starts it twice
(``--client httpx`` and ``--client aiohttp``) and drives it with wrk at 32 connections:

    .venv/bin/python bench/clients.py --client aiohttp --port 9001 --upstream http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

import aiohttp
import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# httpx's default pool keeps 20 idle connections; both clients may keep up to 100.
CONNECTIONS = 100


class Forwarder(Protocol):
    async def forward(self, method: str, url: str, body: bytes) -> tuple[int, bytes]: ...

    async def close(self) -> None: ...


class HttpxForwarder:
    """One shared ``httpx.AsyncClient``, limits raised to 100 connections."""

    def __init__(self) -> None:
        limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
        self.client = httpx.AsyncClient(limits=limits)

    async def forward(self, method: str, url: str, body: bytes) -> tuple[int, bytes]:
        headers = {"content-type": "application/json"}
        response = await self.client.request(method, url, content=body, headers=headers)
        return response.status_code, response.content

    async def close(self) -> None:
        await self.client.aclose()


class AiohttpForwarder:
    """One shared ``aiohttp.ClientSession`` (its connector allows 100 connections)."""

    def __init__(self) -> None:
        connector = aiohttp.TCPConnector(limit=CONNECTIONS)
        self.session = aiohttp.ClientSession(connector=connector)

    async def forward(self, method: str, url: str, body: bytes) -> tuple[int, bytes]:
        headers = {"content-type": "application/json"}
        async with self.session.request(method, url, data=body, headers=headers) as response:
            return response.status, await response.read()

    async def close(self) -> None:
        await self.session.close()


FORWARDERS: dict[str, type[HttpxForwarder] | type[AiohttpForwarder]] = {
    "httpx": HttpxForwarder,
    "aiohttp": AiohttpForwarder,
}


def create_app(client: str, upstream: str) -> Starlette:
    """Forward every request to ``upstream`` with the named client."""
    forwarders: list[Forwarder] = []

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        forwarders.append(FORWARDERS[client]())  # aiohttp needs a running loop
        try:
            yield
        finally:
            await forwarders[0].close()

    async def forward(request: Request) -> Response:
        url = upstream + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        status, body = await forwarders[0].forward(request.method, url, await request.body())
        return Response(body, status, media_type="application/json")

    return Starlette(
        routes=[Route("/{path:path}", forward, methods=["GET", "POST"])], lifespan=lifespan
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", choices=sorted(FORWARDERS), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:9000")
    args = parser.parse_args()
    uvicorn.run(
        create_app(args.client, args.upstream.rstrip("/")),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        workers=1,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
