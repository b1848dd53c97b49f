"""Who may call the gateway: the bearer-token check (``Authorization: Bearer`` or ``?token=``)."""

from __future__ import annotations

import hmac
from urllib.parse import parse_qsl

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .common import _error


class _BearerAuth:
    """401 for every HTTP request without the token (header, or ``?token=`` for EventSource)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token):
                    return True
        for key, given_s in parse_qsl(scope.get("query_string", b"").decode("latin-1")):
            if key == "token" and hmac.compare_digest(given_s.encode(), self.token):
                return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # /healthz answers liveness only (no session data), so orchestrator probes need no token
        if scope["type"] != "http" or scope["path"] == "/healthz" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        headers = {"WWW-Authenticate": "Bearer"}
        response: Response
        if scope["path"] in ("/", scope.get("root_path", "") + "/") and _accepts_html(scope):
            # a person at the viewer's address: ask for the token (the page needs it in its URL)
            headers["Content-Security-Policy"] = "default-src 'none'; form-action 'self'"
            response = Response(_LOGIN, 401, headers, media_type="text/html; charset=utf-8")
        else:
            response = _error(401, "unauthorized", "a bearer token is required", headers)
        await response(scope, receive, send)


def _accepts_html(scope: Scope) -> bool:
    return any(k == b"accept" and b"text/html" in v for k, v in scope.get("headers", ()))


_LOGIN = (
    b"<!doctype html><html lang=en><meta charset=utf-8><title>redis-session viewer</title>"
    b"<form method=get action=''><p>This gateway needs a token.</p>"
    b"<input type=password name=token autofocus required> <button>open</button></form></html>"
)
