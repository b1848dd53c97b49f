"""A Google ADK session service on a redis-session store: `RedisAdkSessionService`.

``google.adk.sessions.BaseSessionService`` with the semantics of ADK's own services
(``InMemorySessionService`` and ``DatabaseSessionService``), on the log. Needs the ``adk`` extra.

Layout (``ns`` is the namespace, ``"adk"`` by default; every part is escaped, see `escape`)::

    {ns}:s:<app>:<user>:<session>   one ADK session: entry 0 is ``adk/session`` (who it belongs to
                                    and its initial session-scoped state), then one ``adk/event``
                                    per appended event ({"event": the event as ADK's database
                                    service stores it: ``model_dump(mode="json", exclude_none=True)``})
    {ns}:u:<app>:<user>             user state: ``adk/state`` entries {"delta": {...}} folded in order
    {ns}:a:<app>                    app state: the same
    {ns}:i:<app>                    the app's session index: ``adk/created`` / ``adk/deleted``

State scopes are ADK's: in a state delta, ``app:k`` goes to the app's state log (as ``k``),
``user:k`` to the user's, ``temp:k`` is applied to the in-memory session only and never stored,
and every other key is session state, folded from the session's own events on read. A session
read back carries its session state plus the app and user state under their prefixes.

Concurrency: a session returned by this service remembers the n of the log it was read at
(ADK's ``_storage_update_marker``), and `append_event` writes at exactly that n. A writer whose
session object is stale (another pod appended first) gets `StaleAdkSessionError`, which is both
ADK's ``StaleSessionError`` (what ``DatabaseSessionService`` raises) and our
`SessionConflictError`; nothing is written, so two pods never interleave events in one session.
Re-delivering an event that already landed (an equal event: same id and fields) is a no-op, as
in ADK's in-memory service (the store's idempotency key is a digest of the event).
App and user state deltas are appended after the event, at the end of their logs (last writer
wins per key, like the database service's row update), each with an idempotency key derived from
the session and the event's digest: if the state write fails after the event landed (the call
raises), retrying ``append_event`` with the same event completes it without applying anything
twice. Until then the event is in the log and its app/user delta is not.

Ids: a store id is at most 256 characters, so the escaped names must fit (a UUID session id with
app and user names of ASCII letters leaves ~190 characters for them); a longer one is an
`InvalidSessionIdError` (a ``ValueError``) that says so. `adk_names` maps a store id back.

Costs: `get_session` reads the session's log once (events are validated only when returned);
app, user and index logs are read incrementally (each service instance folds from where it last
looked). `list_sessions` folds the state of every listed session from its log. The index log
of an app keeps one entry per create and delete (it is never compacted).
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from google.adk.errors import StaleSessionError
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.errors.session_not_found_error import SessionNotFoundError as AdkSessionNotFoundError
from google.adk.events.event import Event
from google.adk.platform import time as platform_time
from google.adk.platform import uuid as platform_uuid
from google.adk.sessions import BaseSessionService, Session, _session_util
from google.adk.sessions.base_session_service import GetSessionConfig, ListSessionsResponse
from google.adk.sessions.state import State

from ..errors import InvalidSessionIdError, SessionAlreadyExistsError, SessionConflictError, SessionNotFoundError
from ..model import Entry, NewEntry, SessionHeader
from ..store import SessionStore
from ._log import SessionLog, resolve_store

__all__ = ["RedisAdkSessionService", "StaleAdkSessionError", "adk_names", "escape", "unescape"]

SESSION, EVENT, STATE, CREATED, DELETED = "adk/session", "adk/event", "adk/state", "adk/created", "adk/deleted"
MARK_TYPES = (SESSION, EVENT, STATE, CREATED, DELETED)

#: ADK's message for a stale session (``DatabaseSessionService``'s, word for word).
STALE_MESSAGE = (
    "The session has been modified in storage since it was loaded. "
    "Please reload the session before appending more events."
)
_MARKER = "rs:"  # our `_storage_update_marker`s: "rs:<n>" (another service's marker is not ours)
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
#: How many app/user/index logs one service instance keeps folded (least recently used go).
CACHE_SIZE = 1024
#: The store's limit on a session id (docs/design.md §3); the store validates every id it is given.
MAX_ID_LENGTH = 256


class StaleAdkSessionError(StaleSessionError, SessionConflictError):  # type: ignore[misc,unused-ignore]
    """The session object is stale: another writer appended to the session since it was read.

    ADK's ``StaleSessionError`` (a ``ValueError``) and our `SessionConflictError` at once, so
    either ``except`` catches it. Nothing was written: reload with ``get_session`` and retry."""

    def __init__(self, session_id: str, expected_n: int, actual_n: int) -> None:
        SessionConflictError.__init__(self, session_id, expected_n, actual_n)
        self.args = (f"{STALE_MESSAGE} (store session {session_id!r}: expected n={expected_n}, log at n={actual_n})",)

    def __str__(self) -> str:
        return str(self.args[0])


def escape(part: str) -> str:
    """One ADK name (app name, user id or session id) as a part of a store id: every character
    but ``A-Z a-z 0-9 _ . - ~`` is percent-encoded from its UTF-8 bytes (``urllib.parse.quote``
    with nothing safe), so ``:``, ``%``, braces, whitespace and control characters never reach
    the store id, and `unescape` gives the name back exactly."""
    return urllib.parse.quote(part, safe="")


def unescape(part: str) -> str:
    return urllib.parse.unquote(part, errors="strict")


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


def _scoped(delta: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """ADK's split of a state delta into ``app``/``user``/``session`` (``temp:`` dropped), coerced
    into JSON the way its database service stores state."""
    return _session_util.extract_json_safe_state_delta(delta or {})  # type: ignore[no-any-return,unused-ignore]


class _Folded:
    """A state or index log folded incrementally by one service instance."""

    def __init__(self, store: SessionStore, store_id: str, fold: Callable[[dict[Any, Any], Entry], None]) -> None:
        self.value: dict[Any, Any] = {}
        self._fold_one = fold
        self.lock = anyio.Lock()
        self.log = SessionLog(store, store_id, origin=None, fold=self._fold, reset=self.value.clear)

    def _fold(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            self._fold_one(self.value, e)

    async def refresh(self) -> dict[Any, Any]:
        async with self.lock:
            await self.log.catch_up()
            return self.value


def _fold_state(value: dict[Any, Any], e: Entry) -> None:
    if e.type == STATE:
        value.update(e.data.get("delta") or {})


def _fold_index(value: dict[Any, Any], e: Entry) -> None:
    key = (e.data.get("user_id"), e.data.get("session_id"))
    if e.type == CREATED:
        value[key] = True
    elif e.type == DELETED:
        value.pop(key, None)


class _Fold:
    """One ADK session folded from its log."""

    __slots__ = ("app_name", "events", "last_update_time", "n", "session_id", "state", "user_id")

    def __init__(self, entries: Sequence[Entry]) -> None:
        if not entries or entries[0].type != SESSION:
            raise ValueError("not an ADK session log (its entry 0 is not adk/session)")
        head = entries[0].data
        self.app_name: str = head["app_name"]
        self.user_id: str = head["user_id"]
        self.session_id: str = head["session_id"]
        self.state: dict[str, Any] = dict(head.get("state") or {})
        self.last_update_time: float = float(head.get("time", entries[0].time / 1000))
        self.events: list[dict[str, Any]] = []
        for e in entries[1:]:
            if e.type != EVENT:
                continue
            ev = e.data["event"]
            self.events.append(ev)
            delta = (ev.get("actions") or {}).get("state_delta")
            if delta:
                self.state.update(_scoped(delta)["session"])
            ts = ev.get("timestamp")
            if isinstance(ts, int | float):
                self.last_update_time = float(ts)
        self.n = entries[-1].n + 1


class RedisAdkSessionService(BaseSessionService):  # type: ignore[misc,unused-ignore]
    """ADK's ``BaseSessionService`` on a redis-session store (or a `Sessions` service).

    ``RedisAdkSessionService(store, namespace="adk")``; see the module documentation for the
    layout and the concurrency rules."""

    def __init__(self, store: Any, *, namespace: str = "adk") -> None:
        if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
            raise ValueError("namespace must be 1-32 characters of A-Z a-z 0-9 _ . -")
        self.store: SessionStore = resolve_store(store)
        self.namespace = namespace
        self._logs: OrderedDict[str, _Folded] = OrderedDict()
        vocabulary = self.store.vocabulary
        for t in MARK_TYPES:
            if t not in vocabulary:
                vocabulary.define(t, None)

    # ------------------------------------------------------------------ ids

    def _id(self, scope: str, *parts: str) -> str:
        for p in parts:
            if not isinstance(p, str):
                raise TypeError(f"ADK names must be str, got {type(p).__name__}")
        sid = ":".join([self.namespace, scope, *(escape(p) for p in parts)])
        if len(sid) > MAX_ID_LENGTH:
            raise InvalidSessionIdError(
                f"app name, user id and session id {parts!r} escape to a {len(sid)}-character store id; "
                f"the limit is {MAX_ID_LENGTH} (every character but A-Z a-z 0-9 _ . - ~ takes 3 per UTF-8 byte)"
            )
        return sid

    def session_store_id(self, app_name: str, user_id: str, session_id: str) -> str:
        """The store id of an ADK session (``{ns}:s:<app>:<user>:<session>``, each part escaped)."""
        return self._id("s", app_name, user_id, session_id)

    def user_state_store_id(self, app_name: str, user_id: str) -> str:
        return self._id("u", app_name, user_id)

    def app_state_store_id(self, app_name: str) -> str:
        return self._id("a", app_name)

    def index_store_id(self, app_name: str) -> str:
        return self._id("i", app_name)

    # ------------------------------------------------------------------ folded logs

    def _folded(self, store_id: str, fold: Callable[[dict[Any, Any], Entry], None]) -> _Folded:
        f = self._logs.get(store_id)
        if f is None:
            f = self._logs[store_id] = _Folded(self.store, store_id, fold)
            while len(self._logs) > CACHE_SIZE:
                self._logs.popitem(last=False)
        else:
            self._logs.move_to_end(store_id)
        return f

    async def _app_state(self, app_name: str) -> dict[str, Any]:
        return dict(await self._folded(self.app_state_store_id(app_name), _fold_state).refresh())

    async def _user_state(self, app_name: str, user_id: str) -> dict[str, Any]:
        return dict(await self._folded(self.user_state_store_id(app_name, user_id), _fold_state).refresh())

    async def _append_at_end(self, store_id: str, entries: Sequence[NewEntry], key: str | None, role: str) -> None:
        """Append at the end of a state or index log (no expected n: these entries do not depend on
        what came before), creating the log on its first write."""
        for _ in range(3):
            try:
                await self.store.put(store_id, None, entries, idempotency_key=key)
                return
            except SessionNotFoundError:
                try:
                    await self.store.create(SessionHeader(id=store_id, origin={"adk": role}))
                except SessionAlreadyExistsError:
                    pass
        await self.store.put(store_id, None, entries, idempotency_key=key)

    async def _write_scoped(
        self, app_name: str, user_id: str, scoped: dict[str, dict[str, Any]], key: str | None
    ) -> None:
        """Append the app and user parts of a delta to their logs. `key` (the event's idempotency
        key) makes a retried write land once."""
        if scoped["app"]:
            await self._append_at_end(
                self.app_state_store_id(app_name),
                [NewEntry(STATE, {"delta": scoped["app"]})],
                None if key is None else _digest(key, "app"),
                "app-state",
            )
        if scoped["user"]:
            await self._append_at_end(
                self.user_state_store_id(app_name, user_id),
                [NewEntry(STATE, {"delta": scoped["user"]})],
                None if key is None else _digest(key, "user"),
                "user-state",
            )

    # ------------------------------------------------------------------ building sessions

    @staticmethod
    def _merge(session_state: dict[str, Any], app: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
        merged = dict(session_state)
        for k, v in app.items():
            merged[State.APP_PREFIX + k] = v
        for k, v in user.items():
            merged[State.USER_PREFIX + k] = v
        return merged

    @staticmethod
    def _mark(session: Session, n: int) -> None:
        try:
            session._storage_update_marker = f"{_MARKER}{n}"
        except (AttributeError, ValueError):  # an ADK without the marker: append_event checks the log instead
            pass

    @staticmethod
    def _marked_n(session: Session) -> int | None:
        marker = getattr(session, "_storage_update_marker", None)
        if isinstance(marker, str) and marker.startswith(_MARKER) and marker[len(_MARKER) :].isdigit():
            return int(marker[len(_MARKER) :])
        return None

    async def _read(self, store_id: str) -> list[Entry] | None:
        try:
            return await self.store.read(store_id)
        except SessionNotFoundError:
            return None

    # ------------------------------------------------------------------ BaseSessionService

    async def create_session(
        self,
        *,
        app_name: str,
        user_id: str,
        state: dict[str, Any] | None = None,
        session_id: str | None = None,
    ) -> Session:
        session_id = session_id.strip() if session_id else None
        session_id = session_id or platform_uuid.new_uuid()
        store_id = self.session_store_id(app_name, user_id, session_id)
        scoped = _scoped(state)
        # The index entry goes first: a session is listed only when its log exists, so a create
        # that fails after it leaves nothing visible, and no created session is ever unlisted.
        await self._append_at_end(
            self.index_store_id(app_name),
            [NewEntry(CREATED, {"user_id": user_id, "session_id": session_id})],
            None,
            "index",
        )
        now: float = platform_time.get_time()
        head: dict[str, Any] = {
            "app_name": app_name,
            "user_id": user_id,
            "session_id": session_id,
            "state": scoped["session"],
            "time": now,
        }
        try:
            created = await self.store.create(
                SessionHeader(
                    id=store_id,
                    title=session_id,
                    origin={"adk": {"app_name": app_name, "user_id": user_id, "session_id": session_id}},
                ),
                [NewEntry(SESSION, head)],
            )
        except SessionAlreadyExistsError:
            raise AlreadyExistsError(f"Session with id {session_id} already exists.") from None
        await self._write_scoped(app_name, user_id, scoped, None)
        session = Session(
            id=session_id,
            app_name=app_name,
            user_id=user_id,
            state=self._merge(
                scoped["session"], await self._app_state(app_name), await self._user_state(app_name, user_id)
            ),
            last_update_time=now,
        )
        self._mark(session, created.n)
        return session

    async def get_session(
        self,
        *,
        app_name: str,
        user_id: str,
        session_id: str,
        config: GetSessionConfig | None = None,
    ) -> Session | None:
        session_id = session_id.strip() if session_id else session_id
        entries = await self._read(self.session_store_id(app_name, user_id, session_id))
        if not entries:
            return None
        folded = _Fold(entries)
        raw = folded.events
        if config is not None:
            if config.after_timestamp is not None:
                raw = [e for e in raw if e.get("timestamp", 0.0) >= config.after_timestamp]
            if config.num_recent_events is not None:
                raw = raw[-config.num_recent_events :] if config.num_recent_events else []
        session = Session(
            id=folded.session_id,
            app_name=folded.app_name,
            user_id=folded.user_id,
            state=self._merge(folded.state, await self._app_state(app_name), await self._user_state(app_name, user_id)),
            events=[Event.model_validate(e) for e in raw],
            last_update_time=folded.last_update_time,
        )
        self._mark(session, folded.n)
        return session

    async def list_sessions(self, *, app_name: str, user_id: str | None = None) -> ListSessionsResponse:
        index = dict(await self._folded(self.index_store_id(app_name), _fold_index).refresh())
        candidates = [(u, s) for (u, s) in index if user_id is None or u == user_id]
        folds: list[_Fold] = []
        limiter = anyio.CapacityLimiter(16)

        async def load(u: str, s: str) -> None:
            async with limiter:
                entries = await self._read(self.session_store_id(app_name, u, s))
            if entries:
                folds.append(_Fold(entries))

        async with anyio.create_task_group() as tg:
            for u, s in candidates:
                tg.start_soon(load, u, s)
        app_state = await self._app_state(app_name)
        user_states = {u: await self._user_state(app_name, u) for u in sorted({f.user_id for f in folds})}
        sessions = [
            Session(
                id=f.session_id,
                app_name=f.app_name,
                user_id=f.user_id,
                state=self._merge(f.state, app_state, user_states[f.user_id]),
                last_update_time=f.last_update_time,
            )
            for f in folds
        ]
        sessions.sort(key=lambda s: (s.last_update_time, s.user_id, s.id))
        return ListSessionsResponse(sessions=sessions)

    async def delete_session(self, *, app_name: str, user_id: str, session_id: str) -> None:
        session_id = session_id.strip() if session_id else session_id
        if await self.store.delete(self.session_store_id(app_name, user_id, session_id)):
            await self._append_at_end(
                self.index_store_id(app_name),
                [NewEntry(DELETED, {"user_id": user_id, "session_id": session_id})],
                None,
                "index",
            )

    async def get_user_state(self, *, app_name: str, user_id: str) -> dict[str, Any]:
        return await self._user_state(app_name, user_id)

    async def _expected_n(self, session: Session, store_id: str) -> int:
        """The n this session object stands at: its marker, or, for a session object this service
        did not return (no marker), the log's n when its last event is the object's last event."""
        n = self._marked_n(session)
        if n is not None:
            return n
        head = await self.store.head(store_id)
        if head is None:
            raise AdkSessionNotFoundError(f"Session {session.id} not found.")
        last = (await self.store.read(store_id, head.n - 1, head.n))[-1] if head.n else None
        if session.events:
            fresh = last is not None and last.type == EVENT and last.data["event"].get("id") == session.events[-1].id
        else:
            fresh = last is not None and last.type == SESSION
        if not fresh:
            raise StaleAdkSessionError(store_id, -1, head.n)
        return head.n

    async def append_event(self, session: Session, event: Event) -> Event:
        if event.partial:
            return event
        # ADK's order: temp state reaches the in-memory session, then leaves the delta for good.
        self._apply_temp_state(session, event)
        event = self._trim_temp_delta_state(event)
        store_id = self.session_store_id(session.app_name, session.user_id, session.id)
        expected = await self._expected_n(session, store_id)
        data = event.model_dump(exclude_none=True, mode="json")
        key = _digest("adk-event", json.dumps(data, sort_keys=True, separators=(",", ":")))
        try:
            stored = await self.store.put(store_id, expected, [NewEntry(EVENT, {"event": data})], idempotency_key=key)
        except SessionConflictError as e:
            raise StaleAdkSessionError(store_id, e.expected_n, e.actual_n) from None
        except SessionNotFoundError:
            raise AdkSessionNotFoundError(f"Session {session.id} not found.") from None
        at = stored[0].n
        await self._write_scoped(
            session.app_name, session.user_id, _scoped(event.actions.state_delta), f"{store_id}#{key}"
        )
        if at < expected:
            return event  # an equal event that already landed: nothing applied twice
        self._mark(session, at + 1)
        session.last_update_time = event.timestamp
        return self._commit_event_to_session(session, event)  # type: ignore[no-any-return,unused-ignore]

    async def aclose(self) -> None:
        """Nothing to release: the store belongs to the caller."""


def adk_names(store_id: str) -> tuple[str, ...]:
    """The ADK names a store id of this adapter stands for: ``("s", app, user, session)``,
    ``("u", app, user)``, ``("a", app)`` or ``("i", app)`` (the namespace dropped)."""
    parts = store_id.split(":")
    return (parts[1], *(unescape(p) for p in parts[2:]))
