"""nanobot's own persistence seam on a redis-session log: ``SessionManager(workspace, store=…)``.

nanobot 0.3.5 (``pip install nanobot-ai``) takes a ``SessionStore`` (``nanobot/session/manager.py``:
``load``, ``save``, ``delete``, ``read``, ``read_metadata``, ``update_metadata``,
``list_sessions``). `RedisNanobotStore` is that protocol on the store, so nanobot's own
`SessionManager`, `AgentLoop`, consolidation, history and commands run unchanged on Redis::

    from pathlib import Path

    from nanobot.session.manager import SessionManager
    from redis_session.adapters.nanobot_store import RedisNanobotStore

    store = RedisNanobotStore()                       # $REDIS_URL, else the embedded server
    sessions = SessionManager(Path("~/.nanobot/workspace").expanduser(), store=store)
    # AgentLoop(bus=…, provider=…, workspace=…, session_manager=sessions)

**What a save writes** (the log layout is `redis_session.projection.nanobot`): only what changed
since this `Session` object was loaded or last saved, in one ``put`` with the expected n and the
incarnation it was loaded from — new messages as ``message`` entries (the nanobot dict as it is),
a message inserted before others (nanobot's hidden summary checkpoint) with its list index, a
``nanobot/state`` mark for the metadata keys, ``provider_state``, ``updated_at`` that changed,
and a ``cut`` when ``last_archived`` moves (consolidation, idle compaction: the summary becomes
the cut's summary, so ``Session.messages()`` shows what nanobot's prompt shows) or messages go
(``/new``: a cut that hides them; nothing is deleted). ``update_metadata`` appends one
``nanobot/state`` mark wherever the log ends (it commutes with every other write; retried after
a lost reply, it lands once).

**Two pods.** A `Session` object belongs to the life of the id it was loaded from (or created):
a save after that life is gone raises `SessionReplacedError`, nothing written: the object then
holds the new life (deleted and created again), or nothing (just deleted: `NanobotSessionDeleted`,
a `SessionReplacedError`; its next save creates the key anew); a save after
another pod saved the same session raises `NanobotSessionConflict` (a `SessionConflictError`),
nothing written, and the object then holds the stored session (so nanobot's cached session is
never stuck behind the log): reapply, save. Only metadata merges from ``update_metadata`` in
between are folded in and retried by themselves. A save retried after a lost reply lands once
(its idempotency key names the write: life, n, entries).

**Keys.** Any key nanobot takes works: `redis_session.projection.nanobot.key_to_id` maps it to a
session id reversibly (``discord:guild 42`` → ``discord:guild%2042``), the same mapping the
importer uses, so ``redis-session import`` of nanobot's files and this store share sessions.
`list_sessions` lists the sessions whose header says ``origin.format == "nanobot"``, each under
the key that loads it (`redis_session.projection.nanobot.listed_key`: a file imported with
``--id`` under the key of that id, never under the file's key; one no key reaches is left out);
a session whose log cannot be folded is listed from its header, so it never hides the others.

Calls are synchronous as nanobot's are; they run on a private event-loop thread, so they work
from nanobot's coroutines too. ``fsync=True`` means nothing more than a normal write (a write is
as durable as the server's persistence).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar, cast

import msgspec
import redis.exceptions
from nanobot.providers.base import ProviderConversationState
from nanobot.session import manager as _nb
from nanobot.session.summary import is_summary_checkpoint

from ..errors import (
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionError,
    SessionNotFoundError,
    SessionReplacedError,
    StoreUnavailableError,
)
from ..keys import Keys
from ..model import CUT, ChatMessageData, Entry, NewEntry, SessionHead, SessionHeader
from ..projection import nanobot as log
from ..store import SessionStore
from ..store.protocol import MAX_READ_RANGE
from ._log import resolve_store
from ._loops import LoopStores, run_sync

T = TypeVar("T")
_logger = logging.getLogger(__name__)

__all__ = ["NanobotSessionConflict", "NanobotSessionDeleted", "RedisNanobotStore"]

#: nanobot's own limits for a listing's preview scan
_PIN = "_redis_session_pin"
_UNKNOWN_OUTCOME = (StoreUnavailableError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
"""What a write that may have landed raises (a reply lost to a closed connection, a timeout)."""
_UNSURE_CREATE = "_redis_session_unsure_create"
"""On a session object: the create of its first save, whose outcome is unknown (the create, or
the rest of its entries after the first batch), as `_UnsureCreate`."""
_UnsureCreate = tuple[str, dict[str, Any], list[NewEntry], list[NewEntry], "_Pin"]
"""(session id, origin, first batch, rest of the entries, pin after them all)."""
_UNSURE = "_redis_session_unsure"
"""On a session object: the write of a save whose outcome is unknown (the store was unreachable
after it was sent: it may have landed), as (n, incarnation, entries, pin after it)."""
_CACHE_SIZE = 256
_REBASES = 16


class NanobotSessionConflict(SessionConflictError):
    """Another writer saved this nanobot session since this `Session` object was loaded: nothing
    of this save was written, and the object now holds the stored session (the other writer's
    messages included; so a cached session is never stuck). Reapply the change and save again."""

    def __init__(self, session_id: str, key: str, expected_n: int, actual_n: int) -> None:
        super().__init__(session_id, expected_n, actual_n)
        self.key = key
        self.args = (
            f"nanobot session {key!r} was saved by another writer since it was loaded "
            f"(expected n={expected_n}, the log is at n={actual_n}); nothing was written, and the "
            "session object now holds the stored session: reapply the change and save again",
        )


class NanobotSessionDeleted(SessionReplacedError):
    """The nanobot session this `Session` object was loaded from (or created as) was deleted
    since: nothing of this save was written, and the object is now empty (as a new session of
    its key); saving it again creates the key anew. A `SessionReplacedError` (the life it
    belonged to is gone), so one ``except`` covers deleted and deleted-and-created-again."""

    def __init__(self, session_id: str, key: str) -> None:
        super().__init__(session_id)
        self.key = key
        self.args = (
            f"nanobot session {key!r} was deleted since this session object was loaded; nothing "
            "was written, and the object is now empty: save it again to create the session anew",
        )


@dataclass
class _Pin:
    """What the log held for a `Session` object when it was loaded or last saved."""

    session_id: str
    incarnation: str
    n: int
    ns: list[int]  # entry n of each message
    encoded: list[bytes]  # each message's JSON then
    metadata: dict[str, bytes]  # each metadata key's JSON then, in order
    provider_state: bytes
    last_archived: int
    created_at: str
    updated_at: str
    floor: int  # entries below are not messages of this session any more


def _message_entry(message: dict[str, Any], at: int | None) -> NewEntry:
    """A nanobot message as an entry: ``message`` when our schema takes it, else a mark."""
    if message.get("_command"):
        kind = log.COMMAND
    elif is_summary_checkpoint(message):
        kind = log.RECORD  # its text is in the summary of the cut that goes with it
    else:
        try:
            msgspec.convert(message, ChatMessageData)
            kind = log.MESSAGE
        except msgspec.ValidationError:
            kind = log.RECORD
    meta = {"nanobot": {"at": at}} if at is not None else None
    return NewEntry(kind, message, meta)


def _provider_record(session: _nb.Session) -> Any:
    state = session.provider_state
    return state.to_private_record() if state is not None else None


def _match_inserts(old: list[bytes], new: list[bytes]) -> list[int] | None:
    """The indexes of `new` that are inserted when `new` is `old` with messages added (anywhere),
    else None."""
    inserted: list[int] = []
    i = 0
    for j, text in enumerate(new):
        if i < len(old) and old[i] == text:
            i += 1
        else:
            inserted.append(j)
    return inserted if i == len(old) else None


def _message_changes(
    pin: _Pin, messages: list[dict[str, Any]], encoded: list[bytes]
) -> tuple[list[NewEntry], list[int], bool]:
    """The message entries that bring the pinned list to `messages`, the entry n of each message
    after them, and whether old messages must be hidden (a cut with a new floor)."""
    n0 = pin.n
    entries: list[NewEntry] = []
    inserted = _match_inserts(pin.encoded, encoded)
    if inserted is not None:  # appends, and messages inserted before others (a checkpoint)
        ns = list(pin.ns)
        for j in inserted:
            entries.append(_message_entry(messages[j], j if j < len(ns) else None))
            ns.insert(j, n0 + len(entries) - 1)
        return entries, ns, False
    # Messages dropped from the front (then some appended): a cut with a floor hides them.
    old = pin.encoded
    drop = next((j for j in range(1, len(old) + 1) if old[j:] == encoded[: len(old) - j]), None)
    kept = pin.ns[drop:] if drop is not None else []
    if drop is not None and (not kept or min(kept) > max(pin.ns[:drop])):
        ns = list(kept)
        fresh = messages[len(kept) :]
    else:  # anything else (an edit in place): the messages again, the old ones hidden
        ns = []
        fresh = messages
    for m in fresh:
        entries.append(_message_entry(m, None))
        ns.append(n0 + len(entries) - 1)
    return entries, ns, True


def _state_changes(pin: _Pin, session: _nb.Session, metadata: dict[str, bytes], provider: bytes) -> dict[str, Any]:
    """The ``nanobot/state`` mark's data for what changed besides the messages (empty: nothing)."""
    state: dict[str, Any] = {}
    changed = {k: session.metadata[k] for k, v in metadata.items() if pin.metadata.get(k) != v}
    gone = [k for k in pin.metadata if k not in metadata]
    expected_order = [k for k in pin.metadata if k not in gone] + [k for k in metadata if k not in pin.metadata]
    if list(metadata) != expected_order:  # a key moved: nanobot's file keeps the order, so do we
        # the values themselves, as messages are: the store takes its own snapshot when it checks
        # them (a deep copy here would refuse metadata nested deeper than Python's stack allows,
        # which nanobot's own files keep)
        state["metadata"] = dict(session.metadata)
    else:
        if changed:
            state["metadata_set"] = changed
        if gone:
            state["metadata_unset"] = gone
    if provider != pin.provider_state:
        state["provider_state"] = _provider_record(session)
    for name, value, was in (
        ("created_at", session.created_at.isoformat(), pin.created_at),
        ("updated_at", session.updated_at.isoformat(), pin.updated_at),
    ):
        if value != was:
            state[name] = value
    return state


def _cut(session: _nb.Session, ns: list[int], la: int, floor: int, cut_n: int, rewrite: bool) -> NewEntry:
    """The cut that moves nanobot's replay to `la` (and hides the entries below `floor`)."""
    messages = session.messages
    summary = log.summary_messages(session.metadata)
    later = ns[la:]
    if la < len(messages) and is_summary_checkpoint(messages[la]):
        # nanobot replays from its hidden checkpoint: the generic projection shows it right after
        # the summary, whichever entry it was written in
        summary.append({"role": "user", "content": messages[la].get("content")})
        later = ns[la + 1 :]
    reason = "nanobot:clear" if not messages else "nanobot:rewrite" if rewrite else "nanobot:archive"
    data = {
        "before": min(later) if later else cut_n,
        "summary": summary,
        "reason": reason,
        "meta": {"nanobot": {"floor": floor, "last_archived": la}},
    }
    return NewEntry(CUT, data)


def _plan(pin: _Pin, session: _nb.Session) -> tuple[list[NewEntry], _Pin]:
    """The entries that bring the log from `pin` to `session`, and the pin after them (pure)."""
    messages = session.messages
    encoded = [log.encode(m, f"message {i}") for i, m in enumerate(messages)]
    entries, ns, rewrite = _message_changes(pin, messages, encoded)
    metadata = {k: log.encode(v, f"metadata[{k!r}]") for k, v in session.metadata.items()}
    provider = log.encode(_provider_record(session), "provider_state")
    state = _state_changes(pin, session, metadata, provider)
    if state:
        entries.append(NewEntry(log.STATE, state))
    la = session.last_archived
    la = la if isinstance(la, int) and 0 <= la <= len(messages) else 0
    floor = pin.floor
    if rewrite or la != pin.last_archived:
        cut_n = pin.n + len(entries)
        if rewrite:
            floor = min(ns) if ns else cut_n
        entries.append(_cut(session, ns, la, floor, cut_n, rewrite))
    after = _Pin(
        session_id=pin.session_id,
        incarnation=pin.incarnation,
        n=pin.n + len(entries),
        ns=ns,
        encoded=encoded,
        metadata=metadata,
        provider_state=provider,
        last_archived=la,
        created_at=session.created_at.isoformat(),
        updated_at=session.updated_at.isoformat(),
        floor=floor,
    )
    return entries, after


def _frozen(entries: Sequence[NewEntry]) -> list[NewEntry]:
    """A copy of `entries` that nanobot's later changes in place (to a message or a metadata
    value, which the entries hold) cannot touch: a write kept to be sent again, as it was sent."""
    return [NewEntry(e.type, log.clone(e.data), log.clone(e.meta), log.clone(e.surface), e.time) for e in entries]


def _write_key(sid: str, incarnation: str, n: int, entries: Sequence[NewEntry]) -> str:
    digest = hashlib.sha256(f"{sid}\0{incarnation}\0{n}\0".encode())
    digest.update(msgspec.json.encode(list(entries)))
    return "nanobot:" + digest.hexdigest()[:32]


def _create_header(sid: str, session: _nb.Session, origin: dict[str, Any], first: Sequence[NewEntry]) -> SessionHeader:
    """The header of `session`'s create, keyed by the create itself (its origin and first
    entries: the same for a resend of the same create), so a resend of a create that landed and
    was deleted since is refused by the store (`SessionReplacedError`), never made again."""
    key = _write_key(sid, "create:" + log.encode(origin).decode(), 0, first)
    created_at = int(session.created_at.timestamp() * 1000)
    return SessionHeader(id=sid, created_at=created_at, origin=origin, create_key=key)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _empty_pin(session_id: str, incarnation: str = "") -> _Pin:
    return _Pin(session_id, incarnation, 0, [], [], {}, log.encode(None), 0, "", "", 0)


def _pin_of(state: log.NanobotState, session: _nb.Session) -> _Pin:
    return _Pin(
        session_id=state.session_id,
        incarnation=state.incarnation,
        n=state.n,
        ns=list(state.ns),
        encoded=[log.encode(m) for m in session.messages],
        metadata={k: log.encode(v) for k, v in session.metadata.items()},
        provider_state=log.encode(_provider_record(session)),
        last_archived=session.last_archived,
        created_at=session.created_at.isoformat(),
        updated_at=session.updated_at.isoformat(),
        floor=min(state.ns) if state.ns else state.n,
    )


def _migrate_exec(messages: list[dict[str, Any]], metadata: dict[str, Any]) -> bool:
    """nanobot's own load-time migration of its old ``write_stdin`` tool records (its loads apply
    it, so ours do: what nanobot reads is the same from either store)."""
    migrate = getattr(_nb, "_migrate_legacy_exec_session_records", None)
    return bool(migrate(messages, metadata)) if migrate is not None else False


def _refresh(session: _nb.Session, fresh: _nb.Session) -> None:
    """Make `session` (the object nanobot holds) the stored session `fresh`, pin included."""
    session.messages = fresh.messages
    session.metadata = fresh.metadata
    session.created_at = fresh.created_at
    session.updated_at = fresh.updated_at
    session.last_consolidated = fresh.last_consolidated
    session.provider_state = fresh.provider_state
    setattr(session, _PIN, getattr(fresh, _PIN, None))


def _time(value: str | None, fallback: datetime | None = None) -> datetime:
    if value:
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            pass
    return fallback or datetime.now()


class RedisNanobotStore:
    """nanobot 0.3.5's ``SessionStore`` on a redis-session store (see the module docstring).

    `store`: a `SessionStore`, a `Sessions` service, a URL, or None (``$REDIS_URL``, else the
    embedded server: the default of every example). A store handed in is used from this
    adapter's private event-loop thread only. `key_to_id` maps a nanobot key to a session id
    (default: `redis_session.projection.nanobot.key_to_id`, reversible, any key)."""

    def __init__(
        self,
        store: SessionStore | Any = None,
        *,
        prefix: str = "rs",
        key_to_id: Callable[[str], str] | None = None,
    ) -> None:
        if store is None or isinstance(store, str):
            from ..redis.connect import open_store

            url = store
            self.store: SessionStore = open_store(url, prefix=prefix)
            self._owned = True
        else:
            self.store = resolve_store(store)
            self._owned = False
        self.prefix = getattr(self.store, "prefix", prefix)
        # A store handed in may be used on its owner's event loop as well: the adapter's calls
        # (on its private loop) get a clone with a pool of its own (`LoopStores`).
        self._stores = None if self._owned else LoopStores(self.store)
        self._key_to_id = key_to_id or log.key_to_id
        self._folds: OrderedDict[str, log.NanobotState] = OrderedDict()
        # id -> (life, n, info; None: no key reaches the session)
        self._listing: dict[str, tuple[str, int, dict[str, Any] | None]] = {}
        # (id, digest of the updates) -> (life, n) an `update_metadata` whose outcome is unknown
        # was based on: its retry sends the same write
        self._merges: OrderedDict[tuple[str, str], tuple[str, int]] = OrderedDict()
        vocabulary = self.store.vocabulary
        for t in log.MARK_TYPES:
            if t not in vocabulary:
                vocabulary.define(t, None)

    # -- plumbing

    def _run(self, fn: Callable[[], Awaitable[T]]) -> T:
        return run_sync(fn)

    @property
    def _store(self) -> SessionStore:
        return self.store if self._stores is None else self._stores.get()

    def session_id(self, key: str) -> str:
        """The session id a nanobot key is stored under."""
        return self._key_to_id(key)

    def close(self) -> None:
        """Close the store this adapter opened (not one handed in)."""
        if self._owned:
            self._run(self.store.aclose)

    async def _read_all(self, sid: str, start: int, stop: int, incarnation: str) -> list[Entry]:
        out: list[Entry] = []
        while start < stop:
            hi = min(stop, start + MAX_READ_RANGE)
            out.extend(await self._store.read(sid, start, hi, incarnation=incarnation))
            start = hi
        return out

    async def _fold(self, sid: str) -> log.NanobotState | None:
        """The session's nanobot state now (folding only what the cache has not seen yet)."""
        for _ in range(3):
            head = await self._store.head(sid)
            if head is None:
                self._folds.pop(sid, None)
                return None
            try:
                return await self._fold_head(head)
            except SessionReplacedError:
                continue  # replaced between the head and the read: read the new life
        return None

    async def _fold_head(self, head: SessionHead, *, remember: bool = True) -> log.NanobotState | None:
        """The state at `head` (a copy the caller may change); `remember` keeps it in the cache."""
        sid = head.header.id
        inc = head.header.incarnation
        cached = self._folds.get(sid)
        try:
            if cached is not None and cached.incarnation == inc and cached.n <= head.n:
                state = cached.copy()
                state.apply(await self._read_all(sid, cached.n, head.n, inc))
            else:
                state = log.fold(head, await self._read_all(sid, 0, head.n, inc))
        except SessionReplacedError:  # another life since the head was read: the caller reads again
            self._folds.pop(sid, None)
            raise
        except SessionNotFoundError:  # deleted since the head was read
            self._folds.pop(sid, None)
            return None
        if not remember:
            return state
        self._folds[sid] = state
        self._folds.move_to_end(sid)
        while len(self._folds) > _CACHE_SIZE:
            self._folds.popitem(last=False)
        return state.copy()

    def _session(self, key: str, state: log.NanobotState) -> _nb.Session:
        provider = (
            ProviderConversationState.from_private_record(state.provider_state)
            if state.provider_state is not None
            else None
        )
        session = _nb.Session(
            key=key,
            messages=state.messages,
            created_at=_time(state.created_at),
            updated_at=_time(state.updated_at),
            metadata=state.metadata,
            last_consolidated=state.last_archived,
            provider_state=provider,
        )
        setattr(session, _PIN, _pin_of(state, session))  # what the log holds
        if state.foreign_summary:
            # A compactor's cut: its summary is what nanobot's prompt carries for the archived
            # part (nanobot's `_last_summary`; the next save writes it down).
            summary = {"text": state.foreign_summary, "last_active": state.foreign_active or ""}
            session.metadata["_last_summary"] = summary
        if _migrate_exec(session.messages, session.metadata):
            session.provider_state = None  # as nanobot's own load; the next save writes both
        return session

    # -- nanobot's SessionStore

    def load(self, key: str) -> _nb.Session | None:
        """The stored session (pinned to the life of the id it was read from), or None."""
        state = self._run(lambda: self._fold(self.session_id(key)))
        return self._session(key, state) if state is not None else None

    def save(self, session: _nb.Session, *, fsync: bool = False) -> None:
        """Append what changed since `session` was loaded or last saved (see the module doc)."""
        del fsync  # durability is the server's (AOF, replicas), not a per-call fsync
        sid = self.session_id(session.key)
        pin = cast(_Pin | None, getattr(session, _PIN, None))
        if pin is not None and pin.session_id != sid:
            pin = None  # a session object renamed to another key: a new session there
        try:
            after = self._run(lambda: self._save(session, sid, pin))
        except (NanobotSessionConflict, SessionNotFoundError):
            # Nothing of this save was written (another pod saved first; or the id was deleted, or
            # deleted and created again: another life). The object now holds what is stored (the
            # new life, or nothing), so nanobot's cached session is never stuck behind the log:
            # its next turn works on the stored session; the refused change is the caller's to
            # reapply (nanobot's turn failed with this error).
            state = self._run(lambda: self._fold(sid))
            _refresh(session, self._session(session.key, state) if state is not None else _nb.Session(key=session.key))
            raise
        setattr(session, _PIN, after)

    async def _save(self, session: _nb.Session, sid: str, pin: _Pin | None) -> _Pin:
        if pin is None:
            pin = await self._settle_create(session, sid)
        if pin is None:
            return await self._create(session, sid)
        try:
            return await self._update(session, sid, pin)
        except SessionReplacedError:
            raise
        except SessionNotFoundError:  # the life this object belongs to is gone (just deleted)
            raise NanobotSessionDeleted(sid, session.key) from None

    async def _update(self, session: _nb.Session, sid: str, pin: _Pin) -> _Pin:
        pin = await self._settle(session, sid, pin)
        for _ in range(_REBASES):
            entries, after = _plan(pin, session)
            if not entries:
                return pin
            try:
                await self._put(sid, pin, entries)
                return after
            except _UNKNOWN_OUTCOME:
                # it may have landed: the next save sends this very write again first (`_settle`),
                # instead of planning from before it and taking its own entries for another pod's
                # a copy: the entries hold the session's own dicts, which nanobot may change in
                # place before it saves again (a changed copy would be another write, another key)
                setattr(session, _UNSURE, (pin.n, pin.incarnation, _frozen(entries), after))
                raise
            except SessionConflictError as e:
                if e.actual_n < pin.n:
                    raise SessionReplacedError(sid, "the log is shorter than this session object saw") from None
                pin = await self._rebase(session, sid, pin, e.actual_n)
        raise NanobotSessionConflict(sid, session.key, pin.n, pin.n)

    async def _settle(self, session: _nb.Session, sid: str, pin: _Pin) -> _Pin:
        """The pin after the write of an earlier save of `session` whose outcome was unknown: that
        write sent again (its key names it: replayed if it landed, written now if not), so this
        save plans from after it; `pin` as it is when another write took its place meanwhile (the
        usual conflict then) or there was none. Unreachable again: it stays unsettled."""
        unsure = getattr(session, _UNSURE, None)
        if unsure is None:
            return pin
        n, incarnation, entries, after = unsure
        if (n, incarnation) != (pin.n, pin.incarnation):
            delattr(session, _UNSURE)  # the object was saved or loaded since: not this pin's write
            return pin
        try:
            await self._put_at(sid, n, incarnation, entries)
        except SessionConflictError:
            delattr(session, _UNSURE)  # it did not land, and another write did
            return pin
        delattr(session, _UNSURE)
        setattr(session, _PIN, after)
        return cast(_Pin, after)

    async def _put(self, sid: str, pin: _Pin, entries: Sequence[NewEntry]) -> None:
        await self._put_at(sid, pin.n, pin.incarnation, entries)

    async def _put_at(self, sid: str, n: int, incarnation: str, entries: Sequence[NewEntry]) -> None:
        # The key names the write itself (this life, this n, these entries): a save retried after
        # a lost reply finds its first attempt and lands once.
        key = _write_key(sid, incarnation, n, entries)
        step = self._store.max_batch
        for i in range(0, len(entries), step):
            await self._store.put(
                sid, n + i, entries[i : i + step], idempotency_key=f"{key}:{i}", incarnation=incarnation
            )

    async def _rebase(self, session: _nb.Session, sid: str, pin: _Pin, actual: int) -> _Pin:
        """Fold other writers' metadata merges into `pin` (and `session`), or raise the conflict."""
        entries = await self._read_all(sid, pin.n, actual, pin.incarnation)
        merges: list[dict[str, Any]] = []
        for e in entries:
            if e.type != log.STATE or not set(e.data) <= {"metadata_set", "metadata_unset"}:
                raise NanobotSessionConflict(sid, session.key, pin.n, actual)
            merges.append(e.data)
        metadata = dict(pin.metadata)
        for data in merges:
            for k, v in (data.get("metadata_set") or {}).items():
                theirs = log.encode(v)
                mine = log.encode(session.metadata[k]) if k in session.metadata else None
                if mine in (metadata.get(k), theirs):
                    session.metadata[k] = log.clone(v)  # not changed by this object: take theirs
                metadata[k] = theirs  # otherwise ours is written over it
            for k in data.get("metadata_unset") or []:
                mine = log.encode(session.metadata[k]) if k in session.metadata else None
                if mine == metadata.get(k):
                    session.metadata.pop(k, None)
                metadata.pop(k, None)
        pin.metadata = metadata
        pin.n = actual
        return pin

    async def _create(self, session: _nb.Session, sid: str) -> _Pin:
        created = session.created_at.isoformat()
        origin = {
            "format": log.FORMAT,
            "key": session.key,
            "created_at": created,
            "updated_at": created,
            "metadata": {},
            "last_archived": 0,
            "last_consolidated": 0,
        }
        entries, after = _plan(_empty_pin(sid), session)
        step = self._store.max_batch
        first, rest = entries[:step], entries[step:]
        # what the next save needs to settle this create when its outcome is unknown: a copy (the
        # entries hold the session's own dicts, which nanobot may change in place meanwhile)
        unsure = (sid, origin, _frozen(first), _frozen(rest), after)
        try:
            head = await self._store.create(_create_header(sid, session, origin, first), first)
        except _UNKNOWN_OUTCOME:
            # it may have landed: the next save looks for it first (`_settle_create`), instead of
            # planning a create again and taking its own session for another pod's
            setattr(session, _UNSURE_CREATE, unsure)
            raise
        except SessionReplacedError:  # made by an earlier attempt and deleted since
            raise NanobotSessionDeleted(sid, session.key) from None
        except SessionAlreadyExistsError:
            found = await self._created_by(sid, origin, first)
            if found is None:
                head_now = await self._store.head(sid)
                raise NanobotSessionConflict(sid, session.key, 0, head_now.n if head_now else 0) from None
            head = found  # our own create, its reply lost: it landed once
        return await self._created(session, sid, head, unsure)

    async def _created(self, session: _nb.Session, sid: str, head: SessionHead, unsure: _UnsureCreate) -> _Pin:
        """The pin after the create `unsure` of `session`, which landed (`head`), once the rest of
        its entries (a first save over one batch) is written too: sent with the key of the write
        itself, so a resend after a lost reply lands once. Unknown outcome again: it stays
        unsettled, for the next save."""
        _, _, first, rest, after = unsure
        after.incarnation = head.header.incarnation
        if rest:
            start = _empty_pin(sid, after.incarnation)
            start.n = len(first)
            try:
                await self._put(sid, start, rest)
            except _UNKNOWN_OUTCOME:
                setattr(session, _UNSURE_CREATE, unsure)
                raise
            except SessionConflictError as e:  # another pod wrote after the first batch: nothing of the rest
                raise NanobotSessionConflict(sid, session.key, start.n, e.actual_n) from None
        return after

    async def _settle_create(self, session: _nb.Session, sid: str) -> _Pin | None:
        """The pin after the create of `session`'s first save, when that save's outcome was
        unknown and it landed (the session at `sid` is exactly that create; the rest of its
        entries is sent again, replayed if it landed): the next save then appends what changed
        since, as after any save. None: there was none, or it did not land and another pod's
        create took the id (the save creates as usual, and meets that conflict). Unreachable
        again: it stays unsettled."""
        unsure = cast(_UnsureCreate | None, getattr(session, _UNSURE_CREATE, None))
        if unsure is None:
            return None
        usid, origin, first = unsure[:3]
        if usid != sid:
            delattr(session, _UNSURE_CREATE)
            return None
        found = await self._created_by(sid, origin, first)
        if found is None and await self._store.head(sid) is None:
            # not there: it did not land, or it landed and was deleted since. That very create sent
            # again tells which (its key is remembered for a deleted life, `Keys.gone`): refused —
            # the session this object made was deleted, nothing is made again —, or made now
            try:
                found = await self._store.create(_create_header(sid, session, origin, first), first)
            except SessionReplacedError:
                delattr(session, _UNSURE_CREATE)
                raise NanobotSessionDeleted(sid, session.key) from None
            except SessionAlreadyExistsError:  # another pod's create took the id meanwhile
                found = None
        delattr(session, _UNSURE_CREATE)
        if found is None:
            return None
        pin = await self._created(session, sid, found, unsure)
        setattr(session, _PIN, pin)
        return pin

    async def _created_by(self, sid: str, origin: dict[str, Any], first: Sequence[NewEntry]) -> SessionHead | None:
        """The head of `sid` when it is exactly the create we sent (a retry after a lost reply)."""
        head = await self._store.head(sid)
        if head is None or head.header.origin != origin or head.n < len(first):
            return None
        stored = await self._store.read(sid, 0, len(first), incarnation=head.header.incarnation)
        same = all(
            e.type == x.type and e.data == x.data and e.meta == x.meta for e, x in zip(stored, first, strict=True)
        )
        return head if same else None

    def delete(self, key: str) -> bool:
        sid = self.session_id(key)

        async def delete() -> bool:
            self._folds.pop(sid, None)
            return await self._store.delete(sid)

        return self._run(delete)

    def read(self, key: str) -> dict[str, Any] | None:
        """``{key, created_at, updated_at, metadata, messages}`` of the stored session, or None."""
        state = self._run(lambda: self._fold(self.session_id(key)))
        if state is None:
            return None
        _migrate_exec(state.messages, state.metadata)
        return {
            "key": state.key if self._listed_key(state.session_id, state.key) == state.key else key,
            "created_at": state.created_at,
            "updated_at": state.updated_at,
            "metadata": state.metadata,
            "messages": state.messages,
        }

    def read_metadata(self, key: str) -> dict[str, Any] | None:
        """``{key, created_at, updated_at, metadata}`` of the stored session, or None."""
        payload = self.read(key)
        if payload is None:
            return None
        payload.pop("messages")
        return payload

    def update_metadata(self, key: str, updates: dict[str, Any], *, fsync: bool = False) -> bool:
        """Merge `updates` into the stored metadata (one mark at the log's end; no history is
        rewritten and no concurrent save is lost). False when there is no such session.

        A call retried after an error (the same key and updates, its reply lost) lands once: the
        write's idempotency key is derived from the life and n it was based on and its content,
        and the adapter keeps that base until the write is known to have landed or not, so the
        retry sends the very same write (it never puts an older value back over one another
        writer set in between)."""
        del fsync
        sid = self.session_id(key)
        digest = _digest(log.encode(updates, "updates"))
        # the values themselves: the store checks them (lossless JSON) and snapshots them
        data = {"metadata_set": dict(updates)}

        async def merge() -> bool:
            head = await self._store.head(sid)
            if head is None:
                self._merges.pop((sid, digest), None)
                return False
            inc = head.header.incarnation
            base = self._merges.get((sid, digest))
            if base is None or base[0] != inc:
                base = (inc, head.n)  # a new write, based on this life at this n
                self._merges[(sid, digest)] = base
                while len(self._merges) > _CACHE_SIZE:
                    self._merges.popitem(last=False)
            write = f"{sid}\0{inc}\0{base[1]}\0{digest}".encode()
            idempotency_key = "nanobot:meta:" + _digest(write)
            try:
                await self._store.put(
                    sid, None, [NewEntry(log.STATE, data)], idempotency_key=idempotency_key, incarnation=inc
                )
            except SessionNotFoundError:  # deleted (or another life) since the head: not written
                self._merges.pop((sid, digest), None)
                return False
            except StoreUnavailableError:
                # a lost reply, a timeout: the outcome is unknown, so the base is kept and a retry
                # of this call sends the same write (the store finds it, if it landed)
                raise
            except SessionError:  # refused (bad updates): nothing written, nothing to retry
                self._merges.pop((sid, digest), None)
                raise
            self._merges.pop((sid, digest), None)
            return True

        return self._run(merge)

    def list_sessions(self) -> list[dict[str, Any]]:
        """``{key, created_at, updated_at, title, preview, path}`` of every nanobot session in
        the store, newest update first (`path` is the session's log key). A session unchanged
        since the last listing costs one head read; listing never evicts the sessions in use
        from the fold cache."""

        async def collect() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            seen: set[str] = set()
            cursor: str | None = None
            while True:
                page = await self._store.list(limit=1000, cursor=cursor)
                for header in page.items:
                    origin = header.origin if isinstance(header.origin, dict) else {}
                    if origin.get("format") != log.FORMAT:
                        continue
                    seen.add(header.id)
                    try:
                        info = await self._info(header.id)
                    except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as e:
                        # one session whose log cannot be read as nanobot's never hides the others:
                        # it is listed from its header (a load of it raises the error itself)
                        _logger.warning("nanobot session %r cannot be folded for the listing: %r", header.id, e)
                        info = self._header_info(header)
                    if info is not None:
                        out.append(dict(info))
                cursor = page.cursor
                if cursor is None:
                    for sid in set(self._listing) - seen:
                        del self._listing[sid]
                    return out

        return sorted(self._run(collect), key=lambda item: item["updated_at"], reverse=True)

    def _listed_key(self, sid: str, stored: str) -> str | None:
        return log.listed_key(sid, stored, self.session_id)

    def _header_info(self, header: SessionHeader) -> dict[str, Any] | None:
        origin = header.origin if isinstance(header.origin, dict) else {}
        stored = origin.get("key")
        key = self._listed_key(header.id, stored if isinstance(stored, str) else header.id)
        if key is None:
            return None
        created = origin.get("created_at")
        updated = origin.get("updated_at")
        now = datetime.now().isoformat()
        return {
            "key": key,
            "created_at": created if isinstance(created, str) else now,
            "updated_at": updated if isinstance(updated, str) else now,
            "title": "",
            "preview": "",
            "path": Keys(self.prefix).log(header.id),
        }

    async def _info(self, sid: str) -> dict[str, Any] | None:
        for _ in range(3):
            head = await self._store.head(sid)
            if head is None:
                self._listing.pop(sid, None)
                return None
            inc = head.header.incarnation
            hit = self._listing.get(sid)
            if hit is not None and hit[0] == inc and hit[1] == head.n:
                return hit[2]
            try:
                state = await self._fold_head(head, remember=sid in self._folds)
            except SessionReplacedError:
                continue
            if state is None:
                return None
            key = self._listed_key(sid, state.key)
            if key is None:
                self._listing[sid] = (inc, head.n, None)
                return None
            now = datetime.now().isoformat()
            info = {
                "key": key,
                "created_at": state.created_at or now,
                "updated_at": state.updated_at or now,
                "title": _nb._metadata_title(state.metadata),
                "preview": _preview(state.messages),
                "path": Keys(self.prefix).log(sid),
            }
            self._listing[sid] = (inc, head.n, info)
            return info
        return None


def _preview(messages: list[dict[str, Any]]) -> str:
    """nanobot's listing preview: the first user text within its scan limits, else the first
    assistant text (its own per-message rule)."""
    fallback = ""
    chars = 0
    for i, item in enumerate(messages):
        chars += len(json.dumps(item, ensure_ascii=False)) + 1  # the line nanobot's file holds
        if i >= _nb._SESSION_LIST_PREVIEW_MAX_RECORDS or chars > _nb._SESSION_LIST_PREVIEW_MAX_CHARS:
            break
        text = str(_nb._message_preview_text(item))
        if not text:
            continue
        if item.get("role") == "user":
            return text
        if not fallback and item.get("role") == "assistant":
            fallback = text
    return fallback
