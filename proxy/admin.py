"""The proxy's record endpoints: each agent's view of its plan sessions, and the operators'
records API under ``/_proxy/admin/`` with its credential check.

- ``GET /_proxy/sessions/{plan}/steps``: every recorded step of one plan session of the
  calling principal, scoped exactly like replays (per guarded route with composite keys).
- ``/_proxy/admin/records...``: list, show, resolve (as completed, or released) and delete
  records; only when ``admin`` is configured (else 404), with an admin bearer token (401
  without one, 403 for a JWT lacking the role). Never forwarded.

The views and the changes themselves (with their audit events) are ``records.py``'s.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import os
from collections.abc import Sequence
from typing import Any

from starlette.datastructures import Secret
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy import records
from proxy.auth.callers import Authenticator, Caller, bearer_token
from proxy.auth.tokens import read_secret_file
from proxy.config import AdminConfig, Config, RouteConfig
from proxy.errors import (
    ConfigError,
    Forbidden,
    InvalidField,
    InvalidJSONBody,
    PlanNotFound,
    RequestTooLarge,
    Unauthorized,
)
from proxy.keys import KeyKind, is_key_part, is_text
from proxy.store import Store

# How the identity of an operator signed in with ``admin.read_role`` ends (console only).
READ_ONLY = " (read-only)"
_RESOLVE_FIELDS = {"as", "status", "headers", "body", "body_base64", "reason"}


def load_admin_token(config: AdminConfig) -> Secret | None:
    """The admin bearer token (None when operators sign in with a role); ``ConfigError``
    naming the field when it cannot be read."""
    if config.token_env is not None:
        value = os.environ.get(config.token_env, "").strip()
        field = f"admin.token_env: environment variable {config.token_env}"
        if not is_text(value):
            raise ConfigError([f"{field} is not UTF-8 text"])
    elif config.token_file is not None:
        field = f"admin.token_file: {config.token_file}"
        try:
            value = read_secret_file("admin.token_file", config.token_file)
        except ValueError as exc:
            raise ConfigError([str(exc)]) from None
    else:
        return None
    if not value:
        raise ConfigError([f"{field} is empty or not set"])
    return Secret(value)


def _has_role(claim: Any, role: str) -> bool:
    """A roles claim holds ``role``: a list of roles, or one space-separated string."""
    if isinstance(claim, str):
        return role in claim.split()
    return isinstance(claim, list) and role in claim


class AdminAuth:
    """Who is calling the admin API: ``token``, or the JWT's issuer and subject."""

    def __init__(self, config: AdminConfig, authenticator: Authenticator | None) -> None:
        self._config = config
        self._token = load_admin_token(config)
        self._authenticator = authenticator

    async def identity(self, request: Request) -> str:
        """The operator's identity for the audit log; 401 or 403 otherwise."""
        return await self.verify(bearer_token(request.headers.get("authorization")))

    async def verify(self, token: str | None, *, looking: bool = False) -> str:
        """The identity of an operator's credential (the admin token or a JWT with the
        role), as ``identity``; the console passes the one its sign-in cookie holds. Only
        ``looking`` (the console's views), a JWT with ``read_role`` is accepted too: its
        identity ends with ``READ_ONLY``."""
        if token is None:
            raise Unauthorized("the admin API requires a bearer token", error="")
        config, read_role = self._config, self._config.read_role if looking else None
        if self._token is not None:
            if hmac.compare_digest(token.encode(), str(self._token).encode()):
                return "token"
            if read_role is None:
                raise Unauthorized("the admin token is not valid")
        assert self._authenticator is not None
        caller = await self._authenticator.validate(token, of_caller=False)  # an operator
        identity = f"jwt iss={caller.claims['iss']} sub={caller.claims['sub']}"
        roles = caller.claims.get(config.roles_claim)
        if config.role is not None and _has_role(roles, config.role):
            return identity
        if read_role is not None and _has_role(roles, read_role):
            return identity + READ_ONLY
        wanted = " or ".join(repr(r) for r in (config.role, read_role) if r is not None)
        raise Forbidden(
            f"the token does not carry the role {wanted} in its {config.roles_claim!r} claim"
        )


class Steps:
    """``GET /_proxy/sessions/{plan}/steps``: the caller's own steps of one plan session."""

    def __init__(self, config: Config, store: Store, authenticator: Authenticator | None) -> None:
        self.store = store
        self.authenticator = authenticator
        self.routes = [
            r
            for r in config.routes
            if r.idempotency is not None and r.idempotency.key is KeyKind.COMPOSITE
        ]

    async def view(self, request: Request) -> Response:
        plan = request.path_params["plan"]
        if not is_key_part(plan):
            raise InvalidField("plan_session_id", "must be 1..128 characters of [A-Za-z0-9._-]")
        scopes = await self._scopes(request.headers.get("authorization"))
        found = await asyncio.gather(*(self.store.records(f"{s}|{plan}") for s in scopes))
        steps = sorted((r for rs in found for r in rs), key=lambda r: r.created_at)
        if not steps:
            raise PlanNotFound(f"no recorded step of plan session {plan} for this caller")
        return JSONResponse(
            {"plan_session_id": plan, "steps": [records.step_view(r) for r in steps]}
        )

    async def _scopes(self, authorization: str | None) -> list[str]:
        """``route|principal`` for each composite route that accepts the caller, as the
        proxy would scope its calls; 401 if some route needs a token and none accepts it."""
        caller: Caller | Unauthorized | None = None
        if authorization and any(r.auth is not None for r in self.routes):
            caller = await self._validate(authorization)
        scopes: list[str] = []
        refused: Unauthorized | None = None
        for route in self.routes:
            principal = self._principal(route, authorization, caller)
            if isinstance(principal, Unauthorized):
                refused = principal
            else:
                scopes.append(f"{route.name}|{principal}")
        if not scopes and refused is not None:
            raise refused
        return scopes

    async def _validate(self, authorization: str) -> Caller | Unauthorized:
        assert self.authenticator is not None
        try:
            token = bearer_token(authorization)
            assert token is not None
            return await self.authenticator.validate(token)
        except Unauthorized as exc:
            return exc

    @staticmethod
    def _principal(
        route: RouteConfig, authorization: str | None, caller: Caller | Unauthorized | None
    ) -> str | Unauthorized:
        """The principal the route gives this caller, or why it refuses the caller."""
        if route.auth is None:
            return ""
        if not authorization:
            if route.auth.required:
                return Unauthorized("this plan's routes require a bearer token", error="")
            return ""
        assert caller is not None
        return caller if isinstance(caller, Unauthorized) else caller.principal


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request's JSON object ({} for an empty body), at most ``limit`` bytes."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestTooLarge(f"the body is over the limit of {limit} bytes")
    if not body:
        return {}
    try:
        data = json.loads(body)
    except ValueError:
        raise InvalidJSONBody("the body is not JSON") from None
    except RecursionError:
        raise InvalidJSONBody("the body nests arrays and objects too deeply") from None
    if not isinstance(data, dict):
        raise InvalidField("(body)", "must be a JSON object")
    return data


def _flag(query: Any, name: str) -> bool:
    value = query.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise InvalidField(name, "must be true or false")
    return value in ("true", "1")


def _headers(value: Any) -> list[tuple[str, str]]:
    """``headers`` of a resolve: an object of names to values, or a list of pairs."""
    if value is None:
        return []
    if isinstance(value, dict):
        value = list(value.items())
    if not isinstance(value, list) or not all(
        isinstance(p, list | tuple) and len(p) == 2 and all(isinstance(x, str) for x in p)
        for p in value
    ):
        raise InvalidField("headers", "must be an object of names to values, or of pairs")
    return [(name, text) for name, text in value]


def _body(data: dict[str, Any]) -> bytes:
    """``body`` (text, sent as UTF-8) or ``body_base64`` of a resolve; at most one."""
    if "body" in data and "body_base64" in data:
        raise InvalidField("body", "give body or body_base64, not both")
    if "body_base64" in data:
        if not isinstance(data["body_base64"], str):
            raise InvalidField("body_base64", "must be a base64 string")
        try:
            return base64.b64decode(data["body_base64"], validate=True)
        except (binascii.Error, ValueError):
            raise InvalidField("body_base64", "not valid base64") from None
    text = data.get("body", "")
    if not isinstance(text, str):
        raise InvalidField("body", "must be a string (use body_base64 for bytes)")
    if not is_text(text):
        raise InvalidField("body", "not valid Unicode (a lone surrogate)")
    return text.encode()


class AdminRecords:
    """The operators' records API (``/_proxy/admin/records``)."""

    def __init__(self, desk: records.Records, auth: AdminAuth, max_body: int) -> None:
        self.desk = desk
        self.auth = auth
        self.max_body = max_body

    async def list(self, request: Request) -> Response:
        await self.auth.identity(request)
        query = request.query_params
        unknown = set(query) - {*records.FILTERS, "limit", "cursor"}
        if unknown:
            raise InvalidField(sorted(unknown)[0], "unknown parameter")
        where = records.parse_filter({name: query.get(name) for name in records.FILTERS})
        limit = records.parse_limit(query.get("limit"))
        page = await records.list_records(self.desk.store, where, limit, query.get("cursor", ""))
        return JSONResponse(
            {
                "records": [records.record_view(r) for r in page.records],
                "next_cursor": page.cursor or None,
            }
        )

    async def show(self, request: Request) -> Response:
        await self.auth.identity(request)
        key = records.parse_id(request.path_params["id"])
        body = _flag(request.query_params, "body")
        return JSONResponse(records.record_view(await self.desk.get(key), body=body))

    async def resolve(self, request: Request) -> Response:
        admin = await self.auth.identity(request)
        key = records.parse_id(request.path_params["id"])
        data = await _read_json(request, self.max_body)
        unknown = set(data) - _RESOLVE_FIELDS
        if unknown:
            raise InvalidField(sorted(unknown)[0], "unknown field")
        reason = records.check_reason(data.get("reason"))
        outcome = data.get("as")
        if outcome == "released":
            if extra := sorted(set(data) - {"as", "reason"}):
                raise InvalidField(extra[0], "only with as=completed")
            await self.desk.release(key, reason, admin)
            return JSONResponse({"id": records.record_id(key), "resolved": "released"})
        if outcome != "completed":
            raise InvalidField("as", "must be completed (the tool ran) or released (it did not)")
        if "status" not in data:
            raise InvalidField("status", "required with as=completed")
        response = records.answer(data["status"], _headers(data.get("headers")), _body(data))
        record = await self.desk.resolve(key, response, reason, admin)
        return JSONResponse({"resolved": "completed", "record": records.record_view(record)})

    async def delete(self, request: Request) -> Response:
        admin = await self.auth.identity(request)
        key = records.parse_id(request.path_params["id"])
        reason = request.query_params.get("reason")
        if reason is None:
            reason = (await _read_json(request, self.max_body)).get("reason")
        record = await self.desk.delete(key, records.check_reason(reason), admin)
        return JSONResponse({"deleted": True, "record": records.record_view(record)})


def record_routes(
    config: Config, store: Store, authenticator: Authenticator | None, log: Any, prefix: str
) -> Sequence[Route]:
    """The steps endpoint, and the admin API when ``admin`` is configured."""
    steps = Route(f"{prefix}sessions/{{plan}}/steps", Steps(config, store, authenticator).view)
    if config.admin is None:
        return [steps]
    desk = records.Records(store, config.routes, log)
    api = AdminRecords(desk, AdminAuth(config.admin, authenticator), config.limits.max_body_bytes)
    base = f"{prefix}admin/records"
    return [
        steps,
        Route(base, api.list, methods=["GET"]),
        Route(f"{base}/{{id}}", api.show, methods=["GET"]),
        Route(f"{base}/{{id}}", api.delete, methods=["DELETE"]),
        Route(f"{base}/{{id}}/resolve", api.resolve, methods=["POST"]),
    ]
