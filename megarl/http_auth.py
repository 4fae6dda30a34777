"""Bearer API keys for megarl's HTTP servers and the clients that call them.

The engine servers (megarl's embedded one, SGLang's, sglang-router) and the retrieval server
take `Authorization: Bearer <key>` as SGLang does; a server started with a key answers 401 to
a request without it, except on the paths it leaves open (health checks). Keys are compared
in constant time. The key reaches a server process through an environment variable, never
its command line (`ps` shows that to every user of the node). Main entry points:
`require_api_key` (servers), `bearer` (clients), `new_api_key`.
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import Callable

# where a server process started by megarl finds its key (the embedded engine server and
# megarl.rollout.with_api_key read it; the fleet sets it in the child's environment only)
ENGINE_KEY_ENV = "MEGARL_ENGINE_API_KEY"
RETRIEVAL_KEY_ENV = "MEGARL_RETRIEVAL_API_KEY"


def new_api_key() -> str:
    """A fresh random key (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def bearer(key: str | None) -> dict[str, str]:
    """The request headers that carry `key` ({} without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def key_matches(authorization: str | None, key: str) -> bool:
    """Whether an Authorization header carries `key` as a Bearer token (constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())


def require_api_key(app, key: str | None, is_open: Callable[[str], bool] = lambda path: False) -> None:
    """Make every request to the ASGI `app` carry `key`, except those whose path `is_open`
    says may go without (nothing changes when `key` is None). A refused request gets 401
    with a JSON body saying why; it never reaches a route."""
    if key:
        app.add_middleware(_ApiKeyMiddleware, key=key, is_open=is_open)


class _ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware), so streaming answers and client disconnects pass
    through untouched."""

    def __init__(self, app, key: str, is_open: Callable[[str], bool]):
        self.app, self.key, self.is_open = app, key, is_open

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.is_open(scope["path"]):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        if key_matches(authorization, self.key):
            return await self.app(scope, receive, send)
        why = "wrong API key" if authorization else "no Authorization header"
        body = json.dumps({"error": "Unauthorized", "message": f"{why}: this server requires the header "
                           "'Authorization: Bearer <its API key>' on every route but its health checks"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
