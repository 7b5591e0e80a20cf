"""``routes[].protocol`` and ``routes[].mcp``: MCP routes."""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import (
    Field,
    field_validator,
)

from proxy.config.fields import Strict


class RouteProtocol(StrEnum):
    """What a route's requests are: plain HTTP calls, or MCP (JSON-RPC over Streamable HTTP)."""

    HTTP = "http"
    MCP = "mcp"


class McpGuard(StrEnum):
    """Which MCP tools' ``tools/call`` requests are guarded."""

    ALL = "all"
    ANNOTATED = "annotated"
    """Every tool whose ``tools/list`` entry is neither readOnlyHint nor idempotentHint."""


# Where an MCP client may send its key besides the header: params._meta.<this>.
DEFAULT_KEY_META = "idempotencyKey"

# The most of a guarded tools/call's answer the proxy holds while it reads it whole: the
# final JSON-RPC response and the part of the SSE stream not yet parsed (progress read
# and dropped does not count). Past it (or past what the route can record, without
# offload) the call is recorded as executed, its result not kept.
DEFAULT_MAX_ANSWER_BYTES = 64 * 1024 * 1024

_META_NAME = re.compile(r"[A-Za-z0-9._/-]{1,128}")


class McpConfig(Strict):
    """How a ``protocol: mcp`` route guards ``tools/call``."""

    guard: McpGuard | tuple[str, ...] = McpGuard.ALL
    key_meta: str = DEFAULT_KEY_META
    max_answer_bytes: int = Field(default=DEFAULT_MAX_ANSWER_BYTES, ge=1)

    @field_validator("guard")
    @classmethod
    def _tools(cls, guard: McpGuard | tuple[str, ...]) -> McpGuard | tuple[str, ...]:
        if isinstance(guard, tuple) and (not guard or not all(guard)):
            raise ValueError("all, annotated, or a non-empty list of tool names")
        return guard

    @field_validator("key_meta")
    @classmethod
    def _meta_name(cls, name: str) -> str:
        if not _META_NAME.fullmatch(name):
            raise ValueError("a _meta member name: 1..128 characters of [A-Za-z0-9._/-]")
        return name
