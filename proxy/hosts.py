"""Which ``Host`` and ``Origin`` the proxy's own listener answers (DNS rebinding).

A page on ``evil.example.com`` whose name is made to resolve to 127.0.0.1 can send
requests to a proxy listening on loopback, with ``Host: evil.example.com`` and, from a
browser, its ``Origin``. The proxy rewrites ``Host`` to the upstream's, so a tool
server's own check (the MCP SDKs') never sees it: the proxy checks both, as the MCP
SDKs do (``mcp.server.transport_security``):

- ``Host`` (``server.allowed_hosts``): an entry ``name`` (or ``name:*``) allows that
  name with any port or none, ``name:port`` that exact value, ``*`` every Host. Not
  allowed: ``421 misdirected-request``.
- ``Origin`` (``server.allowed_origins``): an entry ``scheme://name[:port]`` allows that
  exact origin, ``scheme://name:*`` any port or none, ``*`` every Origin. Unset: an Origin whose
  host is an allowed Host (http or https). Not allowed: ``403 origin-not-allowed``. A
  request without Origin (not from a browser) passes.

Defaults: bound to loopback, loopback names only (``localhost``, ``127.0.0.1``,
``[::1]``, with or without a port); bound to any other address, every Host (a sidecar is
reached by pod IP and service names the proxy cannot know). The health probes are never
checked (a kubelet sends the pod's address).
"""

from __future__ import annotations

import ipaddress

from proxy.errors import MisdirectedRequest, OriginNotAllowed

ANY = "*"
"""The entry that allows every Host (or every Origin)."""
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
"""The Host names allowed by default when the proxy is bound to loopback."""
# Allowed Host and Origin values are remembered (one set lookup next time), at most this
# many: values an attacker chooses are refused, so never remembered.
MAX_REMEMBERED = 256
_SCHEMES = ("http://", "https://")


def is_loopback(address: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (``127.0.0.0/8``, ``::1``)."""
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def split_port(host: str) -> tuple[str, str]:
    """``name:port`` (or ``scheme://name:port``) as ``(name, port)``: the port is the
    digits (or ``*``) after the last colon, if any; ``(host, "")`` without one. An IPv6
    name keeps its brackets."""
    name, colon, port = host.rpartition(":")
    if colon and (port.isdigit() or port in ("", "*")):
        return name, port
    return host, ""


def check_host_entry(entry: str) -> str:
    """An ``allowed_hosts`` entry, lower case; ``ValueError`` if it is not one."""
    entry = entry.strip().lower()
    if entry == ANY:
        return entry
    name = split_port(entry)[0]
    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    if not bare or any(c in bare for c in "/?#@ *[]") or (":" in bare and bare == name):
        raise ValueError(f"not a host, host:port or host:*: {entry!r}")
    return entry


def check_origin_entry(entry: str) -> str:
    """An ``allowed_origins`` entry, lower case; ``ValueError`` if it is not one."""
    entry = entry.strip().lower()
    if entry == ANY:
        return entry
    scheme, sep, host = entry.partition("://")
    if not sep or not scheme.isalpha() or not host or host == ANY:
        raise ValueError(f"not an origin (scheme://host[:port], or :* for any port): {entry!r}")
    check_host_entry(host)
    return entry


class Allowed:
    """A set of allowed values: exact ones, names with any port, or all."""

    __slots__ = ("_any_port", "_exact", "_remembered")

    def __init__(self, entries: tuple[str, ...]) -> None:
        self._exact: set[str] = set()
        self._any_port: set[str] = set()
        self._remembered: set[str] = set()
        for entry in entries:
            name, port = split_port(entry)
            if port == "*":
                self._any_port.add(name)
            else:
                self._exact.add(entry)

    def allows(self, value: str) -> bool:
        """True if ``value`` (a Host, or ``scheme://host[:port]``) is allowed."""
        if value in self._remembered:
            return True
        low = value.lower()
        if not (low in self._exact or split_port(low)[0] in self._any_port):
            return False
        if len(self._remembered) < MAX_REMEMBERED:
            self._remembered.add(value)
        return True


def host_entries(entries: tuple[str, ...]) -> tuple[str, ...]:
    """``allowed_hosts`` as ``Allowed`` takes them: a bare name allows any port, or none."""
    out: list[str] = []
    for entry in entries:
        out.append(entry)
        if not split_port(entry)[1]:
            out.append(entry + ":*")
    return tuple(out)


def origin_entries(hosts: tuple[str, ...]) -> tuple[str, ...]:
    """The origins allowed when ``allowed_origins`` is unset: the allowed Hosts', over
    http or https."""
    return tuple(scheme + host for scheme in _SCHEMES for host in host_entries(hosts))


class Listener:
    """The Host and Origin checks of the proxy's listener."""

    __slots__ = ("hosts", "origins")

    def __init__(self, hosts: Allowed | None, origins: Allowed | None) -> None:
        self.hosts = hosts
        self.origins = origins

    @classmethod
    def of(
        cls, bound: str, hosts: tuple[str, ...] | None, origins: tuple[str, ...] | None
    ) -> Listener | None:
        """The checks for a listener bound to ``bound``; None if every Host and Origin
        passes (nothing to check)."""
        if hosts is None:
            hosts = LOOPBACK_NAMES if is_loopback(bound) else (ANY,)
        if origins is None:
            origins = (ANY,) if ANY in hosts else origin_entries(hosts)
        allowed_hosts = None if ANY in hosts else Allowed(host_entries(hosts))
        allowed_origins = None if ANY in origins else Allowed(origins)
        if allowed_hosts is None and allowed_origins is None:
            return None
        return cls(allowed_hosts, allowed_origins)

    def check(self, host: str | None, origin: str | None) -> None:
        """``MisdirectedRequest`` or ``OriginNotAllowed`` unless both are allowed."""
        if self.hosts is not None and (host is None or not self.hosts.allows(host)):
            raise MisdirectedRequest(
                f"this proxy does not answer for Host {host!r} (server.allowed_hosts)"
                if host is not None
                else "a request without Host is refused here (server.allowed_hosts)"
            )
        if origin is not None and self.origins is not None and not self.origins.allows(origin):
            raise OriginNotAllowed(
                f"requests from Origin {origin!r} are refused (server.allowed_origins)"
            )

    def check_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        """``check`` of the first Host and Origin of ASGI headers."""
        found: dict[bytes, str] = {}
        for name, value in headers:
            if name in (b"host", b"origin") and name not in found:
                found[name] = value.decode("latin-1")
        self.check(found.get(b"host"), found.get(b"origin"))
