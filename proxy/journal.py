"""The local journal: outcomes the store could not take yet, kept on disk until it can.

When the store is out of reach as a call concludes, its outcome (or the release of its
key) is appended to a file of this process's own in the state directory and synced to
disk; the journal writes it to the store as soon as the store answers again. Meanwhile
the key is IN_PROGRESS (the lease goes on) or, once the lease has lapsed, FAILED: never
a free key. A proxy that stops before the store came back leaves its file behind; the
next proxy to start on the same state directory adopts it and records what it holds.

Each process holds an exclusive ``flock`` on its file, so a live process's journal is
never adopted by another. An entry is recorded with the owner token of the call that
made it: for the store it is that call's own late outcome (fenced like any other: a
record another owner took over is not overwritten).

File format, one entry after another, each self-checking (a torn last entry is dropped)::

    <4-byte length of the rest> <JSON head line> "\\n" <payload> <4-byte CRC-32 of the rest>
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import secrets
import struct
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from proxy.errors import ConfigError, ResponseNotStored, StoreRefused, StoreUnavailable
from proxy.outcome import StoredResponse
from proxy.store import RecordKey, State, Store

# How often the journal tries the store again while it holds entries.
RETRY_SECONDS = 0.5
SUFFIX = ".journal"
_LENGTH = struct.Struct(">I")
_NOT_KEPT = b"v2 410"


@dataclass(slots=True)
class Entry:
    """An outcome to record, or (``state`` None) a key to release."""

    route: str
    slot: str
    name: str
    owner: str
    fingerprint: str
    state: str | None
    result_ttl: float
    payload: bytes = field(default=b"", repr=False)
    label: str = ""

    @property
    def key(self) -> RecordKey:
        return RecordKey(self.slot, self.name)

    def encode(self) -> bytes:
        head = {k: v for k, v in asdict(self).items() if k != "payload"}
        rest = json.dumps(head, separators=(",", ":")).encode() + b"\n" + self.payload
        return _LENGTH.pack(len(rest)) + rest + _LENGTH.pack(zlib.crc32(rest))

    @classmethod
    def decode(cls, rest: bytes) -> Entry:
        head, _, payload = rest.partition(b"\n")
        return cls(**json.loads(head), payload=payload)


def read_entries(data: bytes) -> list[Entry]:
    """The whole entries in ``data``, up to the first torn or corrupt one."""
    entries, offset = [], 0
    while offset + _LENGTH.size <= len(data):
        (length,) = _LENGTH.unpack_from(data, offset)
        end = offset + _LENGTH.size + length
        if end + _LENGTH.size > len(data):
            break
        rest = data[offset + _LENGTH.size : end]
        (crc,) = _LENGTH.unpack_from(data, end)
        if zlib.crc32(rest) != crc:
            break
        try:
            entries.append(Entry.decode(rest))
        except (ValueError, TypeError):
            break
        offset = end + _LENGTH.size
    return entries


@dataclass(slots=True)
class _Pending:
    entry: Entry
    done: Callable[[], None] | None
    file: Path


class Journal:
    """This process's journal file, the files it adopted, and the entries still to record."""

    def __init__(self, directory: Path, store: Store, log: Any) -> None:
        self.directory = directory
        self.store = store
        self.log = log
        self._own: Path | None = None
        self._file: IO[bytes] | None = None
        self._adopted: dict[Path, IO[bytes]] = {}
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()
        self._writing = 0
        self.recorded = 0

    def __len__(self) -> int:
        return len(self._pending)

    def open(self) -> None:
        """Create this process's file and adopt the files of proxies that stopped."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for path in sorted(self.directory.glob(f"*{SUFFIX}")):
                self._adopt(path)
            self._file, self._own = self._create()
        except OSError as exc:
            raise ConfigError(
                [f"state_dir: cannot keep the journal in {self.directory}: {exc.strerror}"]
            ) from None
        if self._pending:
            self.log.warning("journal_adopted", entries=len(self._pending))

    def _create(self) -> tuple[IO[bytes], Path]:
        """This process's file, locked before it gets the name others look for (so no
        other process can take it for a dead one's)."""
        name = f"{os.getpid()}-{secrets.token_hex(6)}"
        hidden = self.directory / f".{name}.new"
        file = hidden.open("ab")
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        own = self.directory / f"{name}{SUFFIX}"
        os.rename(hidden, own)
        return file, own

    def _adopt(self, path: Path) -> None:
        try:
            file = path.open("r+b")
        except FileNotFoundError:  # adopted and done by another process meanwhile
            return
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live process's own journal
            file.close()
            return
        data = file.read()
        entries = read_entries(data)
        if not entries:
            file.close()
            if data:  # nothing readable in it: kept aside for a person, never dropped
                path.rename(path.with_suffix(".unreadable"))
                self.log.error("journal_unreadable", file=str(path))
            else:
                path.unlink(missing_ok=True)
            return
        self._adopted[path] = file
        self._pending += [_Pending(entry, None, path) for entry in entries]

    async def keep(self, entry: Entry, done: Callable[[], None] | None = None) -> None:
        """Append ``entry`` to the file, synced to disk (``OSError`` if it cannot be);
        ``done`` is called once the store has it."""
        assert self._file is not None and self._own is not None, "Journal.open() first"
        self._writing += 1  # the file is not truncated while an entry is being written
        try:
            await asyncio.to_thread(_append, self._file, entry.encode())
        finally:
            self._writing -= 1
        self._pending.append(_Pending(entry, done, self._own))
        self._wake.set()

    async def run_forever(self) -> None:
        """Record the pending entries whenever the store answers."""
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.flush()
            except Exception as exc:  # never dies: its entries hold keys IN_PROGRESS
                self.log.error("journal_error", error=repr(exc))
            if self._pending:
                await asyncio.sleep(RETRY_SECONDS)

    async def flush(self) -> None:
        """Try every pending entry once, in order; stop at the first unreachable store."""
        while self._pending:
            pending = self._pending[0]
            try:
                await self._record(pending.entry)
            except StoreRefused as exc:
                if not self._given_up(pending, exc):
                    continue
            except StoreUnavailable:
                return
            except Exception as exc:  # the store broke its contract: give this one up
                self.log.critical(
                    "outcome_not_recorded",
                    route=pending.entry.route,
                    key=pending.entry.label,
                    error=repr(exc),
                )
            self._pending.pop(0)
            self.recorded += 1
            if pending.done is not None:
                pending.done()
            self._forget_done_files()

    def _given_up(self, pending: _Pending, exc: StoreRefused) -> bool:
        """The store refuses the entry: try it once more in its small "not kept" form
        (False), or give it up if it is that already (True)."""
        entry = pending.entry
        self.log.error("outcome_refused", route=entry.route, key=entry.label, error=exc.detail)
        if entry.state == State.COMPLETED.value and not entry.payload.startswith(_NOT_KEPT):
            entry.payload = StoredResponse.of_problem(
                ResponseNotStored(
                    "the call was executed once; the store refused its response "
                    f"({exc.detail}), which cannot be replayed"
                )
            ).encode()
            return False
        self.log.critical("outcome_not_recorded", route=entry.route, key=entry.label)
        return True

    async def _record(self, entry: Entry) -> None:
        if entry.state is None:
            await self.store.release(entry.key, entry.owner)
            event = "journal_released"
        else:
            kept = await self.store.complete(
                entry.key,
                entry.owner,
                entry.fingerprint,
                State(entry.state),
                entry.payload,
                entry.result_ttl,
            )
            event = "journal_recorded" if kept else "journal_fenced"
        self.log.info(event, route=entry.route, key=entry.label)

    def _forget_done_files(self) -> None:
        """Truncate this process's file, delete adopted ones, once nothing in them waits."""
        waiting = {p.file for p in self._pending}
        for path in [p for p in self._adopted if p not in waiting]:
            self._adopted.pop(path).close()
            path.unlink(missing_ok=True)
        if self._own not in waiting and self._file is not None and not self._writing:
            self._file.truncate(0)

    def close(self) -> None:
        """Release the files: what is still pending stays on disk for the next start."""
        if self._pending:
            self.log.warning("journal_left_for_next_start", entries=len(self._pending))
        for file in self._adopted.values():
            file.close()
        if self._file is not None:
            self._file.close()
            if not self._pending and self._own is not None:
                self._own.unlink(missing_ok=True)


def check_directory(directory: Path) -> str | None:
    """A problem naming ``state_dir`` if the journal cannot be kept in ``directory``."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return (
            f"state_dir: the journal cannot be kept in {directory}: {exc.strerror} "
            "(set state_dir, or TOOL_PROXY_STATE_DIR, to a writable directory)"
        )
    return None


def _append(file: IO[bytes], data: bytes) -> None:
    file.write(data)
    file.flush()
    os.fsync(file.fileno())
