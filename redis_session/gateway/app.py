"""The gateway: an HTTP + Server-Sent Events front of a `SessionStore` (reads, live tails and
writes), and the web viewer. Starlette, served by uvicorn. The parts: `routes` (which handler for
which method and scope), `reads`, `writes`, `sse`, `auth` (tokens, scopes, tenants), `body`
(request bodies and preconditions), `errors` (exception -> status), `openapi`, `viewer`.

Routes (``/openapi.json`` describes them)::

    GET  /                              the web viewer (one self-contained HTML page)
    GET  /openapi.json                  this API
    GET  /sessions?limit=&cursor=&parent=  sessions, newest first, paginated; ``parent`` lists branches
    POST /sessions                      create {id?, title?, origin?, delegation_depth?, ttl?, entries?}
    GET  /sessions/{id}                 the head: header, n, updated_at, last_cut (ETag: n)
    DELETE /sessions/{id}               delete (scope admin)
    GET  /sessions/{id}/entries?start=&stop=&limit=   stored entries [start, stop), at most `limit`
    POST /sessions/{id}/entries         append one entry or a batch (If-Match, Idempotency-Key)
    GET  /sessions/{id}/messages?format=openai|anthropic|neutral   the projection
    POST /sessions/{id}/branch          {at, id?}: a branch holding [0, at)
    POST /sessions/{id}/fork            {boundary?, id?}: dsh fork at a turn/end
    GET|PUT /sessions/{id}/draft        the streaming draft
    POST /sessions/{id}/repair          close a crashed writer's open turn
    GET  /sessions/{id}/events?start=   SSE: entries as they land (``id:`` is the entry's n; resume
                                        with ``Last-Event-ID``), ``event: draft`` for the streaming
                                        draft, ``event: end`` when the session is deleted (after
                                        ``event: replaced`` when its id was deleted and created
                                        again: the stream never goes on with the new session), and
                                        a ``: ping`` comment after `heartbeat` idle seconds;
                                    ``&deltas=1`` adds ``event: delta`` (each delta of a streamed
                                    answer) and ids become ``<n>/<live id>`` (resume both)
    GET  /events                        SSE: store-wide notifications (``event: session-branch``)

    GET  /healthz, /readyz              liveness (the process, never Redis), readiness (Redis answers)
    POST /signin, /signout              the viewer's sign-in cookie (with tokens)

Ids in paths are percent-encoded (``/`` as ``%2F``); the raw path is decoded here, so ids with
``/``, ``:`` and any unicode work. With tokens, every route but the probes answers 401 unless the
request carries ``Authorization: Bearer <token>``, the sign-in cookie, or ``?token=<token>``
(EventSource cannot set headers); what a token may do is in `auth`. Before any route, the
``Host`` must be an allowed one (421 otherwise: DNS rebinding), and a page of another origin
gets CORS answers and may write only when its origin is allowed (`routes.WebPolicy`). Without a
token, `serve` binds only loopback unless told `insecure_no_auth` (`check_exposure`).

>>> app = create_app(store, token="s3cret")            # any ASGI server
>>> await serve(store, host="0.0.0.0", port=8765)       # or uvicorn, until cancelled / Ctrl-C
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import signal
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any, cast

import anyio
import msgspec
import uvicorn
from anyio.abc import TaskStatus
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..model import DEFAULT_MAX_BATCH
from ..sessions import Sessions
from ..snapshots import SnapshotCache
from ..store import SessionStore
from . import reads
from . import routes as routes_
from .auth import SCOPES, Token, TokenSet, _TokenAuth
from .body import DEFAULT_MAX_BODY
from .common import MessagesFn, _SessionRoute, log
from .context import Gateway
from .errors import GuardedApp, guarded, http_error, server_error
from .openapi import openapi
from .routes import WebPolicy, _WebGuard
from .sse import _default_stream_limit, _Drafts, _store_events_route, _store_notifications, _Streams
from .tails import Notifications, Tails
from .wire import http_protocol

__all__ = ["MessagesFn", "WebPolicy", "check_exposure", "create_app", "listen", "openapi", "run_workers", "serve"]


def _is_loopback(host: str) -> bool:
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, *, has_token: bool, insecure_no_auth: bool = False) -> None:
    """A gateway reachable from other machines has a token, or is opened on purpose: bound to a
    non-loopback `host` without one, this raises ValueError unless `insecure_no_auth`, and then
    logs loudly that anyone who can reach it may read, write and delete every session."""
    if has_token or _is_loopback(host):
        return
    if not insecure_no_auth:
        raise ValueError(
            f"refusing to serve on {host} without a token: anyone who can reach it could read, write "
            "and delete every session. Set REDIS_SESSION_TOKEN (or --tokens), bind 127.0.0.1, or pass "
            "--insecure-no-auth to open it on purpose"
        )
    log.warning(
        "INSECURE: the gateway on %s has NO TOKEN (--insecure-no-auth): anyone who can reach it may "
        "read, write and delete every session",
        host,
    )


def create_app(
    store: SessionStore,
    *,
    token: str | None = None,
    tokens: Sequence[Token] = (),
    heartbeat: float = 15.0,
    messages: MessagesFn | None = None,
    draft_interval: float = 0.25,
    max_streams: int | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    host: str | None = None,
) -> Starlette:
    """The gateway as an ASGI app: reads, live tails and writes over `store`.

    `token` is one bearer token with every scope; `tokens` adds scoped (and tenant-confined)
    ones (`auth.Token`, `auth.load_tokens`). Without either, every route is open. `heartbeat` is
    the idle time after which an SSE stream sends a comment line (keeps proxies from closing it).
    `messages` answers `/messages` (default: `Sessions.messages`, the projector's cached snapshot
    plus the entries after it). `draft_interval` is how often a stream polls the draft while the
    session is active (it backs off to 2 s when idle). `max_streams` caps concurrent SSE clients
    (default: none). The SSE streams of one session share one live tail, so they hold one pooled
    connection between them (a ``?deltas=1`` stream holds its own); a stream that would need one
    more than the pool can spare answers 503, as one past `max_streams` does.
    `max_body` caps a request body (413 before it is parsed).

    `allowed_hosts` are the ``Host`` names answered (default: `host` — the address served on —
    ``localhost``, ``127.0.0.1``, ``::1``); any other answers 421 on every route (DNS rebinding).
    `allowed_origins` are the other origins whose pages may call it (CORS; none by default).
    See `routes.WebPolicy`.
    """
    if heartbeat <= 0 or draft_interval <= 0:
        raise ValueError("heartbeat and draft_interval must be > 0")
    if max_body < 1:
        raise ValueError("max_body must be >= 1")
    # the projector's snapshot plus the entries after it: no full read of a long log per request;
    # viewers reload the messages of the same sessions often: keep their decoded snapshots
    sessions = Sessions(store, snapshot_cache=SnapshotCache(64 << 20))
    known = _token_set(token, tokens)
    policy = WebPolicy.make(allowed_hosts, allowed_origins, bound=host)
    if "*" in policy.origins and known is None:
        log.warning("gateway: every origin's pages may call it (allowed origins: *) and it has no token")
    gw = Gateway(
        store=store,
        get_messages=messages if messages is not None else sessions.messages,
        custom_messages=messages is not None,
        streams=_Streams(max_streams),
        drafts=_Drafts(),
        tails=Tails(store, _default_stream_limit(store)),
        notifications=Notifications(partial(_store_notifications, store)),
        heartbeat=heartbeat,
        draft_interval=draft_interval,
        auth=known is not None,
        sessions=sessions,
        max_body=max_body,
        max_batch=getattr(store, "max_batch", DEFAULT_MAX_BATCH),
    )
    session_app = GuardedApp(partial(routes_.session, gw))
    routes = [
        # first: the hot route (appends, reads, streams) is found without trying the others; no
        # other route's path starts with /sessions/
        _SessionRoute("/sessions/{rest:path}", session_app, methods=routes_.METHODS),
        Route("/healthz", reads.healthz, methods=["GET"]),
        Route("/readyz", guarded(partial(reads.readyz, gw)), methods=["GET"]),
        Route("/", guarded(partial(reads.viewer, gw)), methods=["GET"]),
        Route("/openapi.json", guarded(partial(reads.openapi_doc, gw)), methods=["GET"]),
        Route("/sessions", GuardedApp(partial(routes_.sessions, gw)), methods=["GET", "POST"]),
        Route(
            "/events",
            guarded(_store_events_route(gw.notifications, gw.tails, heartbeat, gw.streams)),
            methods=["GET"],
        ),
    ]
    middleware = [Middleware(_WebGuard, policy=policy)]
    if known is not None:
        middleware.append(Middleware(_TokenAuth, tokens=known))
    app = _GatewayApp(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    app.hot = _last_resort(_stack(middleware, _http_errors(session_app)))
    app.probe = _last_resort(_stack(middleware, GuardedApp(reads.healthz)))
    app.state.streams = gw.streams
    app.state.tails = gw.tails
    return app


_HOT_METHODS = frozenset(routes_.METHODS)


class _GatewayApp(Starlette):
    """The Starlette app, with a shorter way in for ``/sessions/{id}...`` (every append, read and
    stream) and the liveness probe: the same middleware (the web guard, the token check) around
    the same handler, without Starlette's outer error layer, its exception
    layer, its router and its per-route wrapper, which each wrapped every request and its `send`
    again (about a tenth of an append's time in the gateway). What they did for these routes is
    done the same way by `_last_resort` and `_http_errors`; every other path or method, or a
    mounted app (``root_path``), goes the whole way."""

    hot: ASGIApp | None = None
    probe: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        send = _secured(send)  # outermost: Starlette's own 500 answer carries them too
        if not scope.get("root_path"):
            path: str = scope["path"]
            fast = None
            if path.startswith("/sessions/"):
                fast = self.hot if scope["method"] in _HOT_METHODS else None
            elif path == "/healthz" and scope["method"] in ("GET", "HEAD"):
                fast = self.probe
            if fast is not None:
                scope["app"] = self
                await fast(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _stack(middleware: Sequence[Middleware], app: ASGIApp) -> ASGIApp:
    """`app` inside `middleware`, the first one outermost (as Starlette stacks them)."""
    for cls, args, kwargs in reversed(middleware):
        app = cls(app, *args, **kwargs)
    return app


def _http_errors(app: ASGIApp) -> ASGIApp:
    """An `HTTPException` (404 no such route, 405) answered by `http_error`, as Starlette's
    exception layer does; once the answer has begun there is nothing to answer with."""

    async def caught(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await app(scope, receive, send)
        except HTTPException as e:
            await (await http_error(Request(scope), e))(scope, receive, send)

    return caught


def _last_resort(app: ASGIApp) -> ASGIApp:
    """An unexpected exception answered 500 (`server_error`) when nothing was sent yet, then
    raised on for the server to log, as Starlette's outer error layer does."""

    async def guarded_app(scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def sender(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await app(scope, receive, sender)
        except Exception as e:
            if not started:
                await (await server_error(Request(scope), e))(scope, receive, send)
            raise

    return guarded_app


def _token_set(token: str | None, tokens: Sequence[Token]) -> TokenSet | None:
    """The tokens to check, None for an open gateway; `token` is an all-scopes token."""
    if token is not None and not token:
        raise ValueError("token must not be empty")
    every = [*([Token.make(token, SCOPES, name="--token")] if token is not None else []), *tokens]
    return TokenSet(every) if every else None


SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
)
"""Headers every answer carries, a 500 included: no sniffing, no framing, and no Referer to other
origins (``same-origin``, not ``no-referrer``: that would make the browser send ``Origin: null`` on
the sign-in form's POST, which the cross-origin write check must refuse)."""


def _secured(send: Send) -> Send:
    """`send` adding `SECURITY_HEADERS` to the answer's head."""

    async def sender(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
        await send(message)

    return sender


async def serve(
    store: SessionStore,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    *,
    tokens: Sequence[Token] = (),
    heartbeat: float = 15.0,
    messages: MessagesFn | None = None,
    max_streams: int | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    insecure_no_auth: bool = False,
    log_level: str = "warning",
    http: str = "auto",
    sockets: Sequence[socket.socket] | None = None,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the gateway with uvicorn until cancelled, or until SIGTERM (in the main thread).

    ``await tg.start(serve, store, "127.0.0.1", 0)`` returns the port actually bound. On the way
    out, open SSE streams are ended at once rather than waited for. Ctrl-C is left to the event
    loop (``anyio.run`` cancels the main task, then raises KeyboardInterrupt), so it stops the
    whole program, not just the gateway.

    On a non-loopback `host` without `token`/`tokens` it refuses to start (`check_exposure`)
    unless `insecure_no_auth`. `sockets`: serve on these already-bound sockets (worker processes
    sharing one listening socket) instead of binding `host`:`port`. `http` is uvicorn's HTTP
    parser: ``auto`` (httptools when installed — the ``fast`` extra —, else h11), ``httptools``,
    ``h11``; the event loop is the caller's (the CLI runs uvloop when installed).
    """
    check_exposure(host, has_token=token is not None or bool(tokens), insecure_no_auth=insecure_no_auth)
    app = create_app(
        store,
        token=token,
        tokens=tokens,
        heartbeat=heartbeat,
        messages=messages,
        max_streams=max_streams,
        max_body=max_body,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
        host=host,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        # one write per answer (`_Cork`); an absolute-form target kept for the host check (`wire`)
        http=_corked_protocol(http),
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
                    await server.serve(list(sockets) if sockets else None)
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


class _Cork:
    """A transport whose writes of one event-loop pass leave in one send: uvicorn writes an
    answer's status line and headers, then its body, each at once (two syscalls, two TCP
    segments); here they are joined and sent right after the pass (``call_soon``), so nothing
    is held longer than that, and at once past `FLUSH_AT` bytes, so a fast producer still meets
    the transport's back-pressure (uvicorn pauses on its ``pause_writing``)."""

    FLUSH_AT = 1 << 16
    __slots__ = ("_buf", "_loop", "_size", "_t")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._t = transport
        self._buf: list[bytes] = []
        self._size = 0
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not self._buf:
            self._loop.call_soon(self.flush)
        self._buf.append(data)
        self._size += len(data)
        if self._size >= self.FLUSH_AT:
            self.flush()

    def writelines(self, data: Iterable[bytes]) -> None:
        for d in data:
            self.write(d)

    def flush(self) -> None:
        if not self._buf:
            return
        data = self._buf[0] if len(self._buf) == 1 else b"".join(self._buf)
        self._buf = []
        self._size = 0
        if not self._t.is_closing():
            self._t.write(data)

    def close(self) -> None:
        self.flush()
        self._t.close()

    def write_eof(self) -> None:
        self.flush()
        self._t.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._t.get_write_buffer_size() + self._size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


PARSER_400_MESSAGE = (
    "the request is not valid HTTP/1.1 (a malformed request line, method or target, a raw space or "
    "byte outside ASCII in the query, a control character or NUL in a header, or a part too long "
    "for the parser): nothing was done"
)


def parser_400(default_headers: Iterable[tuple[bytes, bytes]] = ()) -> bytes:
    """The whole answer to a request the HTTP parser (httptools or h11) refuses before the app
    sees it: the documented JSON error ``{error: "bad_request", message}`` with the headers every
    answer carries, not uvicorn's plain-text one; the connection is closed after it."""
    body = msgspec.json.encode({"error": "bad_request", "message": PARSER_400_MESSAGE})
    lines = [b"HTTP/1.1 400 Bad Request"]
    lines += [name + b": " + value for name, value in default_headers]
    lines += [b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
    lines += [name + b": " + value for name, value in SECURITY_HEADERS]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _corked_protocol(http: str) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (`http`: auto, httptools, h11) on a `_Cork`ed transport, the
    httptools one keeping a non-origin-form target for the host check (`wire.http_protocol`);
    a request its parser refuses gets `parser_400` (JSON), on either parser."""
    import importlib

    if http not in ("auto", "httptools", "h11"):
        raise ValueError(f"http is auto, httptools or h11, got {http!r}")
    resolved = http_protocol(http)
    base: Any = (
        importlib.import_module("uvicorn.protocols.http.h11_impl").H11Protocol
        if isinstance(resolved, str)
        else resolved
    )

    class Corked(base):  # type: ignore[misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(_Cork(transport))

        _refused = False  # a refused request waits for the answers of those before it

        def send_400_response(self, msg: str) -> None:
            # what the parser refuses never reaches the app: answer it as the app answers a 400,
            # after the answers of the requests pipelined before it (a write among them is done:
            # its own answer must not be lost behind a 400 that says nothing was done)
            cycle = getattr(self, "cycle", None)
            waiting = cycle is not None and not cycle.response_complete and not cycle.more_body
            if waiting or getattr(self, "pipeline", None):
                self._refused = True
                self.flow.pause_reading()
                return
            self.transport.write(parser_400(self.server_state.default_headers))
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            cycle = getattr(self, "cycle", None)
            if self._refused and not getattr(self, "pipeline", None) and (cycle is None or cycle.response_complete):
                self._refused = False
                self.send_400_response("")

    if isinstance(resolved, str):  # h11 takes what httptools refuses: refused the same way

        class CorkedH11(Corked):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.conn.next_event = _as_httptools_would(self.conn.next_event)

        return cast("type[asyncio.Protocol]", CorkedH11)
    return cast("type[asyncio.Protocol]", Corked)


def _as_httptools_would(next_event: Callable[[], Any]) -> Callable[[], Any]:
    """h11's `next_event`, refusing as a parse error what httptools refuses and h11 takes: a
    method not in upper case (``get``), a control byte in a header or trailer value (h11 refuses
    only NUL, CR and LF), an HTTP version other than 1.0 and 1.1, and both ``Content-Length`` and
    ``Transfer-Encoding`` (RFC 9112 §6.3: a smuggling vector): the same `parser_400` on both
    stacks. h11 stays more lenient than httptools elsewhere (obs-fold, bare LF line ends, chunk
    extensions, any upper-case method, long targets)."""
    import h11

    def checked() -> Any:
        event = next_event()
        if isinstance(event, h11.Request):
            if not _METHOD.fullmatch(event.method):
                raise h11.RemoteProtocolError("the method is not upper case")
            if event.http_version not in (b"1.0", b"1.1"):
                raise h11.RemoteProtocolError("not HTTP/1.1")
            names = set()
            for name, value in event.headers:
                if _CONTROL.search(value):
                    raise h11.RemoteProtocolError("a control byte in a header value")
                names.add(name)
            if b"content-length" in names and b"transfer-encoding" in names:
                raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding")
        elif isinstance(event, h11.EndOfMessage):  # a chunked body's trailer fields
            for _, value in event.headers:
                if _CONTROL.search(value):
                    raise h11.RemoteProtocolError("a control byte in a trailer value")
        return event

    return checked


_METHOD = re.compile(rb"[A-Z][A-Z-]*")
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


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
        dropping = asyncio.get_running_loop().create_task(self._drop_stalled())
        try:
            await super().shutdown(sockets)
        finally:
            dropping.cancel()

    STALL_LOOK, STALL_GRACE = 0.25, 1.0

    async def _drop_stalled(self) -> None:
        """Abort the connections of clients that stopped reading while the server stops: an
        ended stream's last write waits behind what such a client never read, and uvicorn would
        wait out its graceful timeout for it, then cancel it with an error in the log. Stopped
        reading: writes held back (the transport paused) and not one byte of them taken for
        `STALL_GRACE` seconds (looked at every `STALL_LOOK`: a slow reader's kernel takes bytes
        in lumps). A client that reads gets its stream's end, when what it has yet to read
        drains within the stop's grace."""
        loop = asyncio.get_running_loop()
        last: dict[Any, tuple[int, float]] = {}  # connection -> bytes not taken, since when
        while True:
            await asyncio.sleep(self.STALL_LOOK)
            now, seen = loop.time(), {}
            for conn in list(self.server_state.connections):
                flow, transport = getattr(conn, "flow", None), getattr(conn, "transport", None)
                if flow is None or transport is None or not flow.write_paused:
                    continue
                left = transport.get_write_buffer_size()
                before = last.get(conn)
                since = before[1] if before is not None and left >= before[0] else now
                if now - since >= self.STALL_GRACE:
                    transport.abort()
                else:
                    seen[conn] = (left, since)
            last = seen

    def bound_port(self) -> int:
        for s in self.servers:
            for sock in s.sockets:
                return int(sock.getsockname()[1])
        return int(self.config.port)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port`, to share among worker processes (`run_workers`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise OSError(f"the gateway could not listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _end_with(parent: int) -> None:
    """A worker whose parent dies (SIGKILL, a crash: no stop passed on) gets SIGTERM (Linux's
    parent-death signal), instead of serving on orphaned, holding the port, forever."""
    import ctypes
    import os

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's own stop still reaches it
        return
    if os.getppid() != parent:  # it died before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)


STOP_AGAIN = 1.0
"""Seconds after which a stop passed on to a worker that is still running is passed on again."""


def _reaped(pids: Sequence[int], stopping: Callable[[], bool]) -> list[tuple[int, int]]:
    """Wait for every worker of `pids` to end: their wait statuses, in `pids`' order. Once
    `stopping`, a worker still running after `STOP_AGAIN` seconds gets SIGTERM again: a worker
    just forked can take the first one in the instant before its server listens for it (seen once
    in ~25 Ctrl-Cs under load: both workers served on and the command never exited); a second
    SIGTERM to a stopping server is harmless."""
    import os
    import time

    statuses: dict[int, int] = {}
    nudged = None
    while len(statuses) < len(pids):
        for pid in pids:
            if pid not in statuses:
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = raw
        if len(statuses) == len(pids):
            break
        if stopping():
            now = time.monotonic()
            if nudged is None:
                nudged = now
            elif now - nudged >= STOP_AGAIN:
                nudged = now
                for pid in pids:
                    if pid not in statuses:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGTERM)
        time.sleep(0.2)  # a worker's end is seen within this (the parent only waits)
    return [(pid, statuses[pid]) for pid in pids]


def run_workers(count: int, work: Callable[[], None]) -> int:
    """Run `work` in `count` forked processes (each its own event loop, store connections and
    streams, all accepting on the socket `work` serves), until they end. Returns the first
    non-zero exit status, else 0. Call before any event loop or connection exists in this
    process (it forks).

    Ctrl-C signals the whole foreground process group: a worker that took SIGINT itself (and
    the copy passed on after it) was cancelled mid-stream and printed tracebacks. So the workers
    ignore SIGINT, and SIGINT or SIGTERM to this process is passed on to each as SIGTERM
    (`serve`'s graceful stop: open streams end at once); it then waits for them all."""
    import os

    pids: list[int] = []
    stopping = False

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    # before the first fork: a Ctrl-C while the workers start is a stop too, never a traceback
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    # the two signals are blocked across each fork: one that came in between is delivered once the
    # handlers are what they should be (a signal caught by the parent's handler in the child, or
    # replaced before its Python handler ran, was lost there and that worker served on)
    stops = {signal.SIGINT, signal.SIGTERM}
    try:
        for _ in range(count):
            if stopping:
                break
            signal.pthread_sigmask(signal.SIG_BLOCK, stops)
            parent = os.getpid()
            pid = os.fork()
            if pid == 0:  # the worker: SIGTERM is `serve`'s (graceful), SIGINT is the parent's
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                _end_with(parent)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)  # a SIGTERM sent meanwhile ends it here
                if stopping:  # the stop came before the fork (the parent's handler took it)
                    os._exit(0)
                code = 0
                try:
                    work()
                except KeyboardInterrupt:
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
                except BaseException:
                    log.exception("gateway worker failed")
                    code = 1
                os._exit(code)
            pids.append(pid)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)  # what came meanwhile: `forward` knows pid now
            if stopping:  # the signal came between the fork and the append
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        for _pid, raw in _reaped(pids, lambda: stopping):
            code = os.waitstatus_to_exitcode(raw)
            if stopping and code == -signal.SIGTERM:
                code = 0  # still starting, it took the stop we passed on before `serve` handled it: a stop
            if code and not status:
                status = code if code > 0 else 128 - code
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return status
