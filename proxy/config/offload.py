"""``offload``: large answers kept in object storage."""

from __future__ import annotations

from pydantic import (
    Field,
    field_validator,
)

from proxy.config.fields import Duration, Strict

# Response bodies above this go to object storage when `offload` is configured.
DEFAULT_OFFLOAD_THRESHOLD = 100 * 1024

# How long a presigned URL of an offloaded body (offload.presign) stays valid.
DEFAULT_PRESIGN_TTL = 300.0

_OFFLOAD_SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "file", "memory")


class OffloadConfig(Strict):
    """Object storage for large response bodies (the claim check)."""

    url: str
    threshold_bytes: int = Field(default=DEFAULT_OFFLOAD_THRESHOLD, ge=0)
    endpoint_url: str | None = None
    region: str | None = None
    allow_http: bool = False
    presign: bool = False
    presign_ttl: Duration = DEFAULT_PRESIGN_TTL
    sweep: bool = True

    @field_validator("url")
    @classmethod
    def _scheme(cls, url: str) -> str:
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme not in _OFFLOAD_SCHEMES:
            raise ValueError(
                "must be s3://bucket/prefix, gs://..., az://..., file:///dir or memory://"
            )
        return url
