"""``auth`` (issuers, downstream tokens), ``routes[].auth``, ``routes[].token`` and ``admin``."""

from __future__ import annotations

import re
from enum import StrEnum
from urllib.parse import SplitResult, urlsplit

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from proxy.config.fields import Duration, Strict

# Token signatures accepted unless an issuer pins others (never symmetric ones or none).
DEFAULT_ALGORITHMS = ("RS256", "ES256")

# Clock skew tolerated on exp, nbf and iat.
DEFAULT_LEEWAY = 30.0

# The claims whose values scope idempotency records to one caller.
DEFAULT_PRINCIPAL_CLAIMS = ("iss", "sub")

# Downstream tokens are renewed at this fraction of their lifetime.
DEFAULT_REFRESH_AHEAD = 0.8

# Downstream tokens kept in each process at most (auth.token_cache_entries): one per route,
# user and grant in use; the least recently used is evicted first.
DEFAULT_TOKEN_CACHE_ENTRIES = 10_000

# How long fetched signing keys are trusted before they are fetched again.
DEFAULT_JWKS_TTL = 300.0

# The JWT claim holding an operator's roles (admin.role must be one of them).
DEFAULT_ROLES_CLAIM = "roles"

_ASYMMETRIC_ALGORITHMS = (
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
)


# Characters no URL of the configuration may hold: sent as they are, a space or a control
# character breaks the request line (percent-encode them).
_UNSENDABLE = re.compile(r"[\x00-\x20\x7f]")


def check_http_url(url: str) -> SplitResult:
    """``url`` split, if it is an absolute http(s) URL that can be sent: a host, a port
    1..65535 if one is given, no space or control character; else ValueError."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unclosed IPv6 bracket
        raise ValueError(f"not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an absolute http(s) URL")
    if _UNSENDABLE.search(url):
        raise ValueError("a URL has no spaces or control characters (percent-encode them)")
    if not _valid_port(parts):
        raise ValueError(f"not a port in {parts.netloc!r}: a number 1..65535")
    return parts


def _valid_port(parts: SplitResult) -> bool:
    """True if ``parts`` has no port, or one of 1..65535 (``port`` raises ValueError for
    one out of range or not a number, and is 0 for port 0)."""
    try:
        return parts.port != 0
    except ValueError:
        return False


# Time allowed for one token endpoint call (proxy/auth/tokens.py), and so counted in the
# longest a call can take.
TOKEN_TIMEOUT_SECONDS = 10.0


class IssuerConfig(Strict):
    """A trusted token issuer."""

    issuer: str
    jwks_url: str | None = None
    discovery: bool = False
    audiences: tuple[str, ...] = Field(min_length=1)
    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS
    leeway: Duration = DEFAULT_LEEWAY
    required_claims: tuple[str, ...] = ()

    @field_validator("algorithms")
    @classmethod
    def _pinned(cls, algorithms: tuple[str, ...]) -> tuple[str, ...]:
        for algorithm in algorithms:
            if algorithm not in _ASYMMETRIC_ALGORITHMS:
                raise ValueError(
                    f"{algorithm!r} is not allowed: use asymmetric algorithms "
                    f"({', '.join(_ASYMMETRIC_ALGORITHMS)})"
                )
        return algorithms

    @field_validator("jwks_url")
    @classmethod
    def _jwks_url(cls, url: str | None) -> str | None:
        if url is not None:
            check_http_url(url)
        return url

    @model_validator(mode="after")
    def _keys_source(self) -> IssuerConfig:
        if (self.jwks_url is None) == (not self.discovery):
            raise ValueError("set exactly one of jwks_url and discovery: true")
        if self.discovery:
            try:
                check_http_url(self.issuer)
            except ValueError as exc:
                raise ValueError(
                    f"issuer: {exc} (with discovery: true, the keys are found at "
                    "<issuer>/.well-known/openid-configuration)"
                ) from None
        return self


class AuthConfig(Strict):
    """Who may call: trusted issuers, and the claims that make a principal."""

    issuers: tuple[IssuerConfig, ...] = Field(min_length=1)
    principal: tuple[str, ...] = DEFAULT_PRINCIPAL_CLAIMS
    jwks_ttl: Duration = DEFAULT_JWKS_TTL
    token_cache_key_env: str | None = None
    token_cache_entries: int = Field(default=DEFAULT_TOKEN_CACHE_ENTRIES, ge=1)

    @field_validator("principal")
    @classmethod
    def _principal(cls, claims: tuple[str, ...]) -> tuple[str, ...]:
        if not claims or not all(claim.strip() for claim in claims):
            raise ValueError(
                "one claim name at least, none empty: records are scoped by the claims' "
                "values, and without one every caller would share them"
            )
        return claims


class TokenMode(StrEnum):
    """What a route sends upstream as Authorization."""

    PASSTHROUGH = "passthrough"
    CLIENT_CREDENTIALS = "client_credentials"
    TOKEN_EXCHANGE = "token_exchange"
    OBO = "obo"


class TokenConfig(Strict):
    """The token a route forwards (on-behalf-of, exchange or the proxy's own)."""

    mode: TokenMode = TokenMode.PASSTHROUGH
    token_endpoint: str | None = None
    client_id: str | None = None
    client_secret_env: str | None = None
    client_secret_file: str | None = None
    audience: str | None = None
    resource: str | None = None
    scope: str | None = None
    refresh_ahead: float = Field(default=DEFAULT_REFRESH_AHEAD, gt=0, lt=1)
    use_refresh_tokens: bool = False
    actor_token_env: str | None = None
    retry_on_401: bool = False
    """Send a call once more, with a new token, when the tool answers 401. It assumes that a
    tool answering 401 did nothing: if it can act and then answer 401, a call runs twice."""

    @field_validator("token_endpoint")
    @classmethod
    def _token_endpoint(cls, url: str | None) -> str | None:
        if url is not None:
            check_http_url(url)
        return url

    @model_validator(mode="after")
    def _complete(self) -> TokenConfig:
        if self.mode is TokenMode.PASSTHROUGH:
            return self
        missing = [f for f in ("token_endpoint", "client_id") if getattr(self, f) is None]
        if missing:
            raise ValueError(f"mode {self.mode.value} needs {' and '.join(missing)}")
        if (self.client_secret_env is None) == (self.client_secret_file is None):
            raise ValueError("set exactly one of client_secret_env and client_secret_file")
        return self


class RouteAuthConfig(Strict):
    """Caller authentication on one route."""

    required: bool = True


class AdminConfig(Strict):
    """Operator access to ``/_proxy/admin/``: a bearer token read from a secret, or a JWT
    from the ``auth`` issuers carrying a role."""

    token_env: str | None = None
    token_file: str | None = None
    role: str | None = None
    roles_claim: str = DEFAULT_ROLES_CLAIM
    read_role: str | None = None
    """A JWT role that may look at the console's views, and change nothing."""

    @model_validator(mode="after")
    def _one_credential(self) -> AdminConfig:
        if sum(v is not None for v in (self.token_env, self.token_file, self.role)) != 1:
            raise ValueError("set exactly one of token_env, token_file and role")
        return self
