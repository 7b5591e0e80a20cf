"""The Redis store's Lua scripts, one file per script, loaded once at import.

A file is named ``<name>-<keys>.lua`` (``keys``: how many it is given in KEYS, ``n`` for
any number), as BullMQ names its commands. A line ``--- @include "<piece>"`` is replaced
by ``includes/<piece>.lua``. Every key a script touches is one of its KEYS: none is built
inside a script, so a Redis Cluster routes each call to the node that holds them all
(tests/test_redis_scripts.py checks it).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

DIRECTORY = Path(__file__).parent
_INCLUDE = re.compile(r'^--- @include "([a-z_]+)"$', re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Script:
    """One script: its name, how many keys it takes (None: any), its source with the
    includes expanded, and the SHA-1 that EVALSHA names it by."""

    name: str
    keys: int | None
    source: str
    sha: str


def _include(match: re.Match[str]) -> str:
    text = (DIRECTORY / "includes" / f"{match[1]}.lua").read_text().rstrip("\n")
    return _INCLUDE.sub(_include, text)  # a piece may include another


def load(path: Path) -> Script:
    """The script in ``path``, its includes expanded."""
    name, _, keys = path.stem.rpartition("-")
    source = _INCLUDE.sub(_include, path.read_text())
    sha = hashlib.sha1(source.encode()).hexdigest()
    return Script(name, None if keys == "n" else int(keys), source, sha)


SCRIPTS = {script.name: script for script in map(load, sorted(DIRECTORY.glob("*.lua")))}
