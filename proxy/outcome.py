"""Recorded outcomes: a response (or the problem of an unknown outcome) as stored bytes.

Encoding: one line of JSON metadata, a newline, then the body bytes untouched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from starlette.responses import Response

from proxy.errors import ProxyError, StoreError
from proxy.forwarding import RawHeaders
from proxy.offload import ObjectRef
from proxy.problems import MEDIA_TYPE, problem_body

REPLAYED_HEADER = (b"idempotent-replayed", b"true")
# Never stored, so never replayed: another caller's session must not be set.
_NOT_STORED = frozenset({b"set-cookie", b"content-length", b"transfer-encoding"})
_VERSION = 1


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
        meta: dict[str, object] = {
            "v": _VERSION,
            "status": self.status,
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in self.headers],
        }
        if self.ref is not None:
            meta["object"] = {
                "uri": self.ref.uri,
                "path": self.ref.path,
                "size": self.ref.size,
                "sha256": self.ref.sha256,
            }
        return json.dumps(meta, separators=(",", ":")).encode() + b"\n" + self.body

    @classmethod
    def decode(cls, payload: bytes) -> StoredResponse:
        meta_line, _, body = payload.partition(b"\n")
        try:
            meta = json.loads(meta_line)
            headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in meta["headers"]]
            obj = meta.get("object")
            ref = None
            if obj is not None:
                ref = ObjectRef(obj["path"], int(obj["size"]), obj["sha256"], obj.get("uri", ""))
            return cls(int(meta["status"]), headers, body, ref)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreError("a stored outcome is malformed") from exc

    def replay_headers(self, length: int) -> RawHeaders:
        """The stored headers with framing for ``length`` bytes and Idempotent-Replayed."""
        return [*self.headers, (b"content-length", str(length).encode()), REPLAYED_HEADER]

    def to_response(self, *, replayed: bool) -> Response:
        """A starlette response; framing (Content-Length) is recomputed."""
        response = Response(self.body, self.status)
        if replayed:
            response.raw_headers = self.replay_headers(len(self.body))
        else:
            response.raw_headers = [
                *self.headers,
                (b"content-length", str(len(self.body)).encode()),
            ]
        return response
