"""Validating a caller's bearer JWT and deriving the principal that scopes its records,
and the identity (issuer and subject) that its downstream tokens are cached under.

The algorithms come from the configuration, never from the token; ``exp``, ``iat``,
``iss``, ``aud`` and ``sub`` are required; the issuer is chosen by the token's ``iss`` among
the trusted ones, and its keys by ``kid``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import jwt

from proxy.auth.jwks import KeySet
from proxy.config import AuthConfig, IssuerConfig
from proxy.errors import Unauthorized

_REQUIRED = ["exp", "iat", "iss", "aud", "sub"]
# The claims that name one user, whatever ``auth.principal`` says.
IDENTITY_CLAIMS = ("iss", "sub")
# The claims of a caller's token that say what it grants (its audience, client, scopes,
# roles, strength of sign-in, delegation): a downstream token obtained from one is never
# reused for a token of the same user that differs in any of them.
GRANT_CLAIMS = ("aud", "azp", "client_id", "appid", "scope", "scp", "roles", "acr", "amr", "act")


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller."""

    principal: str
    """A digest of the principal claims: records are scoped by it."""
    identity: str
    """A digest of issuer and subject: one user, whatever the principal claims are; the
    downstream tokens obtained for this caller are cached under it."""
    claims: dict[str, Any]
    expired: bool = False
    """Only with ``allow_expired``: the token is genuine but past its ``exp``."""


def principal_of(claims: Mapping[str, Any], names: Sequence[str]) -> str:
    """A short stable digest of the principal claims (never the claims themselves)."""
    values = "\x1f".join(f"{name}={claims.get(name, '')}" for name in names)
    return hashlib.sha256(values.encode()).hexdigest()[:32]


def grant_of(token: str | None) -> str:
    """A digest of what the JWT ``token`` grants (``GRANT_CLAIMS``), read without checking
    its signature (the Authenticator has checked it); "" for no token or an unreadable one."""
    if not token:
        return ""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError, binascii.Error):
        return ""
    return principal_of(claims, GRANT_CLAIMS) if isinstance(claims, dict) else ""


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(
            "the Authorization header is not a bearer token", error="invalid_request"
        )
    return token.strip()


class Authenticator:
    """Validates tokens from the trusted issuers."""

    def __init__(self, config: AuthConfig) -> None:
        self._principal = config.principal
        self._http = httpx.AsyncClient(follow_redirects=False)
        self._issuers: dict[str, tuple[IssuerConfig, KeySet]] = {
            i.issuer: (i, KeySet(self._http, i.issuer, i.jwks_url, config.jwks_ttl))
            for i in config.issuers
        }

    async def close(self) -> None:
        await self._http.aclose()

    async def caller(
        self, authorization: str | None, required: bool, allow_expired: bool = False
    ) -> Caller | None:
        """The caller, None when no token was sent and none is required; else 401."""
        token = bearer_token(authorization)
        if token is None:
            if required:
                raise Unauthorized("this route requires a bearer token", error="")
            return None
        return await self.validate(token, allow_expired)

    async def validate(
        self, token: str, allow_expired: bool = False, *, of_caller: bool = True
    ) -> Caller:
        """Check signature, algorithm, issuer, audience and times; 401 on any failure.
        ``of_caller``: the token scopes records, so each ``auth.principal`` claim is
        required of it (an operator's token, which scopes nothing, needs none of them)."""
        try:
            header = jwt.get_unverified_header(token)
            issued_by = jwt.decode(token, options={"verify_signature": False}).get("iss")
        except jwt.PyJWTError as exc:
            raise Unauthorized(f"the token is malformed: {exc}") from exc
        trusted = self._issuers.get(issued_by) if isinstance(issued_by, str) else None
        if trusted is None:
            raise Unauthorized("the token's issuer is not trusted")
        issuer, keys = trusted
        if header.get("alg") not in issuer.algorithms:
            raise Unauthorized(f"the token's algorithm is not one of {list(issuer.algorithms)}")
        key = await keys.key(header.get("kid"))
        try:
            claims = jwt.decode(
                token,
                key=key.key,
                algorithms=list(issuer.algorithms),
                audience=list(issuer.audiences),
                issuer=issuer.issuer,
                leeway=issuer.leeway,
                options={
                    # a principal claim a token lacks would make its callers one
                    "require": [
                        *_REQUIRED,
                        *issuer.required_claims,
                        *(self._principal if of_caller else ()),
                    ],
                    "verify_exp": not allow_expired,
                },
            )
        except jwt.PyJWTError as exc:
            raise Unauthorized(f"the token is not valid: {exc}") from exc
        if of_caller:
            _check_principal_claims(claims, self._principal)
        expired = allow_expired and claims["exp"] < time.time() - issuer.leeway
        principal = principal_of(claims, self._principal)
        return Caller(principal, principal_of(claims, IDENTITY_CLAIMS), claims, expired)


def _check_principal_claims(claims: Mapping[str, Any], names: Sequence[str]) -> None:
    """A principal claim that is present but empty (``"tid": ""``, ``[]``, ``{}``) names
    no one: the callers whose tokens carry it so would be one principal (401)."""
    for name in names:
        if claims[name] in ("", [], {}):
            raise Unauthorized(f'the token is not valid: its "{name}" claim is empty')
