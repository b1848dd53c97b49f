"""The `Sessions` service and the `Session` handle (ChatLuna ``ctx.sessions``, docs/design.md §5).

`Sessions` opens, creates, branches, forks, lists and deletes sessions on any `SessionStore`;
a `Session` is one writer's (or reader's) view of one session:

>>> sessions = await redis_session.connect()
>>> s = await sessions.open("chat-1")                    # reads the head, not the log
>>> await s.append("user/message", {"content": "hi"})    # expected_n = s.n: a stale handle conflicts
>>> await s.commit({"content": "hello!"})                # an assistant message; clears the draft
>>> [m.text for m in await s.messages()]
['hi', 'hello!']

Concurrency, in short:

- every write of a handle carries the handle's `n` as ``expected_n``: if another handle or pod
  appended first, nothing is written and `SessionConflictError` is raised; the handle is left as
  it was, and `Session.refresh()` catches it up. `Session.transact(fn)` runs that loop for you
  (refresh, retry, jittered backoff);
- writes of one handle go through one lock, so tasks sharing a handle never reorder;
- `Session.enqueue` appends at the end whatever n is, for entries that do not depend on the log;
- `Session.lease()` is the cooperative "one writer per session" lock; `Sessions.repair` closes a
  turn whose writer crashed (no live lease).

This module only talks to the `SessionStore` protocol (plus `doctor`'s storage checks, which look
at the Redis stream itself when the store is a `RedisSessionStore`).
"""

from __future__ import annotations

import builtins
import hashlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import msgspec

from .checks import check_incarnation, check_int, check_seconds
from .doctor import DoctorReport, doctor
from .errors import (
    IdempotencyKeyReusedError,
    InvalidArgumentError,
    InvalidEntryError,
    InvalidSessionIdError,
    LeaseHeldError,
    LeaseLostError,
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionError,
    SessionForkError,
    SessionNotFoundError,
    SessionReplacedError,
    StoreUnavailableError,
)
from .keys import MAX_ID_LENGTH, validate_new_session_id, validate_session_id
from .lease import DEFAULT_LEASE_TTL, SessionLease
from .model import (
    CUT,
    MAX_TTL,
    Entry,
    NewEntry,
    NewEntryLike,
    Page,
    SessionHead,
    SessionHeader,
    Surface,
    as_new_entry,
    check_entries,
    check_idempotency_key,
    create_key_digest,
    encode_batch,
    kind_of,
    ttl_ms,
)
from .projection import Message, ProjectionState, check_surface, history, openai_messages
from .projection.chunks import Delta, DeltaGap, LiveRecord, open_answers
from .projection.invariants import Problem, check_invariants, interrupted_turn_closers
from .projection.request import ReconstructedRequest, reconstruct_request
from .retry import conflict_backoff
from .snapshots import SnapshotCache, fold_into, load_projection, read_range
from .store import MemorySessionStore, SessionStore
from .streaming import (
    DEFAULT_FLUSH_INTERVAL,
    DEFAULT_GRACE,
    DEFAULT_HEARTBEAT,
    DEFAULT_LIVE_TTL,
    DEFAULT_MAX_CHUNKS,
    AnswerStream,
    close_dead_answers,
    forgotten_answer_marks,
    tail_deltas,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_EPHEMERAL_TTL = 3600.0
BRANCH_EVENT = "session-branch"
#: An open streamed answer with nothing new on its live stream for this long has a dead writer.
DEFAULT_STALE_ANSWER = 30.0


# --------------------------------------------------------------------------- helpers


def request_digest(kind: str, *fields: Any, entries: Sequence[NewEntryLike] = ()) -> str:
    """16 hex digits naming a keyed create's (or branch's) request: its `kind` and every field
    given (None for one left out), and its first `entries`, so the key's retry with another body
    is known for one (``idempotency_key_reused``), whatever the stored header shows of it (a
    `ttl`, a `created_at` or entries it was not given leave no trace there). Field values are
    hashed as canonical JSON (sorted keys); a value that is no JSON gets a digest of its own, and
    the store refuses it anyway."""
    items: list[Any] = []
    for e in entries:
        try:
            ne = as_new_entry(e)
        except InvalidEntryError:
            items.append(repr(e))  # the store refuses it with its own words
            continue
        surface: Any = ne.surface
        if surface is not None:
            try:  # the surface as stored: one value for its mapping and its Struct forms
                stored = msgspec.convert(surface, Surface) if isinstance(surface, Mapping) else surface
                surface = msgspec.to_builtins(stored)
            except (msgspec.ValidationError, TypeError):
                pass
        items.append([ne.type, ne.data, ne.meta, surface, ne.time])
    try:
        raw = msgspec.json.encode([kind, list(fields), items], order="sorted")
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError):
        raw = repr((kind, fields, items)).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def keyed_create_key(idempotency_key: str | None, digest: str) -> str | None:
    """The ``header.create_key`` of a creation keyed by `idempotency_key` (None: unkeyed):
    ``<create_key_digest(key)>.<request_digest>``, the key and the request it made."""
    if idempotency_key is None:
        return None
    return f"{create_key_digest(idempotency_key)}.{digest}"


def split_create_key(create_key: str | None) -> tuple[str | None, str | None]:
    """(key digest, request digest) of a ``header.create_key``; the request digest is None in one
    written before requests were recorded (the key's digest alone)."""
    if create_key is None:
        return None, None
    key, dot, request = create_key.partition(".")
    return key, request if dot else None


def keyed_session_id(idempotency_key: str, prefix: str = "") -> str:
    """The id a keyed create without one gets: the same for every retry of the request, so the
    retry finds the session its first attempt made (`prefix`: a tenant's)."""
    return f"{prefix}session-{hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]}"


def keyed_child_id(parent: str, idempotency_key: str) -> str:
    """The id a keyed branch or fork without one gets: the same for every retry of the request."""
    return f"{parent}:branch:{hashlib.sha256(idempotency_key.encode()).hexdigest()[:16]}"


def _same_entries(stored: Sequence[Entry], batch: Sequence[NewEntryLike]) -> bool:
    def norm(e: NewEntry) -> tuple[Any, ...]:
        surface = None if e.surface is None else msgspec.to_builtins(msgspec.convert(e.surface, Surface))
        return (e.type, e.data, e.meta, surface)

    def stored_norm(e: Entry) -> tuple[Any, ...]:
        surface = None if e.surface is None else msgspec.to_builtins(e.surface)
        return (e.type, e.data, e.meta, surface)

    news = [as_new_entry(b) for b in batch]
    return len(stored) == len(news) and all(
        stored_norm(s) == norm(b) and (b.time is None or b.time == s.time) for s, b in zip(stored, news, strict=True)
    )


def _meta_dict(meta: object) -> dict[str, Any]:
    if not isinstance(meta, Mapping):
        raise InvalidArgumentError(f"meta must be a mapping, got {type(meta).__name__}")
    return dict(meta)


def _new_session_id() -> str:
    return f"session-{uuid.uuid4().hex}"


def _default_branch_id(parent: str) -> str:
    branch_id = f"{parent}:branch:{uuid.uuid4().hex[:8]}"
    if len(branch_id) > MAX_ID_LENGTH:
        raise InvalidSessionIdError(
            f"the default branch id of {parent[:60]!r}… would be {len(branch_id)} characters "
            f"(the limit is {MAX_ID_LENGTH}): pass an explicit branch_id"
        )
    try:
        return validate_new_session_id(branch_id)
    except InvalidSessionIdError as e:  # a parent created under an older rule (a format character)
        raise InvalidSessionIdError(
            f"{e}; the default branch id copies the parent's: pass an explicit branch_id"
        ) from None


def _is_user_message(e: Entry) -> bool:
    return e.type == "user/message" or (e.type == "message" and e.data.get("role") == "user")


class _TaskLock:
    """A lock the holding task may re-enter, so `Session.transact` can hold a handle's write lock
    across its function while the writes inside it take the lock again. FIFO like `anyio.Lock`."""

    __slots__ = ("_depth", "_lock", "_owner")

    def __init__(self) -> None:
        self._lock = anyio.Lock()
        self._owner: int | None = None
        self._depth = 0

    async def __aenter__(self) -> None:
        me = anyio.get_current_task().id
        if self._owner == me:
            self._depth += 1
            return
        await self._lock.acquire()
        self._owner, self._depth = me, 1

    async def __aexit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()


# --------------------------------------------------------------------------- Session


class Session:
    """A handle on one session: a snapshot at `n` that its own writes move forward.

    Lazy: opening one reads the head only. The projection is loaded on the first `messages()`
    (from the projector's snapshot plus the entries after it) and then kept current by this
    handle's writes and `refresh()` without reading the log again.

    Every write appends with ``expected_n = n``. `SessionConflictError` means another writer got
    there first; nothing was written and this handle is unchanged: `refresh()` and retry (or use
    `transact`). Writes of one handle are serialized by its lock, in call order.

    A handle belongs to one incarnation of its id (``header.incarnation``): once the id is
    deleted and created again (or replaced by an import), its writes, reads and `refresh()`
    raise `SessionReplacedError`; nothing is written to, or read from, the new session.
    """

    def __init__(self, sessions: Sessions, head: SessionHead) -> None:
        self._sessions = sessions
        self._store: SessionStore = sessions.store
        self._header = head.header
        self._n = head.n
        self._last_cut = head.last_cut
        self._state: ProjectionState | None = None
        self._lock = _TaskLock()
        self._lease: SessionLease | None = None

    def __repr__(self) -> str:
        return f"<Session {self.id!r} n={self._n}>"

    # ------------------------------------------------------------------ sync view

    @property
    def id(self) -> str:
        return self._header.id

    @property
    def header(self) -> SessionHeader:
        return self._header

    @property
    def n(self) -> int:
        """The number of entries as this handle last saw them (its writes and `refresh` move it)."""
        return self._n

    @property
    def last_cut(self) -> int | None:
        """The n of the last cut as this handle last saw it (None: none seen)."""
        return self._last_cut

    @property
    def sessions(self) -> Sessions:
        return self._sessions

    # ------------------------------------------------------------------ writes

    async def append(
        self,
        type: str,
        data: Any,
        meta: Any = None,
        surface: Surface | Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> builtins.list[Entry]:
        """Append one entry at this handle's n. Returns the stored entries (one)."""
        return await self._write([NewEntry(type, data, meta, surface)], idempotency_key=idempotency_key)

    async def append_many(
        self, entries: Iterable[NewEntryLike], *, idempotency_key: str | None = None
    ) -> builtins.list[Entry]:
        """Append a batch atomically: `NewEntry` objects, ``(type, data[, meta[, surface]])`` tuples
        or mappings. All or nothing."""
        return await self._write(entries, idempotency_key=idempotency_key)

    async def mark(self, type: str, data: Any, meta: Any = None) -> builtins.list[Entry]:
        """Append a mark (never sent to the model). Message and cut types are refused."""
        if not isinstance(type, str):
            raise InvalidEntryError(f"an entry type is a str, got {builtins.type(type).__name__}")
        kind = kind_of(type)
        if kind != "mark":
            raise InvalidEntryError(f"mark() takes mark types only; {type!r} is a {kind}")
        return await self._write([NewEntry(type, data, meta)])

    async def commit(self, message: Mapping[str, Any] | NewEntry, meta: Any = None) -> builtins.list[Entry]:
        """Append the assistant's message and clear the draft.

        `message` is ``assistant/message`` data (``{content, …}``), a chat message with
        ``role: "assistant"`` (stored as type ``message``), or a `NewEntry` of one of those.
        """
        if isinstance(message, NewEntry):
            entry = message if meta is None else msgspec.structs.replace(message, meta=meta)
        elif isinstance(message, Mapping):
            entry = NewEntry("message" if "role" in message else "assistant/message", dict(message), meta)
        else:
            raise InvalidEntryError(f"commit() takes a message mapping or a NewEntry, got {type(message).__name__}")
        role_ok = entry.type == "assistant/message" or (
            entry.type == "message" and isinstance(entry.data, Mapping) and entry.data.get("role") == "assistant"
        )
        if not role_ok:
            raise InvalidEntryError("commit() takes assistant messages only")
        stored = await self._write([entry])
        try:
            await self._store.set_draft(self.id, None)
        except (StoreUnavailableError, SessionNotFoundError) as e:  # the message landed; a stale draft is cosmetic
            log.warning("clearing the draft of %r failed: %s", self.id, e)
        return stored

    async def compact(
        self,
        before: int,
        summary: Sequence[Mapping[str, Any] | Message],
        reason: str,
        native: Any = None,
        meta: Mapping[str, Any] | None = None,
    ) -> builtins.list[Entry]:
        """Write a `cut`: from now on the projection is `summary` (or a usable `native`) followed by
        the messages of entries with n >= `before`. Entries before it stay in the log.

        `summary` holds chat messages (``{role, content, …}``) or projected `Message` objects.
        """
        if isinstance(summary, (str, bytes, Mapping)) or not isinstance(summary, Iterable):
            raise InvalidEntryError(f"a cut's summary is a list of messages, got {type(summary).__name__}")
        items: builtins.list[Any] = []
        for i, m in enumerate(summary):
            if not isinstance(m, (Message, Mapping)):
                raise InvalidEntryError(f"summary[{i}] must be a message ({{role, content}}), got {type(m).__name__}")
            items.extend(openai_messages([m]) if isinstance(m, Message) else [dict(m)])
        if meta is not None and not isinstance(meta, Mapping):
            raise InvalidEntryError(f"a cut's meta is a mapping, got {type(meta).__name__}")
        data: dict[str, Any] = {"before": before, "summary": items, "reason": reason}
        if native is not None:
            data["native"] = native
        if meta is not None:
            data["meta"] = dict(meta)
        return await self._write([NewEntry(CUT, data)])

    async def enqueue(self, type: str, data: Any, meta: Any = None) -> builtins.list[Entry]:
        """Append at the end of the log *whatever its n* (no conflict, no retry): for entries that
        do not depend on what came before, like an enqueued user input or a mark (docs/design.md §4).

        The handle then stands after the new entry; entries other writers put before it are
        folded into its projection when it has one loaded (one read, only in that case).
        """
        return await self._write([NewEntry(type, data, meta)], expected=False)

    async def transact(
        self,
        fn: Callable[[Session], Awaitable[T]],
        *,
        retries: int = 8,
        base_delay: float = 0.005,
        max_delay: float = 0.5,
    ) -> T:
        """Run ``await fn(self)``; on `SessionConflictError`, sleep (full jitter, doubling from
        `base_delay` up to `max_delay`), `refresh()` and run it again, at most `retries` more times.

        `fn` must rebuild whatever it writes from the refreshed handle (``s.n``, ``await
        s.messages()``…). The handle's write lock is held for the whole call, so other tasks
        sharing this handle wait instead of writing in between; `fn` should write from the calling
        task (a task it spawns that writes to this handle would wait for the lock forever).
        """
        check_int(retries, "retries")
        async with self._lock:
            attempt = 0
            while True:
                try:
                    return await fn(self)
                except SessionConflictError:
                    if attempt >= retries:
                        raise
                await conflict_backoff(attempt, base=base_delay, cap=max_delay)
                attempt += 1
                await self.refresh()

    async def _write(
        self,
        items: Iterable[NewEntryLike],
        *,
        expected: bool = True,
        idempotency_key: str | None = None,
    ) -> builtins.list[Entry]:
        check_entries(items)
        batch = [as_new_entry(item, i) for i, item in enumerate(items)]
        async with self._lock:
            if self._lease is not None:
                self._lease.check()
            first = self._n
            if expected and any(e.surface is not None for e in batch):
                # A surface op is only sound against the surface it was written for: check it
                # against this handle's state at `first`; expected_n makes the put fail if the log
                # has moved since, so the check cannot go stale.
                encoded = encode_batch(
                    batch,
                    self._store.vocabulary,
                    first_n=first,
                    max_entry_bytes=self._store.max_entry_bytes,
                    max_batch=self._store.max_batch,
                )
                check_surface(await self._load_state(), encoded, first)
            stored = await self._store.put(
                self.id,
                first if expected else None,
                batch,
                idempotency_key=idempotency_key,
                incarnation=self._header.incarnation or None,
            )
            await self._advance(stored)
            return stored

    async def _advance(self, stored: Sequence[Entry]) -> None:
        """Move the handle past `stored` (called with the lock held, after a successful put)."""
        if not stored:
            return
        first, last = stored[0].n, stored[-1].n
        if first > self._n:
            # An `enqueue` landed after entries this handle has not seen.
            gap: builtins.list[Entry] = []
            inc = self._header.incarnation or None
            if self._state is not None:
                try:
                    gap = await read_range(self._store, self.id, self._n, first, inc)
                    self._state.extend(gap)
                except Exception:  # the write landed; only the cached projection is lost
                    self._state = None
                    gap = []
                self._see(gap)
            else:
                await self._see_gap(first, last, inc)
            self._n = first
        if first == self._n:
            if self._state is not None:
                try:
                    self._state.extend(stored)
                except ValueError:
                    self._state = None
            self._see(stored)
            self._n = last + 1
        elif last >= self._n:  # an idempotent retry overlapping what we saw: reload lazily
            self._state = None
            self._see(stored)
            self._n = last + 1

    async def _see_gap(self, first: int, last: int, incarnation: str | None) -> None:
        """`last_cut` across entries [n, first) other writers put before our `enqueue` at
        [first, last], without a loaded projection: the header's `last_cut` when it is below
        `first` (or in our own entries, seen after this), else the gap's cuts."""
        try:
            head = await self._store.head(self.id)
            if head is not None and head.header.incarnation == self._header.incarnation:
                if head.last_cut is None or head.last_cut <= last:
                    if head.last_cut is not None and head.last_cut < first:
                        self._last_cut = head.last_cut
                    return
            self._see(await read_range(self._store, self.id, self._n, first, incarnation))
        except Exception:  # the write landed; `refresh()` brings last_cut back
            log.warning("last_cut of %r may be stale after an enqueue", self.id, exc_info=True)

    def _see(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            if e.type == CUT:
                self._last_cut = e.n

    # ------------------------------------------------------------------ reads

    async def _load_state(self) -> ProjectionState:
        """The projection state at this handle's n (lock held by the caller)."""
        state = self._state
        if state is None or state.n != self._n:
            head = SessionHead(header=self._header, n=self._n, updated_at=0, last_cut=self._last_cut)
            state = self._state = await load_projection(self._store, head)
        return state

    async def messages(self) -> builtins.list[Message]:
        """The projection at this handle's n (what the model sees), as `Message` objects."""
        async with self._lock:
            return (await self._load_state()).messages()

    async def history(
        self,
        max_messages: int | None = None,
        max_tokens: int | None = None,
        *,
        estimator: Callable[[Message], int] | None = None,
    ) -> builtins.list[Message]:
        """The longest legal suffix of `messages()` within the caps (see `projection.history`)."""
        return history(await self.messages(), max_messages, max_tokens, estimator=estimator)

    async def read(self, start: int = 0, stop: int | None = None) -> builtins.list[Entry]:
        """Entries [start, stop), stitched for branches; `stop` defaults to this handle's n."""
        check_int(start, "start")
        if stop is not None:
            check_int(stop, "stop")
        return await read_range(
            self._store, self.id, start, self._n if stop is None else stop, self._header.incarnation or None
        )

    async def reconstruct_request(self, at: int) -> ReconstructedRequest:
        """What was sent to the model at entry `at` (0 ≤ at ≤ n): header and messages."""
        check_int(at, "at")
        if at > self._n:
            raise InvalidArgumentError(f"at={at} is beyond this handle's n={self._n}")
        return reconstruct_request(await self.read(0, at), at)

    async def check_invariants(self) -> builtins.list[Problem]:
        """Every broken log invariant of entries [0, n) (reports, never repairs)."""
        return check_invariants(await self.read())

    def tail(self, start: int | None = None) -> AsyncIterator[Entry]:
        """``async for e in s.tail():`` entries from `start` (default: this handle's n at the time
        of the call), then each new one as it lands; ends when the session is deleted. Does not
        move the handle (`refresh()` does). Raises `SessionReplacedError` once the id names another
        incarnation."""
        if not self._header.incarnation:
            return self._store.tail(self.id, self._n if start is None else start)
        return self._store.tail(self.id, self._n if start is None else start, incarnation=self._header.incarnation)

    def tail_deltas(
        self, start: int | None = None, *, live_after: str | None = None
    ) -> AsyncIterator[Entry | Delta | DeltaGap]:
        """`tail`, plus the deltas of streamed answers as they are streamed (`Delta`): a reader
        arriving mid-answer gets the answer so far, then the rest, or a `DeltaGap` naming what the
        live stream no longer holds (see `streaming.tail_deltas`;
        `live.follow_deltas` also survives dropped connections)."""
        return tail_deltas(
            self._store,
            self.id,
            self._n if start is None else start,
            incarnation=self._header.incarnation or None,
            live_after=live_after,
        )

    async def refresh(self) -> int:
        """Catch up with other writers: re-read the head and fold the new entries into the loaded
        projection (if any). Returns the new n.

        Raises `SessionReplacedError` when the id now names another session (deleted and created
        again, or replaced by an import): the handle is not moved onto it; open the id again."""
        async with self._lock:
            head = await self._store.head(self.id)
            if head is None:
                raise SessionNotFoundError(self.id)
            if head.header.incarnation != self._header.incarnation:
                raise SessionReplacedError(self.id)
            try:
                if head.n < self._n:
                    self._state = None  # never expected within one incarnation: reload lazily
                elif self._state is not None and head.n > self._n:
                    await fold_into(self._store, self.id, self._state, head.n, self._header.incarnation or None)
            except BaseException:
                self._state = None
                raise
            self._header, self._n, self._last_cut = head.header, head.n, head.last_cut
            return self._n

    def stream(
        self,
        *,
        turn: int | None = None,
        step: int | None = None,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        live_ttl: float = DEFAULT_LIVE_TTL,
        grace: float = DEFAULT_GRACE,
        heartbeat: float = DEFAULT_HEARTBEAT,
        meta: Mapping[str, Any] | None = None,
    ) -> AnswerStream:
        """``async with s.stream(turn=1, step=1) as w: await w.delta("Hel")`` — stream one
        assistant answer (see `redis_session.streaming`): each delta reaches tailing readers at
        once on the session's live stream and lands in the log packed into ``assistant/chunk``
        rows (every `flush_interval` s or `max_chunks` deltas; a row of fewer than half of
        `max_chunks`, 32 at most, waits for more up to 4 × `flush_interval`); a clean exit appends the
        ``assistant/message`` (refused with `SessionConflictError` when anyone else wrote since
        this handle's n and the answer's own rows), an error or a cancellation an
        ``assistant/interrupted`` mark. Every write goes through the store's answer protocol
        (``lua/answer.lua``), in this handle's life; the writer beats every `heartbeat` seconds
        while quiet, so `repair` never closes it. Write through the handle after the block (the
        handle moves past the answer's rows and message on exit)."""
        return AnswerStream(
            self._store,
            self.id,
            position=lambda: self._n,
            advance=self._absorb,
            incarnation=self._header.incarnation or None,
            turn=turn,
            step=step,
            flush_interval=flush_interval,
            max_chunks=max_chunks,
            live_ttl=live_ttl,
            grace=grace,
            heartbeat=heartbeat,
            meta=None if meta is None else _meta_dict(meta),
        )

    async def _absorb(self, stored: Sequence[Entry]) -> None:
        """Move the handle past entries written outside `_write` (an answer's rows and message)."""
        async with self._lock:
            await self._advance(stored)

    async def draft(self) -> dict[str, Any] | None:
        """The streaming assistant draft other readers can see (None when there is none): the
        open streamed answer so far, else what `set_draft` left. Only this handle's life
        (`SessionReplacedError` once the id was deleted and created again)."""
        return await self._store.get_draft(self.id, incarnation=self._header.incarnation or None)

    async def set_draft(self, draft: Mapping[str, Any] | None) -> None:
        """Publish (or with None, clear) the streaming draft; `commit` clears it. Only into this
        handle's life of the id (`SessionReplacedError` once it is another)."""
        if draft is not None and not isinstance(draft, Mapping):
            raise InvalidArgumentError(f"a draft is a mapping or None, got {type(draft).__name__}")
        await self._store.set_draft(
            self.id, None if draft is None else dict(draft), incarnation=self._header.incarnation or None
        )

    # ------------------------------------------------------------------ lease, repair, branches

    def lease(self, ttl: float = DEFAULT_LEASE_TTL) -> SessionLease:
        """``async with s.lease(ttl=30):`` — hold the session's writer lease (see `SessionLease`)."""
        return SessionLease(self, ttl)

    @property
    def lease_held(self) -> bool:
        return self._lease is not None and self._lease.held

    async def repair(
        self, *, lease_ttl: float = DEFAULT_LEASE_TTL, stale_after: float = DEFAULT_STALE_ANSWER
    ) -> builtins.list[Entry]:
        """Close a turn a crashed writer left open (dsh ``interruptedTurnClosers``): synthetic
        error results for unanswered tool calls, ``step/end``, ``turn/end {interrupted}``.

        Nothing is done while a streamed answer is still live (something new on the live stream
        less than `stale_after` seconds ago). First, every streamed answer whose writer died (open
        on the live stream, nothing new on it for `stale_after` seconds) is closed: the deltas
        the log lacks are packed from the live stream into chunk rows, followed by an
        ``assistant/interrupted`` mark (reason ``crashed``).

        Returns the entries appended ([] when no turn is open). When this handle holds the lease
        the open turn is its own (a restarted writer) and it closes it; otherwise it takes the
        lease for the repair, raising `LeaseHeldError` when a live writer holds it. The append
        uses expected_n, so it never races a writer: on a conflict it re-reads and decides again.
        """
        last_conflict: SessionConflictError | None = None
        stale_ms = round(check_seconds(stale_after, "stale_after", zero=True) * 1000)
        for _ in range(3):
            await self.refresh()
            records = await self._store.read_live(self.id)
            opened = list(open_answers(records))
            if not opened and not interrupted_turn_closers(await self.read()):
                return []
            try:
                if self.lease_held:
                    return await self._repair_now(records, opened, stale_ms)
                token = uuid.uuid4().hex
                life = self._header.incarnation or None
                if not await self._store.acquire_lease(self.id, token, ttl_ms(lease_ttl), incarnation=life):
                    raise LeaseHeldError(f"session {self.id!r} has a live writer (its lease is held): not repairing")
                try:
                    return await self._repair_now(records, opened, stale_ms)
                finally:
                    with anyio.CancelScope(shield=True):
                        await self._store.release_lease(self.id, token)
            except SessionConflictError as e:
                last_conflict = e
        assert last_conflict is not None
        raise last_conflict

    async def _repair_now(
        self, records: Sequence[LiveRecord], opened: Sequence[str], stale_ms: int
    ) -> builtins.list[Entry]:
        """Close the dead answers (the server refuses one whose writer wrote or beat within
        `stale_ms`: then nothing is done), then the open turn."""
        out: builtins.list[Entry] = []
        if opened:
            before = self._n
            marks, alive = await close_dead_answers(
                self._store, self.id, await self.read(), records, opened,
                incarnation=self._header.incarnation or None, stale_ms=stale_ms,
            )  # fmt: skip
            if alive:
                return []  # an answer is still streaming: its writer is alive
            await self.refresh()
            out = await self.read(before, self._n) if marks else []
        entries = await self.read()
        closers = interrupted_turn_closers(entries)
        if closers:
            # answers the protocol can no longer close (their state expired with the live
            # stream): their marks, from the log's rows, land with the closers in one batch
            forgotten = await forgotten_answer_marks(self._store, self.id, entries, stale_ms=stale_ms)
            out.extend(await self._write([*forgotten, *closers]))
        return out

    async def branch(
        self,
        at: int,
        *,
        branch_id: str | None = None,
        delegation_depth: int | None = None,
        title: str | None = None,
        origin: Any = None,
    ) -> Session:
        """`Sessions.branch` of this session, from this handle's life of the id."""
        return await self._sessions.branch(
            self.id, at, branch_id=branch_id, delegation_depth=delegation_depth, title=title, origin=origin,
            incarnation=self._header.incarnation or None,
        )  # fmt: skip

    async def fork(self, boundary: int | None = None, *, fork_id: str | None = None) -> Session:
        """`Sessions.fork` of this session, from this handle's life of the id."""
        return await self._sessions.fork(
            self.id, boundary, fork_id=fork_id, incarnation=self._header.incarnation or None
        )


# --------------------------------------------------------------------------- Sessions


class Sessions:
    """The session service (ChatLuna ``ctx.sessions``) over one `SessionStore`.

    >>> sessions = Sessions(MemorySessionStore())     # or: await redis_session.connect(url)
    >>> s = await sessions.open("chat-1")
    """

    def __init__(
        self,
        store: SessionStore | None = None,
        *,
        ephemeral_ttl: float = DEFAULT_EPHEMERAL_TTL,
        snapshot_cache: SnapshotCache | None = None,
    ) -> None:
        self.store: SessionStore = store if store is not None else MemorySessionStore()
        self.ephemeral_ttl = ephemeral_ttl
        # For readers that load the same sessions again and again (the gateway): decoded
        # snapshots are kept and extended with the log's tail instead of decoded anew.
        self.snapshot_cache = snapshot_cache

    async def aclose(self) -> None:
        await self.store.aclose()

    async def __aenter__(self) -> Sessions:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ lifecycle

    async def open(
        self,
        session_id: str,
        *,
        ephemeral: bool = False,
        ttl: float | None = None,
        title: str | None = None,
        origin: Any = None,
        delegation_depth: int | None = None,
    ) -> Session:
        """A new, independent handle on `session_id`, creating the session if it does not exist.

        The keyword arguments only apply when this call creates it: ``ephemeral=True`` (or a
        `ttl` in seconds) makes every key of the session expire together `ttl` seconds after its
        last write (default `ephemeral_ttl`). Reads the head only.
        """
        validate_session_id(session_id)
        head = await self.store.head(session_id)
        if head is None:
            if ephemeral and ttl is None:
                ttl = self.ephemeral_ttl
            try:
                return await self.create(
                    session_id, title=title, origin=origin, delegation_depth=delegation_depth, ttl=ttl
                )
            except SessionAlreadyExistsError:
                head = await self.store.head(session_id)  # another pod created it first
                if head is None:
                    raise
        return Session(self, head)

    async def create(
        self,
        session_id: str | None = None,
        *,
        title: str | None = None,
        origin: Any = None,
        delegation_depth: int | None = None,
        ttl: float | None = None,
        entries: Sequence[NewEntryLike] = (),
        created_at: int | None = None,
        idempotency_key: str | None = None,
    ) -> Session:
        """Create a session (id default ``session-<uuid hex>``), optionally with seed `entries`.
        `ttl` (seconds) makes it ephemeral; `created_at` (ms) is kept as given (default: the
        store's clock, as ChatLuna's header takes the caller's). `SessionAlreadyExistsError` if
        the id is taken. `idempotency_key` is recorded with the creation (``header.create_key``,
        `keyed_create_key`: a digest of the key and one of every argument but the id), so a retry
        can tell its own creation from another request's, and the key's reuse for another one."""
        if created_at is not None:
            check_int(created_at, "created_at")
        digest = ""
        if idempotency_key is not None:
            check_entries(entries)
            entries = entries if isinstance(entries, (list, tuple)) else list(entries)
            ms = None if ttl is None else ttl_ms(ttl)  # 60 and 60.0 are one request
            digest = request_digest("create", title, origin, delegation_depth, ms, created_at, entries=entries)
        check_idempotency_key(idempotency_key)
        if session_id is None:
            session_id = _new_session_id() if idempotency_key is None else keyed_session_id(idempotency_key)
        header = SessionHeader(
            id=session_id,
            title=title,
            origin=origin,
            delegation_depth=0 if delegation_depth is None else delegation_depth,
            created_at=created_at or 0,
            create_key=keyed_create_key(idempotency_key, digest),
        )
        try:
            head = await self.store.create(header, entries, ttl_ms=None if ttl is None else ttl_ms(ttl))
        except SessionAlreadyExistsError as taken:
            if idempotency_key is None:
                raise
            head = await self._replayed_create(header, idempotency_key, digest, entries, taken)
        return Session(self, head)

    async def _own_creation(self, session_id: str, idempotency_key: str, taken: SessionError) -> SessionHead:
        """The session at the taken id, when this `idempotency_key` created it (a retry whose first
        attempt landed); else `taken`: another request made it, keyed or not."""
        head = await self.store.head(session_id)
        if head is None or split_create_key(head.header.create_key)[0] != create_key_digest(idempotency_key):
            raise taken  # the store's own words (a hidden id names its branches)
        return head

    async def _replayed_create(
        self,
        header: SessionHeader,
        idempotency_key: str,
        digest: str,
        entries: Sequence[NewEntryLike],
        taken: SessionAlreadyExistsError,
    ) -> SessionHead:
        """A keyed create of a taken id: its own creation, when the same key made it with the same
        request (the request digest its `create_key` records: `ttl`, `created_at` and entries
        included, which the header alone cannot tell); `IdempotencyKeyReusedError` when that key
        made it with another; else `taken`."""
        head = await self._own_creation(header.id, idempotency_key, taken)
        h = head.header
        recorded = split_create_key(h.create_key)[1]
        if recorded is not None:
            if recorded != digest:
                raise IdempotencyKeyReusedError(header.id, idempotency_key)
            return head
        # a creation recorded before requests were (the key's digest alone): what its header shows
        same = (h.parent, h.title, h.origin, h.delegation_depth) == (
            None,
            header.title,
            header.origin,
            header.delegation_depth,
        ) and head.n >= len(entries)
        if same and entries:
            same = _same_entries(await self.store.read(header.id, 0, len(entries), incarnation=h.incarnation), entries)
        if not same:
            raise IdempotencyKeyReusedError(header.id, idempotency_key)
        return head

    async def _replayed_branch(
        self,
        child: str,
        parent: str,
        at: int | None,
        idempotency_key: str,
        digest: str,
        taken: SessionError,
    ) -> SessionHead:
        """A keyed branch or fork onto a taken id (or of a parent gone since): the child, when
        this key made it from the same parent at the same point (`at`; None: a fork's default,
        any) with the same fields (`digest`); `IdempotencyKeyReusedError` when that key made
        another; else `taken`."""
        head = await self._own_creation(child, idempotency_key, taken)
        recorded = split_create_key(head.header.create_key)[1]
        if (
            head.header.parent != parent
            or (at is not None and head.header.at != at)
            or (recorded is not None and recorded != digest)
        ):
            raise IdempotencyKeyReusedError(parent, idempotency_key)
        return head

    async def branch(
        self,
        session_id: str,
        at: int,
        *,
        branch_id: str | None = None,
        delegation_depth: int | None = None,
        title: str | None = None,
        origin: Any = None,
        idempotency_key: str | None = None,
        incarnation: str | None = None,
    ) -> Session:
        """A new session holding entries [0, at) of `session_id` (0 ≤ at ≤ its n), then its own.

        Nothing is copied: the child's header names the parent and `at`, and reads stitch, so
        branching a 100 000-entry session costs what branching a 10-entry one does. The child's
        `delegation_depth`, `title` and `origin` are the parent's unless given (ChatLuna's
        ``create(id, {parent, at})`` rule). Default id ``<parent>:branch:<8 hex>``
        (an `InvalidSessionIdError` asks for an explicit `branch_id` when that would be too long).
        Publishes ``session-branch {parent, session, at}`` (pub/sub and change feed, never a log entry).
        `idempotency_key` is recorded with the creation, as for `create` (with `delegation_depth`,
        `title` and `origin` as given).

        The branch is of the parent's life it read (the header its defaults come from), or of
        `incarnation` when given: a parent deleted and created again before, or between the read
        and the link (checked in the store's link step, atomically), raises `SessionReplacedError`
        and nothing is created.
        """
        validate_session_id(session_id)
        check_idempotency_key(idempotency_key)
        if branch_id is None and idempotency_key is not None:
            branch_id = keyed_child_id(session_id, idempotency_key)  # a retry finds its first attempt's
        if branch_id is not None:
            validate_new_session_id(branch_id)  # before any round trip: nothing is read or written
        check_int(at, "at")
        digest = request_digest("branch", delegation_depth, title, origin)  # as given: None inherits
        parent = await self.store.head(session_id)
        if parent is None:
            gone = SessionNotFoundError(session_id)
            if idempotency_key is None or branch_id is None:
                raise gone
            # a retry whose first attempt landed, the parent deleted since (hidden while the child
            # reads it): the child it made, else the parent's absence
            return Session(self, await self._replayed_branch(branch_id, session_id, at, idempotency_key, digest, gone))
        life = parent.header.incarnation or None
        if incarnation is not None and life != incarnation:
            raise SessionReplacedError(session_id, f"it is incarnation {life} now, not {incarnation}: not branched")
        if at > parent.n:
            raise InvalidEntryError(f"branch point at={at} is beyond the parent's n={parent.n}")
        if branch_id == session_id:
            raise SessionAlreadyExistsError(branch_id, "it is the parent's id")
        depth = parent.header.delegation_depth if delegation_depth is None else delegation_depth
        title = parent.header.title if title is None else title
        origin = parent.header.origin if origin is None else origin
        for attempt in range(3):
            child_id = _default_branch_id(session_id) if branch_id is None else branch_id
            header = SessionHeader(
                id=child_id,
                parent=session_id,
                at=at,
                delegation_depth=depth,
                title=title,
                origin=origin,
                create_key=keyed_create_key(idempotency_key, digest),
            )
            try:
                head = await self.store.create(header, parent_incarnation=life)
                break
            except SessionAlreadyExistsError as taken:
                if idempotency_key is not None:
                    head = await self._replayed_branch(child_id, session_id, at, idempotency_key, digest, taken)
                    return Session(self, head)  # replayed: published when it was made
                if branch_id is not None or attempt == 2:
                    raise  # 8 random hex digits colliding three times is not luck
        try:
            await self.store.publish(BRANCH_EVENT, {"parent": session_id, "session": head.id, "at": at})
        except StoreUnavailableError as e:  # the branch exists; a lost notification must not hide that
            log.warning("publishing %s for %r failed: %s", BRANCH_EVENT, head.id, e)
        return Session(self, head)

    async def fork(
        self,
        session_id: str,
        boundary: int | None = None,
        *,
        fork_id: str | None = None,
        idempotency_key: str | None = None,
        incarnation: str | None = None,
    ) -> Session:
        """dsh fork: a child holding the source's entries [0, boundary] (inclusive), where the
        boundary entry must be a ``turn/end`` (default: the last entry; an empty source gives an
        empty child). A branch at boundary + 1 underneath, as cheap as any branch.

        Raises `SessionForkError` with `code` SESSION_NOT_FOUND, SESSION_ALREADY_EXISTS (checked
        before the boundary), INVALID_BOUNDARY (explicit boundary on an empty source, a negative,
        non-integer or bool boundary, or one ≥ n) or OPEN_TURN (the boundary is not a turn/end).
        No child is created on any error. The fork is of the source's life it read (or of
        `incarnation`, when given): one deleted and created again before the child is linked
        raises `SessionReplacedError`.
        """
        validate_session_id(session_id)
        check_idempotency_key(idempotency_key)
        head = await self.store.head(session_id)
        if head is None:
            return await self._fork_of_gone_source(session_id, boundary, fork_id, idempotency_key)
        life = head.header.incarnation or None
        if incarnation is not None and life != incarnation:
            raise SessionReplacedError(session_id, f"it is incarnation {life} now, not {incarnation}: not forked")
        if fork_id is None and idempotency_key is not None:
            fork_id = keyed_child_id(session_id, idempotency_key)  # a retry finds its first attempt's
        if fork_id is not None and await self.store.head(validate_new_session_id(fork_id)) is not None:
            taken = SessionAlreadyExistsError(fork_id)
            if idempotency_key is not None:  # this key's own fork, retried: the same child
                at = None if boundary is None else boundary + 1
                digest = request_digest("branch", None, None, None)  # a fork gives no header field
                try:
                    return Session(
                        self, await self._replayed_branch(fork_id, session_id, at, idempotency_key, digest, taken)
                    )
                except SessionAlreadyExistsError:
                    pass
            raise SessionForkError(f"session {fork_id!r} already exists", "SESSION_ALREADY_EXISTS")
        n = head.n
        last = "none" if n == 0 else str(n - 1)
        if boundary is None:
            at = 0 if n == 0 else n  # empty source: an empty child (dsh)
            check: int | None = None if n == 0 else n - 1
        else:
            if isinstance(boundary, bool) or not isinstance(boundary, int):
                raise SessionForkError(
                    f"invalid fork boundary {boundary!r}: an integer entry n is required (last seq: {last})",
                    "INVALID_BOUNDARY",
                )
            if not 0 <= boundary < n:
                raise SessionForkError(f"invalid fork boundary {boundary} (last seq: {last})", "INVALID_BOUNDARY")
            at, check = boundary + 1, boundary
        if check is not None:
            got = await self.store.read(session_id, check, check + 1, incarnation=life)
            kind = got[0].type if got else "nothing"
            if kind != "turn/end":
                raise SessionForkError(await self._fork_hint(session_id, check, kind), "OPEN_TURN")
        try:
            return await self.branch(
                session_id, at, branch_id=fork_id, idempotency_key=idempotency_key, incarnation=life
            )
        except SessionAlreadyExistsError as e:
            raise SessionForkError(str(e), "SESSION_ALREADY_EXISTS") from e
        except SessionReplacedError:  # deleted and created again under us: not the source it read
            raise
        except SessionNotFoundError as e:  # deleted under us
            raise SessionForkError(str(e), "SESSION_NOT_FOUND") from e

    async def _fork_of_gone_source(
        self, session_id: str, boundary: int | None, fork_id: str | None, idempotency_key: str | None
    ) -> Session:
        """A fork of a source that is not there: SESSION_NOT_FOUND, unless it is a keyed retry whose
        first attempt landed before the source was deleted: the child it made."""
        missing = SessionForkError(f"session {session_id!r} not found", "SESSION_NOT_FOUND")
        if idempotency_key is None:
            raise missing
        child = fork_id if fork_id is not None else keyed_child_id(session_id, idempotency_key)
        at = None if boundary is None else boundary + 1
        digest = request_digest("branch", None, None, None)  # a fork gives no header field
        return Session(self, await self._replayed_branch(child, session_id, at, idempotency_key, digest, missing))

    async def _fork_hint(self, session_id: str, check: int, kind: str, window: int = 1000) -> str:
        """Why a fork at `check` is refused, and the boundary to pass instead (the last turn/end
        among the `window` entries before it), or `branch` when there is none."""
        lo = max(0, check - window)
        ends = [e.n for e in await self.store.read(session_id, lo, check) if e.type == "turn/end"]
        msg = f"fork boundary {check} must be turn/end, got {kind}"
        if ends:
            return f"{msg}: fork({session_id!r}, {ends[-1]}) forks after the last completed turn (entry {ends[-1]})"
        where = "" if lo == 0 else f" in entries {lo}..{check}"
        return f"{msg}, and there is no turn/end{where}: use branch({session_id!r}, at=N) to branch at any entry"

    async def fork_before_user(self, session_id: str, k: int, *, fork_id: str | None = None) -> Session | None:
        """nanobot edit-and-retry: a child holding everything before the `k`-th user message
        (counted from 0 over ``user/message`` entries and ``message`` entries with role user);
        `k` may equal the number of user messages (the child then holds the whole log).

        Returns None, creating nothing, for a negative or non-int `k`, a missing source, or `k`
        above the number of user messages. A taken `fork_id` raises `SessionAlreadyExistsError`.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            return None
        head = await self.store.head(validate_session_id(session_id))
        if head is None:
            return None
        entries = await read_range(self.store, session_id, 0, head.n)
        users = [e.n for e in entries if _is_user_message(e)]
        if k > len(users):
            return None
        at = users[k] if k < len(users) else head.n
        try:
            return await self.branch(session_id, at, branch_id=fork_id)
        except SessionNotFoundError:
            return None

    async def list(self, parent: str | None = None, limit: int = 100, cursor: str | None = None) -> Page[SessionHeader]:
        """Session headers, newest first (only `parent`'s branches when given); page on with `cursor`."""
        return await self.store.list(parent=parent, limit=limit, cursor=cursor)

    async def head(self, session_id: str) -> SessionHead | None:
        """The header and n of a session without loading its log (None when absent)."""
        return await self.store.head(session_id)

    async def delete(self, session_id: str, *, incarnation: str | None = None) -> bool:
        """Delete a session (its live branches keep reading their prefix). False when absent.
        With `incarnation`, only that life of the id (`SessionReplacedError` otherwise, checked
        atomically: nothing is deleted)."""
        check_incarnation(incarnation)
        if incarnation is None:
            return await self.store.delete(session_id)
        return await self.store.delete(session_id, incarnation=incarnation)

    def define(self, type: str, schema: Any = None) -> None:
        """Register an entry type's schema (a msgspec Struct, TypedDict, dataclass … or None for
        any JSON object) on the store's vocabulary; later writes are validated against it."""
        self.store.vocabulary.define(type, schema)

    # ------------------------------------------------------------------ reads and repair

    async def messages(self, session_id: str) -> builtins.list[Message]:
        """The projection of `session_id` at its current n, from the projector's snapshot plus the
        entries after it (a full fold when there is no usable snapshot) — never the log blindly."""
        head = await self.store.head(session_id)
        if head is None:
            raise SessionNotFoundError(session_id)
        return (await load_projection(self.store, head, self.snapshot_cache)).messages()

    async def repair(
        self,
        session_id: str,
        *,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        stale_after: float = DEFAULT_STALE_ANSWER,
        incarnation: str | None = None,
    ) -> builtins.list[Entry]:
        """Repair what a crashed writer left: stale child links (a branch cut short between its two
        steps; see `SessionStore.repair_links`; a deleted session kept only by them is purged),
        then an open turn (see `Session.repair`). Returns the entries appended.

        With `incarnation`, only that life of the id: another one raises `SessionReplacedError`
        before anything is done, and once the repair began every write of it is pinned to the
        life it read (checked by the store with the write)."""
        if incarnation is not None:
            before = await self.store.head(session_id)
            if before is not None and (before.header.incarnation or None) != incarnation:
                raise SessionReplacedError(
                    session_id, f"it is incarnation {before.header.incarnation} now: not repaired"
                )
        removed = await self.store.repair_links(session_id)
        head = await self.store.head(session_id)
        if head is None:
            if removed:
                return []
            raise SessionNotFoundError(session_id)
        if incarnation is not None and (head.header.incarnation or None) != incarnation:
            raise SessionReplacedError(session_id, f"it is incarnation {head.header.incarnation} now: not repaired")
        return await Session(self, head).repair(lease_ttl=lease_ttl, stale_after=stale_after)

    async def doctor(self, session_id: str) -> DoctorReport:
        return await doctor(self.store, session_id)


async def connect(
    url: str | None = None, *, prefix: str = "rs", cluster: bool | None = None, **kwargs: Any
) -> Sessions:
    """The `Sessions` service on Redis: `url`, else ``$REDIS_URL``, else the embedded server."""
    from .redis.connect import open_store

    return Sessions(open_store(url, prefix=prefix, cluster=cluster, **kwargs))


__all__ = [
    "BRANCH_EVENT",
    "MAX_TTL",  # re-exported: it lives in `redis_session.model`
    "DoctorReport",  # re-exported: the doctor lives in `redis_session.doctor`
    "LeaseLostError",
    "Session",
    "SessionLease",  # re-exported: it lives in `redis_session.lease`
    "Sessions",
    "doctor",
    "load_projection",  # re-exported: it lives in `redis_session.snapshots`
]
