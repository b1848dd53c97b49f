"""Which handler answers ``/sessions`` and ``/sessions/{id}[/{sub}]`` for which method, and what
the token must allow for it (a session outside the token's tenant answers 404 before anything);
and, before any route, which ``Host`` names and which browser origins may call at all
(`WebPolicy`, `_WebGuard`: DNS rebinding, CORS, cross-origin writes)."""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import SessionNotFoundError, SessionReplacedError
from ..model import legacy_incarnation
from . import answers, reads, writes
from .auth import principal
from .body import pinned_incarnation
from .common import PROBE_PATHS, _error, _session_path, route_key
from .context import Gateway
from .wire import TARGET

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
SCRIPT_CHECKED = frozenset({
    (None, "DELETE"), ("entries", "POST"), ("draft", "PUT"), ("answers", "POST"),
    ("answers/{answer}/deltas", "POST"), ("answers/{answer}/end", "POST"),
})  # fmt: skip
"""The routes whose one store script checks the pin with the write, in the order `_pinned` would
(no session: 404, then another life: 409): no check of their own first (a round trip saved on
every pinned append and delta batch; the script's check is the atomic one anyway)."""


async def sessions(gw: Gateway, request: Request) -> Response:
    """``/sessions``: GET lists, POST creates."""
    who = principal(request.scope)
    if request.method == "POST":
        who.require("write")
        return await writes.create(gw, request)
    who.require("read")
    return await reads.list_sessions(gw, request)


async def session(gw: Gateway, request: Request) -> Response:
    """``/sessions/{id}[/{sub}]``, by the table above; every one through `_pinned`."""
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
    return await _pinned(gw, request, sid, method, sub, handler)


async def _pinned(gw: Gateway, request: Request, sid: str, method: str, sub: str | None, handler: Handler) -> Response:
    """The one place a request pinned to a life of the id (`pinned_incarnation`: the
    ``X-Session-Incarnation`` header, ``If-Match: "<n>;<incarnation>"`` or ``?incarnation=``) is
    held to it: 404 when the id names no session, 409 ``session_replaced`` when it names another
    life — on every route, before the handler runs (an SSE stream before it opens).

    That check alone would leave a window (the id deleted and created again right after it), so
    the handlers close it: every write passes the pin to the store, which checks it in the same
    script as the write (append, draft, branch/fork link, repair's writes, answers, delete: for
    those in `SCRIPT_CHECKED` that check is the only one); a read is checked once more after it
    was read (a life never comes back, so the same life before and after is the life that was
    read: else 409, and nothing of the read is sent); a live stream rechecks after every read
    (``event: replaced``)."""
    pin = pinned_incarnation(request)
    if pin is None:
        return await handler(gw, request, sid)
    if (sub, method) not in SCRIPT_CHECKED:
        await _check_life(gw, sid, pin)
    response = await handler(gw, request, sid)
    if method == "GET" and sub != "events" and response.status_code < 300:
        await _check_life(gw, sid, pin)
    return response


async def _check_life(gw: Gateway, sid: str, pin: str) -> None:
    head = await gw.store.head(sid)
    if head is None:
        raise SessionNotFoundError(sid)
    current = head.header.incarnation or legacy_incarnation(head.header.created_at)
    if current != pin:
        raise SessionReplacedError(sid, f"it is incarnation {current} now, not {pin}")


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
        return _allows_host(self, host)

    def allows_origin(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins


@functools.lru_cache(maxsize=256)
def _allows_host(policy: WebPolicy, host: str) -> bool:
    """`WebPolicy.allows_host`, remembered: a gateway hears the same few Host names."""
    name = _host_name(host)
    if not name:
        return False
    if "*" in policy.hosts or name in policy.hosts:
        return True
    if policy.any_ip and _is_ip(name):
        return True
    return any(h.startswith(".") and (name.endswith(h) or name == h[1:]) for h in policy.hosts)


def split_list(text: str | None) -> list[str]:
    """A comma- or space-separated list (an environment variable's value)."""
    return [p for p in (text or "").replace(",", " ").split() if p]


_ABSOLUTE = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]*://")
_HOST_VALUE = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|[A-Za-z0-9._-]*)(?::(?P<port>[0-9]{1,5}))?")
"""A ``Host`` value: a DNS name or IPv4 address, or an IPv6 one in brackets, and a port."""


@functools.lru_cache(maxsize=256)
def _host_problem(host: str) -> str | None:
    """Why `host` is no ``Host`` value (None when it is one): a name (no empty label; one trailing
    dot, the root, is one) or IPv4 address, or an IPv6 address in brackets, with an optional port
    of 1-5 digits no larger than 65535."""
    m = _HOST_VALUE.fullmatch(host)
    if m is None:
        return "is not a host name or address with an optional port"
    if m.group("port") is not None and int(m.group("port")) > 65535:
        return "names a port above 65535"
    v6 = m.group("v6")
    name = host if m.group("port") is None else host[: host.rindex(":")]
    if v6 is None and name and "" in name.removesuffix(".").split("."):
        return "has an empty label (a leading dot, or two dots in a row)"  # no DNS name: a.., .a
    if v6 is not None:
        try:
            ipaddress.IPv6Address(v6)
        except ValueError:
            return "holds no IPv6 address within its brackets"
    return None


def _request_target(scope: Scope) -> bytes:
    """The request target as the client sent it, without the query: the parser's own (`wire`)
    when it kept only the path, else ``raw_path`` (h11 keeps an absolute-form target there)."""
    kept: bytes | None = scope.get(TARGET)
    if kept is not None:
        return kept.split(b"?", 1)[0]
    raw: bytes = scope.get("raw_path") or scope.get("path", "").encode("latin-1", "replace")
    root = scope.get("root_path", "").encode("latin-1", "replace")
    return raw[len(root) :] if root and raw.startswith(root) else raw


def _ambiguity(scope: Scope, hosts: list[str], origins: list[str]) -> str | None:
    """Why the host this request is for is ambiguous (a 400), or None. Every layer must see the
    one name the host check saw: more than one ``Host`` header (parsers and frameworks disagree
    on which one counts), a ``Host`` that is no host[:port] (``a, b``), or an absolute-form target
    (``GET http://other/...``, which RFC 9112 makes the host the request is for) naming another
    authority than ``Host``. Two ``Origin`` headers are refused for the same reason."""
    if len(hosts) > 1:
        return f"the request has {len(hosts)} Host headers; exactly one is allowed"
    if len(origins) > 1:
        return f"the request has {len(origins)} Origin headers; at most one is allowed"
    host = hosts[0].strip() if hosts else ""
    problem = _host_problem(host)
    if problem is not None:
        return f"the Host header {host[:80]!r} {problem}"
    target = _request_target(scope)
    if _ABSOLUTE.match(target):
        try:
            authority = urlsplit(target.decode("latin-1")).netloc
        except ValueError:  # "http://[x/": not a URL
            return "the request target is not a URL"
        if authority.lower() != host.lower():
            return f"the request target names host {authority[:80]!r}, the Host header {host[:80]!r}"
    return None


def _origin_form(scope: Scope) -> Scope:
    """The scope of an absolute-form request (its authority already found equal to ``Host``) with
    the path alone, as httptools gives it: the routes match on both parsers."""
    root: str = scope.get("root_path", "")
    target = _request_target(scope)
    if TARGET in scope or not _ABSOLUTE.match(target):
        return scope
    rel = urlsplit(target.decode("latin-1")).path or "/"
    return {**scope, "raw_path": root.encode("latin-1") + rel.encode("latin-1"), "path": root + unquote(rel)}


def _query_problem(scope: Scope) -> str | None:
    """The rule of every query string, whichever parameters the route reads (so `common.query_arg`
    reads the one value there is): a parameter sent twice is ambiguous, one sent empty
    means nothing; both are a 400 before anything is read, written or streamed (``?token=``
    has the token check's own rule)."""
    qs: bytes = scope.get("query_string", b"")
    if not qs:
        return None
    seen: dict[str, int] = {}
    for name, value in parse_qsl(qs.decode("latin-1"), keep_blank_values=True):
        if name == "token":
            continue  # a credential: the token check's own rule ("send one")
        seen[name] = seen.get(name, 0) + 1
        if value == "":
            return f"?{name[:40]}= is empty: give it a value or leave it out"
    for name, count in seen.items():
        if count > 1:
            return f"?{name[:40]}= was sent {count} times: send it once"
    return None


class _WebGuard:
    """Before every route: the Host must be unambiguous (400: one ``Host`` header, and an
    absolute-form target naming the same host) and allowed (421); a page of another origin gets
    CORS answers only when its origin is allowed, and may write only then (403)."""

    def __init__(self, app: ASGIApp, policy: WebPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts: list[str] = []
        origins: list[str] = []
        for k, v in scope.get("headers", ()):
            if k == b"host":
                hosts.append(v.decode("latin-1"))
            elif k == b"origin":
                origins.append(v.decode("latin-1"))
        problem = _ambiguity(scope, hosts, origins) or _query_problem(scope)
        if problem is not None:  # on every route, the probes too: no layer may pick another host
            await _error(400, "bad_request", problem)(scope, receive, send)
            return
        scope = _origin_form(scope)
        host = hosts[0].strip() if hosts else None
        origin = origins[0] if origins else None
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
