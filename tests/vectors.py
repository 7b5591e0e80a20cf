"""The shared key test vectors (clients/test-vectors/keys.json): the proxy and both
clients check them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VECTORS_PATH = Path(__file__).parent.parent / "clients" / "test-vectors" / "keys.json"


def key_vectors() -> dict[str, Any]:
    """The parsed file: ``vectors`` (plan, step, arguments, canonical, args_hash, key) and
    ``bodies`` (body, content_type, args_hash)."""
    document: dict[str, Any] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))
    return document
