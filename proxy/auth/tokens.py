"""Downstream tokens: the token a route forwards instead of the caller's.

Modes: ``client_credentials`` (the proxy's own token for the route's audience),
``token_exchange`` (RFC 8693, the caller's JWT as subject_token) and ``obo`` (Entra's
on-behalf-of: jwt-bearer grant with requested_token_use=on_behalf_of).

Tokens are cached per (route, caller identity, grant): the identity a digest of the
caller's issuer and subject, never the principal that scopes records (which may be as
coarse as a tenant), the grant a digest of what the caller's token grants (its audience,
client, scopes, roles: ``callers.GRANT_CLAIMS``), so a token exchanged from a wide
subject token is never reused for a narrower one of the same user, while the same user's
next token with the same grant (or the expired one a refresh token renews) finds it;
``client_credentials`` tokens, which belong to no user, are cached per route. The cache
keeps at most ``max_entries`` tokens, the least recently used evicted first. They are
renewed at ``refresh_ahead`` of their
lifetime (and never inside the last ``MIN_VALIDITY_SECONDS``), and fetched once for any
number of concurrent requests: in this process (one task), and across replicas when
``auth.token_cache_key_env`` is set (a short lock in the shared store; the token is then
published there, sealed with AES-GCM, for the other replicas). The token endpoint is
called with httpx: these calls are rare and off the hot path. Client secrets are read
from an environment variable or a file (a Kubernetes secret) and kept in starlette's
``Secret``, whose repr hides them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
from starlette.datastructures import Secret

from proxy.auth.callers import grant_of
from proxy.auth.sealing import Sealer
from proxy.config import (
    DEFAULT_TOKEN_CACHE_ENTRIES,
    TOKEN_TIMEOUT_SECONDS,
    RouteConfig,
    TokenConfig,
    TokenMode,
)
from proxy.errors import (
    ConfigError,
    IdentityProviderUnavailable,
    ReauthenticationRequired,
    StoreUnavailable,
)
from proxy.keys import is_text
from proxy.store import Store

TOKEN_EXCHANGE_GRANT = "urn:ietf:params:oauth:grant-type:token-exchange"
JWT_BEARER_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"
# A cached token is never used when it expires within this many seconds.
MIN_VALIDITY_SECONDS = 10.0
# How long one replica may hold the lock to fetch a shared token, and how often the
# others look for the token it publishes.
SHARED_LOCK_SECONDS = 10.0
SHARED_POLL_SECONDS = 0.05
# How long a refresh token is kept when the IdP does not say (refresh_expires_in).
DEFAULT_REFRESH_LIFETIME = 8 * 3600.0

Key = tuple[str, str, str]
"""Where a token is cached: (route, caller identity, grant of the caller's token)."""


@dataclass(slots=True)
class _Cached:
    token: str
    refresh_at: float
    expires_at: float
    refresh_token: str | None = None
    refresh_expires_at: float = 0.0


def read_secret_file(field: str, path: str) -> str:
    """The text of the secret file at ``path``, stripped; ``ValueError`` saying, after
    ``field``, why it cannot be read (a missing file, bytes that are not UTF-8, a path
    holding a NUL byte)."""
    shown = f"{field}: {path if path.isprintable() else repr(path)}"
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"{shown} cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{shown} is not UTF-8 text (byte {exc.start})") from None
    except ValueError:  # raised before the file is opened
        why = "a NUL byte" if "\x00" in path else "a character this file system cannot encode"
        raise ValueError(f"{shown} cannot be read (the path holds {why})") from None


def load_secret(config: TokenConfig) -> Secret | str:
    """The client secret, or a problem naming the field when it cannot be read."""
    if config.client_secret_env:
        value = os.environ.get(config.client_secret_env)
        field = f"client_secret_env: environment variable {config.client_secret_env}"
        if value and not is_text(value):
            return f"{field} is not UTF-8 text"
    else:
        assert config.client_secret_file is not None
        field = f"client_secret_file: {config.client_secret_file}"
        try:
            value = read_secret_file("client_secret_file", config.client_secret_file)
        except ValueError as exc:
            return str(exc)
    return Secret(value) if value else f"{field} is empty or not set"


def load_secrets(routes: list[RouteConfig]) -> dict[str, tuple[TokenConfig, Secret]]:
    """Every token route's policy and client secret; ``ConfigError`` lists each missing one."""
    policies: dict[str, tuple[TokenConfig, Secret]] = {}
    problems: list[str] = []
    for i, route in enumerate(routes):
        if route.token is None or route.token.mode is TokenMode.PASSTHROUGH:
            continue
        loaded = load_secret(route.token)
        if isinstance(loaded, str):
            problems.append(f"routes[{i}].token.{loaded}")
        else:
            policies[route.name] = (route.token, loaded)
    if problems:
        raise ConfigError(problems)
    return policies


def _shared_name(key: Key) -> str:
    """The name under which the replicas share the token of (route, identity, grant)."""
    return "token|" + "|".join(key)


K = TypeVar("K")
V = TypeVar("V")


class _Bounded(OrderedDict[K, V]):
    """A dict of at most ``limit`` entries: the least recently set or got goes first."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def recent(self, key: K) -> V | None:
        """The value of ``key`` (None if absent), now the most recently used."""
        found = self.get(key)
        if found is not None:
            self.move_to_end(key)
        return found

    def put(self, key: K, value: V) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class DownstreamTokens:
    """Gets, caches and renews the tokens of every route that has a token policy."""

    def __init__(
        self,
        routes: list[RouteConfig],
        clock: Callable[[], float] = time.time,
        store: Store | None = None,
        sealer: Sealer | None = None,
        max_entries: int = DEFAULT_TOKEN_CACHE_ENTRIES,
    ) -> None:
        self._clock = clock
        self._shared = store if sealer is not None else None
        self._sealer = sealer
        self._policies = load_secrets(routes)
        self._http = httpx.AsyncClient(follow_redirects=False, timeout=TOKEN_TIMEOUT_SECONDS)
        self._cache: _Bounded[Key, _Cached] = _Bounded(max_entries)
        self._pending: dict[Key, asyncio.Task[_Cached]] = {}
        # The last token an upstream refused, per shared name: a copy the replicas still
        # share is not taken again (one entry per cached token at most, like the cache).
        self._refused: _Bounded[str, str] = _Bounded(max_entries)

    def applies(self, route: str) -> bool:
        """True if ``route`` forwards a token of its own."""
        return route in self._policies

    async def close(self) -> None:
        await self._http.aclose()

    def _key(self, route: str, identity: str, subject: str | None) -> Key:
        """Where the token of ``route`` for ``identity`` and what its token ``subject``
        grants is cached (one per route for client credentials: the proxy's own token)."""
        policy, _ = self._policies[route]
        if policy.mode is TokenMode.CLIENT_CREDENTIALS:
            return (route, "", "")
        return (route, identity, grant_of(subject))

    async def token(self, route: str, identity: str, subject: str | None) -> str:
        """The downstream token for ``route``, the caller ``identity`` (``Caller.identity``,
        issuer and subject; "" for an anonymous caller) and its token ``subject``."""
        key = self._key(route, identity, subject)
        now = self._clock()
        cached = self._cache.recent(key)
        if cached is not None and now < cached.refresh_at:
            return cached.token
        fetch = self._pending.get(key)
        if fetch is None:
            renewal = cached.refresh_token if cached is not None else None
            fetch = asyncio.get_running_loop().create_task(
                self._obtain(route, key, subject, renewal)
            )
            self._pending[key] = fetch
            fetch.add_done_callback(lambda task: self._settled(key, task))
        try:
            fresh = await asyncio.shield(fetch)
        except IdentityProviderUnavailable:
            if cached is not None and now < cached.expires_at - MIN_VALIDITY_SECONDS:
                return cached.token  # the IdP is down, but the current token still works
            raise
        self._cache.put(key, fresh)
        return fresh.token

    def _settled(self, key: Key, task: asyncio.Task[_Cached]) -> None:
        self._pending.pop(key, None)
        if not task.cancelled():
            task.exception()  # seen by every waiter; retrieved here if none is left

    def drop(self, route: str, identity: str, subject: str | None, refused: str) -> None:
        """Forget ``refused``, a token the upstream refused (a 401 although it looked
        fresh); a newer one, fetched meanwhile by another request, is kept."""
        key = self._key(route, identity, subject)
        cached = self._cache.get(key)
        if cached is not None and cached.token == refused:
            del self._cache[key]
        if self._shared is not None:
            self._refused.put(_shared_name(key), refused)

    def refreshes(self, route: str) -> bool:
        """True if ``route`` opted in to refresh tokens (callers may outlive their token)."""
        found = self._policies.get(route)
        return found is not None and found[0].use_refresh_tokens

    async def can_refresh(self, route: str, identity: str, subject: str | None) -> bool:
        """True if a refresh token can renew the downstream token of caller ``identity``
        obtained from a token granting what ``subject`` grants."""
        key = self._key(route, identity, subject)
        cached = self._cache.get(key)
        if cached is None and self._shared is not None:
            cached = await self._read_shared(_shared_name(key), fresh_only=False)
        if cached is None:
            return False
        if cached.refresh_token is not None and self._clock() < cached.refresh_expires_at:
            if key not in self._cache:
                self._cache.put(key, cached)
            return True
        return False

    async def _obtain(
        self, route: str, key: Key, subject: str | None, renewal: str | None = None
    ) -> _Cached:
        """A fresh token: from the other replicas through the store, or fetched (by one)."""
        if self._shared is None:
            return await self._fetch(route, subject, renewal)
        name = _shared_name(key)
        shared = await self._read_shared(name)
        if shared is not None:
            return shared
        me = secrets.token_hex(8)
        try:
            locked = await self._shared.acquire(name, me, SHARED_LOCK_SECONDS)
        except StoreUnavailable:
            return await self._fetch(route, subject, renewal)
        if not locked:
            return await self._wait_shared(name) or await self._fetch(route, subject, renewal)
        try:
            # another replica may have published between our read and our lock
            if (published := await self._read_shared(name)) is not None:
                return published
            fresh = await self._fetch(route, subject, renewal)
            await self._publish(name, fresh)
            return fresh
        finally:
            with contextlib.suppress(StoreUnavailable):
                await self._shared.unlock(name, me)

    async def _read_shared(self, name: str, fresh_only: bool = True) -> _Cached | None:
        """A token another replica published (if ``fresh_only``: one not due for renewal
        and not refused by an upstream here)."""
        assert self._shared is not None and self._sealer is not None
        try:
            sealed = await self._shared.get_value(name)
        except StoreUnavailable:
            return None
        document = None if sealed is None else self._sealer.open(name, sealed)
        if document is None:
            return None
        cached = _Cached(**document)
        if not fresh_only:
            return cached
        fresh = self._clock() < cached.refresh_at and cached.token != self._refused.get(name)
        return cached if fresh else None

    async def _wait_shared(self, name: str) -> _Cached | None:
        """Wait for the replica that holds the lock to publish its token."""
        deadline = self._clock() + SHARED_LOCK_SECONDS
        while self._clock() < deadline:
            await asyncio.sleep(SHARED_POLL_SECONDS)
            if (found := await self._read_shared(name)) is not None:
                return found
        return None

    async def _publish(self, name: str, fresh: _Cached) -> None:
        assert self._shared is not None and self._sealer is not None
        document = dataclasses.asdict(fresh)
        ttl = max(fresh.expires_at, fresh.refresh_expires_at) - self._clock()
        if ttl > 0:
            with contextlib.suppress(StoreUnavailable):
                await self._shared.put_value(name, self._sealer.seal(name, document), ttl)

    async def _fetch(self, route: str, subject: str | None, renewal: str | None = None) -> _Cached:
        policy, _ = self._policies[route]
        if renewal is not None and policy.use_refresh_tokens:
            try:
                return await self._post(
                    route, {"grant_type": "refresh_token", "refresh_token": renewal}
                )
            except ReauthenticationRequired:
                if subject is None:
                    raise  # no caller token to start over with
        return await self._post(route, _grant(policy, subject))

    async def _post(self, route: str, form: dict[str, str]) -> _Cached:
        policy, secret = self._policies[route]
        form.update({"client_id": policy.client_id or "", "client_secret": str(secret)})
        try:
            response = await self._http.post(policy.token_endpoint or "", data=form)
        except httpx.HTTPError as exc:
            raise IdentityProviderUnavailable(
                f"the token endpoint of route {route} cannot be reached ({type(exc).__name__})"
            ) from exc
        return self._parse(route, policy, response)

    def _parse(self, route: str, policy: TokenConfig, response: httpx.Response) -> _Cached:
        try:
            document = response.json()
        except ValueError:
            document = {}
        if response.status_code >= 500 or not isinstance(document, dict):
            raise IdentityProviderUnavailable(
                f"the token endpoint of route {route} answered {response.status_code}"
            )
        if response.status_code != 200 or "access_token" not in document:
            error = document.get("error", f"http_{response.status_code}")
            raise ReauthenticationRequired(
                f"the identity provider refused a token for route {route}: {error}",
                error="invalid_token",
            )
        lifetime = float(document.get("expires_in", 300))
        now = self._clock()
        refresh_at = now + min(lifetime * policy.refresh_ahead, lifetime - MIN_VALIDITY_SECONDS)
        refresh_token = document.get("refresh_token") if policy.use_refresh_tokens else None
        refresh_lifetime = float(document.get("refresh_expires_in", DEFAULT_REFRESH_LIFETIME))
        return _Cached(
            str(document["access_token"]),
            refresh_at,
            now + lifetime,
            str(refresh_token) if refresh_token else None,
            now + refresh_lifetime if refresh_token else 0.0,
        )


def _grant(policy: TokenConfig, subject: str | None) -> dict[str, str]:
    if policy.mode is TokenMode.CLIENT_CREDENTIALS:
        form = {"grant_type": "client_credentials"}
    elif policy.mode is TokenMode.TOKEN_EXCHANGE:
        form = {
            "grant_type": TOKEN_EXCHANGE_GRANT,
            "subject_token": subject or "",
            "subject_token_type": ACCESS_TOKEN_TYPE,
            "requested_token_type": ACCESS_TOKEN_TYPE,
        }
        if policy.actor_token_env and (actor := os.environ.get(policy.actor_token_env)):
            form.update(actor_token=actor, actor_token_type=ACCESS_TOKEN_TYPE)
    else:
        form = {
            "grant_type": JWT_BEARER_GRANT,
            "assertion": subject or "",
            "requested_token_use": "on_behalf_of",
        }
    for name in ("audience", "resource", "scope"):
        if (value := getattr(policy, name)) is not None:
            form[name] = value
    return form
