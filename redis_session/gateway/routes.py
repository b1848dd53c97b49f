"""Which handler answers ``/sessions`` and ``/sessions/{id}[/{sub}]`` for which method, and what
the token must allow for it (a session outside the token's tenant answers 404 before anything)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from . import answers, reads, writes
from .auth import Forbidden, principal
from .common import _session_path, route_key
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


def check_origin(request: Request) -> None:
    """A browser page of another origin may not write (no CSRF against a gateway without tokens):
    browsers send ``Origin`` on such requests; other clients send none."""
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise Forbidden("writes from another origin's page are refused")


async def sessions(gw: Gateway, request: Request) -> Response:
    """``/sessions``: GET lists, POST creates."""
    who = principal(request.scope)
    if request.method == "POST":
        who.require("write")
        check_origin(request)
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
    if method != "GET":
        check_origin(request)
    return await handler(gw, request, sid)
