"""Encryption at rest for the secrets the store keeps (AES-256-GCM): downstream tokens
shared by replicas, and the credentials in async jobs' stored requests.

The key is 32 bytes, base64 (url-safe or standard), in the environment variable that
``store.sealing_key_env`` (or ``auth.token_cache_key_env``) names; every replica must
have the same one.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from proxy.errors import ConfigError

NONCE_BYTES = 12


def load_key(env_name: str, option: str = "auth.token_cache_key_env") -> bytes:
    """The sealing key, or ``ConfigError`` naming the field (``option``)."""
    field = f"{option}: environment variable {env_name}"
    raw = os.environ.get(env_name, "")
    try:
        key = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != 32:
        raise ConfigError(
            [f"{field} must hold 32 bytes in base64 (e.g. `openssl rand -base64 32`)"]
        )
    return key


class Sealer:
    """Seals and opens small JSON documents; the store key is bound as associated data."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal(self, name: str, document: dict[str, Any]) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        plain = json.dumps(document, separators=(",", ":")).encode()
        return nonce + self._aead.encrypt(nonce, plain, name.encode())

    def open(self, name: str, sealed: bytes) -> dict[str, Any] | None:
        """The document, or None if it was not sealed by this key for this name."""
        try:
            plain = self._aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], name.encode())
            document = json.loads(plain)
        except (InvalidTag, ValueError):
            return None
        return document if isinstance(document, dict) else None
