"""Recorded outcomes: a response (or the problem of an unknown outcome) as stored bytes.

Only the encoding: ``replay.py`` renders an outcome as an HTTP response.

Encoding: an HTTP-like head (version and status, then the headers), a blank line, then the
body bytes untouched. Cheaper to write and read than JSON, on every first execution and
every replay.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from proxy.asgi import RawHeaders
from proxy.errors import ProxyError, StoreError
from proxy.offload import ObjectRef
from proxy.problems import MEDIA_TYPE, problem_body

# Never stored, so never replayed: another caller's session must not be set.
_NOT_STORED = frozenset({b"set-cookie", b"content-length", b"transfer-encoding"})


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """Status, end-to-end headers and body of an outcome."""

    status: int
    headers: RawHeaders
    body: bytes
    ref: ObjectRef | None = None
    """Set when the body lives in object storage (``body`` is then empty)."""

    def offloaded(self, ref: ObjectRef) -> StoredResponse:
        """This response with its body replaced by a pointer."""
        return replace(self, body=b"", ref=ref)

    def with_header(self, name: bytes, value: bytes) -> StoredResponse:
        """This response with one more header."""
        return replace(self, headers=[*self.headers, (name, value)])

    def with_body(self, body: bytes) -> StoredResponse:
        """This response with its body fetched back."""
        return replace(self, body=body, ref=None)

    @classmethod
    def of(cls, status: int, headers: RawHeaders, body: bytes) -> StoredResponse:
        """An upstream answer, without the headers that must never be replayed."""
        kept = [(k, v) for k, v in headers if k.lower() not in _NOT_STORED]
        return cls(status, kept, body)

    @classmethod
    def of_problem(cls, exc: ProxyError) -> StoredResponse:
        """The problem document of ``exc`` as an outcome (a FAILED record)."""
        return cls(exc.status, [(b"content-type", MEDIA_TYPE.encode())], problem_body(exc))

    def encode(self) -> bytes:
        """``v2 <status>``, the headers as ``name: value`` lines, a blank line, the body.

        Header lines cannot hold CR or LF (HTTP forbids them, and the client's parser
        rejects them), so the blank line always ends the head.
        """
        lines = [b"v2 %d" % self.status, *(k + b": " + v for k, v in self.headers)]
        if self.ref is not None:
            ref = self.ref
            lines.append(
                b":object: %s %d %s %s"
                % (ref.sha256.encode(), ref.size, ref.path.encode(), ref.uri.encode())
            )
        return b"\r\n".join(lines) + b"\r\n\r\n" + self.body

    @classmethod
    def decode(cls, payload: bytes) -> StoredResponse:
        head, _, body = payload.partition(b"\r\n\r\n")
        first, *lines = head.split(b"\r\n")
        try:
            version, status = first.split(b" ")
            if version != b"v2":
                raise ValueError(f"unknown record version {version!r}")
            headers: RawHeaders = []
            ref = None
            for line in lines:
                name, _, value = line.partition(b": ")
                if name == b":object":
                    digest, size, path, uri = value.split(b" ", 3)
                    ref = ObjectRef(path.decode(), int(size), digest.decode(), uri.decode())
                else:
                    headers.append((name, value))
            return cls(int(status), headers, body, ref)
        except ValueError as exc:
            raise StoreError("a stored outcome is malformed") from exc
