"""API keys: `Authorization: Bearer <key>` on every /v1 route (and /metrics, /health with
`protect_metrics`), checked before routing so an unknown /v1 path is a 401 too, not a 404
that tells a stranger which routes exist.

Keys are compared in constant time: both sides are hashed to 32 bytes first (so a key's
length does not leak either) and every configured key is compared, without stopping early.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import OpenAIError

_OPEN_PATHS = ("/health", "/metrics")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class APIKeys:
    def __init__(self, keys: tuple[str, ...]):
        self._digests = [_digest(k) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def accepts(self, authorization: str) -> bool:
        scheme, _, token = authorization.partition(" ")
        presented = _digest(token.strip())
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)
        return matched and scheme.lower() == "bearer"


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: APIKeys, protect_metrics: bool):
        self.app = app
        self.keys = keys
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        if path == "/v1" or path.startswith("/v1/"):
            return True
        return self.protect_metrics and (path in _OPEN_PATHS or path.startswith("/health/"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or not self._protected(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        if self.keys.accepts(authorization):
            await self.app(scope, receive, send)
            return
        message = ("Missing API key: send 'Authorization: Bearer <key>'." if not authorization else
                   "Incorrect API key provided.")
        error = OpenAIError(401, message, code="invalid_api_key")
        response = error.response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
