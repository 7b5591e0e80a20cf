"""``server``: where `serve` listens, the Host and Origin it answers; ``limits``: request limits."""

from __future__ import annotations

import ipaddress
import re

from pydantic import (
    Field,
    field_validator,
)

from proxy.config.fields import Duration, Strict, check_entries
from proxy.hosts import check_host_entry, check_origin_entry

# Where `serve` listens unless the file or --host/--port say otherwise.
DEFAULT_HOST = "0.0.0.0"

DEFAULT_PORT = 8080

# The ports `serve` may listen on (server.port, --port).
MIN_PORT = 1
MAX_PORT = 65535

# A host name `serve` may listen on: dot-separated labels of letters, digits, "-" (not at
# either end) and "_" (container names have them), an optional final dot.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")

# Request bodies above this get 413 and are never forwarded (10 MiB).
DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024

# JSON bodies that nest arrays and objects deeper than this are refused before they are
# parsed (400). serde_json's default; tool arguments nest a few levels (structured
# outputs of LLM APIs allow 5 to 10), and the decoders and the RFC 8785 encoder, which
# recurse once per level, stay far below Python's recursion limit (1000).
DEFAULT_MAX_JSON_DEPTH = 128

# The most that limits.max_json_depth may be: room left under Python's recursion limit.
MAX_JSON_DEPTH_LIMIT = 512

# A request head (request line and header lines) above this gets 431: Envoy's default
# (60 KiB); nginx allows 32 KiB in all (4 lines of 8 KiB). Room for large bearer tokens.
DEFAULT_MAX_HEADER_BYTES = 60 * 1024

# The least that limits.max_header_bytes may be.
MIN_HEADER_BYTES = 1024

# How long a request head may take to arrive whole, and a body may go without a byte
# (408 then): nginx's client_header_timeout and client_body_timeout.
DEFAULT_HEADER_TIMEOUT = 60.0
DEFAULT_BODY_TIMEOUT = 60.0


def check_listen_host(host: str) -> str:
    """``host`` if `serve` may listen on it: an IP address (IPv6 without brackets) or a host
    name; else ``ValueError`` saying why (a URL, a port, a path, a character no name has)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if host.startswith("[") and host.endswith("]"):
        raise ValueError(f"write an IPv6 address without brackets: {host[1:-1]!r}")
    last = host.rstrip(".").rpartition(".")[2]
    if len(host) <= 253 and _HOST_NAME.fullmatch(host) and not last.isdigit():
        return host
    if not host:
        raise ValueError("empty: give a host name or an IP address (0.0.0.0: every interface)")
    raise ValueError(f"not a host name or an IP address (no scheme, port or path): {host!r}")


class ServerConfig(Strict):
    """Where `serve` listens, and the Host and Origin it answers (``proxy/hosts.py``)."""

    host: str = DEFAULT_HOST
    port: int = Field(default=DEFAULT_PORT, ge=MIN_PORT, le=MAX_PORT)
    allowed_hosts: tuple[str, ...] | None = None
    """None: loopback names when bound to loopback, else every Host."""
    allowed_origins: tuple[str, ...] | None = None
    """None: the origins of the allowed Hosts (every Origin if every Host)."""

    @field_validator("host")
    @classmethod
    def _host(cls, host: str) -> str:
        return check_listen_host(host)

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, hosts: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if hosts is None else check_entries(hosts, check_host_entry)

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, origins: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if origins is None else check_entries(origins, check_origin_entry)


class LimitsConfig(Strict):
    """Request limits."""

    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=0)
    max_json_depth: int = Field(default=DEFAULT_MAX_JSON_DEPTH, ge=1, le=MAX_JSON_DEPTH_LIMIT)
    max_header_bytes: int = Field(default=DEFAULT_MAX_HEADER_BYTES, ge=MIN_HEADER_BYTES)
    header_timeout: Duration = DEFAULT_HEADER_TIMEOUT
    body_timeout: Duration = DEFAULT_BODY_TIMEOUT
