"""Signing keys of one issuer, fetched over HTTP and cached.

Keys are trusted for ``ttl`` seconds. A token whose ``kid`` is unknown triggers one
refetch (key rotation), but never more than one per ``REFETCH_INTERVAL_SECONDS``, and
concurrent requests share it: a flood of made-up kids costs the issuer nothing.
httpx is the client here: these calls are rare, off the hot path.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from jwt import PyJWK, PyJWKSet
from jwt.exceptions import PyJWKError, PyJWKSetError

from proxy.errors import IdentityProviderUnavailable, Unauthorized

# The least time between two fetches of one issuer's keys caused by unknown kids.
REFETCH_INTERVAL_SECONDS = 30.0
# Time allowed for one JWKS or discovery request.
FETCH_TIMEOUT_SECONDS = 5.0


class KeySet:
    """The JWKS of one issuer (from ``jwks_url``, or found through OIDC discovery)."""

    def __init__(
        self, http: httpx.AsyncClient, issuer: str, jwks_url: str | None, ttl: float
    ) -> None:
        self._http = http
        self._issuer = issuer.rstrip("/")
        self._jwks_url = jwks_url
        self._ttl = ttl
        self._keys: dict[str, PyJWK] = {}
        self._fetched_at = float("-inf")
        self._lock = asyncio.Lock()

    async def key(self, kid: str | None) -> PyJWK:
        """The signing key for ``kid`` (the only key when the token names none)."""
        now = time.monotonic()
        stale = now - self._fetched_at > self._ttl
        if stale or (kid not in self._keys and now - self._fetched_at > REFETCH_INTERVAL_SECONDS):
            await self._refresh(self._fetched_at)
        if kid is None and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        found = self._keys.get(kid or "")
        if found is None:
            raise Unauthorized("the token's signing key (kid) is not one of the issuer's keys")
        return found

    async def _refresh(self, seen: float) -> None:
        async with self._lock:
            if self._fetched_at != seen:
                return  # another request fetched while this one waited
            try:
                url = self._jwks_url or await self._discover()
                document = await self._get_json(url)
                keys = PyJWKSet.from_dict(document)
            except (httpx.HTTPError, ValueError, PyJWKError, PyJWKSetError) as exc:
                if self._keys and time.monotonic() - self._fetched_at < 2 * self._ttl:
                    self._fetched_at = time.monotonic()  # keep serving the keys we have
                    return
                raise IdentityProviderUnavailable(
                    f"cannot fetch the signing keys of {self._issuer}: {exc}"
                ) from exc
            self._keys = {k.key_id: k for k in keys.keys if k.key_id}
            if len(keys.keys) == 1 and not self._keys:
                self._keys = {"": keys.keys[0]}
            self._fetched_at = time.monotonic()

    async def _discover(self) -> str:
        document = await self._get_json(f"{self._issuer}/.well-known/openid-configuration")
        url = document.get("jwks_uri")
        if not isinstance(url, str):
            raise ValueError("the discovery document has no jwks_uri")
        return url

    async def _get_json(self, url: str) -> dict[str, Any]:
        response = await self._http.get(url, timeout=FETCH_TIMEOUT_SECONDS)
        response.raise_for_status()
        document = response.json()
        if not isinstance(document, dict):
            raise ValueError(f"{url} did not return a JSON object")
        return document
