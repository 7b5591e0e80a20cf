"""A tool with a side effect: every executed charge is counted.

``POST /tools/charge`` with ``{"account": "...", "amount": 42, "delay": 2}`` sleeps
``delay`` seconds (so a duplicate can arrive while it works), then records the charge.
``GET /tools/charge/executions`` tells how many charges really ran (and how many are
running now).
"""

from __future__ import annotations

import asyncio
import json
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def create_tool_app() -> Starlette:
    """The demo tool, with its own execution counter."""
    executions = 0
    in_flight = 0

    async def charge(request: Request) -> Response:
        nonlocal executions, in_flight
        try:
            args = json.loads(await request.body())
            delay = float(args.get("delay", 0))
        except (ValueError, AttributeError, TypeError):
            return JSONResponse({"error": "send a JSON object"}, 400)
        in_flight += 1
        try:
            await asyncio.sleep(delay)
        finally:
            in_flight -= 1
        executions += 1
        result = {
            "charge_id": str(uuid.uuid4()),
            "account": args.get("account"),
            "amount": args.get("amount"),
            "execution": executions,
        }
        return JSONResponse(result, 201)

    async def count(request: Request) -> Response:
        return JSONResponse({"executions": executions, "in_flight": in_flight})

    return Starlette(
        routes=[
            Route("/tools/charge", charge, methods=["POST"]),
            Route("/tools/charge/executions", count, methods=["GET"]),
        ]
    )
