"""The read routes: the session list, a head, entries, the projection, the live tail, health."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..errors import SessionNotFoundError
from ..keys import id_from_index_member, index_member, validate_session_id
from ..model import SessionHeader
from ..projection.render import to_anthropic, to_openai
from .auth import principal
from .body import pinned_incarnation, single_value
from .common import (
    _JSON,
    DEFAULT_ENTRY_LIMIT,
    FORMATS,
    MAX_ENTRY_LIMIT,
    _BadRequest,
    _bool_arg,
    _head_dict,
    _header_dict,
    _int_arg,
    query_arg,
)
from .context import Gateway
from .openapi import openapi
from .sse import _EventStream, parse_resume
from .viewer import _viewer


async def viewer(gw: Gateway, request: Request) -> Response:
    html, csp = _viewer()
    return Response(
        html,
        media_type="text/html; charset=utf-8",
        headers={"Content-Security-Policy": csp, "Cache-Control": "no-cache"},
    )


async def openapi_doc(gw: Gateway, request: Request) -> Response:
    return _JSON(openapi(auth=gw.auth))


async def healthz(request: Request) -> Response:
    """Liveness: this process answers. Never Redis: a Redis failover must not restart every pod."""
    return Response(b'{"ok":true}', media_type="application/json")


async def readyz(gw: Gateway, request: Request) -> Response:
    """Readiness: the store answers (one round trip); 503 ``unavailable`` while it does not."""
    await gw.store.head("readyz")
    return _JSON({"ok": True})


async def list_sessions(gw: Gateway, request: Request) -> Response:
    limit = _int_arg(request, "limit", 100, 1, 1000)
    assert limit is not None
    cursor = query_arg(request, "cursor")
    parent = query_arg(request, "parent")
    if cursor is not None and len(cursor) > 400:
        raise _BadRequest("invalid cursor")
    who = principal(request.scope)
    if parent is not None:
        who.check_session(validate_session_id(parent))
    if who.prefix is None:
        page = await gw.store.list(parent=parent, limit=limit, cursor=cursor)
        items, cursor, unreadable = page.items, page.cursor, page.unreadable
    else:
        items, cursor, unreadable = await _tenant_page(gw, who.sees, parent, limit, cursor)
    return _JSON({"items": [_header_dict(h) for h in items], "cursor": cursor, "unreadable": unreadable})


TENANT_SCAN_PAGES = 10
"""Store pages a tenant's list reads per request at most; a page may come back short (with a
cursor) when the tenant's sessions are sparse among many others."""


async def _tenant_page(
    gw: Gateway, sees: Callable[[str], bool], parent: str | None, limit: int, cursor: str | None
) -> tuple[list[SessionHeader], str | None, list[str]]:
    """One page of the sessions a tenant token sees: the store's pages, filtered.

    The cursor never names another tenant's session: when the scan stops on one, it becomes the
    bound ``<inverted created_at>:`` of that member (or this page's last own member, if later),
    which resumes exactly there — no item skipped, none repeated — and tells nothing but a time."""
    items: list[SessionHeader] = []
    unreadable: list[str] = []
    for _ in range(TENANT_SCAN_PAGES):
        page = await gw.store.list(parent=parent, limit=limit - len(items), cursor=cursor)
        for h in page.items:
            if sees(h.id):
                items.append(h)
        unreadable += [sid for sid in page.unreadable if sees(sid)]
        cursor = page.cursor
        if cursor is None or len(items) >= limit:
            break
    if cursor is not None and not sees(id_from_index_member(cursor)):
        bound = cursor[: len(cursor) - len(id_from_index_member(cursor))]  # "<inverted created_at>:"
        own = index_member(items[-1].created_at, items[-1].id) if items else ""
        cursor = max(bound, own)
    return items, cursor, unreadable


async def head(gw: Gateway, request: Request, sid: str) -> Response:
    got = await gw.store.head(sid)
    if got is None:
        raise SessionNotFoundError(sid)
    tags = {"ETag": f'"{got.n}"', "X-Session-Incarnation": got.header.incarnation}
    return _JSON(_head_dict(got), headers=tags)


async def entries(gw: Gateway, request: Request, sid: str) -> Response:
    start = _int_arg(request, "start", 0)
    stop = _int_arg(request, "stop", None)
    limit = _int_arg(request, "limit", DEFAULT_ENTRY_LIMIT, 1, MAX_ENTRY_LIMIT)
    assert start is not None and limit is not None
    if stop is not None and stop < start:
        raise _BadRequest(f"stop ({stop}) is before start ({start})")
    got = await gw.store.head(sid)
    if got is None:
        raise SessionNotFoundError(sid)
    end = min(got.n, start + limit, got.n if stop is None else stop)
    page = await gw.store.read(sid, start, end, incarnation=got.header.incarnation) if end > start else []
    want_end = got.n if stop is None else min(stop, got.n)
    return _JSON({"n": got.n, "entries": page, "next": end if end < want_end else None})


async def messages(gw: Gateway, request: Request, sid: str) -> Response:
    fmt = query_arg(request, "format") or "openai"
    if fmt not in FORMATS:
        raise _BadRequest(f"format must be one of {', '.join(FORMATS)}")
    if gw.custom_messages and await gw.store.head(sid) is None:  # Sessions.messages checks itself
        raise SessionNotFoundError(sid)
    last = _int_arg(request, "last", None, 1)
    msgs = await gw.get_messages(sid)
    total = len(msgs)
    if last is not None:  # only the newest are converted: a long session's tail costs what a short one does
        msgs = msgs[-last:]
    body: Any
    if fmt == "openai":
        body = to_openai(msgs)
    elif fmt == "anthropic":
        body = to_anthropic(msgs)
    else:
        body = list(msgs)
    if last is None:
        return _JSON({"session": sid, "format": fmt, "messages": body})
    # the newest `last` messages (a viewer opening a long session), and how many there are (neutral)
    return _JSON({"session": sid, "format": fmt, "messages": body, "total": total})


async def events(gw: Gateway, request: Request, sid: str) -> Response:
    """The live tail as SSE. Event ids are ``<incarnation>:<n>`` (``<incarnation>:<n>/<live id>``
    on a ``?deltas=1`` stream), so a Last-Event-ID names the life it resumes: a resume into
    another life (the id deleted and created again) is answered ``event: replaced``. A plain
    ``<n>`` (an id of an older release) names none: it is taken only with the life pinned by
    ``X-Session-Incarnation`` or ``?incarnation=``, else answered ``event: replaced`` too (it
    could be read as the new life's).

    A ``?start=`` pinned to a life (``?incarnation=``, ``X-Session-Incarnation`` or the life of
    ``If-Match``) is a resume too: the client read that life up to `start`, so a log that ends
    before it was rolled back (`event: rewound`); without a pin it is a fresh tail, and one
    started ahead of the log waits for it, as `tail(start=)` does."""
    last_id = single_value(request.headers.getlist("last-event-id"), "Last-Event-ID")
    pinned = pinned_incarnation(request)
    live_after: str | None = None
    incarnation: str | None = pinned
    if last_id:
        resume = parse_resume(last_id)
        if resume is None:
            raise _BadRequest("Last-Event-ID must be <incarnation>:<n> or <incarnation>:<n>/<live id>, as sent")
        if resume.incarnation is not None and pinned is not None and resume.incarnation != pinned:
            raise _BadRequest("Last-Event-ID and X-Session-Incarnation name different lives")
        start, live_after = resume.start, resume.live_after
        # a plain <n> without a pin could continue any life: it continues none ("" matches no life)
        incarnation = resume.incarnation or pinned or ""
    else:
        start = _int_arg(request, "start", 0) or 0
    if await gw.store.head(sid) is None:
        raise SessionNotFoundError(sid)
    return _EventStream(
        gw.store,
        sid,
        start,
        heartbeat=gw.heartbeat,
        draft_interval=gw.draft_interval,
        streams=gw.streams,
        drafts=gw.drafts,
        tails=gw.tails,
        deltas=_bool_arg(request, "deltas"),
        live_after=live_after,
        incarnation=incarnation,
        # a resume: a Last-Event-ID, or a ?start= pinned to the life it was read from (what an
        # EventSource reconnecting by its own URL sends); past the log's end it is answered
        # `event: rewound`. An unpinned ?start= is a fresh tail: ahead of the log, it waits.
        resumed=bool(last_id) or pinned is not None,
    )
