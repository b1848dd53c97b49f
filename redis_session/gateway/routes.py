"""Which handler answers ``/sessions`` and ``/sessions/{id}[/{sub}]`` for which method, and what
the token must allow for it (a session outside the token's tenant answers 404 before anything);
and, before any route, which ``Host`` names and which browser origins may call at all
(`WebPolicy`, `_WebGuard`: DNS rebinding, CORS, cross-origin writes)."""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import answers, reads, writes
from .auth import principal
from .common import PROBE_PATHS, _error, _session_path, route_key
from .context import Gateway

Handler = Callable[[Gateway, Request, str], Awaitable[Response]]

SESSION_ROUTES: dict[tuple[str | None, str], tuple[str, Handler]] = {
    (None, "GET"): ("read", reads.head),
    (None, "DELETE"): ("admin", writes.delete),
    ("entries", "GET"): ("read", reads.entries),
    ("entries", "POST"): ("write", writes.append),
    ("messages", "GET"): ("read", reads.messages),
    ("events", "GET"): ("read", reads.events),
    ("draft", "GET"): ("read", writes.get_draft),
    ("draft", "PUT"): ("write", writes.put_draft),
    ("branch", "POST"): ("write", writes.branch),
    ("fork", "POST"): ("write", writes.fork),
    ("repair", "POST"): ("write", writes.repair),
    ("answers", "POST"): ("write", answers.begin),
    ("answers/{answer}/deltas", "POST"): ("write", answers.deltas),
    ("answers/{answer}/end", "POST"): ("write", answers.end),
}
METHODS = sorted({m for _, m in SESSION_ROUTES} | {"HEAD"})


async def sessions(gw: Gateway, request: Request) -> Response:
    """``/sessions``: GET lists, POST creates."""
    who = principal(request.scope)
    if request.method == "POST":
        who.require("write")
        return await writes.create(gw, request)
    who.require("read")
    return await reads.list_sessions(gw, request)


async def session(gw: Gateway, request: Request) -> Response:
    """``/sessions/{id}[/{sub}]``, by the table above."""
    sid, path = _session_path(request.scope)
    sub, _ = route_key(path)
    method = "GET" if request.method == "HEAD" else request.method
    found = SESSION_ROUTES.get((sub, method))
    if found is None:
        allowed = [m for s, m in SESSION_ROUTES if s == sub]
        if not allowed:
            raise HTTPException(404, "no such route")
        raise HTTPException(405, headers={"Allow": ", ".join(allowed)})
    scope, handler = found
    who = principal(request.scope)
    who.check_session(sid)
    who.require(scope)
    return await handler(gw, request, sid)


# --------------------------------------------------------------------------- hosts and origins

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_CORS_METHODS = "GET, HEAD, POST, PUT, DELETE"
_CORS_HEADERS = "authorization, content-type, if-match, idempotency-key, x-session-incarnation, last-event-id"
_CORS_EXPOSE = "etag, x-session-incarnation, retry-after, location"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _host_name(value: str) -> str:
    """The name of a ``Host`` header or a bind address, without the port: lower case, no
    trailing dot, IPv6 without brackets (``[::1]:80`` -> ``::1``)."""
    v = value.strip().lower()
    if v.startswith("["):
        v = v[1 : v.find("]")] if "]" in v else v[1:]
    elif v.count(":") == 1:
        v = v.split(":", 1)[0]
    return v.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _origin_of(value: str) -> str | None:
    """``scheme://host[:port]`` of an origin, normalised; None when it is not one."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
        return None
    return f"{parts.scheme}://{parts.netloc.lower()}"


@dataclass(frozen=True)
class WebPolicy:
    """Which ``Host`` names the gateway answers, and which other origins' pages may call it.

    `hosts`: exact names (``gw.example.com``, ``10.0.0.7``, ``::1``), ``.example.com`` for that
    domain and every name under it, or ``*`` for any. Every other Host answers 421 on every
    route (SSE and the viewer included) but `PROBE_PATHS`: a DNS-rebinding page (its own name,
    pointed at our address) reaches nothing. `any_ip`: also any IP literal (a gateway bound to a
    wildcard address: a rebinding page always names a domain, never an IP).

    `origins`: the browser origins (``https://app.example.com``, or ``*``) whose pages may call
    the gateway across origins (CORS: preflight answered, ``Access-Control-Allow-Origin`` on the
    answers, writes admitted). None by default: a page of another origin can neither read an
    answer nor write (a cross-origin write answers 403 before any handler runs)."""

    hosts: frozenset[str]
    origins: frozenset[str] = frozenset()
    any_ip: bool = False

    @classmethod
    def make(
        cls, hosts: Iterable[str] | None = None, origins: Iterable[str] = (), *, bound: str | None = None
    ) -> WebPolicy:
        """`hosts` None: the default — the bound address (`bound`), ``localhost``, ``127.0.0.1``
        and ``::1`` (and any IP literal when `bound` is a wildcard address: ``0.0.0.0``, ``::``)."""
        wildcard = bound is not None and _host_name(bound) in ("", "0.0.0.0", "::")
        if hosts is None:
            names = set(LOOPBACK_HOSTS)
            if bound is not None and not wildcard:
                names.add(_host_name(bound))
        else:
            names = {_host_name(h) if h.strip() not in ("*",) else "*" for h in hosts if h.strip()}
            if not names:
                raise ValueError("allowed hosts: give at least one name (or * for any)")
        wanted: set[str] = set()
        for o in origins:
            if not o.strip():
                continue
            norm = "*" if o.strip() == "*" else _origin_of(o)
            if norm is None:
                raise ValueError(f"allowed origin {o!r} is not scheme://host[:port] (or *)")
            wanted.add(norm)
        return cls(frozenset(names), frozenset(wanted), any_ip=wildcard)

    def allows_host(self, host: str) -> bool:
        name = _host_name(host)
        if not name:
            return False
        if "*" in self.hosts or name in self.hosts:
            return True
        if self.any_ip and _is_ip(name):
            return True
        return any(h.startswith(".") and (name.endswith(h) or name == h[1:]) for h in self.hosts)

    def allows_origin(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins


def split_list(text: str | None) -> list[str]:
    """A comma- or space-separated list (an environment variable's value)."""
    return [p for p in (text or "").replace(",", " ").split() if p]


class _WebGuard:
    """Before every route: the Host must be allowed (421); a page of another origin gets CORS
    answers only when its origin is allowed, and may write only then (403)."""

    def __init__(self, app: ASGIApp, policy: WebPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = origin = None
        for k, v in scope.get("headers", ()):
            if k == b"host":
                host = v.decode("latin-1")
            elif k == b"origin":
                origin = v.decode("latin-1")
        path: str = scope["path"]
        if path not in PROBE_PATHS and not self.policy.allows_host(host or ""):
            shown = (host or "")[:80]
            response = _error(421, "misdirected", f"this gateway does not answer for host {shown!r}")
            await response(scope, receive, send)
            return
        # same origin: the page's host:port is the one it asked (the scheme may differ behind a
        # TLS-terminating proxy)
        cross = origin is not None and urlsplit(origin).netloc.lower() != (host or "").lower()
        if not cross:
            await self.app(scope, receive, send)
            return
        assert origin is not None
        allowed = self.policy.allows_origin(_origin_of(origin) or "")
        method: str = scope["method"]
        if method == "OPTIONS" and any(k == b"access-control-request-method" for k, _ in scope["headers"]):
            await _preflight(allowed, origin)(scope, receive, send)
            return
        if not allowed and method not in _SAFE_METHODS:
            await _error(403, "forbidden", "writes from another origin's page are refused")(scope, receive, send)
            return
        if not allowed:  # a read: served, but the browser keeps the answer from the page
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _with_cors(send, origin))


def _preflight(allowed: bool, origin: str) -> Response:
    if not allowed:
        return _error(403, "forbidden", "this origin may not call the gateway (see --allowed-origin)")
    return Response(
        status_code=204,
        headers={
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": _CORS_METHODS,
            "Access-Control-Allow-Headers": _CORS_HEADERS,
            "Access-Control-Max-Age": "600",
            "Vary": "Origin",
        },
    )


def _with_cors(send: Send, origin: str) -> Send:
    extra = [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"access-control-expose-headers", _CORS_EXPOSE.encode()),
        (b"vary", b"Origin"),
    ]

    async def sender(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return sender
