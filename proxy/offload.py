"""Claim check: response bodies above a threshold live in object storage.

The store keeps only a pointer (object path, size, SHA-256); a replay reads the body back
and checks its digest, so a missing or altered object is a clear 502, never a wrong body.
obstore gives one async API over S3, GCS, Azure, local files and memory; credentials,
region and endpoint come from the usual environment variables (AWS_*, GOOGLE_*,
AZURE_*) or from ``offload`` in the configuration.

Objects are written create-only under ``<prefix>/<route>/<expiry>-<random>``: unguessable,
never overwritten, and named with the unix second after which no record can point at
them any more (the route's result_ttl when written, plus ``EXPIRY_MARGIN_SECONDS``). The
sweep reads that expiry from the name, never the store's last_modified, and leaves every
name that does not follow the scheme alone (older versions, other users of the prefix).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, TYPE_CHECKING, Any

import obstore
from obstore.exceptions import BaseError, NotFoundError
from obstore.store import AzureStore, GCSStore, S3Store, from_url

from proxy.config import DEFAULT_RESULT_TTL, OffloadConfig

if TYPE_CHECKING:
    from obstore import GetResult
from proxy.errors import OffloadUnavailable, StoredResponseUnavailable

# Offloaded bodies up to this size are read and checked whole before a replay starts;
# larger ones stream in chunks of STREAM_CHUNK_BYTES (memory stays bounded per replay).
VERIFY_WHOLE_BYTES = 1024 * 1024
STREAM_CHUNK_BYTES = 256 * 1024
# Added to the result_ttl in an object's expiry: the record is written after the object,
# and the clocks of the writer and of a later sweeper may differ.
EXPIRY_MARGIN_SECONDS = 3600.0
# ``<route>/<expiry>-<32 hex digits>``: the only names the sweep ever deletes.
_SWEEPABLE = re.compile(r"[A-Za-z0-9._-]{1,64}/(?P<expiry>[0-9]{1,12})-[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """Where an offloaded body is, and what it must hash to."""

    path: str
    size: int
    sha256: str
    uri: str = ""
    """The full object URI (offload.url + path), for people reading the store."""


def _store_options(config: OffloadConfig) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if config.endpoint_url:
        options["config"] = {"endpoint": config.endpoint_url}
    if config.region:
        options.setdefault("config", {})["region"] = config.region
    if config.allow_http:
        options["client_options"] = {"allow_http": True}
    return options


@contextmanager
def _reading(ref: ObjectRef) -> Iterator[None]:
    """Translate the object store's errors on reading ``ref``."""
    try:
        yield
    except (NotFoundError, FileNotFoundError) as exc:
        raise StoredResponseUnavailable(
            f"the stored response body {ref.path} is missing from the object store"
        ) from exc
    except (BaseError, OSError) as exc:
        raise StoredResponseUnavailable(
            f"the object store could not return {ref.path}: {exc}"
        ) from exc


def _mismatch(ref: ObjectRef) -> StoredResponseUnavailable:
    return StoredResponseUnavailable(
        f"the stored response body {ref.path} does not match its recorded size and digest"
    )


class Spool:
    """A body on its way to object storage: in memory up to the threshold, then in a
    temporary file (under ``$TMPDIR``). The SHA-256 is computed as the chunks arrive.

    ``read`` takes any part already written without moving the file's position
    (``os.pread``), so the first caller can read the body while it is still being written,
    or uploaded by obstore's threads. Each user that ``hold``s it ``close``s it; the last
    one closes the file (which deletes it).
    """

    def __init__(self, threshold: int) -> None:
        self._threshold = threshold
        self._memory = bytearray()
        self._file: IO[bytes] | None = None
        self._users = 1
        self.size = 0
        self._digest = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        if self._file is None and self.size + len(chunk) > self._threshold:
            file = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
            try:
                file.write(self._memory)
                file.flush()
            except BaseException:
                file.close()  # the spool stays in memory, whole
                raise
            self._file, self._memory = file, bytearray()
        if self._file is None:
            self._memory += chunk
        else:
            self._file.write(chunk)
            self._file.flush()  # readable by ``read`` at once
        self._digest.update(chunk)
        self.size += len(chunk)

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset``; ``OSError`` if fewer were written there."""
        if self._file is None:
            chunk = bytes(self._memory[offset : offset + size])
        else:
            chunk = os.pread(self._file.fileno(), size, offset)
        if len(chunk) != size:
            raise OSError(f"the spool holds {len(chunk)} bytes at {offset}, not {size}")
        return chunk

    def whole(self) -> bytes:
        return b"".join(
            self.read(offset, min(STREAM_CHUNK_BYTES, self.size - offset))
            for offset in range(0, self.size, STREAM_CHUNK_BYTES)
        )

    def source(self) -> bytes | IO[bytes]:
        """What to upload: the bytes, or the file from its start."""
        if self._file is None:
            return bytes(self._memory)
        self._file.seek(0)
        return self._file

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def hold(self) -> None:
        self._users += 1

    def close(self) -> None:
        self._users -= 1
        if self._users == 0 and self._file is not None:
            self._file.close()


def expiry_of(path: str) -> int | None:
    """The expiry (unix seconds) in an object's name; None for names of another scheme."""
    found = _SWEEPABLE.fullmatch(path)
    return None if found is None else int(found["expiry"])


class Offload:
    """Puts and gets offloaded bodies, and sweeps the expired ones.

    ``result_ttls`` maps each route to its result_ttl: how long a ``put`` without
    ``keep_for`` keeps its object (the longest of them for a route not in it).
    """

    def __init__(
        self,
        config: OffloadConfig,
        result_ttls: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = config.url
        self.threshold = config.threshold_bytes
        self.presign = config.presign
        self.presign_ttl = config.presign_ttl
        self.sweeps = config.sweep
        self._result_ttls = dict(result_ttls or {})
        self._clock = clock
        self._store = from_url(config.url, **_store_options(config))

    async def presigned(self, ref: ObjectRef) -> str | None:
        """A short-lived GET URL for the object, if enabled and the store can sign."""
        store = self._store
        if not self.presign or not isinstance(store, S3Store | GCSStore | AzureStore):
            return None  # file:// and memory:// cannot sign; the body is sent either way
        try:
            return await obstore.sign_async(
                store, "GET", ref.path, timedelta(seconds=self.presign_ttl)
            )
        except (BaseError, OSError, ValueError):
            return None

    def wants(self, size: int) -> bool:
        """True if a body of ``size`` bytes goes to object storage."""
        return size > self.threshold

    def _expiry(self, route: str, keep_for: float | None) -> int:
        """The unix second after which no record of ``route`` written now can remain."""
        if keep_for is None:
            longest = max(self._result_ttls.values(), default=DEFAULT_RESULT_TTL)
            keep_for = self._result_ttls.get(route, longest)
        return math.ceil(self._clock() + keep_for + EXPIRY_MARGIN_SECONDS)

    async def put(
        self, route: str, body: bytes | Spool, *, keep_for: float | None = None
    ) -> ObjectRef:
        """Write ``body`` create-only under a new unguessable name (multipart when large),
        kept ``keep_for`` seconds (the record's result_ttl; by default the route's)."""
        path = f"{route}/{self._expiry(route, keep_for)}-{secrets.token_hex(16)}"
        if isinstance(body, Spool):
            data: bytes | IO[bytes] = body.source()
            size, digest = body.size, body.sha256
        else:
            data = body
            size, digest = len(body), hashlib.sha256(body).hexdigest()
        ref = ObjectRef(path, size, digest, f"{self.url.rstrip('/')}/{path}")
        try:
            await obstore.put_async(self._store, path, data, mode="create")
        except (BaseError, OSError) as exc:
            raise OffloadUnavailable(f"object store {self.url}: {exc}") from exc
        return ref

    async def get(self, ref: ObjectRef) -> bytes | AsyncIterator[bytes]:
        """The body, checked against its size and digest.

        Up to ``VERIFY_WHOLE_BYTES`` it is read and checked before anything is returned.
        A larger body comes as chunks, the last one held back until the digest is checked:
        a corrupt object then ends in ``StoredResponseUnavailable`` mid-stream, and the
        caller gets a response cut short, never a wrong complete body.
        """
        with _reading(ref):
            result = await obstore.get_async(self._store, ref.path)
        if result.meta["size"] != ref.size:
            raise _mismatch(ref)
        if ref.size > VERIFY_WHOLE_BYTES:
            return self._verified(result, ref)
        with _reading(ref):
            body = bytes(await result.bytes_async())
        if hashlib.sha256(body).hexdigest() != ref.sha256:
            raise _mismatch(ref)
        return body

    async def _verified(self, result: GetResult, ref: ObjectRef) -> AsyncIterator[bytes]:
        digest = hashlib.sha256()
        held = b""
        with _reading(ref):
            async for chunk in result.stream(min_chunk_size=STREAM_CHUNK_BYTES):
                if held:
                    yield held
                held = bytes(chunk)
                digest.update(held)
        if digest.hexdigest() != ref.sha256:
            raise _mismatch(ref)
        yield held

    async def sweep(self) -> int:
        """Delete the objects whose expiry has passed; return how many.

        The expiry is read from each name (written with it); objects named otherwise are
        never deleted, whatever their age.
        """
        now = self._clock()
        stale: list[str] = []
        try:
            async for chunk in obstore.list(self._store, chunk_size=1000):
                for meta in chunk:
                    expiry = expiry_of(meta["path"])
                    if expiry is not None and expiry < now:
                        stale.append(meta["path"])
            if stale:
                await obstore.delete_async(self._store, stale)
        except (BaseError, OSError) as exc:
            raise OffloadUnavailable(f"object store {self.url}: {exc}") from exc
        return len(stale)
