"""A Google ADK session service on a redis-session store: `RedisAdkSessionService`.

``google.adk.sessions.BaseSessionService`` with the semantics of ADK's own services
(``InMemorySessionService`` and ``DatabaseSessionService``), on the log. Needs the ``adk`` extra.

Layout (``ns`` is the namespace, ``"adk"`` by default; every part is escaped, see `escape`)::

    {ns}:s:<app>:<user>:<session>   one ADK session: entry 0 is ``adk/session`` (who it belongs to
                                    and its initial session-scoped state), then one ``adk/event``
                                    per appended event ({"event": the event as ADK's database
                                    service stores it: ``model_dump(mode="json", exclude_none=True)``};
                                    an event larger than one entry is its JSON text in pieces,
                                    ``adk/event {"id", "json", "parts": k}`` then k ``adk/part``
                                    ``{"id", "json"}``, in the same batch, joined on read)
    {ns}:u:<app>:<user>             user state: ``adk/state`` entries {"delta": {...}} folded in order
    {ns}:a:<app>                    app state: the same
    {ns}:i:<app>                    the app's session index: ``adk/created`` / ``adk/deleted``

State scopes are ADK's: in a state delta, ``app:k`` goes to the app's state log (as ``k``),
``user:k`` to the user's, ``temp:k`` is applied to the in-memory session only and never stored,
and every other key is session state, folded from the session's own events on read. Stored state
is what the stored event says (its JSON dump: bytes are URL-safe base64 text, NaN/Infinity null,
as ADK's ``Event`` serialises them; a create's state is coerced the same way). Everything a call
would write is checked first: a key or value that cannot be stored (a lone surrogate, an app/user
delta or initial state over the entry limit) is an `InvalidEntryError` naming it, and nothing is
written; an id that cannot be is an `InvalidSessionIdError` naming the field. A session
read back carries its session state plus the app and user state under their prefixes.

Concurrency: a session returned by this service remembers the life of the store session it was
read from (its incarnation) and the n of the log it was read at (ADK's
``_storage_update_marker``: ``rs:<incarnation>:<n>``, a private attribute every copy ADK makes
keeps), and `append_event` writes at exactly that n of exactly that life (checked in the append
script). A writer whose session object is stale (another pod appended first) gets
`StaleAdkSessionError`, which is both ADK's ``StaleSessionError`` (what ``DatabaseSessionService``
raises) and our `SessionConflictError`; one whose session was deleted and created again gets
`ReplacedAdkSessionError` (``StaleSessionError`` and our `SessionReplacedError`). Nothing is
written either way, so two pods never interleave events in one session and no write of one life
lands in another. `get_session` reads the log against the incarnation its head named.
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

Selection: importing this module registers the service in ADK's service registry (`register`),
so ``adk web/run --session_service_uri redis-session://host:6379/0`` picks it.

Costs: `get_session` reads the session's head and log (events are validated only when
returned; with ``shared_events`` only the entries after the cached fold, see the class);
app, user and index logs are read incrementally (each service instance folds from where it last
looked). `list_sessions` folds the state of every listed session from its log. The index log
of an app keeps one entry per create and delete (it is never compacted).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import re
import types
import urllib.parse
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import anyio
import msgspec
from google.adk.errors import StaleSessionError
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.errors.session_not_found_error import SessionNotFoundError as AdkSessionNotFoundError
from google.adk.events.event import Event
from google.adk.platform import time as platform_time
from google.adk.platform import uuid as platform_uuid
from google.adk.sessions import BaseSessionService, Session, _session_util
from google.adk.sessions.base_session_service import GetSessionConfig, ListSessionsResponse
from google.adk.sessions.state import State
from pydantic import TypeAdapter
from pydantic_core import PydanticSerializationError, to_jsonable_python

from ..errors import (
    InvalidEntryError,
    InvalidSessionIdError,
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionNotFoundError,
    SessionReplacedError,
)
from ..model import Entry, NewEntry, SessionHead, SessionHeader, encode_batch, lossless_json
from ..store import SessionStore
from ._log import resolve_store
from ._loops import LoopStores, run_sync

__all__ = [
    "SCHEMES",
    "RedisAdkSessionService",
    "ReplacedAdkSessionError",
    "StaleAdkSessionError",
    "adk_names",
    "escape",
    "register",
    "unescape",
]

T = TypeVar("T")

SESSION, EVENT, STATE, CREATED, DELETED = "adk/session", "adk/event", "adk/state", "adk/created", "adk/deleted"
#: The rest of an event too big for one entry (see `_event_entries`).
PART = "adk/part"
MARK_TYPES = (SESSION, EVENT, STATE, CREATED, DELETED, PART)
#: Room an entry's envelope (type, meta, the part's fields) takes beside its payload.
_ENVELOPE = 1024

#: ADK's message for a stale session (``DatabaseSessionService``'s, word for word).
STALE_MESSAGE = (
    "The session has been modified in storage since it was loaded. "
    "Please reload the session before appending more events."
)
#: Our `_storage_update_marker`s: ``"rs:<incarnation>:<n>"``, the life of the store session the
#: object was read from and the n it stands at (``"rs:<n>"`` from before incarnations: n only).
#: Another service's marker is not ours. A private attribute of ADK's ``Session``, so it travels
#: with every copy ADK makes (``model_copy``, ``copy.deepcopy``).
_MARKER = "rs:"
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
#: How many app/user/index logs one service instance keeps folded (least recently used go).
CACHE_SIZE = 1024
#: The store's limit on a session id (docs/design.md §3); the store validates every id it is given.
MAX_ID_LENGTH = 256
#: URI schemes `register` puts in ADK's service registry: always ours; ``redis``/``rediss`` only
#: when nothing (ADK itself, a later version) has taken them.
SCHEMES = ("redis-session", "redis-session+tls")
_PLAIN_SCHEMES = ("redis", "rediss")
#: Query parameters of a service URI that are ours (the rest go to redis-py).
_URI_OPTIONS = ("prefix", "namespace", "ttl_seconds", "shared_events", "cluster")
#: The ADK names each kind of store id is made of (for errors naming the field).
_ID_FIELDS = {
    "s": ("app_name", "user_id", "session_id"),
    "u": ("app_name", "user_id"),
    "a": ("app_name",),
    "i": ("app_name",),
}
#: Attempts of a read that finds the id re-created between its head and its log read.
_READ_ATTEMPTS = 5


class StaleAdkSessionError(StaleSessionError, SessionConflictError):  # type: ignore[misc,unused-ignore]
    """The session object is stale: another writer appended to the session since it was read.

    ADK's ``StaleSessionError`` (a ``ValueError``) and our `SessionConflictError` at once, so
    either ``except`` catches it. Nothing was written: reload with ``get_session`` and retry."""

    def __init__(self, session_id: str, expected_n: int, actual_n: int) -> None:
        SessionConflictError.__init__(self, session_id, expected_n, actual_n)
        self.args = (f"{STALE_MESSAGE} (store session {session_id!r}: expected n={expected_n}, log at n={actual_n})",)

    def __str__(self) -> str:
        return str(self.args[0])


class ReplacedAdkSessionError(StaleSessionError, SessionReplacedError):  # type: ignore[misc,unused-ignore]
    """The session object belongs to another life of its id: the session was deleted and created
    again since the object was read. ADK's ``StaleSessionError`` (what its database service
    raises when the stored revision is not the object's) and our `SessionReplacedError` at once.
    Nothing was written: ``get_session`` gives the new session."""

    def __init__(self, session_id: str) -> None:
        SessionReplacedError.__init__(self, session_id)
        self.args = (f"{STALE_MESSAGE} (store session {session_id!r} was deleted and created again)",)

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


def _json_state(state: dict[str, Any] | None) -> dict[str, Any]:
    """A state dict as JSON, coerced the way ADK's ``Event`` dumps its ``state_delta`` (so a value
    reads back the same whether it came from a create or an event): bytes as URL-safe base64
    text, NaN/Infinity as null, other objects pydantic cannot serialise by their ``str``."""
    if not isinstance(state, dict | None):
        raise InvalidEntryError(f"state must be a dict, got {type(state).__name__}")
    _check_state({k: None for k in state or {}})  # the keys first: an error naming the key
    try:
        out = to_jsonable_python(state or {}, bytes_mode="base64", inf_nan_mode="null", serialize_unknown=True)
    except (PydanticSerializationError, ValueError, TypeError, RecursionError) as e:
        raise InvalidEntryError(f"state is not serializable: {e}") from None
    return cast(dict[str, Any], out)


def _scoped(delta: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """ADK's split of a JSON state delta into ``app``/``user``/``session`` (``temp:`` dropped)."""
    return _session_util.extract_state_delta(delta or {})  # type: ignore[no-any-return,unused-ignore]


def _check_state(state: dict[str, Any]) -> None:
    """Every key and value of a (JSON) state must be storable: `InvalidEntryError` naming the key."""
    for k, v in state.items():
        if not isinstance(k, str):
            raise InvalidEntryError(f"state key {k!r} is not a str")
        try:
            k.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidEntryError(f"state key {k!r} is not valid Unicode (a lone surrogate)") from None
        lossless_json(v, f"state[{k!r}]")


def _utf8_cuts(raw: bytes, size: int) -> list[bytes]:
    """`raw` (UTF-8) in pieces of at most `size` bytes, each cut at a character boundary."""
    out: list[bytes] = []
    i = 0
    while i < len(raw):
        j = min(i + size, len(raw))
        while j < len(raw) and (raw[j] & 0xC0) == 0x80:
            j -= 1
        out.append(raw[i:j])
        i = j
    return out


async def _read_life(store: SessionStore, store_id: str) -> tuple[str, list[Entry]] | None:
    """One life of a store session: its incarnation and its whole log, or None when the id does
    not exist. The log is read against the incarnation its head named, so a delete and re-create
    in between is noticed (and read again), never mixed."""
    for _ in range(_READ_ATTEMPTS):
        head = await store.head(store_id)
        if head is None:
            return None
        try:
            return head.header.incarnation, await store.read(store_id, incarnation=head.header.incarnation)
        except SessionReplacedError:
            continue
        except SessionNotFoundError:
            return None
    raise SessionReplacedError(store_id, f"re-created during each of {_READ_ATTEMPTS} reads")


class _Folded:
    """A state or index log folded incrementally by one service instance, pinned to the life of
    the log it began on (a log that expired and was created again is folded again from 0)."""

    def __init__(self, store_id: str, fold: Callable[[dict[Any, Any], Entry], None]) -> None:
        self.store_id = store_id
        self.value: dict[Any, Any] = {}
        self._fold_one = fold
        self._incarnation: str | None = None
        self._n = 0
        self.lock = anyio.Lock()

    def _reset(self) -> None:
        self.value.clear()
        self._incarnation, self._n = None, 0

    async def refresh(self, store: SessionStore) -> dict[Any, Any]:
        async with self.lock:
            for _ in range(_READ_ATTEMPTS):
                if self._incarnation is None:
                    head = await store.head(self.store_id)
                    if head is None:
                        return self.value
                    self._incarnation = head.header.incarnation
                try:
                    entries = await store.read(self.store_id, self._n, incarnation=self._incarnation)
                except SessionReplacedError:
                    self._reset()
                    continue
                except SessionNotFoundError:
                    self._reset()
                    return self.value
                for e in entries:
                    self._fold_one(self.value, e)
                if entries:
                    self._n = entries[-1].n + 1
                return self.value
            raise SessionReplacedError(self.store_id, f"re-created during each of {_READ_ATTEMPTS} reads")


def _fold_state(value: dict[Any, Any], e: Entry) -> None:
    if e.type == STATE:
        value.update(e.data.get("delta") or {})


def _fold_index(value: dict[Any, Any], e: Entry) -> None:
    key = (e.data.get("user_id"), e.data.get("session_id"))
    if e.type == CREATED:
        value[key] = True
    elif e.type == DELETED:
        value.pop(key, None)


@functools.cache
def _events_adapter() -> TypeAdapter[list[Event]]:
    """Validates a list of stored events in one call (a third faster than one call per event)."""
    return TypeAdapter(list[Event])


def _event_id(e: Entry) -> str | None:
    """The id of the event an ``adk/event`` (or a big event's ``adk/part``) entry belongs to."""
    if e.type == EVENT and isinstance(e.data.get("event"), dict):
        return cast(str | None, e.data["event"].get("id"))
    if e.type in (EVENT, PART):
        return cast(str | None, e.data.get("id"))
    return None


def _event_order(ev: dict[str, Any]) -> tuple[float, str]:
    ts = ev.get("timestamp")
    return (float(ts) if isinstance(ts, int | float) else 0.0, str(ev.get("id") or ""))


class _Fold:
    """One ADK session folded from its log (one life of it), extendable with the entries after."""

    __slots__ = (
        "app_name",
        "events",
        "incarnation",
        "last_update_time",
        "n",
        "session_id",
        "state",
        "user_id",
        "validated",
    )

    def __init__(self, incarnation: str, entries: Sequence[Entry]) -> None:
        if not entries or entries[0].type != SESSION:
            raise ValueError("not an ADK session log (its entry 0 is not adk/session)")
        self.incarnation = incarnation
        head = entries[0].data
        self.app_name: str = head["app_name"]
        self.user_id: str = head["user_id"]
        self.session_id: str = head["session_id"]
        self.state: dict[str, Any] = dict(head.get("state") or {})
        self.last_update_time: float = float(head.get("time", entries[0].time / 1000))
        self.events: list[dict[str, Any]] = []  # in log order
        self.validated: list[Event] | None = None  # the same events validated (the shared cache)
        self.n = entries[0].n + 1
        self.extend(entries[1:])

    def extend(self, entries: Sequence[Entry]) -> None:
        pending: tuple[int, list[str]] | None = None  # a big event's text: parts still to come
        for e in entries:
            if e.type == PART and pending is not None:
                pending[1].append(str(e.data.get("json", "")))
                if len(pending[1]) <= pending[0]:
                    continue
                ev = json.loads("".join(pending[1]))
                pending = None
            elif e.type != EVENT:
                continue
            elif "event" not in e.data:  # the head of a big event (`_event_entries`)
                pending = (int(e.data.get("parts", 0)), [str(e.data.get("json", ""))])
                if pending[0] > 0:
                    continue
                ev = json.loads(pending[1][0])
                pending = None
            else:
                ev = e.data["event"]
            self.events.append(ev)
            delta = (ev.get("actions") or {}).get("state_delta")
            if delta:
                self.state.update(_scoped(delta)["session"])
            ts = ev.get("timestamp")
            if isinstance(ts, int | float):
                self.last_update_time = float(ts)
        if entries:
            self.n = entries[-1].n + 1

    def copy(self) -> _Fold:
        other = object.__new__(_Fold)
        for name in _Fold.__slots__:
            setattr(other, name, getattr(self, name))
        other.events = list(self.events)
        other.state = dict(self.state)
        other.validated = None if self.validated is None else list(self.validated)
        return other

    def order(self) -> list[int]:
        """Indexes of the events in ADK's database order: by timestamp, ties by event id (a stable
        sort: the log's order whenever timestamps grow, as they do for events of one writer)."""
        return sorted(range(len(self.events)), key=lambda i: _event_order(self.events[i]))


def _service_options(uri: str) -> tuple[str | None, dict[str, str]]:
    """A service URI as a redis-py URL (None: ``$REDIS_URL`` or the embedded server) and our
    options from its query (`_URI_OPTIONS`)."""
    parts = urllib.parse.urlsplit(uri)
    # The scheme chose this service (in ADK's registry, or a ``services.yaml`` naming any scheme);
    # the connection is TLS for ``rediss`` and ``…+tls``, a socket for ``unix``, else plain.
    scheme = parts.scheme.lower()
    if not scheme:
        raise ValueError(f"not a service URI: {uri!r} (use redis-session://host:port/db)")
    scheme = "rediss" if scheme == "rediss" or scheme.endswith("+tls") else "unix" if scheme == "unix" else "redis"
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in _URI_OPTIONS}
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k not in _URI_OPTIONS])
    if not parts.netloc and scheme != "unix" and parts.path in ("", "/"):
        return None, ours
    return urllib.parse.urlunsplit((scheme, parts.netloc, parts.path, rest, "")), ours


class RedisAdkSessionService(BaseSessionService):  # type: ignore[misc,unused-ignore]
    """ADK's ``BaseSessionService`` on a redis-session store (or a `Sessions` service).

    ``RedisAdkSessionService(store, namespace="adk", ttl_seconds=None)``, or from a URI
    (``RedisAdkSessionService(uri="redis-session://host:6379/0?prefix=rs")``, what ADK's service
    registry and ``services.yaml`` call): the service then owns its store and `close` closes it.
    `ttl_seconds` (as ADK's own ``RedisSessionService`` has it): sessions and app/user state
    expire that long after their last write. `shared_events` (default 0: off) keeps the validated
    events of that many sessions per service and hands the same ``Event`` objects to every read of
    a session (each read costs only the entries appended since), as ADK's
    ``IN_MEMORY_SESSION_SERVICE_LIGHT_COPY`` does for its in-memory service: the returned lists
    and state are the caller's, the events in them must not be changed in place. See the module
    documentation for the layout and the concurrency rules."""

    def __init__(
        self,
        store: Any = None,
        *,
        uri: str | None = None,
        namespace: str | None = None,
        ttl_seconds: float | None = None,
        shared_events: int = 0,
        agents_dir: str | None = None,  # what ADK's registry passes to every factory; unused
    ) -> None:
        del agents_dir
        url: str | None = None
        options: dict[str, str] = {}
        if uri is not None:
            if store is not None:
                raise TypeError("give a store or a uri, not both")
            url, options = _service_options(uri)
            namespace = namespace or options.get("namespace")
            for name in ("ttl_seconds", "shared_events"):
                if name in options and not (name == "ttl_seconds" and ttl_seconds is not None):
                    try:
                        value = float(options[name]) if name == "ttl_seconds" else int(options[name])
                    except ValueError:
                        raise ValueError(f"{name} in the service URI must be a number, got {options[name]!r}") from None
                    if name == "ttl_seconds":
                        ttl_seconds = value
                    elif not shared_events:
                        shared_events = int(value)
        elif store is None:
            raise TypeError("RedisAdkSessionService needs a store (or a Sessions service) or a uri")
        namespace = namespace or "adk"
        if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
            raise ValueError("namespace must be 1-32 characters of A-Z a-z 0-9 _ . -")
        if ttl_seconds is not None and (
            isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int | float) or not 0 < ttl_seconds < 2**40
        ):
            raise ValueError(f"ttl_seconds must be a positive number of seconds, got {ttl_seconds!r}")
        if isinstance(shared_events, bool) or not isinstance(shared_events, int) or shared_events < 0:
            raise ValueError(f"shared_events must be a number of sessions >= 0, got {shared_events!r}")
        owns = False
        if uri is not None:  # every argument checked: only now open connections
            from ..redis.connect import open_store

            cluster = options.get("cluster")
            store = open_store(
                url,
                prefix=options.get("prefix", "rs"),
                cluster=None if cluster is None else cluster.lower() in ("1", "true", "yes"),
                announce=None,
            )
            owns = True
        self.store: SessionStore = resolve_store(store)
        self.shared_events = shared_events
        self._sessions: weakref.WeakKeyDictionary[Any, OrderedDict[str, _Fold]] = weakref.WeakKeyDictionary()
        self.namespace = namespace
        self.ttl_seconds = ttl_seconds
        self._ttl_ms = None if ttl_seconds is None else max(1, round(ttl_seconds * 1000))
        self._owns_store = owns
        self._stores = LoopStores(self.store)
        # Folded app/user/index logs, one cache per store (per event loop: a sync call runs on
        # another loop, with a clone of the store).
        self._logs: weakref.WeakKeyDictionary[Any, OrderedDict[str, _Folded]] = weakref.WeakKeyDictionary()
        vocabulary = self.store.vocabulary
        for t in MARK_TYPES:
            if t not in vocabulary:
                vocabulary.define(t, None)

    @property
    def _store(self) -> SessionStore:
        """The store to use on the running event loop (`LoopStores`)."""
        return self._stores.get()

    # ------------------------------------------------------------------ ids

    def _id(self, scope: str, *parts: str) -> str:
        for field, p in zip(_ID_FIELDS[scope], parts, strict=True):
            if not isinstance(p, str):
                raise TypeError(f"ADK names must be str, got {type(p).__name__} for {field}")
            try:
                p.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidSessionIdError(f"{field} {p!r} is not valid Unicode (a lone surrogate)") from None
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

    async def _refresh(self, store_id: str, fold: Callable[[dict[Any, Any], Entry], None]) -> dict[Any, Any]:
        store = self._store
        logs = self._logs.get(store)
        if logs is None:
            logs = self._logs[store] = OrderedDict()
        f = logs.get(store_id)
        if f is None:
            f = logs[store_id] = _Folded(store_id, fold)
            while len(logs) > CACHE_SIZE:
                logs.popitem(last=False)
        else:
            logs.move_to_end(store_id)
        return dict(await f.refresh(store))

    async def _app_state(self, app_name: str) -> dict[str, Any]:
        return await self._refresh(self.app_state_store_id(app_name), _fold_state)

    async def _user_state(self, app_name: str, user_id: str) -> dict[str, Any]:
        return await self._refresh(self.user_state_store_id(app_name, user_id), _fold_state)

    async def _app_and_user_state(self, app_name: str, user_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
        box: dict[str, dict[str, Any]] = {}

        async def app() -> None:
            box["app"] = await self._app_state(app_name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(app)
            box["user"] = await self._user_state(app_name, user_id)
        return box["app"], box["user"]

    async def _append_at_end(
        self, store_id: str, entries: Sequence[NewEntry], key: str | None, role: str, *, ttl: bool
    ) -> None:
        """Append at the end of a state or index log (no expected n: these entries do not depend on
        what came before), creating the log on its first write (expiring `ttl_seconds` after its
        last write when `ttl`)."""
        store = self._store
        for _ in range(3):
            try:
                await store.put(store_id, None, entries, idempotency_key=key)
                return
            except SessionNotFoundError:
                try:
                    await store.create(
                        SessionHeader(id=store_id, origin={"adk": role}), ttl_ms=self._ttl_ms if ttl else None
                    )
                except SessionAlreadyExistsError:
                    pass
        await store.put(store_id, None, entries, idempotency_key=key)

    def _scoped_writes(
        self, app_name: str, user_id: str, scoped: dict[str, dict[str, Any]], key: str | None
    ) -> list[tuple[str, list[NewEntry], str | None, str]]:
        """The app and user parts of a delta as (store id, entries, idempotency key, role) writes,
        each checked by `_validated`. `key` (the event's idempotency key) makes a retried write
        land once."""
        writes: list[tuple[str, list[NewEntry], str | None, str]] = []
        if scoped["app"]:
            writes.append((
                self.app_state_store_id(app_name),
                [NewEntry(STATE, {"delta": scoped["app"]})],
                None if key is None else _digest(key, "app"),
                "app-state",
            ))  # fmt: skip
        if scoped["user"]:
            writes.append((
                self.user_state_store_id(app_name, user_id),
                [NewEntry(STATE, {"delta": scoped["user"]})],
                None if key is None else _digest(key, "user"),
                "user-state",
            ))  # fmt: skip
        for _, entries, _, role in writes:
            keys = sorted(entries[0].data["delta"])
            self._validated(entries, f"the {role.split('-')[0]} state delta (keys {keys[:5]})")
        return writes

    async def _write_scoped(self, writes: Sequence[tuple[str, list[NewEntry], str | None, str]]) -> None:
        for store_id, entries, key, role in writes:
            await self._append_at_end(store_id, entries, key, role, ttl=True)

    def _validated(self, entries: Sequence[NewEntry], what: str = "") -> list[NewEntry]:
        """`entries` as the store will check them (`InvalidEntryError`, naming `what`), before
        anything is written: a call that is refused writes nothing."""
        store = self._store
        try:
            encode_batch(entries, store.vocabulary, max_entry_bytes=store.max_entry_bytes)
        except InvalidEntryError as e:
            if not what:
                raise
            raise InvalidEntryError(f"{what}: {e}") from None
        return list(entries)

    def _event_entries(self, data: dict[str, Any]) -> list[NewEntry]:
        """An event as log entries: ``adk/event {"event": ...}``, or, when it is larger than one
        entry may be, its JSON text in pieces: ``adk/event {"id", "json", "parts": k}`` then k
        ``adk/part {"id", "json"}``, appended as one batch (so atomically) and joined on read."""
        raw = lossless_json(data, "event")
        limit = self._store.max_entry_bytes
        if len(raw) + _ENVELOPE <= limit:
            return self._validated([NewEntry(EVENT, {"event": data})])
        # a piece's characters take at most 2 bytes each in its entry (JSON text escapes none
        # but '"' and '\\' when it is a string value again)
        cuts = [c.decode("utf-8") for c in _utf8_cuts(raw, max(1024, (limit - _ENVELOPE) // 2))]
        eid = str(data.get("id", ""))
        return self._validated([
            NewEntry(EVENT, {"id": eid, "json": cuts[0], "parts": len(cuts) - 1}),
            *(NewEntry(PART, {"id": eid, "json": c}) for c in cuts[1:]),
        ])  # fmt: skip

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
    def _mark(session: Session, incarnation: str, n: int) -> None:
        try:
            session._storage_update_marker = f"{_MARKER}{incarnation}:{n}"
        except (AttributeError, ValueError):  # an ADK without the marker: append_event checks the log instead
            pass

    @staticmethod
    def _marked(session: Session) -> tuple[str | None, int] | None:
        """(incarnation, n) of our marker on `session` (incarnation None: a marker from before
        incarnations), or None when it carries none of ours."""
        marker = getattr(session, "_storage_update_marker", None)
        if not isinstance(marker, str) or not marker.startswith(_MARKER):
            return None
        inc, _, n = marker[len(_MARKER) :].rpartition(":")
        if not n.isdigit():
            return None
        return (inc or None), int(n)

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
        index_id = self.index_store_id(app_name)
        # Everything is checked before anything is written: a refused create leaves no session.
        initial = _json_state(state)
        _check_state(initial)
        scoped = _scoped(initial)
        now: float = platform_time.get_time()
        head: dict[str, Any] = {
            "app_name": app_name,
            "user_id": user_id,
            "session_id": session_id,
            "state": scoped["session"],
            "time": now,
        }
        first = self._validated([NewEntry(SESSION, head)], f"the session state (keys {sorted(head['state'])[:5]})")
        index_entries = self._validated([NewEntry(CREATED, {"user_id": user_id, "session_id": session_id})])
        scoped_writes = self._scoped_writes(app_name, user_id, scoped, None)
        # The index entry goes first: a session is listed only when its log exists, so a create
        # that fails after it leaves nothing visible, and no created session is ever unlisted.
        await self._append_at_end(index_id, index_entries, None, "index", ttl=False)
        try:
            created: SessionHead = await self._store.create(
                SessionHeader(
                    id=store_id,
                    title=session_id,
                    origin={"adk": {"app_name": app_name, "user_id": user_id, "session_id": session_id}},
                ),
                first,
                ttl_ms=self._ttl_ms,
            )
        except SessionAlreadyExistsError:
            raise AlreadyExistsError(f"Session with id {session_id} already exists.") from None
        await self._write_scoped(scoped_writes)
        app_state, user_state = await self._app_and_user_state(app_name, user_id)
        session = Session(
            id=session_id,
            app_name=app_name,
            user_id=user_id,
            state=self._merge(scoped["session"], app_state, user_state),
            last_update_time=now,
        )
        self._mark(session, created.header.incarnation, created.n)
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
        store_id = self.session_store_id(app_name, user_id, session_id)
        box: dict[str, Any] = {}

        async def states() -> None:
            box["app"], box["user"] = await self._app_and_user_state(app_name, user_id)

        async with anyio.create_task_group() as tg:
            tg.start_soon(states)
            folded = await self._life(store_id)
        if folded is None:
            return None
        order = folded.order()
        if config is not None:
            if config.after_timestamp is not None:
                after = config.after_timestamp
                order = [i for i in order if _event_order(folded.events[i])[0] >= after]
            if config.num_recent_events is not None:
                order = order[-config.num_recent_events :] if config.num_recent_events else []
        if folded.validated is not None:
            events = [folded.validated[i] for i in order]
            state = msgspec.json.decode(msgspec.json.encode(folded.state))  # shared fold: the caller's copy
        else:
            events = _events_adapter().validate_python([folded.events[i] for i in order])
            state = folded.state
        session = Session(
            id=folded.session_id,
            app_name=folded.app_name,
            user_id=folded.user_id,
            state=self._merge(state, box["app"], box["user"]),
            events=events,
            last_update_time=folded.last_update_time,
        )
        self._mark(session, folded.incarnation, folded.n)
        return session

    async def _life(self, store_id: str) -> _Fold | None:
        """The session's current life folded: read whole, or (`shared_events`) the cached fold of
        that same life extended by the entries after it."""
        store = self._store
        if not self.shared_events:
            life = await _read_life(store, store_id)
            return _Fold(*life) if life is not None and life[1] else None
        cache = self._sessions.get(store)
        if cache is None:
            cache = self._sessions[store] = OrderedDict()
        for _ in range(_READ_ATTEMPTS):
            head = await store.head(store_id)
            if head is None:
                cache.pop(store_id, None)
                return None
            inc = head.header.incarnation
            cached = cache.get(store_id)
            start = cached.n if cached is not None and cached.incarnation == inc and cached.n <= head.n else 0
            try:
                entries = await store.read(store_id, start, incarnation=inc)
            except SessionReplacedError:
                continue
            except SessionNotFoundError:
                cache.pop(store_id, None)
                return None
            if start:
                assert cached is not None and cached.validated is not None
                if not entries:
                    cache.move_to_end(store_id)
                    return cached
                folded = cached.copy()
                had = len(folded.events)
                folded.extend(entries)
                assert folded.validated is not None
                folded.validated.extend(_events_adapter().validate_python(folded.events[had:]))
            else:
                if not entries:
                    return None
                folded = _Fold(inc, entries)
                folded.validated = _events_adapter().validate_python(folded.events)
            cache[store_id] = folded
            cache.move_to_end(store_id)
            while len(cache) > self.shared_events:
                cache.popitem(last=False)
            return folded
        raise SessionReplacedError(store_id, f"re-created during each of {_READ_ATTEMPTS} reads")

    async def list_sessions(self, *, app_name: str, user_id: str | None = None) -> ListSessionsResponse:
        index = await self._refresh(self.index_store_id(app_name), _fold_index)
        candidates = [(u, s) for (u, s) in index if user_id is None or u == user_id]
        folds: list[_Fold] = []
        limiter = anyio.CapacityLimiter(16)
        store = self._store

        async def load(u: str, s: str) -> None:
            async with limiter:
                life = await _read_life(store, self.session_store_id(app_name, u, s))
            if life is not None and life[1]:
                folds.append(_Fold(*life))

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
        if await self._store.delete(self.session_store_id(app_name, user_id, session_id)):
            await self._append_at_end(
                self.index_store_id(app_name),
                [NewEntry(DELETED, {"user_id": user_id, "session_id": session_id})],
                None,
                "index",
                ttl=False,
            )

    async def get_user_state(self, *, app_name: str, user_id: str) -> dict[str, Any]:
        return await self._user_state(app_name, user_id)

    async def _position(self, session: Session, store_id: str) -> tuple[str, int]:
        """(incarnation, n) this session object stands at: its marker, or, for a session object
        this service did not return (no marker: pinned to the life the store holds now), the log's
        n when its last event is the object's last event."""
        store = self._store
        marked = self._marked(session)
        if marked is not None and marked[0] is not None:
            return marked[0], marked[1]
        head = await store.head(store_id)
        if head is None:
            raise AdkSessionNotFoundError(f"Session {session.id} not found.")
        inc = head.header.incarnation
        if marked is not None:  # a marker from before incarnations: its n, on today's life
            return inc, marked[1]
        try:
            last = (await store.read(store_id, head.n - 1, head.n, incarnation=inc))[-1] if head.n else None
        except SessionReplacedError:
            raise ReplacedAdkSessionError(store_id) from None
        except SessionNotFoundError:
            raise AdkSessionNotFoundError(f"Session {session.id} not found.") from None
        if session.events:
            fresh = last is not None and _event_id(last) == session.events[-1].id
        else:
            fresh = last is not None and last.type == SESSION
        if not fresh:
            raise StaleAdkSessionError(store_id, -1, head.n)
        return inc, head.n

    async def append_event(self, session: Session, event: Event) -> Event:
        if event.partial:
            return event
        # ADK's order: temp state reaches the in-memory session, then leaves the delta for good.
        self._apply_temp_state(session, event)
        event = self._trim_temp_delta_state(event)
        store_id = self.session_store_id(session.app_name, session.user_id, session.id)
        # The whole event and its state deltas are checked before anything is written (a refused
        # append writes nothing). State is what the stored event says: its JSON dump, where bytes
        # are base64 text and NaN is null, as in ADK's own stored events.
        _check_state({k: None for k in event.actions.state_delta or {}})  # the JSON dump mangles bad keys
        try:
            data = event.model_dump(exclude_none=True, mode="json")
        except (PydanticSerializationError, ValueError, TypeError, RecursionError) as e:
            raise InvalidEntryError(f"event is not serializable (its state_delta?): {e}") from None
        delta = (data.get("actions") or {}).get("state_delta") or {}
        _check_state(delta)
        entries = self._event_entries(data)
        key = _digest("adk-event", json.dumps(data, sort_keys=True, separators=(",", ":")))
        scoped_writes = self._scoped_writes(session.app_name, session.user_id, _scoped(delta), f"{store_id}#{key}")
        incarnation, expected = await self._position(session, store_id)
        try:
            stored = await self._store.put(store_id, expected, entries, idempotency_key=key, incarnation=incarnation)
        except SessionConflictError as e:
            raise StaleAdkSessionError(store_id, e.expected_n, e.actual_n) from None
        except SessionReplacedError:
            raise ReplacedAdkSessionError(store_id) from None
        except SessionNotFoundError:
            raise AdkSessionNotFoundError(f"Session {session.id} not found.") from None
        await self._write_scoped(scoped_writes)
        if stored[0].n < expected:
            return event  # an equal event that already landed: nothing applied twice
        self._mark(session, incarnation, stored[-1].n + 1)
        session.last_update_time = event.timestamp
        return self._commit_event_to_session(session, event)  # type: ignore[no-any-return,unused-ignore]

    # ------------------------------------------------------------------ sync twins, closing

    def create_session_sync(
        self,
        *,
        app_name: str,
        user_id: str,
        state: dict[str, Any] | None = None,
        session_id: str | None = None,
    ) -> Session:
        """`create_session`, blocking (as ``InMemorySessionService.create_session_sync``); works
        inside and outside a running event loop (it runs on a private loop thread)."""
        return self._sync(
            lambda: self.create_session(app_name=app_name, user_id=user_id, state=state, session_id=session_id)
        )

    def get_session_sync(
        self,
        *,
        app_name: str,
        user_id: str,
        session_id: str,
        config: GetSessionConfig | None = None,
    ) -> Session | None:
        return self._sync(
            lambda: self.get_session(app_name=app_name, user_id=user_id, session_id=session_id, config=config)
        )

    def list_sessions_sync(self, *, app_name: str, user_id: str | None = None) -> ListSessionsResponse:
        return self._sync(lambda: self.list_sessions(app_name=app_name, user_id=user_id))

    def delete_session_sync(self, *, app_name: str, user_id: str, session_id: str) -> None:
        self._sync(lambda: self.delete_session(app_name=app_name, user_id=user_id, session_id=session_id))

    def append_event_sync(self, session: Session, event: Event) -> Event:
        return self._sync(lambda: self.append_event(session, event))

    @staticmethod
    def _sync(fn: Callable[[], Awaitable[T]]) -> T:
        return run_sync(fn)

    async def close(self) -> None:
        """Close the store when this service opened it (from a URI); a store given to the
        constructor belongs to the caller and stays open."""
        if not self._owns_store:
            return
        self._owns_store = False
        # The store's connections belong to the first event loop that used it; once that loop has
        # ended they are gone with it (nothing to close, and redis-py cannot close them from here).
        home = self._stores.home_loop()
        if home is not None and home is not asyncio.get_running_loop() and home.is_closed():
            return
        await self.store.aclose()

    async def aclose(self) -> None:
        await self.close()

    async def __aenter__(self) -> RedisAdkSessionService:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: types.TracebackType | None,
    ) -> None:
        await self.close()


def _factory(uri: str, **kwargs: Any) -> RedisAdkSessionService:
    """ADK's ``ServiceFactory`` for our schemes: ``(uri, agents_dir=..., **session_db_kwargs)``."""
    return RedisAdkSessionService(uri=uri, **kwargs)


def register(registry: Any = None, *, schemes: Sequence[str] | None = None) -> list[str]:
    """Put `RedisAdkSessionService` in ADK's service registry (``get_service_registry()`` unless
    given), so ``adk web/run/api_server --session_service_uri redis-session://host:6379/0`` picks
    it. Registers `SCHEMES`, and ``redis``/``rediss`` only where nothing holds them yet (ADK
    2.13 registers neither; a scheme ADK takes later stays ADK's). `schemes` registers exactly
    those (overriding). Returns the schemes registered. Importing this module calls it once."""
    if registry is None:
        from google.adk.cli.service_registry import get_service_registry

        registry = get_service_registry()
    if schemes is not None:
        chosen = list(schemes)
    else:
        taken = getattr(registry, "_session_factories", None)
        chosen = list(SCHEMES)
        if isinstance(taken, dict):
            chosen += [s for s in _PLAIN_SCHEMES if taken.get(s) in (None, _factory)]
    for scheme in chosen:
        registry.register_session_service(scheme, _factory)
    return chosen


def adk_names(store_id: str) -> tuple[str, ...]:
    """The ADK names a store id of this adapter stands for: ``("s", app, user, session)``,
    ``("u", app, user)``, ``("a", app)`` or ``("i", app)`` (the namespace dropped)."""
    parts = store_id.split(":")
    return (parts[1], *(unescape(p) for p in parts[2:]))


try:
    register()
except ImportError:  # an ADK without the CLI's registry: construct the service yourself
    pass
