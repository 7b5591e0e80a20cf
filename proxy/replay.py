"""A recorded outcome as the response a caller gets: the first time, and again.

The record's bytes (``outcome.py``) know nothing of HTTP responses; this module renders
them, reading an offloaded body back from object storage (and checking its digest) when
the record holds only a pointer to it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response, StreamingResponse

from proxy.asgi import RawHeaders, Reply
from proxy.errors import StoredResponseUnavailable
from proxy.offload import ObjectRef, Offload
from proxy.outcome import StoredResponse

REPLAYED_HEADER = (b"idempotent-replayed", b"true")


def replay_headers(stored: StoredResponse, length: int) -> RawHeaders:
    """The stored headers with framing for ``length`` bytes and Idempotent-Replayed."""
    return [*stored.headers, (b"content-length", str(length).encode()), REPLAYED_HEADER]


def reply(stored: StoredResponse, *, replayed: bool) -> Response:
    """The whole response of an outcome whose body is at hand; framing is recomputed."""
    if replayed:
        return Reply(stored.status, replay_headers(stored, len(stored.body)), stored.body)
    return answer(stored.status, stored.headers, stored.body)


def answer(status: int, headers: RawHeaders, body: bytes) -> Response:
    """The first caller's whole answer: the tool's, with framing for ``body``."""
    return Reply(status, [*headers, (b"content-length", str(len(body)).encode())], body)


class Replayer:
    """Replays of one route's recorded outcomes."""

    def __init__(self, route: str, offload: Offload | None, log: Any) -> None:
        self.route = route
        self.offload = offload
        self.log = log

    async def response(self, label: str, stored: StoredResponse) -> Response:
        """The replay of ``stored``; ``StoredResponseUnavailable`` (502) if an offloaded
        body is gone, altered, or no object store is configured any more."""
        ref = stored.ref
        if ref is None:
            return reply(stored, replayed=True)
        try:
            if self.offload is None:
                raise StoredResponseUnavailable(
                    "the response body was offloaded, but no object store is configured now"
                )
            body = await self.offload.get(ref)
        except StoredResponseUnavailable as exc:
            self._unavailable(label, ref, exc)
            raise
        location = await self.offload.presigned(ref)
        if location is not None:
            stored = stored.with_header(b"content-location", location.encode())
        if isinstance(body, bytes):
            return reply(stored.with_body(body), replayed=True)
        response = StreamingResponse(self._watched(label, ref, body), stored.status)
        response.raw_headers = replay_headers(stored, ref.size)
        return response

    async def _watched(
        self, label: str, ref: ObjectRef, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except StoredResponseUnavailable as exc:
            self._unavailable(label, ref, exc, note="the replay was cut short")
            raise

    def _unavailable(
        self, label: str, ref: ObjectRef, exc: StoredResponseUnavailable, note: str = ""
    ) -> None:
        self.log.error(
            "stored_response_unavailable",
            route=self.route,
            key=label,
            object=ref.path,
            error=exc.detail,
            note=note,
        )
