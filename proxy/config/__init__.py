"""The YAML configuration: validated models, defaults, and every problem reported at once.

Unknown keys are errors. Durations are seconds (a number) or a string with a unit:
``250ms``, ``5s``, ``2m``, ``24h``, ``7d``.

Each capability's section is a module of its own (its model, defaults and checks):
``store``, ``server`` (and request ``limits``), ``idempotency`` (and ``reconcile``),
``limits`` (routes' shared limits), ``resources`` (``lock``, ``versioning``), ``cache``,
``mcp``, ``jobs`` (``async``, ``workers``), ``auth`` (issuers, tokens, ``admin``),
``offload``; ``routes`` combines them in one route and checks them across sections;
``fields`` holds what they are all made of. This module is the whole file (``Config``),
its loading, and every name of the sections, so ``from proxy.config import X`` works.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from proxy.config.auth import (
    DEFAULT_ALGORITHMS as DEFAULT_ALGORITHMS,
)
from proxy.config.auth import (
    DEFAULT_JWKS_TTL as DEFAULT_JWKS_TTL,
)
from proxy.config.auth import (
    DEFAULT_LEEWAY as DEFAULT_LEEWAY,
)
from proxy.config.auth import (
    DEFAULT_PRINCIPAL_CLAIMS as DEFAULT_PRINCIPAL_CLAIMS,
)
from proxy.config.auth import (
    DEFAULT_REFRESH_AHEAD as DEFAULT_REFRESH_AHEAD,
)
from proxy.config.auth import (
    DEFAULT_ROLES_CLAIM as DEFAULT_ROLES_CLAIM,
)
from proxy.config.auth import (
    DEFAULT_TOKEN_CACHE_ENTRIES as DEFAULT_TOKEN_CACHE_ENTRIES,
)
from proxy.config.auth import (
    TOKEN_TIMEOUT_SECONDS as TOKEN_TIMEOUT_SECONDS,
)
from proxy.config.auth import (
    AdminConfig as AdminConfig,
)
from proxy.config.auth import (
    AuthConfig as AuthConfig,
)
from proxy.config.auth import (
    IssuerConfig as IssuerConfig,
)
from proxy.config.auth import (
    RouteAuthConfig as RouteAuthConfig,
)
from proxy.config.auth import (
    TokenConfig as TokenConfig,
)
from proxy.config.auth import (
    TokenMode as TokenMode,
)
from proxy.config.cache import (
    CACHEABLE_STATUSES as CACHEABLE_STATUSES,
)
from proxy.config.cache import (
    DEFAULT_CACHE_MAX_BYTES as DEFAULT_CACHE_MAX_BYTES,
)
from proxy.config.cache import (
    DEFAULT_CACHE_METHODS as DEFAULT_CACHE_METHODS,
)
from proxy.config.cache import (
    DEFAULT_CACHE_STATUSES as DEFAULT_CACHE_STATUSES,
)
from proxy.config.cache import (
    DEFAULT_CACHE_TTL as DEFAULT_CACHE_TTL,
)
from proxy.config.cache import (
    CacheConfig as CacheConfig,
)
from proxy.config.cache import (
    CachedTools as CachedTools,
)
from proxy.config.cache import (
    CacheScope as CacheScope,
)
from proxy.config.fields import (
    HEADER_NAME as HEADER_NAME,
)
from proxy.config.fields import (
    METHOD as METHOD,
)
from proxy.config.fields import (
    Duration as Duration,
)
from proxy.config.fields import (
    Strict as Strict,
)
from proxy.config.fields import (
    Wait as Wait,
)
from proxy.config.fields import (
    check_json_source as check_json_source,
)
from proxy.config.fields import (
    check_name as check_name,
)
from proxy.config.fields import (
    check_statuses as check_statuses,
)
from proxy.config.fields import (
    entries as entries,
)
from proxy.config.fields import (
    parse_duration as parse_duration,
)
from proxy.config.fields import (
    parse_wait as parse_wait,
)
from proxy.config.idempotency import (
    DEFAULT_LOCK_TTL as DEFAULT_LOCK_TTL,
)
from proxy.config.idempotency import (
    DEFAULT_METHODS as DEFAULT_METHODS,
)
from proxy.config.idempotency import (
    DEFAULT_RECONCILE_INTERVAL as DEFAULT_RECONCILE_INTERVAL,
)
from proxy.config.idempotency import (
    DEFAULT_RECONCILE_RETRIES as DEFAULT_RECONCILE_RETRIES,
)
from proxy.config.idempotency import (
    DEFAULT_RECONCILE_TIMEOUT as DEFAULT_RECONCILE_TIMEOUT,
)
from proxy.config.idempotency import (
    DEFAULT_RELEASE_ON_STATUS as DEFAULT_RELEASE_ON_STATUS,
)
from proxy.config.idempotency import (
    DEFAULT_RESULT_TTL as DEFAULT_RESULT_TTL,
)
from proxy.config.idempotency import (
    DEFAULT_RETRY_AFTER as DEFAULT_RETRY_AFTER,
)
from proxy.config.idempotency import (
    IdempotencyConfig as IdempotencyConfig,
)
from proxy.config.idempotency import (
    LapsedLease as LapsedLease,
)
from proxy.config.idempotency import (
    ReconcileConfig as ReconcileConfig,
)
from proxy.config.jobs import (
    DEFAULT_ASYNC_ATTEMPTS as DEFAULT_ASYNC_ATTEMPTS,
)
from proxy.config.jobs import (
    DEFAULT_ASYNC_BACKOFF as DEFAULT_ASYNC_BACKOFF,
)
from proxy.config.jobs import (
    DEFAULT_ASYNC_BACKOFF_MAX as DEFAULT_ASYNC_BACKOFF_MAX,
)
from proxy.config.jobs import (
    DEFAULT_ASYNC_MAX_QUEUED as DEFAULT_ASYNC_MAX_QUEUED,
)
from proxy.config.jobs import (
    DEFAULT_ASYNC_VISIBILITY as DEFAULT_ASYNC_VISIBILITY,
)
from proxy.config.jobs import (
    DEFAULT_WORKERS as DEFAULT_WORKERS,
)
from proxy.config.jobs import (
    AsyncConfig as AsyncConfig,
)
from proxy.config.jobs import (
    AsyncMode as AsyncMode,
)
from proxy.config.jobs import (
    CredentialsAtRest as CredentialsAtRest,
)
from proxy.config.jobs import (
    WorkersConfig as WorkersConfig,
)
from proxy.config.limits import (
    DEFAULT_PAUSE_MAX as DEFAULT_PAUSE_MAX,
)
from proxy.config.limits import (
    DEFAULT_SLOT_TTL as DEFAULT_SLOT_TTL,
)
from proxy.config.limits import (
    CostConfig as CostConfig,
)
from proxy.config.limits import (
    LimitConfig as LimitConfig,
)
from proxy.config.limits import (
    PauseScope as PauseScope,
)
from proxy.config.limits import (
    StoreDown as StoreDown,
)
from proxy.config.limits import (
    parse_rate as parse_rate,
)
from proxy.config.mcp import (
    DEFAULT_KEY_META as DEFAULT_KEY_META,
)
from proxy.config.mcp import (
    DEFAULT_MAX_ANSWER_BYTES as DEFAULT_MAX_ANSWER_BYTES,
)
from proxy.config.mcp import (
    McpConfig as McpConfig,
)
from proxy.config.mcp import (
    McpGuard as McpGuard,
)
from proxy.config.mcp import (
    RouteProtocol as RouteProtocol,
)
from proxy.config.offload import (
    DEFAULT_OFFLOAD_THRESHOLD as DEFAULT_OFFLOAD_THRESHOLD,
)
from proxy.config.offload import (
    DEFAULT_PRESIGN_TTL as DEFAULT_PRESIGN_TTL,
)
from proxy.config.offload import (
    OffloadConfig as OffloadConfig,
)
from proxy.config.resources import (
    DEFAULT_FENCING_HEADER as DEFAULT_FENCING_HEADER,
)
from proxy.config.resources import (
    DEFAULT_RESOURCE_LOCK_TTL as DEFAULT_RESOURCE_LOCK_TTL,
)
from proxy.config.resources import (
    DEFAULT_RESOURCE_WAIT as DEFAULT_RESOURCE_WAIT,
)
from proxy.config.resources import (
    DEFAULT_VERSION_TTL as DEFAULT_VERSION_TTL,
)
from proxy.config.resources import (
    DEFAULT_VERSIONED_METHODS as DEFAULT_VERSIONED_METHODS,
)
from proxy.config.resources import (
    LockConfig as LockConfig,
)
from proxy.config.resources import (
    VersioningConfig as VersioningConfig,
)
from proxy.config.resources import (
    check_resource_key as check_resource_key,
)
from proxy.config.routes import (
    DEFAULT_TIMEOUT as DEFAULT_TIMEOUT,
)
from proxy.config.routes import (
    RESERVED_PREFIX as RESERVED_PREFIX,
)
from proxy.config.routes import (
    RouteConfig as RouteConfig,
)
from proxy.config.server import (
    DEFAULT_HOST as DEFAULT_HOST,
)
from proxy.config.server import (
    DEFAULT_MAX_BODY_BYTES as DEFAULT_MAX_BODY_BYTES,
)
from proxy.config.server import (
    DEFAULT_MAX_HEADER_BYTES as DEFAULT_MAX_HEADER_BYTES,
)
from proxy.config.server import (
    DEFAULT_MAX_JSON_DEPTH as DEFAULT_MAX_JSON_DEPTH,
)
from proxy.config.server import (
    DEFAULT_PORT as DEFAULT_PORT,
)
from proxy.config.server import (
    MAX_JSON_DEPTH_LIMIT as MAX_JSON_DEPTH_LIMIT,
)
from proxy.config.server import (
    MIN_HEADER_BYTES as MIN_HEADER_BYTES,
)
from proxy.config.server import (
    LimitsConfig as LimitsConfig,
)
from proxy.config.server import (
    ServerConfig as ServerConfig,
)
from proxy.config.store import (
    DEFAULT_DURABILITY_TIMEOUT as DEFAULT_DURABILITY_TIMEOUT,
)
from proxy.config.store import (
    DEFAULT_STATE_DIR as DEFAULT_STATE_DIR,
)
from proxy.config.store import (
    DEFAULT_STORE_URL as DEFAULT_STORE_URL,
)
from proxy.config.store import (
    MAX_DURABILITY_REPLICAS as MAX_DURABILITY_REPLICAS,
)
from proxy.config.store import (
    MAX_DURABILITY_TIMEOUT as MAX_DURABILITY_TIMEOUT,
)
from proxy.config.store import (
    DurabilityConfig as DurabilityConfig,
)
from proxy.config.store import (
    StoreConfig as StoreConfig,
)
from proxy.config.store import (
    check_store_url as check_store_url,
)
from proxy.errors import ConfigError

ENV_CONFIG = "TOOL_PROXY_CONFIG"


ENV_STORE_URL = "TOOL_PROXY_STORE_URL"


ENV_STATE_DIR = "TOOL_PROXY_STATE_DIR"


# The address `serve` binds (--host), for the app in each worker: the Host checks follow it.
ENV_HOST = "TOOL_PROXY_HOST"


class Config(Strict):
    """The whole file."""

    store: StoreConfig = StoreConfig()
    offload: OffloadConfig | None = None
    auth: AuthConfig | None = None
    server: ServerConfig = ServerConfig()
    limits: LimitsConfig = LimitsConfig()
    state_dir: str | None = None
    """Where the journal of outcomes not yet recorded is kept (see ``journal_dir``)."""
    routes: tuple[RouteConfig, ...] = Field(min_length=1)
    admin: AdminConfig | None = None

    def sealing_key_env(self) -> tuple[str, str] | None:
        """The variable of the key that seals stored requests' credentials, and the
        option that names it (``store.sealing_key_env``, else
        ``auth.token_cache_key_env``); None if neither is set."""
        if self.store.sealing_key_env:
            return self.store.sealing_key_env, "store.sealing_key_env"
        if self.auth is not None and self.auth.token_cache_key_env:
            return self.auth.token_cache_key_env, "auth.token_cache_key_env"
        return None

    @model_validator(mode="after")
    def _sealed_credentials_need_a_key(self) -> Config:
        if self.store.url.startswith("memory://") or self.sealing_key_env():
            return self
        for route in self.routes:
            if route.async_ is not None and route.async_.credentials is CredentialsAtRest.SEAL:
                raise ValueError(
                    f"routes[{route.name}].async.credentials: seal (the default) needs a "
                    "sealing key for the stored requests' credentials: set "
                    "store.sealing_key_env (32 bytes in base64), or say credentials: clear"
                )
        return self

    @model_validator(mode="after")
    def _admin_role_needs_auth(self) -> Config:
        if self.admin is not None and self.admin.role is not None and self.auth is None:
            raise ValueError("admin.role: needs a top-level auth section with trusted issuers")
        if self.admin is not None and self.admin.read_role is not None and self.auth is None:
            raise ValueError("admin.read_role: needs a top-level auth section with trusted issuers")
        return self

    def journal_dir(self) -> Path | None:
        """The journal's directory: ``state_dir``; else the SQLite database's directory,
        or DEFAULT_STATE_DIR for Redis; None for memory:// (nothing outlives the process)."""
        if self.state_dir:
            return Path(self.state_dir)
        url = self.store.url
        if url.startswith("memory://"):
            return None
        if url.startswith("sqlite://"):
            path = url.removeprefix("sqlite://").partition("?")[0]
            return Path(path).parent
        return Path(DEFAULT_STATE_DIR)

    @model_validator(mode="after")
    def _unique_routes(self) -> Config:
        problems = []
        if self.auth is None:
            problems += [
                f"routes[{i}].auth: needs a top-level auth section with trusted issuers"
                for i, route in enumerate(self.routes)
                if route.auth is not None
            ]
        problems += [
            f"routes[{i}].token: mode {route.token.mode.value} needs caller authentication "
            "(routes[].auth) to take the caller's token from"
            for i, route in enumerate(self.routes)
            if route.token is not None
            and route.token.mode in (TokenMode.TOKEN_EXCHANGE, TokenMode.OBO)
            and route.auth is None
        ]
        for attr in ("name", "path_prefix"):
            seen: set[str] = set()
            for i, route in enumerate(self.routes):
                value = getattr(route, attr)
                if value in seen:
                    problems.append(f"routes[{i}].{attr}: {value!r} is used by another route")
                seen.add(value)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith("function-") or "[" in part:
            continue
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


def _message(error: Any) -> str:
    kind, msg = error["type"], str(error["msg"])
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required"
    return msg.removeprefix("Value error, ")


def parse_config(data: Any, *, env: Mapping[str, str] | None = None) -> Config:
    """Validate parsed YAML; raise ``ConfigError`` listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError(["(top level): the configuration must be a mapping"])
    environ = os.environ if env is None else env
    if store_url := environ.get(ENV_STORE_URL):
        data = {**data, "store": {**(data.get("store") or {}), "url": store_url}}
    if state_dir := environ.get(ENV_STATE_DIR):
        data = {**data, "state_dir": state_dir}
    if host := environ.get(ENV_HOST):
        data = {**data, "server": {**(data.get("server") or {}), "host": host}}
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([f"{_location(e['loc'])}: {_message(e)}" for e in exc.errors()]) from None


def load_config(path: str | Path | None = None, *, env: Mapping[str, str] | None = None) -> Config:
    """Read, parse and validate a YAML file (``TOOL_PROXY_CONFIG`` when no path is given)."""
    path = path or (os.environ if env is None else env).get(ENV_CONFIG)
    if not path:
        raise ConfigError([f"no configuration: pass --config FILE or set {ENV_CONFIG}"])
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text (byte {exc.start})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    return parse_config(data, env=env)
