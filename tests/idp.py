"""A real identity provider for the tests: JWKS and OIDC discovery over HTTP, real keys."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import urllib.parse
import uuid
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

AUDIENCE = "tool-proxy"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class IdentityProvider:
    """Signs tokens with rotating RSA and EC keys and publishes the public halves."""

    def __init__(self) -> None:
        self.url = ""
        self.jwks_hits = 0
        self.keys: dict[str, Any] = {}
        self.client_secret = "s3cr3t-client-secret"
        self.token_lifetime = 300
        self.refuse_with: str | None = None
        self.issue_refresh_tokens = False
        self._refresh_owner: dict[str, str] = {}
        self.grants: list[dict[str, str]] = []
        self.app = Starlette(
            routes=[
                Route("/jwks", self.jwks),
                Route("/.well-known/openid-configuration", self.discovery),
                Route("/token", self.token_endpoint, methods=["POST"]),
            ]
        )
        self.rotate("RS256")

    @property
    def issuer(self) -> str:
        return self.url

    def rotate(self, algorithm: str = "RS256") -> str:
        """Add a new signing key; return its kid."""
        kid = uuid.uuid4().hex[:12]
        if algorithm.startswith("ES"):
            self.keys[kid] = (algorithm, ec.generate_private_key(ec.SECP256R1()))
        else:
            self.keys[kid] = (
                algorithm,
                rsa.generate_private_key(public_exponent=65537, key_size=2048),
            )
        return kid

    def token(self, sub: str | None = "alice", *, kid: str | None = None, **overrides: Any) -> str:
        kid = kid or next(reversed(self.keys))
        algorithm, key = self.keys[kid]
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": sub, "aud": AUDIENCE, "iat": now, "exp": now + 300}
        claims.update(overrides)
        claims = {k: v for k, v in claims.items() if v is not None}
        return jwt.encode(claims, key, algorithm=algorithm, headers={"kid": kid})

    def hs256_signed_with_public_key(self) -> str:
        """The classic confusion attack: HS256 with the RSA public key as the secret."""
        kid = next(iter(self.keys))
        pem = (
            self.keys[kid][1]
            .public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        claims = jwt.decode(self.token(kid=kid), options={"verify_signature": False})
        head = _b64(json.dumps({"alg": "HS256", "kid": kid, "typ": "JWT"}).encode())
        body = _b64(json.dumps(claims).encode())
        signature = hmac.new(pem, f"{head}.{body}".encode(), hashlib.sha256).digest()
        return f"{head}.{body}.{_b64(signature)}"

    def public_jwk(self, kid: str) -> dict[str, Any]:
        algorithm, key = self.keys[kid]
        algo = jwt.get_algorithm_by_name(algorithm)
        jwk = json.loads(algo.to_jwk(key.public_key()))
        return {**jwk, "kid": kid, "alg": algorithm, "use": "sig"}

    async def jwks(self, request: Request) -> Response:
        self.jwks_hits += 1
        return JSONResponse({"keys": [self.public_jwk(kid) for kid in self.keys]})

    async def token_endpoint(self, request: Request) -> Response:
        """An OAuth token endpoint: client_credentials, RFC 8693 exchange, Entra OBO."""
        form = dict(urllib.parse.parse_qsl((await request.body()).decode()))
        self.grants.append(form)
        if form.get("client_secret") != self.client_secret:
            return JSONResponse({"error": "invalid_client"}, 401)
        if self.refuse_with:
            return JSONResponse({"error": self.refuse_with}, 400)
        subject = form.get("subject_token") or form.get("assertion")
        who = "machine"
        if form.get("grant_type") == "refresh_token":
            if form.get("refresh_token") not in self._refresh_owner:
                return JSONResponse({"error": "invalid_grant"}, 400)
            who = self._refresh_owner[form["refresh_token"]]
        elif subject:
            who = jwt.decode(subject, options={"verify_signature": False})["sub"]
        token = f"dt-{len(self.grants)}-{who}"
        answer: dict[str, Any] = {
            "access_token": token,
            "token_type": "Bearer",
            "expires_in": self.token_lifetime,
        }
        if self.issue_refresh_tokens:
            refresh = f"rt-{len(self.grants)}-{who}"
            self._refresh_owner[refresh] = who
            answer.update(refresh_token=refresh, refresh_expires_in=3600)
        return JSONResponse(answer)

    async def discovery(self, request: Request) -> Response:
        return JSONResponse({"issuer": self.issuer, "jwks_uri": f"{self.url}/jwks"})
