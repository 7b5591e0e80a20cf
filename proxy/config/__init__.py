"""The YAML configuration: validated models, defaults, and every problem reported at once.

Unknown keys are errors, and so are a key given twice in one mapping and a section given
empty (``idempotency:`` with its keys commented out: YAML's null). Durations are seconds
(a number) or a string with a unit: ``250ms``, ``5s``, ``2m``, ``24h``, ``7d``.

Each capability's section is a module of its own (its model, defaults and checks):
``store``, ``server`` (and request ``limits``), ``idempotency`` (and ``reconcile``),
``limits`` (routes' shared limits), ``resources`` (``lock``, ``versioning``), ``cache``,
``mcp``, ``jobs`` (``async``, ``workers``), ``auth`` (issuers, tokens, ``admin``),
``offload``; ``routes`` combines them in one route and checks them across sections;
``fields`` holds what they are all made of. This module is the whole file (``Config``),
its loading, and every name of the sections, so ``from proxy.config import X`` works.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from proxy.config.auth import (
    DEFAULT_ALGORITHMS,
    DEFAULT_JWKS_TTL,
    DEFAULT_LEEWAY,
    DEFAULT_PRINCIPAL_CLAIMS,
    DEFAULT_REFRESH_AHEAD,
    DEFAULT_ROLES_CLAIM,
    DEFAULT_TOKEN_CACHE_ENTRIES,
    TOKEN_TIMEOUT_SECONDS,
    AdminConfig,
    AuthConfig,
    IssuerConfig,
    RouteAuthConfig,
    TokenConfig,
    TokenMode,
)
from proxy.config.cache import (
    CACHEABLE_STATUSES,
    DEFAULT_CACHE_MAX_BYTES,
    DEFAULT_CACHE_METHODS,
    DEFAULT_CACHE_STATUSES,
    DEFAULT_CACHE_TTL,
    CacheConfig,
    CachedTools,
    CacheScope,
)
from proxy.config.fields import (
    HEADER_NAME,
    METHOD,
    Duration,
    Strict,
    Wait,
    check_entries,
    check_json_source,
    check_methods,
    check_name,
    check_statuses,
    parse_duration,
    parse_wait,
)
from proxy.config.idempotency import (
    DEFAULT_LOCK_TTL,
    DEFAULT_METHODS,
    DEFAULT_RECONCILE_INTERVAL,
    DEFAULT_RECONCILE_RETRIES,
    DEFAULT_RECONCILE_TIMEOUT,
    DEFAULT_RELEASE_ON_STATUS,
    DEFAULT_RESULT_TTL,
    DEFAULT_RETRY_AFTER,
    IdempotencyConfig,
    LapsedLease,
    ReconcileConfig,
)
from proxy.config.jobs import (
    DEFAULT_ASYNC_ATTEMPTS,
    DEFAULT_ASYNC_BACKOFF,
    DEFAULT_ASYNC_BACKOFF_MAX,
    DEFAULT_ASYNC_MAX_QUEUED,
    DEFAULT_ASYNC_VISIBILITY,
    DEFAULT_WORKERS,
    AsyncConfig,
    AsyncMode,
    CredentialsAtRest,
    WorkersConfig,
)
from proxy.config.limits import (
    DEFAULT_PAUSE_MAX,
    DEFAULT_SLOT_TTL,
    CostConfig,
    LimitConfig,
    PauseScope,
    StoreDown,
    parse_rate,
)
from proxy.config.mcp import (
    DEFAULT_KEY_META,
    DEFAULT_MAX_ANSWER_BYTES,
    McpConfig,
    McpGuard,
    RouteProtocol,
)
from proxy.config.offload import (
    DEFAULT_OFFLOAD_THRESHOLD,
    DEFAULT_PRESIGN_TTL,
    OffloadConfig,
)
from proxy.config.resources import (
    DEFAULT_FENCING_HEADER,
    DEFAULT_RESOURCE_LOCK_TTL,
    DEFAULT_RESOURCE_WAIT,
    DEFAULT_RESOURCE_WRITES,
    DEFAULT_VERSION_TTL,
    DEFAULT_VERSIONED_METHODS,
    LockConfig,
    ResourceConfig,
    VersioningConfig,
    check_resource_key,
    resource_scope,
)
from proxy.config.routes import (
    DEFAULT_TIMEOUT,
    RESERVED_PREFIX,
    RouteConfig,
)
from proxy.config.server import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_PORT,
    MAX_JSON_DEPTH_LIMIT,
    MIN_HEADER_BYTES,
    LimitsConfig,
    ServerConfig,
)
from proxy.config.store import (
    DEFAULT_DURABILITY_TIMEOUT,
    DEFAULT_STATE_DIR,
    DEFAULT_STORE_URL,
    MAX_DURABILITY_REPLICAS,
    MAX_DURABILITY_TIMEOUT,
    DurabilityConfig,
    StoreConfig,
    check_store_url,
)
from proxy.errors import ConfigError

__all__ = [
    "CACHEABLE_STATUSES",
    "DEFAULT_ALGORITHMS",
    "DEFAULT_ASYNC_ATTEMPTS",
    "DEFAULT_ASYNC_BACKOFF",
    "DEFAULT_ASYNC_BACKOFF_MAX",
    "DEFAULT_ASYNC_MAX_QUEUED",
    "DEFAULT_ASYNC_VISIBILITY",
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_CACHE_MAX_BYTES",
    "DEFAULT_CACHE_METHODS",
    "DEFAULT_CACHE_STATUSES",
    "DEFAULT_CACHE_TTL",
    "DEFAULT_DURABILITY_TIMEOUT",
    "DEFAULT_FENCING_HEADER",
    "DEFAULT_HEADER_TIMEOUT",
    "DEFAULT_HOST",
    "DEFAULT_JWKS_TTL",
    "DEFAULT_KEY_META",
    "DEFAULT_LEEWAY",
    "DEFAULT_LOCK_TTL",
    "DEFAULT_MAX_ANSWER_BYTES",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_JSON_DEPTH",
    "DEFAULT_METHODS",
    "DEFAULT_OFFLOAD_THRESHOLD",
    "DEFAULT_PAUSE_MAX",
    "DEFAULT_PORT",
    "DEFAULT_PRESIGN_TTL",
    "DEFAULT_PRINCIPAL_CLAIMS",
    "DEFAULT_RECONCILE_INTERVAL",
    "DEFAULT_RECONCILE_RETRIES",
    "DEFAULT_RECONCILE_TIMEOUT",
    "DEFAULT_REFRESH_AHEAD",
    "DEFAULT_RELEASE_ON_STATUS",
    "DEFAULT_RESOURCE_LOCK_TTL",
    "DEFAULT_RESOURCE_WAIT",
    "DEFAULT_RESOURCE_WRITES",
    "DEFAULT_RESULT_TTL",
    "DEFAULT_RETRY_AFTER",
    "DEFAULT_ROLES_CLAIM",
    "DEFAULT_SLOT_TTL",
    "DEFAULT_STATE_DIR",
    "DEFAULT_STORE_URL",
    "DEFAULT_TIMEOUT",
    "DEFAULT_TOKEN_CACHE_ENTRIES",
    "DEFAULT_VERSIONED_METHODS",
    "DEFAULT_VERSION_TTL",
    "DEFAULT_WORKERS",
    "ENV_CONFIG",
    "ENV_HOST",
    "ENV_STATE_DIR",
    "ENV_STORE_URL",
    "HEADER_NAME",
    "MAX_DURABILITY_REPLICAS",
    "MAX_DURABILITY_TIMEOUT",
    "MAX_JSON_DEPTH_LIMIT",
    "METHOD",
    "MIN_HEADER_BYTES",
    "RESERVED_PREFIX",
    "TOKEN_TIMEOUT_SECONDS",
    "AdminConfig",
    "AsyncConfig",
    "AsyncMode",
    "AuthConfig",
    "CacheConfig",
    "CacheScope",
    "CachedTools",
    "Config",
    "CostConfig",
    "CredentialsAtRest",
    "DurabilityConfig",
    "Duration",
    "IdempotencyConfig",
    "IssuerConfig",
    "LapsedLease",
    "LimitConfig",
    "LimitsConfig",
    "LockConfig",
    "McpConfig",
    "McpGuard",
    "OffloadConfig",
    "PauseScope",
    "ReconcileConfig",
    "ResourceConfig",
    "RouteAuthConfig",
    "RouteConfig",
    "RouteProtocol",
    "ServerConfig",
    "StoreConfig",
    "StoreDown",
    "Strict",
    "TokenConfig",
    "TokenMode",
    "VersioningConfig",
    "Wait",
    "WorkersConfig",
    "check_entries",
    "check_json_source",
    "check_methods",
    "check_name",
    "check_resource_key",
    "check_statuses",
    "check_store_url",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_rate",
    "parse_wait",
    "resource_scope",
]

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

    def cached_resources(self) -> frozenset[str]:
        """The resources whose reads some route caches: their writes, on every route that
        names them, invalidate those reads."""
        return frozenset(
            name
            for route in self.routes
            if route.cache is not None and (name := route.resource_name()) is not None
        )

    def versioned_resources(self) -> frozenset[str]:
        """The named resources some route versions: their reads carry the ETag on every
        route that caches them."""
        return frozenset(
            name
            for route in self.routes
            if route.versioning is not None and (name := route.resource_name()) is not None
        )

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


# The variables that replace a value of the file, by the value's location.
_ENV_VALUES = {"store.url": ENV_STORE_URL, "state_dir": ENV_STATE_DIR, "server.host": ENV_HOST}


def _location(loc: tuple[int | str, ...], unknown_key: bool = False) -> str:
    """``routes[0].idempotency.lock_ttl``: the keys of the file, without the tags pydantic
    adds for a union's members (``float``, ``str-enum[McpGuard]``, ``function-after[...]``);
    ``unknown_key``: the last part is a key no model has (kept)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _keys(Config) or (unknown_key and i == len(loc) - 1):
            out += f".{part}" if out else part
    return out or "(top level)"


def _message(error: Any) -> str:
    kind, msg = error["type"], str(error["msg"])
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required"
    if kind == "model_type":  # not "a valid dictionary or instance of StoreConfig"
        return f"must be a mapping of its keys, not {type(error['input']).__name__}"
    return msg.removeprefix("Value error, ")


def _reported_elsewhere(error: Any) -> bool:
    """A list pydantic finds too short only because items failed (each reported)."""
    if error["type"] != "too_short":
        return False
    try:
        return len(error["input"]) >= int(error["ctx"]["min_length"])
    except (KeyError, TypeError, ValueError):
        return False


def _model_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """A model's fields by the key the file gives them (``async``, not ``async_``)."""
    return {field.alias or name: field for name, field in model.model_fields.items()}


def _section(field: FieldInfo) -> tuple[type[BaseModel], bool] | None:
    """The model of a section-valued field (a mapping, or a list of mappings: True)."""
    annotation = field.annotation
    if get_origin(annotation) in (Union, UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) != 1:
            return None
        annotation = members[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    item = get_args(annotation)[0] if get_origin(annotation) is tuple else None
    if isinstance(item, type) and issubclass(item, BaseModel):
        return item, True
    return None


@functools.cache  # (`cache` here is the submodule proxy.config.cache)
def _keys(model: type[BaseModel]) -> frozenset[str]:
    """Every key of ``model`` and of its sections, at any depth."""
    keys = set(_model_fields(model))
    for field in model.model_fields.values():
        if (section := _section(field)) is not None:
            keys |= _keys(section[0])
    return frozenset(keys)


def _empty_sections(
    model: type[BaseModel], data: Mapping[Any, Any], at: str, problems: dict[str, str]
) -> dict[Any, Any]:
    """``data`` with each section given as null (``idempotency:`` with its keys commented
    out) replaced by an empty one, and a problem for it: YAML reads it as null, which
    would turn the capability off (or fail as not a mapping) without a word."""
    fields = _model_fields(model)
    out = dict(data)
    for key, value in data.items():
        field = fields.get(key) if isinstance(key, str) else None
        section = None if field is None else _section(field)
        if field is None or section is None:
            continue
        inner, many = section
        path = f"{at}.{key}" if at else key
        if value is None:
            if many:
                advice = (
                    "at least one entry is needed"
                    if field.is_required()
                    else "write [] for an empty list, or remove it"
                )
            else:
                try:
                    inner.model_validate({})
                    advice = "write {} for the defaults, or remove it"
                except ValidationError:
                    advice = "give its keys, or remove it"
            problems[path] = f"{path}: empty; {advice}"
            out[key] = [] if many else {}
        elif many and isinstance(value, list):
            out[key] = [
                _empty_sections(inner, item, f"{path}[{i}]", problems)
                if isinstance(item, dict)
                else item
                for i, item in enumerate(value)
            ]
        elif not many and isinstance(value, dict):
            out[key] = _empty_sections(inner, value, path, problems)
    return out


def _under(location: str, paths: Mapping[str, str]) -> bool:
    return any(location == p or location.startswith((f"{p}.", f"{p}[")) for p in paths)


def parse_config(data: Any, *, env: Mapping[str, str] | None = None) -> Config:
    """Validate parsed YAML; raise ``ConfigError`` listing every problem."""
    if data is None:
        raise ConfigError(["(top level): the configuration is empty"])
    if not isinstance(data, dict):
        raise ConfigError(["(top level): the configuration must be a mapping"])
    empty: dict[str, str] = {}  # the problems of sections given as null, by location
    data = _empty_sections(Config, data, "", empty)
    environ = os.environ if env is None else env
    replaced: dict[str, str] = {}  # location: the variable its value is from
    for location, variable in _ENV_VALUES.items():
        value = environ.get(variable)
        if not value:
            continue
        section, _, key = location.rpartition(".")
        if not section:
            data = {**data, key: value}
        elif isinstance(found := data.get(section, {}), dict):  # else: reported as it is
            data = {**data, section: {**found, key: value}}
            empty.pop(section, None)  # left empty for the variable to fill: as before
        else:
            continue
        replaced[location] = variable
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        problems = list(empty.values())
        for error in exc.errors():
            location = _location(error["loc"], error["type"] == "extra_forbidden")
            if _reported_elsewhere(error) or _under(location, empty):
                continue
            if location in replaced:
                location += f" (from {replaced[location]})"
            problems.append(f"{location}: {_message(error)}")
        raise ConfigError(problems) from None
    if empty:
        raise ConfigError(list(empty.values()))
    return config


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
    loader = _Loader(text)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    finally:
        loader.dispose()
    if loader.problems:
        raise ConfigError(
            [f"{path}: line {line}: {problem}" for line, problem in sorted(loader.problems)]
        )
    if data is None:
        raise ConfigError([f"{path}: the file is empty (a configuration needs routes at least)"])
    return parse_config(data, env=env)


_MERGE = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, but a key given twice in one mapping is a problem (YAML
    would keep the last and drop the first unseen), and a value YAML cannot construct (an
    int of 5000 digits, a month 13) is a YAML error at its line, not a ValueError.
    Merge keys (``<<: *anchor``) still work: the keys they bring may be given again."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.problems: list[tuple[int, str]] = []  # (line, problem)
        self._checked: set[yaml.MappingNode] = set()

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if node not in self._checked:  # once, and before merging puts the merged keys in
            self._checked.add(node)
            first: dict[tuple[str, str], int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE:
                    continue
                key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
                if key in first:
                    self.problems.append(
                        (
                            line,
                            f"duplicate key {key_node.value!r} (first on line {first[key]}): "
                            "YAML would keep only the last; write it once",
                        )
                    )
                else:
                    first[key] = line
        super().flatten_mapping(node)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:
            raise yaml.constructor.ConstructorError(
                None, None, f"not a valid {node.tag.rpartition(':')[2]}: {exc}", node.start_mark
            ) from None
