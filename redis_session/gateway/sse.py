"""Server-Sent Events: a session's live tail (`_EventStream`), the store-wide notifications
(`_StoreEventStream`), and the bookkeeping they share (open streams, the per-session draft poll)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..errors import (
    SessionError,
    SessionNotFoundError,
    SessionReplacedError,
    SessionRewoundError,
    StoreUnavailableError,
)
from ..live import RETRYABLE
from ..model import Entry
from ..projection.chunks import Delta, DeltaGap, LiveRecord, merge_live
from ..store import SessionStore
from ..streaming import LiveReader, _id_key
from .auth import principal
from .common import _error, _json, log
from .tails import DROPPED, REPLACED, SUBSCRIBED, Notifications, Subscriber, Tails, stop

END_PATIENCE = 2.0
"""Seconds an ended stream's last write may wait behind what its client has yet to read: past
the stopping gateway's patience with a client that took nothing (1 s, `app._Server`), within
uvicorn's graceful stop (3 s)."""


async def _admitted(
    response: Response,
    streams: _Streams,
    tails: Tails,
    holder: Hashable,
    serve: Callable[[Scope, Receive, Send], Awaitable[None]],
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    """Run a stream's `serve` if it is admitted: a HEAD gets the head alone; past the streams'
    cap, or past the connections the pool can spare for followed sessions (`holder` names the
    one it shares, counted before the first await so concurrent requests cannot all slip under),
    503 ``busy``."""
    if scope["method"] == "HEAD":
        await send({"type": "http.response.start", "status": 200, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if streams.full() or not tails.reserve(holder):
        busy = _error(503, "busy", "too many live streams; retry later", {"Retry-After": "5"})
        await busy(scope, receive, send)
        return
    try:
        await serve(scope, receive, send)
    finally:
        tails.release(holder)


class _Streams:
    """The open SSE streams, so a shutting-down server can end them at once instead of waiting
    for clients that never hang up; `limit` caps how many (`create_app(max_streams=)`)."""

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
    """The draft of one session for all its SSE clients: one poller reads it (fast while the
    session is active, backing off to `IDLE` when not) and wakes the clients when it changes, so
    a thousand viewers of one session cost one GET per interval and no task of their own."""

    IDLE = 2.0
    ACTIVE_WINDOW = 10.0  # seconds after the last entry or draft change during which it polls fast

    def __init__(self, store: SessionStore, session_id: str, live: bool, interval: float) -> None:
        self.store, self.session_id, self.interval = store, session_id, interval
        self.live = live  # False: only set_draft's draft (the stream sends deltas itself)
        self.raw = b"null"
        self.version = 0  # bumped on every change; 0: not read yet
        self.gone = False  # the session was deleted
        self.users = 0
        self.active_at = time.monotonic()
        self._changed = anyio.Event()
        self.task: asyncio.Task[None] | None = None

    def poke(self) -> None:
        """An entry landed: poll fast again (an answer may be starting)."""
        self.active_at = time.monotonic()

    async def next(self, seen: int) -> tuple[int, bytes] | None:
        """The draft once its version is past `seen`; None when the session is gone."""
        while self.version <= seen and not self.gone:
            await self._changed.wait()
        return None if self.gone else (self.version, self.raw)

    def _wake(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    async def poll(self) -> None:
        interval = self.interval
        while True:
            try:
                raw = _json.encode(await self.store.get_draft(self.session_id, live=self.live))
            except SessionNotFoundError:
                self.gone = True
                self._wake()
                return
            except StoreUnavailableError:
                await anyio.sleep(self.IDLE)
                continue
            now = time.monotonic()
            if raw != self.raw or self.version == 0:
                self.raw, self.version, self.active_at = raw, self.version + 1, now
                self._wake()
            active = now - self.active_at < self.ACTIVE_WINDOW
            interval = self.interval if active else min(interval * 1.5, self.IDLE)
            await anyio.sleep(interval)


class _Drafts:
    def __init__(self) -> None:
        self.slots: dict[tuple[str, bool], _DraftSlot] = {}

    @contextlib.contextmanager
    def use(self, store: SessionStore, session_id: str, interval: float, live: bool = True) -> Iterator[_DraftSlot]:
        key = (session_id, live)
        slot = self.slots.get(key)
        if slot is None or slot.gone:
            slot = self.slots[key] = _DraftSlot(store, session_id, live, interval)
            slot.task = asyncio.get_running_loop().create_task(slot.poll())
        slot.users += 1
        try:
            yield slot
        finally:
            slot.users -= 1
            if slot.users == 0:
                if self.slots.get(key) is slot:
                    del self.slots[key]
                stop(slot.task)


def _default_stream_limit(store: SessionStore) -> int | None:
    """Each live tail holds one pooled connection in XREAD BLOCK (one per followed session, one
    per ``?deltas=1`` stream, one for every ``/events`` stream together); past the pool's size
    the next command would wait for one, then fail. Keep a margin for the short commands
    (appends, reads, ``/readyz``): a tenth of the pool, at least 4, but at most half of a small
    pool and never none — a pool of 1 has no connection to spare for a stream, one of 2 has one."""
    size = getattr(store, "max_connections", None)
    if isinstance(size, int) and size > 0:
        return size - max(1, min(max(4, size // 10), size // 2))
    return None


# --------------------------------------------------------------------------- SSE


def _event_id(inc: str, n: int, cursor: str | None) -> bytes:
    """``<incarnation>:<n>``, or ``<incarnation>:<n>/<live id>`` once a delta was sent: the resume
    token names the life it belongs to, so a resume into another life is answered ``replaced``."""
    if cursor:
        return b"%b:%d/%b" % (inc.encode(), n, cursor.encode())
    return b"%b:%d" % (inc.encode(), n)


def _entry_event(e: Entry, inc: str, cursor: str | None = None, body: bytes | None = None) -> bytes:
    """An entry's event; `body` is its JSON when already encoded (once, by a shared tail)."""
    return b"id: %b\ndata: %b\n\n" % (_event_id(inc, e.n, cursor), _json.encode(e) if body is None else body)


Write = Callable[[bytes], Awaitable[None]]


async def _flush(write: Write, out: list[bytes]) -> int:
    """Write `out` at once and empty it; the bytes written."""
    if not out:
        return 0
    data = b"".join(out)
    out.clear()
    await write(data)
    return len(data)


class _Pages:
    """How many entries a stream reads from the store at once: few at first, twice as many after
    each page under half of `BYTES`, fewer after one over it. A page is written before the next
    is read, and the server stops taking writes a client does not read, so a reader that stopped
    reading holds about two pages: a fixed page of 1 000 entries near the 1 MiB entry limit held
    a GiB per reader."""

    FIRST, MOST, BYTES = 8, 1000, 1 << 20

    __slots__ = ("size",)

    def __init__(self) -> None:
        self.size = self.FIRST

    def took(self, nbytes: int) -> None:
        if nbytes > self.BYTES:
            self.size = max(1, self.size * self.BYTES // nbytes)
        elif nbytes * 2 < self.BYTES:
            self.size = min(self.MOST, self.size * 2)


# --------------------------------------------------------------------------- SSE deltas (§8.2)

_RESUME = re.compile(r"(?:([0-9A-Za-z_.-]{1,64}):)?(-1|[0-9]{1,15})(?:/([0-9]{1,20}-[0-9]{1,20}))?")


class Resume(msgspec.Struct, frozen=True):
    """A parsed Last-Event-ID: the life it names (None: a plain ``<n>`` of an older release),
    the n to start at and the live cursor (``?deltas=1`` streams)."""

    incarnation: str | None
    start: int
    live_after: str | None


MAX_STREAM_PART = 2**64 - 1
"""Each half of a Redis stream id (``<ms>-<seq>``) is an unsigned 64-bit number."""


def is_stream_id(value: str) -> bool:
    """Whether `value` is ``<ms>-<seq>`` with both halves within 64 bits (what XREAD accepts:
    a larger one was sent to Redis and failed the live tail server-side)."""
    ms, sep, seq = value.partition("-")
    return bool(sep) and all(p.isdigit() and p.isascii() and int(p) <= MAX_STREAM_PART for p in (ms, seq))


def parse_resume(last_id: str) -> Resume | None:
    """``<incarnation>:<n>[/<live id>]`` (or a plain ``<n>[/<live id>]``); None if malformed.

    n is -1 only in the ids this gateway sends for a delta before the session's first entry, and
    those carry a live id: ``<incarnation>:-1`` alone is none of its ids (it was served from n=0)."""
    m = _RESUME.fullmatch(last_id.strip())
    if m is None or (m.group(3) is not None and not is_stream_id(m.group(3))):
        return None
    if m.group(2) == "-1" and m.group(3) is None:
        return None
    return Resume(m.group(1), int(m.group(2)) + 1, m.group(3))


def _delta_event(inc: str, last_n: int, d: Delta) -> bytes:
    body: dict[str, Any] = {"answer": d.answer, "index": d.index, "kind": d.kind, "text": d.text}
    if d.call_id is not None:
        body["callId"] = d.call_id
    if d.name is not None:
        body["name"] = d.name
    return b"event: delta\nid: %b\ndata: %b\n\n" % (_event_id(inc, last_n, d.cursor), _json.encode(body))


def _gap_event(inc: str, last_n: int, g: DeltaGap, cursor: str | None) -> bytes:
    body = {"answer": g.answer, "start": g.start, "stop": g.stop}
    return b"event: gap\nid: %b\ndata: %b\n\n" % (_event_id(inc, last_n, cursor), _json.encode(body))


class _EventStream(Response):
    """One SSE client: the backlog in pages, then the session's shared live tail (`tails.Tails`:
    a dropped store connection is retried and resumed without gap), its shared draft poll and a
    heartbeat.

    All three write straight to the response under one lock. A slow client slows no one else: its
    queue on the shared tail is bounded, and past it the client is detached and catches up from
    the store alone."""

    media_type = "text/event-stream"

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
        incarnation: str | None = None,
        tails: Tails,
        resumed: bool = False,
    ) -> None:
        # not Response.__init__: it would announce a Content-Length of 0
        self.status_code = 200
        # `resumed`: `start` is a Last-Event-ID's, or a ?start= pinned to a life — the reader was
        # given what is before it (a log that ends before it was rolled back); an unpinned
        # ?start= ahead of the log is a fresh tail and just waits for it
        self.resumed = resumed
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.store = store
        self.session_id = session_id
        self.start = start
        self.heartbeat = heartbeat
        self.draft_interval = draft_interval
        self.streams = streams
        self.drafts = drafts
        self._draft_slot: _DraftSlot | None = None  # the session's shared draft poll, poked by entries
        self._last_write = time.monotonic()
        self._incarnation: str | None = incarnation  # the life a resume names (None: the one met first)
        self.deltas = deltas  # `event: delta` too (`_shared_deltas`); drafts then only set_draft's
        self.live_after = live_after
        self.tails = tails  # the process's shared tails: this stream joins its session's
        self._pages = _Pages()  # how many entries it reads from the store at once

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # a shared tail's streams hold one pooled connection between them, a `?deltas=1` stream
        # its own
        held = Tails.holder(self.session_id, self.deltas)
        await _admitted(self, self.streams, self.tails, held, self._serve, scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        lock = anyio.Lock(fast_acquire=True)
        async with anyio.create_task_group() as tg:
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
        with anyio.CancelScope(shield=True), anyio.move_on_after(END_PATIENCE), contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _poke(self) -> None:
        if self._draft_slot is not None:
            self._draft_slot.poke()

    async def _watch_disconnect(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    async def _entries(self, write: Write) -> None:
        try:
            if self.deltas:
                await self._shared_deltas(write, self.tails)
            else:
                await self._shared_tail(write, self.tails)
        except SessionReplacedError:
            # the id was deleted and created again: this stream's session is gone for good
            await write(b"event: replaced\ndata: %b\n\n" % _json.encode({"session": self.session_id}))
        except SessionNotFoundError:
            pass
        except SessionRewoundError as exc:
            # a failover took back entries this stream sent: the browser re-reads the session
            body = {"session": self.session_id, "cursor": exc.cursor, "n": exc.n}
            await write(b"event: rewound\ndata: %b\n\n" % _json.encode(body))
        except SessionError as exc:  # a corrupt log: say so, then end the stream
            log.exception("tail of %r failed", self.session_id)
            await write(b"event: error\ndata: %b\n\n" % _json.encode({"error": type(exc).__name__}))
        await write(b"event: end\ndata: {}\n\n")

    async def _shared_tail(self, write: Write, tails: Tails) -> None:
        """The live part from the session's shared tail (`tails.Tails`): every entry once and in
        order, whatever the hub had handed out before this stream joined (read from the store),
        and after falling behind (detached, caught up from the store, joined again)."""
        nxt = await self._backlog(write)
        delay = 0.05
        while True:
            if self._incarnation is None:  # not there at the start: the same end as a tail's
                return
            inc = self._incarnation
            try:
                with tails.join(self.session_id, inc, nxt) as joined:
                    if joined.behind > nxt:
                        nxt = await self._read_to(write, nxt, joined.behind)
                    nxt, done = await self._drain(write, joined.subscriber, inc, nxt, None)
                    if done:
                        return
                    delay = 0.05
            except RETRYABLE:  # this stream's own reads; the hub retries its own
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)
            nxt = await self._backlog(write, nxt)  # behind (or a read failed): catch up, then join again

    async def _shared_deltas(self, write: Write, tails: Tails) -> None:
        """A ``?deltas=1`` stream on the session's shared live tail. The reader's own
        `LiveReader` decides what it is owed of the live records — those the hub hands out, and
        those it reads itself when it joins behind the hub or catches up after falling behind —
        so it gets what a tail of its own (`follow_deltas`) would: every entry and delta once and
        in the order they happened (`merge_live`, as the hub's tail gives them), a gap where the
        live stream cannot give a delta."""
        sid = self.session_id
        nxt = self.start
        reader: LiveReader | None = None
        delay = 0.05
        while True:
            try:
                head = await self.store.head(sid)  # the log's end, before the records (`_catch_up`)
                records = await self.store.read_live(sid)
                if head is None:
                    return
                if self._incarnation is None:
                    self._incarnation = head.header.incarnation
                elif head.header.incarnation != self._incarnation:
                    raise SessionReplacedError(sid)
                if nxt > head.n and (self.resumed or nxt > self.start):
                    raise SessionRewoundError(sid, nxt, head.n)
                inc = self._incarnation or ""
                if reader is None:
                    # a fresh stream gets no deltas of answers closed in what is stored (their
                    # messages are there); a resume, those after its cursor — its live cursor, or
                    # its n when it names none (a reader that had no delta yet, or a client that
                    # sends back `<inc>:<n>` alone): every answer that ended after that n
                    following = nxt if self.live_after is not None or self.resumed else head.n
                    reader = LiveReader(sid, following, inc or None, self.live_after)
                # (again after falling behind: a stream that no longer holds the cursor says so)
                await self._send_live(write, inc, nxt, reader, reader.prime(records))
                # alone, as far as the log went before the records were read
                nxt = await self._catch_up(write, inc, nxt, head.n, reader, records, exact=False)
                with tails.join(sid, inc, nxt, reader.cursor or "0-0") as joined:
                    if joined.behind > nxt or _id_key(joined.cursor) > _id_key(reader.cursor or "0-0"):
                        # what the hub handed out before the join (those it hands out again are
                        # behind the reader, and skipped): all of it, up to the hub's place
                        upto = _id_key(joined.cursor)
                        more = [r for r in await self.store.read_live(sid, reader.cursor) if _id_key(r.id) <= upto]
                        nxt = await self._catch_up(write, inc, nxt, joined.behind, reader, more, exact=True)
                    nxt, done = await self._drain(write, joined.subscriber, inc, nxt, reader)
                    if done:
                        return
                    delay = 0.05
            except RETRYABLE:  # this stream's own reads; the hub retries its own
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _catch_up(
        self,
        write: Write,
        inc: str,
        nxt: int,
        stop: int,
        reader: LiveReader,
        records: list[LiveRecord],
        *,
        exact: bool,
    ) -> int:
        """Send the entries [`nxt`, `stop`) and the live `records` after the reader's cursor,
        merged in the order they happened (`merge_live`, the tails' own rule), a page of entries
        per write; the n of the next entry owed. `exact`: the records are all there is up to
        the last entry (the hub's place at a join); otherwise later entries may have landed
        before some of them, and the records after the last entry sent wait (read again)."""
        floor = _id_key(reader.cursor or "0-0")
        pending = [r for r in records if _id_key(r.id) > floor]
        while True:
            page: list[Entry] = []
            if nxt < stop:
                page = await self.store.read(self.session_id, nxt, min(stop, nxt + self._pages.size), incarnation=inc)
            last = not page or page[-1].n + 1 >= stop
            if not page and not (exact and pending):
                return nxt
            merged = merge_live(page, pending, more_entries=not (last and exact))
            out: list[bytes] = []
            for item in merged.items:
                if isinstance(item, Entry):
                    out.extend(self._live_events(inc, nxt, reader, reader.entry(item)))
                    out.append(_entry_event(item, inc, self.live_after))
                    nxt = item.n + 1
                else:
                    out.extend(self._live_events(inc, nxt, reader, reader.feed(item)))
            pending = pending[merged.records :]
            if out:
                self._poke()
                self._pages.took(await _flush(write, out))
            if last or not merged.entries:
                return nxt

    async def _drain(
        self, write: Write, sub: Subscriber, inc: str, nxt: int, reader: LiveReader | None
    ) -> tuple[int, bool]:
        """Send what the hub hands `sub` until it ends (True) or detaches `sub` for falling
        behind (False); the n of the next entry owed. What queued up meanwhile goes out in one
        write: a busy session costs a reader one send per wake-up, not one per entry."""
        while (items := await sub.take()) is not None:
            out: list[bytes] = []
            for item in items:
                if isinstance(item, tuple):
                    e, body = item
                    if e.n < nxt:
                        continue
                    if e.n > nxt:  # never expected: filled by a read
                        await _flush(write, out)
                        nxt = await self._read_to(write, nxt, e.n, reader)
                    if reader is not None:
                        out.extend(self._live_events(inc, nxt, reader, reader.entry(e)))
                    out.append(_entry_event(e, inc, self.live_after, body))
                    nxt = e.n + 1
                elif isinstance(item, LiveRecord):
                    if reader is not None and _id_key(item.id) > _id_key(reader.cursor or "0-0"):
                        out.extend(self._live_events(inc, nxt, reader, reader.feed(item)))
                else:
                    await _flush(write, out)
                    if item == REPLACED:
                        raise SessionReplacedError(self.session_id)
                    if isinstance(item, SessionRewoundError) and nxt <= item.n:
                        return nxt, False  # the hub was ahead of the log, not this stream: go on alone
                    if isinstance(item, SessionError):
                        raise item
                    return nxt, True  # deleted
            if out:
                self._poke()
                await _flush(write, out)
        return nxt, not sub.lagged

    def _live_events(self, inc: str, nxt: int, reader: LiveReader, given: Sequence[Delta | DeltaGap]) -> list[bytes]:
        """The events of what a `LiveReader` gave; the stream's cursor moves to the reader's."""
        out = []
        for d in given:
            if isinstance(d, Delta):
                out.append(_delta_event(inc, nxt - 1, d))
            else:
                out.append(_gap_event(inc, nxt - 1, d, d.cursor or reader.cursor))
        self.live_after = reader.cursor
        return out

    async def _send_live(
        self, write: Write, inc: str, nxt: int, reader: LiveReader, given: list[Delta | DeltaGap]
    ) -> None:
        out = self._live_events(inc, nxt, reader, given)
        if out:
            self._poke()
            await _flush(write, out)

    async def _read_to(self, write: Write, nxt: int, stop: int, reader: LiveReader | None = None) -> int:
        inc = self._incarnation or ""
        while nxt < stop:
            page = await self.store.read(self.session_id, nxt, min(stop, nxt + self._pages.size), incarnation=inc)
            if not page:
                break
            out: list[bytes] = []
            for e in page:
                if reader is not None:
                    out.extend(self._live_events(inc, e.n, reader, reader.entry(e)))
                out.append(_entry_event(e, inc, self.live_after))
            self._pages.took(await _flush(write, out))
            nxt = page[-1].n + 1
        return nxt

    async def _backlog(self, write: Write, start: int | None = None) -> int:
        """Send what is already stored from `start` (default: the stream's), a page per write;
        the n the live tail starts at.

        A reconnecting viewer of a long session catches up in a few large reads and writes, not
        one per entry. A store error here is left to the live tail, which retries it."""
        nxt = self.start if start is None else start
        try:
            while True:
                head = await self.store.head(self.session_id)
                if head is None:
                    return nxt
                if self._incarnation is None:
                    self._incarnation = head.header.incarnation  # the session this stream follows
                elif head.header.incarnation != self._incarnation:
                    raise SessionReplacedError(self.session_id)
                if nxt > head.n and (self.resumed or nxt > self.start):
                    raise SessionRewoundError(self.session_id, nxt, head.n)
                if nxt == head.n:
                    return nxt
                page = await self.store.read(
                    self.session_id, nxt, min(head.n, nxt + self._pages.size), incarnation=self._incarnation
                )
                if not page:
                    return nxt
                inc = self._incarnation or ""
                self._pages.took(await _flush(write, [_entry_event(e, inc, self.live_after) for e in page]))
                nxt = page[-1].n + 1
        except RETRYABLE:
            return nxt

    async def _drafts(self, write: Write) -> None:
        """Send the draft when it changes (`_DraftSlot`: one poller per session, shared)."""
        with self.drafts.use(self.store, self.session_id, self.draft_interval, live=not self.deltas) as slot:
            self._draft_slot = slot
            last, seen = b"null", 0
            while (got := await slot.next(seen)) is not None:
                seen, raw = got
                if raw != last:
                    last = raw
                    await write(b'event: draft\ndata: {"draft":%b}\n\n' % raw)

    async def _heartbeats(self, write: Write) -> None:
        while True:
            idle = time.monotonic() - self._last_write
            if idle >= self.heartbeat:
                await write(b": ping\n\n")
                idle = 0.0
            await anyio.sleep(self.heartbeat - idle)


# --------------------------------------------------------------------------- store-wide events


def _store_events_route(
    notifications: Notifications, tails: Tails, heartbeat: float, streams: _Streams
) -> Callable[[Request], Awaitable[Response]]:
    """``GET /events``: the store's notifications as SSE (``event: session-branch`` with
    ``{parent, session, at}``), so a viewer updates its branch tree and session list at once.

    Every stream of them shares one subscription (`notifications`), counted as one connection
    of the pool in `tails`: past what the pool can spare, or past `streams`' cap, a new one
    answers 503 ``busy``. Its streams are ended with the session streams when the server shuts
    down, so a stop with a viewer open is clean instead of a cancelled task's traceback."""

    async def store_events(request: Request) -> Response:
        who = principal(request.scope)
        sees = None if who.prefix is None else who.sees
        return _StoreEventStream(notifications, tails, heartbeat, sees, streams)

    return store_events


async def _store_notifications(store: SessionStore) -> Any:
    """Each notification published on the store's ``{prefix}:events`` channel, as a dict, with
    `SUBSCRIBED` each time the subscription is in place and `DROPPED` where it dropped (what is
    published until it is made again is lost: `Notifications` ends its streams, whose browsers
    reconnect and re-read the list); across dropped connections (resubscribing). Stores without
    pub/sub (memory, cluster) yield `SUBSCRIBED` and nothing more."""
    from redis.asyncio import Redis

    client, keys = getattr(store, "client", None), getattr(store, "keys", None)
    if not isinstance(client, Redis) or keys is None:
        yield SUBSCRIBED
        await anyio.sleep_forever()
        return
    while True:
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(keys.events)
            yield SUBSCRIBED
            async for message in pubsub.listen():
                with contextlib.suppress(msgspec.DecodeError):
                    body = msgspec.json.decode(message["data"])
                    if isinstance(body, dict) and isinstance(body.get("event"), str):
                        yield body
        except RETRYABLE:
            yield DROPPED
            await anyio.sleep(1.0)
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def _registered(scopes: set[anyio.CancelScope]) -> Iterator[list[anyio.CancelScope]]:
    """Yield a list the caller puts its cancel scope in; it leaves `scopes` on the way out."""
    mine: list[anyio.CancelScope] = []
    try:
        yield mine
    finally:
        scopes.difference_update(mine)


class _StoreEventStream(Response):
    """One client of ``/events``: store notifications, with heartbeats."""

    media_type = "text/event-stream"

    def __init__(
        self,
        notifications: Notifications,
        tails: Tails,
        heartbeat: float,
        sees: Callable[[str], bool] | None,
        streams: _Streams,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.notifications = notifications
        self.tails = tails
        self.heartbeat = heartbeat
        self.sees = sees  # a tenant's token: only notifications about its own sessions
        self.streams = streams  # ended with the others on shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _admitted(self, self.streams, self.tails, Notifications.HOLDER, self._serve, scope, receive, send)

    READY_WITHIN = 5.0

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        scopes = self.streams.scopes
        with contextlib.suppress(OSError), _registered(scopes) as mine, self.notifications.join() as got:
            # opened once subscribed: whatever is published after the open reaches it, or it ends
            if not await self.notifications.ready(self.READY_WITHIN):
                down = _error(503, "unavailable", "the store's notifications are unavailable; retry later")
                await down(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with anyio.create_task_group() as tg:
                mine.append(tg.cancel_scope)
                scopes.add(tg.cancel_scope)

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
                async for event, frame in got:
                    if self.sees is not None and not all(
                        self.sees(v) for k, v in event.items() if k in ("session", "parent") and isinstance(v, str)
                    ):
                        continue
                    await body(frame)
                tg.cancel_scope.cancel()  # the subscription ended (too far behind): so does the stream
        with anyio.CancelScope(shield=True), anyio.move_on_after(END_PATIENCE), contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})
