"""The live-tail gateway: a read-only HTTP + Server-Sent Events front of a `SessionStore`, and the
web viewer. Starlette, served by uvicorn.

Routes (every one a GET; ``/openapi.json`` describes them)::

    /                               the web viewer (one self-contained HTML page)
    /openapi.json                   this API
    /sessions?limit=&cursor=&parent=  sessions, newest first, paginated; ``parent`` lists branches
    /sessions/{id}                  the head: header, n, updated_at, last_cut
    /sessions/{id}/entries?start=&stop=&limit=   stored entries [start, stop), at most `limit`
    /sessions/{id}/messages?format=openai|anthropic|neutral   the projection
    /sessions/{id}/events?start=    SSE: entries as they land (``id:`` is the entry's n; resume
                                    with ``Last-Event-ID``), ``event: draft`` for the streaming
                                    draft, ``event: end`` when the session is deleted (after
                                    ``event: replaced`` when its id was deleted and created
                                    again: the stream never goes on with the new session), and
                                    a ``: ping`` comment after `heartbeat` idle seconds;
                                    ``&deltas=1`` adds ``event: delta`` (each delta of a streamed
                                    answer) and ids become ``<n>/<live id>`` (resume both)
    /events                         SSE: store-wide notifications (``event: session-branch``)

Ids in paths are percent-encoded (``/`` as ``%2F``); the raw path is decoded here, so ids with
``/``, ``:`` and any unicode work. With a `token`, every route answers 401 unless the request
carries ``Authorization: Bearer <token>`` or ``?token=<token>`` (EventSource cannot set headers).
The gateway never writes.

>>> app = create_app(store, token="s3cret")            # any ASGI server
>>> await serve(store, host="0.0.0.0", port=8765)       # or uvicorn, until cancelled / Ctrl-C
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from functools import cache
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes

import anyio
import msgspec
import uvicorn
from anyio.abc import TaskStatus
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import (
    InvalidSessionIdError,
    SessionError,
    SessionNotFoundError,
    SessionReplacedError,
    StoreUnavailableError,
)
from ..keys import validate_session_id
from ..live import RETRYABLE, follow, follow_deltas
from ..model import Entry, SessionHead, SessionHeader
from ..projection.chunks import Delta
from ..projection.fold import Message, to_anthropic, to_openai
from ..sessions import Sessions
from ..snapshots import SnapshotCache
from ..store.memory import SessionStore

log = logging.getLogger("redis_session.gateway")

MessagesFn = Callable[[str], Awaitable[Sequence[Message]]]
"""Where `/messages` gets a session's projection: ``async (session_id) -> [Message]``."""

FORMATS = ("openai", "anthropic", "neutral")
DEFAULT_ENTRY_LIMIT = 1000
MAX_ENTRY_LIMIT = 10_000
_INT = re.compile(r"[0-9]{1,15}")
_json = msgspec.json.Encoder()


# --------------------------------------------------------------------------- JSON helpers


def _header_dict(h: SessionHeader) -> dict[str, Any]:
    # every field, defaults included: API clients should not need to know the defaults
    return msgspec.structs.asdict(h)


def _head_dict(h: SessionHead) -> dict[str, Any]:
    return {
        "id": h.header.id,
        "header": _header_dict(h.header),
        "n": h.n,
        "updated_at": h.updated_at,
        "last_cut": h.last_cut,
    }


class _JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _json.encode(content)


def _error(status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return _JSON({"error": code, "message": message}, status_code=status, headers=headers)


class _BadRequest(Exception):
    pass


def _int_arg(request: Request, name: str, default: int | None, lo: int = 0, hi: int | None = None) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if not _INT.fullmatch(raw):
        raise _BadRequest(f"{name} must be a non-negative integer, got {raw[:40]!r}")
    v = int(raw)
    if v < lo or (hi is not None and v > hi):
        raise _BadRequest(f"{name} must be in [{lo}, {hi if hi is not None else '∞'}], got {v}")
    return v


def _session_path(scope: Scope) -> tuple[str, str | None]:
    """(session id, sub-resource) of ``/sessions/{id}[/{sub}]``, decoded from the raw path.

    The decoded ``path`` cannot tell ``a%2Fb`` (one id) from ``a/b``; the raw path can."""
    raw: bytes | None = scope.get("raw_path")
    root = scope.get("root_path", "").encode()
    rel: bytes | None = None
    if raw is not None:
        for base in (root + b"/sessions/", b"/sessions/"):
            if raw.startswith(base):
                rel = raw[len(base) :]
                break
    if rel is None:  # a server without raw_path: the decoded path is the best there is
        path: str = scope["path"]
        rel = path[path.index("/sessions/") + len("/sessions/") :].encode()
        parts = rel.split(b"/", 1)
    else:
        parts = rel.split(b"/")
        if len(parts) > 2:
            raise HTTPException(404, "no such route")
    try:
        sid = unquote_to_bytes(parts[0]).decode("utf-8")
    except UnicodeDecodeError:
        raise _BadRequest("the session id is not valid UTF-8 once percent-decoded") from None
    sub = parts[1].decode("latin-1") if len(parts) > 1 else None
    validate_session_id(sid)
    return sid, sub


class _SessionRoute(Route):
    """``/sessions/...`` whatever follows: Starlette's path pattern stops at a decoded newline, but
    an id with one must still reach the handler, to be refused with a 400 (not a 404)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http":
            path: str = scope["path"]
            root: str = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root) :]
            if path.startswith("/sessions/"):
                return super().matches({**scope, "path": "/sessions/-", "root_path": ""})
        return Match.NONE, {}


# --------------------------------------------------------------------------- the app


class _Streams:
    """The open SSE streams, so a shutting-down server can end them at once instead of waiting
    for clients that never hang up."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.scopes: set[anyio.CancelScope] = set()
        self.closing = False

    def full(self) -> bool:
        return self.closing or (self.limit is not None and len(self.scopes) >= self.limit)

    def close_all(self) -> None:
        self.closing = True
        for s in list(self.scopes):
            s.cancel()


class _DraftSlot:
    """The last draft read for one session, shared by its SSE clients: whoever finds it older
    than `max_age` reads it again while the others wait on the lock and take that answer."""

    def __init__(self, live: bool = True) -> None:
        self.lock = anyio.Lock()
        self.raw = b"null"
        self.read_at = -1e9
        self.users = 0
        self.live = live  # False: only set_draft's draft (the stream sends deltas itself)

    async def get(self, store: SessionStore, session_id: str, max_age: float) -> bytes:
        async with self.lock:
            if time.monotonic() - self.read_at >= max_age:
                self.raw = _json.encode(await store.get_draft(session_id, live=self.live))
                self.read_at = time.monotonic()
            return self.raw


class _Drafts:
    def __init__(self) -> None:
        self.slots: dict[tuple[str, bool], _DraftSlot] = {}

    @contextlib.contextmanager
    def use(self, session_id: str, live: bool = True) -> Iterator[_DraftSlot]:
        key = (session_id, live)
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = _DraftSlot(live)
        slot.users += 1
        try:
            yield slot
        finally:
            slot.users -= 1
            if slot.users == 0:
                del self.slots[key]


def _default_stream_limit(store: SessionStore) -> int | None:
    """Each SSE client holds one pooled connection in XREAD BLOCK; past the pool's size the next
    command would fail with "Too many connections". Keep a margin for the short commands."""
    pool = getattr(getattr(store, "client", None), "connection_pool", None)
    size = getattr(pool, "max_connections", None)
    if isinstance(size, int) and 0 < size < 1 << 30:
        return max(1, size - max(4, size // 10))
    return None


def create_app(  # noqa: C901 - to split
    store: SessionStore,
    *,
    token: str | None = None,
    heartbeat: float = 15.0,
    messages: MessagesFn | None = None,
    draft_interval: float = 0.25,
    max_streams: int | None = None,
) -> Starlette:
    """The gateway as an ASGI app (read-only; never writes to `store`).

    `token` enables bearer auth on every route. `heartbeat` is the idle time after which an SSE
    stream sends a comment line (keeps proxies from closing it). `messages` answers `/messages`
    (default: `Sessions.messages`, the projector's cached snapshot plus the entries after it).
    `draft_interval` is how often a stream polls the draft while the session is active (it backs
    off to 2 s when idle). `max_streams` caps concurrent SSE clients (default: what the store's
    connection pool can hold); past it `/events` answers 503.
    """
    if heartbeat <= 0 or draft_interval <= 0:
        raise ValueError("heartbeat and draft_interval must be > 0")
    # the projector's snapshot plus the entries after it: no full read of a long log per request
    # viewers reload the messages of the same sessions often: keep their decoded snapshots
    get_messages: MessagesFn = (
        messages if messages is not None else Sessions(store, snapshot_cache=SnapshotCache(64 << 20)).messages
    )
    streams = _Streams(max_streams if max_streams is not None else _default_stream_limit(store))
    drafts = _Drafts()

    async def viewer(request: Request) -> Response:
        html, csp = _viewer()
        return Response(
            html,
            media_type="text/html; charset=utf-8",
            headers={"Content-Security-Policy": csp, "Cache-Control": "no-cache"},
        )

    async def openapi_doc(request: Request) -> Response:
        return _JSON(openapi(auth=token is not None))

    async def list_sessions(request: Request) -> Response:
        limit = _int_arg(request, "limit", 100, 1, 1000)
        assert limit is not None
        cursor = request.query_params.get("cursor") or None
        parent = request.query_params.get("parent") or None
        if cursor is not None and len(cursor) > 400:
            raise _BadRequest("invalid cursor")
        if parent is not None:
            validate_session_id(parent)
        page = await store.list(parent=parent, limit=limit, cursor=cursor)
        return _JSON({"items": [_header_dict(h) for h in page.items], "cursor": page.cursor})

    async def session_route(request: Request) -> Response:
        sid, sub = _session_path(request.scope)
        if sub is None:
            head = await store.head(sid)
            if head is None:
                raise SessionNotFoundError(sid)
            return _JSON(_head_dict(head))
        if sub == "entries":
            return await entries(request, sid)
        if sub == "messages":
            return await messages_route(request, sid)
        if sub == "events":
            return await events(request, sid)
        raise HTTPException(404, "no such route")

    async def entries(request: Request, sid: str) -> Response:
        start = _int_arg(request, "start", 0)
        stop = _int_arg(request, "stop", None)
        limit = _int_arg(request, "limit", DEFAULT_ENTRY_LIMIT, 1, MAX_ENTRY_LIMIT)
        assert start is not None and limit is not None
        if stop is not None and stop < start:
            raise _BadRequest(f"stop ({stop}) is before start ({start})")
        head = await store.head(sid)
        if head is None:
            raise SessionNotFoundError(sid)
        end = min(head.n, start + limit, head.n if stop is None else stop)
        got = await store.read(sid, start, end, incarnation=head.header.incarnation) if end > start else []
        want_end = head.n if stop is None else min(stop, head.n)
        return _JSON({"n": head.n, "entries": got, "next": end if end < want_end else None})

    async def messages_route(request: Request, sid: str) -> Response:
        fmt = request.query_params.get("format") or "openai"
        if fmt not in FORMATS:
            raise _BadRequest(f"format must be one of {', '.join(FORMATS)}")
        if messages is not None and await store.head(sid) is None:  # Sessions.messages checks itself
            raise SessionNotFoundError(sid)
        msgs = await get_messages(sid)
        body: Any
        if fmt == "openai":
            body = to_openai(msgs)
        elif fmt == "anthropic":
            body = to_anthropic(msgs)
        else:
            body = list(msgs)
        return _JSON({"session": sid, "format": fmt, "messages": body})

    async def events(request: Request, sid: str) -> Response:
        last_id = request.headers.get("last-event-id")
        live_after: str | None = None
        if last_id and "/" in last_id:
            start, live_after = _delta_cursor(last_id)
        elif last_id:
            if not _INT.fullmatch(last_id.strip()):
                raise _BadRequest("Last-Event-ID must be an entry n")
            start = int(last_id.strip()) + 1
        else:
            start = _int_arg(request, "start", 0) or 0
        if await store.head(sid) is None:
            raise SessionNotFoundError(sid)
        return _EventStream(
            store, sid, start, heartbeat=heartbeat, draft_interval=draft_interval, streams=streams, drafts=drafts,
            deltas=request.query_params.get("deltas") in ("1", "true"), live_after=live_after,
        )  # fmt: skip

    def guarded(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Map every expected failure to a JSON answer: bad input never becomes a 500."""

        async def endpoint(request: Request) -> Response:
            try:
                return await fn(request)
            except (_BadRequest, InvalidSessionIdError) as e:
                return _error(400, "bad_request", str(e))
            except SessionNotFoundError as e:
                return _error(404, "not_found", str(e))
            except StoreUnavailableError as e:
                log.warning("store unavailable: %s", e)
                return _error(503, "unavailable", "the store is unreachable", {"Retry-After": "2"})
            except ValueError as e:  # the store's own argument checks (limit, cursor, range)
                return _error(400, "bad_request", str(e))
            except SessionError as e:
                log.exception("gateway request failed")
                return _error(500, "internal", type(e).__name__)

        return endpoint

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        codes = {404: "not_found", 405: "method_not_allowed"}
        return _error(exc.status_code, codes.get(exc.status_code, "error"), str(exc.detail), exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        return _error(500, "internal", "internal error")

    async def healthz(request: Request) -> Response:
        await store.head("healthz")  # one round trip: proves the store answers
        return _JSON({"ok": True})

    routes = [
        Route("/healthz", guarded(healthz), methods=["GET"]),
        Route("/", guarded(viewer), methods=["GET"]),
        Route("/openapi.json", guarded(openapi_doc), methods=["GET"]),
        Route("/sessions", guarded(list_sessions), methods=["GET"]),
        _SessionRoute("/sessions/{rest:path}", guarded(session_route), methods=["GET"]),
        Route("/events", guarded(_store_events_route(store, heartbeat)), methods=["GET"]),
    ]
    middleware = [Middleware(_SecurityHeaders)]
    if token is not None:
        if not token:
            raise ValueError("token must not be empty")
        middleware.append(Middleware(_BearerAuth, token=token))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    app.state.streams = streams
    return app


# --------------------------------------------------------------------------- SSE


def _entry_event(e: Entry, cursor: str | None = None) -> bytes:
    if cursor:
        return b"id: %d/%b\ndata: %b\n\n" % (e.n, cursor.encode(), _json.encode(e))
    return b"id: %d\ndata: %b\n\n" % (e.n, _json.encode(e))


# --------------------------------------------------------------------------- SSE deltas (§8.2)

_DELTA_CURSOR = re.compile(r"(-1|[0-9]{1,15})/([0-9]{1,20}-[0-9]{1,20})")


def _delta_cursor(last_id: str) -> tuple[int, str]:
    """``<n>/<live id>`` (the id of every event of a ``?deltas=1`` stream once a delta was sent:
    the last entry n and the last delta's live stream id) as (start, live_after)."""
    m = _DELTA_CURSOR.fullmatch(last_id.strip())
    if m is None:
        raise _BadRequest("Last-Event-ID must be an entry n, or <n>/<live id> on a stream with deltas")
    return int(m.group(1)) + 1, m.group(2)


def _delta_event(last_n: int, d: Delta) -> bytes:
    body: dict[str, Any] = {"answer": d.answer, "index": d.index, "kind": d.kind, "text": d.text}
    if d.call_id is not None:
        body["callId"] = d.call_id
    if d.name is not None:
        body["name"] = d.name
    return b"event: delta\nid: %d/%b\ndata: %b\n\n" % (last_n, d.cursor.encode(), _json.encode(body))


async def _stream_with_deltas(stream: _EventStream, write: Write, on_retry: Any) -> None:
    """The live part of a ``?deltas=1`` stream: entries and ``event: delta`` as they come
    (`follow_deltas`), every event id ``<last n>/<last delta's live id>`` so a reconnect with
    Last-Event-ID resumes both without gap or repeat."""
    nxt = await stream._backlog(write)
    items = follow_deltas(
        stream.store, stream.session_id, nxt, live_after=stream.live_after, on_retry=on_retry,
        incarnation=stream._incarnation,
    )  # fmt: skip
    async with contextlib.aclosing(items) as live:
        async for item in live:
            stream._active_at = time.monotonic()
            if isinstance(item, Delta):
                stream.live_after = item.cursor
                await write(_delta_event(nxt - 1, item))
            else:
                nxt = item.n + 1
                await write(_entry_event(item, stream.live_after))


Write = Callable[[bytes], Awaitable[None]]


class _EventStream(Response):
    """One SSE client: the backlog in pages, then a live tail (`follow`, so a dropped store
    connection is retried and resumed without gap), a draft poller and a heartbeat.

    All three write straight to the response under one lock. A slow client therefore slows its
    own XREAD loop and no one else's, and nothing buffers without bound; and a new entry is on the
    wire before the tail asks Redis for the next one."""

    media_type = "text/event-stream"
    IDLE_DRAFT_INTERVAL = 2.0
    ACTIVE_WINDOW = 10.0  # seconds after the last entry or draft change during which drafts poll fast
    BACKLOG_PAGE = 1000

    def __init__(
        self,
        store: SessionStore,
        session_id: str,
        start: int,
        *,
        heartbeat: float,
        draft_interval: float,
        streams: _Streams,
        drafts: _Drafts,
        deltas: bool = False,
        live_after: str | None = None,
    ) -> None:
        # not Response.__init__: it would announce a Content-Length of 0
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.store = store
        self.session_id = session_id
        self.start = start
        self.heartbeat = heartbeat
        self.draft_interval = draft_interval
        self.streams = streams
        self.drafts = drafts
        self._active_at = time.monotonic()
        self._last_write = time.monotonic()
        self._incarnation: str | None = None
        self.deltas = deltas  # `event: delta` too (`_stream_with_deltas`); drafts then only set_draft's
        self.live_after = live_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "HEAD":
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if self.streams.full():
            busy = _error(503, "busy", "too many live streams; retry later", {"Retry-After": "5"})
            await busy(scope, receive, send)
            return
        lock = anyio.Lock(fast_acquire=True)
        async with anyio.create_task_group() as tg:
            # counted before the first await: concurrent requests cannot all slip under the limit
            self.streams.scopes.add(tg.cancel_scope)

            async def write(body: bytes) -> None:
                async with lock:
                    try:
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                    except OSError:  # the client went away mid-write
                        tg.cancel_scope.cancel()
                    self._last_write = time.monotonic()

            try:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope)
                # the first bytes flush the headers through any buffering proxy at once
                await write(b"retry: 1000\n: open\n\n")
                tg.start_soon(self._drafts, write)
                tg.start_soon(self._heartbeats, write)
                await self._entries(write)  # returns when the session is deleted
                tg.cancel_scope.cancel()
            finally:
                self.streams.scopes.discard(tg.cancel_scope)
        with anyio.CancelScope(shield=True), anyio.move_on_after(1), contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch_disconnect(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    async def _entries(self, write: Write) -> None:
        def on_retry(exc: BaseException, wait: float, at: int) -> None:
            log.warning("tail of %r dropped (%s); resuming at n=%d in %.2fs", self.session_id, exc, at, wait)

        try:
            if self.deltas:
                await _stream_with_deltas(self, write, on_retry)
            else:
                nxt = await self._backlog(write)
                tail = follow(self.store, self.session_id, nxt, on_retry=on_retry, incarnation=self._incarnation)
                async with contextlib.aclosing(tail) as entries:
                    async for e in entries:
                        self._active_at = time.monotonic()
                        await write(_entry_event(e))
        except SessionReplacedError:
            # the id was deleted and created again: this stream's session is gone for good
            await write(b"event: replaced\ndata: %b\n\n" % _json.encode({"session": self.session_id}))
        except SessionNotFoundError:
            pass
        except SessionError as exc:  # a corrupt log: say so, then end the stream
            log.exception("tail of %r failed", self.session_id)
            await write(b"event: error\ndata: %b\n\n" % _json.encode({"error": type(exc).__name__}))
        await write(b"event: end\ndata: {}\n\n")

    async def _backlog(self, write: Write) -> int:
        """Send what is already stored, a page per write; the n the live tail starts at.

        A reconnecting viewer of a long session catches up in a few large reads and writes, not
        one per entry. A store error here is left to the live tail, which retries it."""
        nxt = self.start
        try:
            while True:
                head = await self.store.head(self.session_id)
                if head is None:
                    return nxt
                if self._incarnation is None:
                    self._incarnation = head.header.incarnation  # the session this stream follows
                elif head.header.incarnation != self._incarnation:
                    raise SessionReplacedError(self.session_id)
                if nxt >= head.n:
                    return nxt
                page = await self.store.read(
                    self.session_id, nxt, min(head.n, nxt + self.BACKLOG_PAGE), incarnation=self._incarnation
                )
                if not page:
                    return nxt
                await write(b"".join([_entry_event(e, self.live_after) for e in page]))
                nxt = page[-1].n + 1
        except RETRYABLE:
            return nxt

    async def _drafts(self, write: Write) -> None:
        """Send the draft when it changes. Polled fast while the session is active, slower when
        idle; the clients of one session share each poll (`_Drafts`), so fifty viewers of one
        session cost one GET per interval, not fifty."""
        with self.drafts.use(self.session_id, live=not self.deltas) as slot:
            last = b"null"
            interval = self.draft_interval
            while True:
                try:
                    raw = await slot.get(self.store, self.session_id, max_age=self.draft_interval * 0.9)
                except SessionNotFoundError:
                    return
                except StoreUnavailableError:
                    await anyio.sleep(self.IDLE_DRAFT_INTERVAL)
                    continue
                now = time.monotonic()
                if raw != last:
                    last = raw
                    self._active_at = now
                    await write(b'event: draft\ndata: {"draft":%b}\n\n' % raw)
                active = now - self._active_at < self.ACTIVE_WINDOW
                interval = self.draft_interval if active else min(interval * 1.5, self.IDLE_DRAFT_INTERVAL)
                await anyio.sleep(interval)

    async def _heartbeats(self, write: Write) -> None:
        while True:
            idle = time.monotonic() - self._last_write
            if idle >= self.heartbeat:
                await write(b": ping\n\n")
                idle = 0.0
            await anyio.sleep(self.heartbeat - idle)


# --------------------------------------------------------------------------- store-wide events


def _store_events_route(store: SessionStore, heartbeat: float) -> Callable[[Request], Awaitable[Response]]:
    """``GET /events``: the store's notifications as SSE (``event: session-branch`` with
    ``{parent, session, at}``), so a viewer updates its branch tree and session list at once."""

    async def store_events(request: Request) -> Response:
        return _StoreEventStream(store, heartbeat)

    return store_events


async def _store_notifications(store: SessionStore) -> Any:
    """Each notification published on the store's ``{prefix}:events`` channel, as a dict; across
    dropped connections (resubscribing). Stores without pub/sub (memory, cluster) yield nothing."""
    from redis.asyncio import Redis

    client, keys = getattr(store, "client", None), getattr(store, "keys", None)
    if not isinstance(client, Redis) or keys is None:
        await anyio.sleep_forever()
        return
    while True:
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(keys.events)
            async for message in pubsub.listen():
                with contextlib.suppress(msgspec.DecodeError):
                    body = msgspec.json.decode(message["data"])
                    if isinstance(body, dict) and isinstance(body.get("event"), str):
                        yield body
        except RETRYABLE:
            await anyio.sleep(1.0)
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]


class _StoreEventStream(Response):
    """One client of ``/events``: store notifications, with heartbeats."""

    media_type = "text/event-stream"

    def __init__(self, store: SessionStore, heartbeat: float) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.store = store
        self.heartbeat = heartbeat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        if scope["method"] == "HEAD":
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        with contextlib.suppress(OSError):
            async with anyio.create_task_group() as tg:

                async def disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                async def heartbeats() -> None:
                    while True:
                        await anyio.sleep(self.heartbeat)
                        await body(b": ping\n\n")

                tg.start_soon(disconnect)
                tg.start_soon(heartbeats)
                await body(b"retry: 1000\n: open\n\n")
                async for event in _store_notifications(self.store):
                    name = str(event.pop("event")).encode()
                    await body(b"event: %b\ndata: %b\n\n" % (name, _json.encode(event)))
        with anyio.CancelScope(shield=True), anyio.move_on_after(1), contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


# --------------------------------------------------------------------------- middleware


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


class _SecurityHeaders:
    """Headers every answer carries: no sniffing, and no Referer (the viewer's URL may hold a token)."""

    HEADERS = (
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
        (b"x-frame-options", b"DENY"),
    )

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


# --------------------------------------------------------------------------- viewer


@cache
def _viewer() -> tuple[bytes, str]:
    """The viewer page, and a Content-Security-Policy that admits exactly its inline script and
    style (by hash) and connections to this origin."""
    html = resources.files("redis_session").joinpath("gateway", "static", "viewer.html").read_bytes()
    text = html.decode()

    def hashes(tag: str) -> str:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.S)
        digests = [base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() for s in found]
        return " ".join(f"'sha256-{d}'" for d in digests)

    csp = (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    )
    return html, csp


# --------------------------------------------------------------------------- OpenAPI


def openapi(*, auth: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the gateway."""

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    def error(description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": ref("Error")}}}

    def ok(description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": schema}}}

    sid = {
        "name": "session_id",
        "in": "path",
        "required": True,
        "description": "Session id, percent-encoded (`/` as `%2F`). 1-256 characters; "
        "no braces, whitespace or control characters.",
        "schema": {"type": "string", "minLength": 1, "maxLength": 256},
    }

    def nonneg(name: str, description: str) -> dict[str, Any]:
        return {"name": name, "in": "query", "description": description, "schema": {"type": "integer", "minimum": 0}}

    common = {"401": error("Missing or wrong bearer token")} if auth else {}
    session_errors = {
        "400": error("Invalid session id or parameter"),
        "404": error("Unknown session"),
        "503": error("The store is unreachable"),
        **common,
    }
    json_any: dict[str, Any] = {}
    header = {
        "type": "object",
        "required": ["id"],
        "properties": {
            "id": {"type": "string"},
            "format_version": {"type": "integer"},
            "created_at": {"type": "integer", "description": "ms since the epoch"},
            "parent": {"type": ["string", "null"]},
            "at": {"type": ["integer", "null"], "description": "branch point in the parent's log"},
            "delegation_depth": {"type": "integer"},
            "title": {"type": ["string", "null"]},
            "origin": json_any,
            "incarnation": {"type": "string", "description": "unique per creation of the id"},
        },
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "redis-session gateway",
            "version": "1",
            "description": "Read-only access to agent sessions and their live tails.",
        },
        "paths": {
            "/healthz": {
                "get": {
                    "summary": "Liveness and store reachability (no token needed)",
                    "security": [],
                    "responses": {
                        "200": ok("The store answers", {"type": "object"}),
                        "503": error("The store is unreachable"),
                    },
                }
            },
            "/": {
                "get": {
                    "summary": "The web viewer",
                    "responses": {"200": {"description": "HTML page", "content": {"text/html": {}}}, **common},
                }
            },
            "/openapi.json": {
                "get": {"summary": "This document", "responses": {"200": ok("OpenAPI document", {}), **common}}
            },
            "/sessions": {
                "get": {
                    "summary": "List sessions, newest first",
                    "parameters": [
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100},
                        },
                        {
                            "name": "cursor",
                            "in": "query",
                            "description": "`cursor` of the previous page",
                            "schema": {"type": "string"},
                        },
                        {
                            "name": "parent",
                            "in": "query",
                            "description": "only the live branches of this session",
                            "schema": {"type": "string"},
                        },
                    ],
                    "responses": {"200": ok("One page", ref("SessionPage")), "400": error("Bad parameter"), **common},
                }
            },
            "/sessions/{session_id}": {
                "get": {
                    "summary": "A session's head",
                    "parameters": [sid],
                    "responses": {"200": ok("The head", ref("SessionHead")), **session_errors},
                }
            },
            "/sessions/{session_id}/entries": {
                "get": {
                    "summary": "Stored entries [start, stop), at most `limit` of them",
                    "parameters": [
                        sid,
                        nonneg("start", "first n (default 0)"),
                        nonneg("stop", "end n, exclusive (default: the session's n)"),
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ENTRY_LIMIT},
                        },
                    ],
                    "responses": {"200": ok("Entries", ref("EntryPage")), **session_errors},
                }
            },
            "/sessions/{session_id}/messages": {
                "get": {
                    "summary": "The projection: what the model sees",
                    "parameters": [
                        sid,
                        {
                            "name": "format",
                            "in": "query",
                            "schema": {"type": "string", "enum": list(FORMATS), "default": "openai"},
                        },
                    ],
                    "responses": {"200": ok("Messages", ref("Messages")), **session_errors},
                }
            },
            "/sessions/{session_id}/events": {
                "get": {
                    "summary": "Live tail (Server-Sent Events)",
                    "description": "Each entry is an event whose `id` is its n and whose data is the entry "
                    "as JSON; `event: draft` carries `{draft}` when the streaming draft changes; "
                    "`event: end` when the session is deleted (`event: replaced` first when it was replaced); "
                    "`: ping` comments after `heartbeat` "
                    "idle seconds. Reconnect with `Last-Event-ID` (resumes at id + 1), else `start`. "
                    "With `deltas=1`, `event: delta` carries `{answer, index, kind, text, callId?, name?}` "
                    "for each delta of a streamed answer, and event ids become `<n>/<live id>` "
                    "(last entry n, last delta's live stream id) once a delta was sent; "
                    "`Last-Event-ID` resumes both without gap or repeat.",
                    "parameters": [
                        sid,
                        nonneg("start", "first n (default 0)"),
                        {
                            "name": "deltas",
                            "in": "query",
                            "description": "1: also send streamed answers' deltas (`event: delta`)",
                            "schema": {"type": "string", "enum": ["0", "1", "true"]},
                        },
                        {
                            "name": "Last-Event-ID",
                            "in": "header",
                            "description": "the last n received; takes precedence over `start`",
                            "schema": {"type": "string"},
                        },
                    ],
                    "responses": {
                        "200": {"description": "An event stream", "content": {"text/event-stream": {}}},
                        **session_errors,
                        "503": error("The store is unreachable, or too many live streams"),
                    },
                }
            },
            "/events": {
                "get": {
                    "summary": "Store-wide notifications (Server-Sent Events)",
                    "description": "`event: session-branch` with `{parent, session, at}` when a branch or fork "
                    "is created (what the viewer's branch tree and session list follow); `: ping` comments "
                    "after `heartbeat` idle seconds. Stores without pub/sub send only the pings.",
                    "responses": {"200": {"description": "An event stream", "content": {"text/event-stream": {}}}},
                }
            },
        },
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error", "message"],
                    "properties": {"error": {"type": "string"}, "message": {"type": "string"}},
                },
                "SessionHeader": header,
                "SessionHead": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "header": ref("SessionHeader"),
                        "n": {"type": "integer", "description": "number of entries"},
                        "updated_at": {"type": "integer"},
                        "last_cut": {"type": ["integer", "null"]},
                    },
                },
                "SessionPage": {
                    "type": "object",
                    "properties": {
                        "items": {"type": "array", "items": ref("SessionHeader")},
                        "cursor": {"type": ["string", "null"], "description": "null on the last page"},
                    },
                },
                "Entry": {
                    "type": "object",
                    "required": ["n", "time", "type", "data"],
                    "properties": {
                        "n": {"type": "integer"},
                        "time": {"type": "integer", "description": "ms since the epoch"},
                        "type": {"type": "string"},
                        "data": {"type": "object"},
                        "meta": {"type": "object"},
                        "surface": {"type": "object"},
                    },
                },
                "EntryPage": {
                    "type": "object",
                    "properties": {
                        "n": {"type": "integer", "description": "the session's n when read"},
                        "entries": {"type": "array", "items": ref("Entry")},
                        "next": {"type": ["integer", "null"], "description": "start of the next page"},
                    },
                },
                "Messages": {
                    "type": "object",
                    "properties": {
                        "session": {"type": "string"},
                        "format": {"type": "string", "enum": list(FORMATS)},
                        "messages": {
                            "description": "openai: a list of chat messages; anthropic: "
                            "{system, messages}; neutral: [{role, content: blocks, source: [n]}]"
                        },
                    },
                },
            }
        },
    }
    if auth:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "query": {"type": "apiKey", "in": "query", "name": "token"},
        }
        doc["security"] = [{"bearer": []}, {"query": []}]
    return doc


# --------------------------------------------------------------------------- serving


async def serve(
    store: SessionStore,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    *,
    heartbeat: float = 15.0,
    messages: MessagesFn | None = None,
    max_streams: int | None = None,
    log_level: str = "warning",
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the gateway with uvicorn until cancelled, or until SIGTERM (in the main thread).

    ``await tg.start(serve, store, "127.0.0.1", 0)`` returns the port actually bound. On the way
    out, open SSE streams are ended at once rather than waited for. Ctrl-C is left to the event
    loop (``anyio.run`` cancels the main task, then raises KeyboardInterrupt), so it stops the
    whole program, not just the gateway.
    """
    app = create_app(store, token=token, heartbeat=heartbeat, messages=messages, max_streams=max_streams)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
    )
    started = anyio.Event()
    server = _Server(config, app.state.streams, started.set)
    failed: list[OSError] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            # uvicorn does not survive cancellation mid-serve (it would skip closing its sockets),
            # so it runs shielded and is asked to exit instead
            with anyio.CancelScope(shield=True):
                try:
                    await server.serve()
                except SystemExit:  # uvicorn's answer to a port it cannot bind (it logged why)
                    failed.append(OSError(f"the gateway could not listen on {host}:{port}"))
            tg.cancel_scope.cancel()

        async def on_sigterm() -> None:
            try:
                with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                    async for _ in signals:
                        server.should_exit = True  # a graceful stop, as Kubernetes asks for one
            except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
                await anyio.sleep_forever()

        tg.start_soon(run)
        tg.start_soon(on_sigterm)
        try:
            await started.wait()
            task_status.started(server.bound_port())
            await anyio.sleep_forever()
        finally:
            server.should_exit = True
    if failed:
        raise failed[0]


class _Server(uvicorn.Server):
    """uvicorn's server, ending the open SSE streams as it shuts down (it would otherwise wait
    for every client to hang up)."""

    def __init__(self, config: uvicorn.Config, streams: _Streams, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._streams = streams
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_started()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn would take over SIGINT and SIGTERM, stop only itself, and re-raise them inside
        # our task group; `serve` handles SIGTERM and leaves SIGINT to the event loop instead
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._streams.close_all()
        await super().shutdown(sockets)

    def bound_port(self) -> int:
        for s in self.servers:
            for sock in s.sockets:
                return int(sock.getsockname()[1])
        return int(self.config.port)
