"""One live tail per session and life, shared by every SSE stream of it in this process.

A thousand viewers of fifty sessions cost fifty XREAD BLOCK connections, not a thousand: each
`_Hub` follows one (session id, incarnation) — with `live.follow` (a dropped connection retried
and resumed without gap), or for ``?deltas=1`` streams with `live.follow_live` (entries and the
live stream's records, resumed after the last of each) — and hands every entry, its JSON encoded
once, and every live record to its subscribers. What a reader is owed of the live records is
decided by each reader (`streaming.LiveReader`), as for a reader of its own.

The rules a subscriber keeps, so sharing changes nothing it delivers:

- it joins with the n it needs next (after reading its own backlog); an entry the hub delivered
  before the join is read from the store (`Joined.behind`), an entry it already has is skipped,
  and a gap (never expected) is filled by a read: every entry once, in order;
- the hub never waits for a subscriber. Each has a bounded queue; one that falls `QUEUE` entries
  or `QUEUE_BYTES` behind is detached (`Subscriber.lagged`) and catches up from the store on its
  own before it joins again, so a slow client slows no one else and nothing buffers without
  bound (the queues share the entries: a hub holds at most its slowest reader's window);
- the hub's end is every subscriber's end, said once: deleted (`END`), replaced by another life
  (`REPLACED`) or a corrupt log (a `SessionError`); a hub that ended leaves the registry at
  once, so a later stream of a new life gets a new hub.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import SessionError, SessionNotFoundError, SessionReplacedError, SessionRewoundError
from ..live import follow, follow_live
from ..model import Entry
from ..projection.chunks import LiveRecord
from ..store import SessionStore
from .common import _json, log

END: Final = "end"
REPLACED: Final = "replaced"

Item = tuple[Entry, bytes] | LiveRecord | str | SessionError
"""What a subscriber receives: an entry with its JSON, a live record (``?deltas=1`` hubs), or how
the tail ended."""


def stop(task: asyncio.Task[None] | None) -> None:
    """Cancel `task`, again every 50 ms until it is done. One cancellation can be lost: on
    Python 3.11 `asyncio.wait_for` (redis-py's socket timeout around a read) returns the result
    when it lands as the cancellation does, and the loop goes on for ever, holding its pooled
    connection (a gateway whose readers hung up would end with none left)."""
    if task is None or task.done():
        return
    task.cancel()
    loop = task.get_loop()

    def again() -> None:
        if not task.done():
            task.cancel()
            loop.call_later(0.05, again)

    loop.call_later(0.05, again)


def _size(item: Item) -> int:
    if isinstance(item, tuple):
        return len(item[1])
    if isinstance(item, LiveRecord):
        return len(item.text) + 64
    return 0


@dataclass(eq=False)
class Subscriber:
    send: MemoryObjectSendStream[Item]
    receive: MemoryObjectReceiveStream[Item]
    lagged: bool = False  # detached for falling behind: catch up from the store, then join again
    pending: int = 0  # bytes handed and not yet taken (`taken`)

    async def take(self) -> list[Item] | None:
        """Whatever is queued (waiting for at least one item); None once the queue is closed
        (the hub ended, or detached this subscriber: see `lagged`)."""
        try:
            items = [await self.receive.receive()]
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return None
        while True:
            try:
                items.append(self.receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        self.pending -= sum(_size(item) for item in items)
        return items


@dataclass(eq=False)
class _Hub:
    key: tuple[str, str, bool]  # session id, incarnation, with the live stream's records
    next: int  # the n of the next entry it will hand out
    cursor: str  # the id of the last live record it handed out (live hubs)
    subscribers: set[Subscriber] = field(default_factory=set)
    task: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class Joined:
    subscriber: Subscriber
    behind: int  # the hub's next n at the join: entries from the subscriber's n up to it are read
    cursor: str  # the hub's last live record at the join: records after the subscriber's, up to it


class Tails:
    """The shared tails of one gateway process, and what they hold of the store's pool."""

    QUEUE = 4096  # entries a subscriber may be behind before it is detached to catch up alone
    QUEUE_BYTES = 16 << 20  # … or bytes of events

    def __init__(self, store: SessionStore, connection_limit: int | None) -> None:
        self.store = store
        self.connection_limit = connection_limit
        self._hubs: dict[tuple[str, str, bool], _Hub] = {}
        self._reserved: dict[Hashable, int] = {}  # what holds a connection -> its streams

    def reserve(self, holder: Hashable) -> bool:
        """Count a stream before its first await: `holder` names the tail it will share (see
        `holder`), or is a key of its own for a stream that follows alone. False when it would
        need one more connection than the pool can spare (the caller answers 503)."""
        users = self._reserved.get(holder, 0)
        if users == 0 and self.connection_limit is not None and len(self._reserved) >= self.connection_limit:
            return False
        self._reserved[holder] = users + 1
        return True

    def release(self, holder: Hashable) -> None:
        users = self._reserved.get(holder, 0) - 1
        if users <= 0:
            self._reserved.pop(holder, None)
        else:
            self._reserved[holder] = users

    @property
    def connections(self) -> int:
        """The sessions with a tail held or reserved (each is at most one pooled connection)."""
        return len(self._reserved)

    @staticmethod
    def holder(session_id: str, live: bool) -> Hashable:
        """What the streams of one tail share in `reserve`: one connection per session and kind."""
        return (session_id, live)

    @contextlib.contextmanager
    def join(self, session_id: str, incarnation: str, nxt: int, cursor: str | None = None) -> Iterator[Joined]:
        """Subscribe to the tail of `session_id`'s life `incarnation` — with the live stream's
        records after `cursor` when one is given — started at (`nxt`, `cursor`) if none runs. No
        await between reading the hub's position and subscribing: every item the hub hands out
        after (`behind`, `cursor`) reaches this subscriber."""
        key = (session_id, incarnation, cursor is not None)
        hub = self._hubs.get(key)
        if hub is None:
            hub = self._hubs[key] = _Hub(key, nxt, cursor or "0-0")
            hub.task = asyncio.get_running_loop().create_task(self._run(hub))
        send, receive = anyio.create_memory_object_stream[Item](self.QUEUE)
        sub = Subscriber(send, receive)
        hub.subscribers.add(sub)
        try:
            yield Joined(sub, hub.next, hub.cursor)
        finally:
            hub.subscribers.discard(sub)
            send.close()
            receive.close()
            if not hub.subscribers and self._hubs.get(key) is hub:
                del self._hubs[key]
                stop(hub.task)

    async def _run(self, hub: _Hub) -> None:
        """Follow the hub's session (`live.follow`, or `live.follow_live` for a ``?deltas=1``
        hub: entries and the live stream's records) and hand out what comes; a dropped
        connection is retried and resumed after the last entry and record handed out."""
        session_id, incarnation, live = hub.key

        def on_retry(exc: BaseException, wait: float, at: int) -> None:
            log.warning("tail of %r dropped (%s); resuming at n=%d in %.2fs", session_id, exc, at, wait)

        end: Item = END
        try:
            tail: AsyncGenerator[Entry | LiveRecord, None] = (
                follow_live(self.store, session_id, hub.next, live_after=hub.cursor, incarnation=incarnation,
                            on_retry=on_retry)
                if live
                else follow(self.store, session_id, hub.next, on_retry=on_retry, incarnation=incarnation)
            )  # fmt: skip
            async with contextlib.aclosing(tail) as got:
                async for e in got:
                    if isinstance(e, LiveRecord):
                        hub.cursor = e.id
                        item: Item = e
                    else:
                        hub.next = e.n + 1
                        item = (e, _json.encode(e))
                    for sub in list(hub.subscribers):
                        self._hand(hub, sub, item, self.QUEUE_BYTES)
        except SessionReplacedError:
            end = REPLACED
        except SessionNotFoundError:
            end = END
        except SessionRewoundError as exc:  # each subscriber decides what it means for it
            log.warning("tail of %r: %s", session_id, exc)
            end = exc
        except SessionError as exc:
            log.exception("tail of %r failed", session_id)
            end = exc
        except Exception as exc:  # never leave subscribers waiting on a dead hub
            log.exception("tail of %r failed", session_id)
            end = SessionError(f"the live tail failed: {type(exc).__name__}")
        self._finish(hub, end)

    def _finish(self, hub: _Hub, end: Item) -> None:
        if self._hubs.get(hub.key) is hub:
            del self._hubs[hub.key]  # a stream arriving now starts a new tail (of a new life)
        for sub in list(hub.subscribers):
            self._hand(hub, sub, end, None)
            sub.send.close()

    @staticmethod
    def _hand(hub: _Hub, sub: Subscriber, item: Item, max_bytes: int | None) -> None:
        try:
            if max_bytes is not None and sub.pending > max_bytes:
                raise anyio.WouldBlock
            sub.send.send_nowait(item)
            sub.pending += _size(item)
        except anyio.WouldBlock:
            # too far behind: detached, it reads what it missed from the store and joins again
            sub.lagged = True
            hub.subscribers.discard(sub)
            sub.send.close()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            hub.subscribers.discard(sub)


Notification = tuple[dict[str, Any], bytes]
"""A store notification (``{event, session, parent, ...}``) and its SSE frame, encoded once."""


SUBSCRIBED: Final = "subscribed"
DROPPED: Final = "dropped"
"""What a notification source yields besides notifications: its subscription is (again) in place,
or it dropped (what is published until it is made again is lost)."""


class Notifications:
    """The store's notifications (``GET /events``): one subscription per gateway process, shared
    by every stream of them, as a session's streams share its tail. It holds one pooled
    connection (counted in `Tails` as `HOLDER`) however many viewers are open; it starts with the
    first stream and stops with the last.

    A stream opens once the subscription is in place (`ready`), so whatever is published after
    it opened reaches it, or it ends: one that falls `QUEUE` notifications behind is ended (its
    browser reconnects and re-reads the list), so a slow client slows no one, and when the
    subscription drops every open stream is ended so (a stream that stayed open would miss what
    is published until the subscription is made again, silently)."""

    QUEUE = 1024
    HOLDER: Final = ("store-events",)

    def __init__(self, source: Callable[[], AsyncIterator[dict[str, Any] | str]]) -> None:
        self._source = source
        self._subscribers: set[MemoryObjectSendStream[Notification]] = set()
        self._task: asyncio.Task[None] | None = None
        self._live = anyio.Event()
        self._waiting: set[MemoryObjectSendStream[Notification]] = set()  # joined, not yet open

    @contextlib.contextmanager
    def join(self) -> Iterator[MemoryObjectReceiveStream[Notification]]:
        """A queue of the notifications published from now on, once `ready` said the
        subscription is in place; until then a drop does not end it (nothing was promised yet)."""
        send, receive = anyio.create_memory_object_stream[Notification](self.QUEUE)
        self._subscribers.add(send)
        self._waiting.add(send)
        if self._task is None or self._task.done():
            self._live = anyio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            yield receive
        finally:
            self._subscribers.discard(send)
            self._waiting.discard(send)
            send.close()
            receive.close()
            if not self._subscribers:
                stop(self._task)
                self._task = None

    async def ready(self, within: float) -> bool:
        """Wait until the subscription is in place, at most `within` seconds (across drops and
        subscribing again): whether it is. From then on, the joined queue ends at a drop."""
        with anyio.move_on_after(within):
            while not self._live.is_set():
                await self._live.wait()  # a drop replaces the event: wait on the new one
        if not self._live.is_set():
            return False
        self._waiting.clear()  # every stream waiting is open now (no await since the check)
        return True

    async def _run(self) -> None:
        try:
            async for event in self._source():
                if event == SUBSCRIBED:
                    self._live.set()
                    continue
                if not isinstance(event, dict):  # dropped: every open stream has a gap now
                    live, self._live = self._live, anyio.Event()
                    live.set()  # wakes the waiters of `ready`, which wait on the new one
                    for send in list(self._subscribers - self._waiting):
                        send.close()
                    self._subscribers &= self._waiting
                    continue
                name = str(event.get("event")).encode()
                data = _json.encode({k: v for k, v in event.items() if k != "event"})
                item = (event, b"event: %b\ndata: %b\n\n" % (name, data))
                for send in list(self._subscribers):
                    try:
                        send.send_nowait(item)
                    except anyio.WouldBlock:  # too far behind: its stream ends
                        self._subscribers.discard(send)
                        send.close()
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        self._subscribers.discard(send)
        except Exception:  # never leave streams waiting on a dead subscription
            log.exception("the store's notifications failed")
        for send in list(self._subscribers):
            send.close()
