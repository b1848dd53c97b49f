"""What the adapters share: one session's log, read incrementally and appended with expected n,
always on the one life of the id that the adapter object belongs to.

`SessionLog` keeps the n it has folded up to. Reads fetch only the entries after it; writes go
through `store.put(session_id, n, entries)` and, on a conflict (another writer appended first),
catch up and rebuild the entries from the fresh state before retrying, so no write is ever lost
or interleaved silently. The session is created on the first write (reads of a missing session
see an empty log and create nothing).

**One session reference** (docs/design.md): a log pins the incarnation of the id it first sees
(the life it reads, or the one its first write creates) in a `Life`, shared by every log of one
adapter object (one per event loop), and passes it on every read and write, so the store refuses
another life atomically: once the id was deleted and created again (by anyone but this object),
every read and write raises `SessionReplacedError`, however long the new life is. A life that
ended with nothing in its place (deleted, or an ephemeral session that expired) reads as empty,
and the next write creates a new life that this object then belongs to; a life created by
someone else meanwhile is refused.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import Any, NamedTuple, TypeVar

import anyio
import msgspec
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from ..errors import (
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionNotFoundError,
    SessionReplacedError,
    StoreUnavailableError,
)
from ..keys import validate_session_id
from ..model import Entry, NewEntry, SessionHead, SessionHeader
from ..redis.wire import socket_timeout
from ..retry import conflict_backoff
from ..store import SessionStore
from ._loops import LoopStores

#: Attempts of one write under contention before the last conflict is raised.
MAX_ATTEMPTS = 100
#: Pauses (seconds) before re-sending a write whose reply was lost, with its idempotency key;
#: the last one repeats until the store's socket timeout (`resend_window`) has passed.
LOST_REPLY_PAUSES = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0)
#: The resend window when the store does not say its socket timeout (seconds), and its cap.
DEFAULT_RESEND_WINDOW = 10.0
MAX_RESEND_WINDOW = 30.0

T = TypeVar("T")
_encode = msgspec.json.Encoder()


def resend_window(store: Any) -> float:
    """How long (seconds) a write whose reply was lost is re-sent: the store's socket timeout
    (a redis-py client's), else `DEFAULT_RESEND_WINDOW`; at most `MAX_RESEND_WINDOW`."""
    client = getattr(store, "client", None)
    timeout = socket_timeout(client) if isinstance(client, (aioredis.Redis, RedisCluster)) else None
    if timeout is None or timeout <= 0:
        return DEFAULT_RESEND_WINDOW
    return float(min(timeout, MAX_RESEND_WINDOW))


async def resend(store: Any, call: Callable[[], Awaitable[T]], what: str) -> T:
    """`call()`, re-sent after each lost reply (`StoreUnavailableError`) until the store's
    timeout has passed; then the last error, saying that `what` may have landed."""
    deadline = time.monotonic() + resend_window(store)
    for i in range(1_000_000):
        try:
            return await call()
        except StoreUnavailableError as e:
            pause = LOST_REPLY_PAUSES[min(i, len(LOST_REPLY_PAUSES) - 1)]
            if time.monotonic() + pause > deadline:
                raise StoreUnavailableError(
                    f"{e} ({what} may have landed: retry the same call on the same object, which "
                    "re-sends it with its idempotency key, so it lands once)"
                ) from e
            await anyio.sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover


def batch_key(nonce: str, incarnation: str, n: int, entries: Sequence[NewEntry]) -> str:
    """The idempotency key of a write: a function of the writing object (`nonce`), the life and
    the n it is appended at, and its content, so a caller's retry of the same call is the same
    write (and two objects writing equal entries at one n are not)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{nonce}|{incarnation}|{n}|".encode())
    h.update(_encode.encode([(e.type, e.data, e.meta, e.surface, e.time) for e in entries]))
    return h.hexdigest()


class _Pending(NamedTuple):
    """A write whose outcome is unknown (its reply was lost until the resends gave up)."""

    incarnation: str
    n: int
    entries: Sequence[NewEntry]
    key: str


def resolve_store(store_or_sessions: Any) -> SessionStore:
    """A `SessionStore`, given a store or a `Sessions` service (anything with a `.store`)."""
    inner = getattr(store_or_sessions, "store", None)
    store = inner if inner is not None and hasattr(inner, "put") else store_or_sessions
    for attr in ("head", "read", "put", "create"):
        if not callable(getattr(store, attr, None)):
            raise TypeError(f"expected a SessionStore or a Sessions, got {type(store_or_sessions).__name__}")
    return store  # type: ignore[no-any-return]


class Life:
    """The life (incarnation) of a session id that one adapter object belongs to: None until the
    object first sees one; then only a create by this object moves it (onto the life it made).
    Shared by logs on several threads without a lock (an async path never waits on one): the
    first pin is a ``dict.setdefault``, atomic in CPython."""

    __slots__ = ("_pin",)

    def __init__(self, incarnation: str | None = None) -> None:
        self._pin: dict[str, str] = {} if incarnation is None else {"life": incarnation}

    @property
    def incarnation(self) -> str | None:
        return self._pin.get("life")

    def adopt(self, incarnation: str) -> str:
        """Pin `incarnation` unless a life is pinned already; the pinned one."""
        return self._pin.setdefault("life", incarnation)

    def created(self, incarnation: str) -> None:
        """This object created `incarnation` (the life it belonged to had ended): it is its now."""
        self._pin["life"] = incarnation


class SessionLog:
    """One session's log as an adapter sees it: `fold` is called with every entry in order
    (contiguous n from 0), `reset` when the folded state must be dropped (the life it was folded
    from ended), after which everything is folded again from 0.

    `store` is a `SessionStore`, or a `LoopStores` (then each call uses the store of the running
    event loop). `life` is shared by the logs of one adapter object (see the module docstring);
    each log gets a `Life` of its own by default. Reads and writes raise `SessionReplacedError`
    once the id names another life than the pinned one."""

    def __init__(
        self,
        store: SessionStore | LoopStores,
        session_id: str,
        *,
        origin: Any,
        fold: Callable[[Sequence[Entry]], None],
        reset: Callable[[], None],
        mark_types: Iterable[str] = (),
        ttl_ms: int | None = None,
        life: Life | None = None,
    ) -> None:
        self._stores = store if isinstance(store, LoopStores) else None
        self._store: SessionStore = store.store if isinstance(store, LoopStores) else store
        self.ttl_ms = ttl_ms
        self.session_id = validate_session_id(session_id)
        self.life = Life() if life is None else life
        self.n = 0
        self._origin = origin
        self._fold = fold
        self._reset = reset
        self._exists = False
        self._of: str | None = None  # the life the folded state is of (None: nothing folded yet)
        self._nonce = uuid.uuid4().hex  # this log's part of its writes' idempotency keys
        self._pending: _Pending | None = None
        self._unfinished: tuple[str, list[Any], int] | None = None  # see `append`
        vocabulary = self._store.vocabulary
        for t in mark_types:
            # The adapter's own mark types, registered as "any JSON object" so a strict
            # vocabulary accepts them; a schema someone defined already is left alone.
            if t not in vocabulary:
                vocabulary.define(t, None)

    @property
    def store(self) -> SessionStore:
        """The store to use now (on the running loop, given a `LoopStores`)."""
        return self._store if self._stores is None else self._stores.get()

    @property
    def incarnation(self) -> str | None:
        """The life of the id this log belongs to (None until it first sees one)."""
        return self.life.incarnation

    @property
    def max_batch(self) -> int:
        return self._store.max_batch

    def _restart(self) -> None:
        self.n = 0
        self._reset()

    def _align(self) -> str | None:
        """The pinned life, with the folded state made of it: another log of the same object may
        have moved the pin onto a life it created (the state of the ended one is dropped)."""
        pin = self.life.incarnation
        if self._of != pin:
            if self._of is not None:
                self._restart()
                self._exists = False
            self._of = pin
        return pin

    def _ended(self) -> None:
        """The pinned life is gone and nothing took its place: nothing of it remains."""
        self._restart()
        self._exists = False

    def _replaced(self, detail: str = "") -> SessionReplacedError:
        return SessionReplacedError(
            self.session_id, detail or f"this object belongs to incarnation {self.life.incarnation}"
        )

    async def catch_up(self) -> None:
        """Fold the entries other writers appended since we last looked (`SessionReplacedError`
        when the id names another life now)."""
        store = self.store
        pin = self._align()
        if pin is None:
            head = await store.head(self.session_id)
            if head is None:
                self._exists = False
                return
            pin = self.life.adopt(head.header.incarnation)
            self._align()
        try:
            entries = await store.read(self.session_id, self.n, incarnation=pin)
        except SessionReplacedError:
            raise self._replaced() from None
        except SessionNotFoundError:
            if self.n:
                self._ended()
            self._exists = False
            return
        self._exists = True
        if entries:
            self._apply(entries)

    def _apply(self, entries: Sequence[Entry]) -> None:
        self._fold(entries)
        self.n = entries[-1].n + 1

    async def _ensure_exists(self, store: SessionStore) -> str:
        """The pinned life, after creating one (owned by this object) if none exists."""
        pin = self._align()
        if self._exists and pin is not None:
            return pin
        header = SessionHeader(id=self.session_id, origin=self._origin)
        for _ in range(MAX_ATTEMPTS):
            lost = False

            async def create() -> SessionHead:
                nonlocal lost
                try:
                    return await store.create(header, ttl_ms=self.ttl_ms)
                except StoreUnavailableError:
                    lost = True  # it may have landed: a re-send may find our own create
                    raise

            try:
                created = await resend(store, create, "the session's creation")
            except SessionAlreadyExistsError:
                head = await store.head(self.session_id)
                if head is None:
                    continue  # gone again (or hidden): try to create it once more
                current = self.life.incarnation
                if current is None:
                    current = self.life.adopt(head.header.incarnation)
                elif lost and head.n == 0 and head.header.incarnation != current:
                    # the reply of our create was lost and the id holds an empty life: ours
                    # (or one created at that instant, with nothing in it yet)
                    current = head.header.incarnation
                    self.life.created(current)
                if head.header.incarnation != current:
                    raise self._replaced("created again by another writer after this object's life ended") from None
            else:
                # The life this object belonged to had ended (or it had none): the one it created
                # is its own now, with an empty log.
                current = created.header.incarnation
                self.life.created(current)
            self._align()
            self._exists = True
            return current
        raise self._replaced("the id kept being deleted and created again")

    async def write(self, build: Callable[[], Sequence[NewEntry]], *, fresh: bool) -> list[Entry]:
        """Append what `build()` returns (called again after each conflict, against the caught-up
        state) at the current n, on the pinned life (`SessionReplacedError` on another one).
        `fresh` catches up first (for entries that depend on the log); otherwise the first
        attempt is optimistic. An empty build writes nothing.

        A write whose reply stayed lost raises `StoreUnavailableError` (it may have landed) and
        is remembered: the caller's retry of the same call (the same entries, built on the same
        state) re-sends it at its n with its key, so it lands once (a pop pops once)."""
        retried = await self._retry_pending(build)
        if retried is not None:
            return retried
        if fresh:
            await self.catch_up()
        store = self.store
        last: Exception | None = None
        for attempt in range(MAX_ATTEMPTS):
            self._align()
            entries = build()
            if not entries:
                return []
            pin = await self._ensure_exists(store)
            try:
                stored = await self._put(store, pin, self.n, entries)
            except SessionReplacedError:
                raise self._replaced("nothing was written") from None
            except SessionConflictError as e:
                last = e
                await self.catch_up()
                await conflict_backoff(attempt, base=0.0005, cap=0.05)
                continue
            except SessionNotFoundError as e:
                last = e  # the life ended since we looked: the next attempt starts a new one
                self._ended()
                continue
            self._apply(stored)
            return stored
        assert last is not None
        raise last

    async def append(self, entry_type: str, datas: Sequence[Any]) -> None:
        """Append one `entry_type` entry per item of `datas`, in order, one expected-n write per
        store batch. When a batch fails after earlier ones landed, the call is remembered: the
        caller's retry of it (the same items) goes on from the batch that failed (re-sent as
        that write, see `write`), so the batches that landed are not written again."""
        items = list(datas)
        step = self.max_batch
        start = 0
        unfinished, self._unfinished = self._unfinished, None
        if unfinished is not None and unfinished[0] == entry_type and unfinished[1] == items:
            start = unfinished[2]
        for lo in range(start, len(items), step):
            chunk = [NewEntry(entry_type, d) for d in items[lo : lo + step]]
            try:
                await self.write(partial(list, chunk), fresh=False)
            except StoreUnavailableError:
                self._unfinished = (entry_type, items, lo)
                raise

    async def _retry_pending(self, build: Callable[[], Sequence[NewEntry]]) -> list[Entry] | None:
        """The caller's retry of the write whose outcome is unknown: re-sent as it was (the
        entries, n and key it was made with); None when this call is another write (or the
        pending one was refused: then it did not land, and this call is an ordinary write)."""
        pending, self._pending = self._pending, None
        if pending is None or self._align() != pending.incarnation:
            return None
        entries = build()  # on the state it was built on, unless a read folded more since
        if list(entries) != list(pending.entries):
            return None
        store = self.store
        try:
            stored = await self._put(store, pending.incarnation, pending.n, entries)
        except (SessionConflictError, SessionNotFoundError):
            return None  # it never landed, and the log moved on: an ordinary write
        except SessionReplacedError:
            raise self._replaced("nothing was written") from None
        if stored and stored[0].n == self.n:
            self._apply(stored)  # not folded yet (a read that folded it has moved n past it)
        return stored

    async def _put(self, store: SessionStore, pin: str, n: int, entries: Sequence[NewEntry]) -> list[Entry]:
        """One expected-n put on the pinned life. A lost reply (`StoreUnavailableError`: the write
        may have landed) is re-sent as it was, with its key, until the store's timeout: the store
        answers a landed batch with what it wrote, so it lands once; the incarnation still
        refuses another life. When the resends give up, the write is remembered (`write`)."""
        key = batch_key(self._nonce, pin, n, entries)

        async def put() -> list[Entry]:
            return await store.put(self.session_id, n, entries, idempotency_key=key, incarnation=pin)

        try:
            return await resend(store, put, "the write")
        except StoreUnavailableError:
            self._pending = _Pending(pin, n, list(entries), key)
            raise

    async def delete(self) -> bool:
        """Delete the pinned life of the id (the store's delete, guarded by the incarnation):
        `SessionReplacedError` when the id names another life now (nothing is deleted); False
        when nothing is there. An object that never saw a life deletes whichever is there."""
        pin = self._align()
        try:
            deleted = await self.store.delete(self.session_id, incarnation=pin)
        except SessionReplacedError:
            raise self._replaced("nothing was deleted") from None
        self._ended()
        return deleted
