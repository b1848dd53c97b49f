"""An OpenAI Agents SDK session on redis-session: `RedisEventSession`.

It satisfies the SDK's `agents.memory.Session` protocol (``session_id``, ``session_settings``,
``get_items(limit=None)``, ``add_items(items)``, ``pop_item()``, ``clear_session()``), so it drops
in wherever the SDK takes a session::

    store = redis_session.open_store("redis://localhost:6379/0")
    session = RedisEventSession("user-42", store)
    result = await Runner.run(agent, "Hi", session=session)

The log stays append-only; nothing is ever deleted:

- each item is one ``openai/item`` entry whose data is the item (a Responses input item, as JSON);
- ``pop_item()`` appends ``openai/pop {"n": k}``, a tombstone hiding item k (the last visible one);
- ``clear_session()`` appends ``cut {before: n, summary: [], reason: "openai-agents:clear_session"}``,
  which hides every entry before it;
- the SDK's atomic replacement hook (``_atomic_replace_items``, which
  ``OpenAIResponsesCompactionSession`` calls to swap the history for the compacted one) appends
  ONE batch: a ``cut`` (reason ``openai-agents:compaction``) and the new items. Another reader sees
  the old history or the new one, never an empty or a mixed one.

Built as the SDK's ``RedisSession`` is built, too: ``RedisEventSession.from_url(session_id,
url=..., redis_kwargs=..., key_prefix=..., ttl=..., session_settings=...)`` or
``RedisEventSession(session_id, redis_client=client, key_prefix=...)`` (``key_prefix`` is the
store's key prefix; ``rs`` by default, so every redis-session reader finds the session).

``ttl`` (seconds, as in the SDK) makes a session this instance creates ephemeral: every key of it
expires ``ttl`` after its last write. Unlike the SDK's ``RedisSession``, a session that exists
already keeps its own expiry (a session is ephemeral or not from its creation; the store has no
call that changes it), so a ``ttl`` never makes another tool's durable session expire.
``pop_item``, ``clear_session`` and the replacement finish their write even when the caller is
cancelled (the cancellation is raised once the write has landed, as the SDK does), so a call never
stops between the store's commit and this instance's view of it. After ``close()`` of a session
built by ``from_url``, every call raises ``RuntimeError``. An item that is not JSON raises
``TypeError``, as in the SDK. One session works from several event loops (``Runner.run_sync`` next
to ``asyncio.run``): each loop gets its own connections.

A session object belongs to one life of its id: the incarnation it first sees is checked by the
store on every read and write, so once the id is deleted and created again by someone else (a
new conversation, however long), every call raises `SessionReplacedError`; nothing is written to,
or read from, the new conversation. Open a new ``RedisEventSession`` to work on it. A session that
was only deleted (or expired) reads as empty, and the next write starts a new one.

``get_items`` folds those: the items of the entries with n >= the last cut's ``before`` that no
pop hid (after a compaction by another tool, the cut's ``summary`` messages come first, as
``{role, content}`` items). Every write is an expected-n append: concurrent writers (other pods,
other instances) conflict, catch up and retry, so none of their items are lost, doubled or
reordered within a call (a batch lands whole); the SDK's ``Session`` has no notion of a conflict
(the Runner's ``add_items`` must not fail), so two turns run at once on one session are NOT
serialised: their batches land in the order they arrive (``[q0, q1, a1, a0]``). Run one turn
at a time per session (a lease, a queue) when the order matters. ``pop_item`` pops exactly the
item it returns, even while others append. A write whose reply was lost is re-sent with its
idempotency key until the store's socket timeout; when it gives up, the
``StoreUnavailableError`` says the write may have landed, and the caller's retry of the same call
on the same instance is that same write (it lands once; a retried ``pop_item`` pops once). A
compaction (``_atomic_replace_items``) keeps the items other writers added after the history it
summarised was read, after the summary. The SDK's
own ``RedisSession`` has neither the expected-n check nor the audit trail. The session is created
on the first write. It satisfies the protocol structurally (as the SDK asks third-party sessions
to), so importing it does not need the SDK; running agents does (the ``openai-agents`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio

from ..errors import InvalidEntryError
from ..model import CUT, Entry, NewEntry, lossless_json
from ..shield import finish_then_cancel
from ._log import SessionLog, resolve_store
from ._loops import LoopStores

if TYPE_CHECKING:
    from agents.items import TResponseInputItem
    from agents.memory import SessionSettings

    from ..redis.store import RedisSessionStore

ITEM = "openai/item"
POP = "openai/pop"
CLEAR_REASON = "openai-agents:clear_session"
COMPACTION_REASON = "openai-agents:compaction"
_SUMMARY_ROLES = frozenset({"user", "assistant", "system", "developer"})

__all__ = ["CLEAR_REASON", "COMPACTION_REASON", "ITEM", "POP", "RedisEventSession"]

T = TypeVar("T")


class _CallLock:
    """Serialises the calls of one instance across tasks AND event loops (threads): a lock per
    loop orders the tasks of that loop fairly; a thread lock, taken without blocking the loop,
    orders the loops (an ``anyio.Lock`` is bound to one loop: two threads deadlocked on it)."""

    def __init__(self) -> None:
        self._thread = threading.Lock()
        self._guard = threading.Lock()  # held only for the dict lookup below
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.Lock] = weakref.WeakKeyDictionary()

    @contextlib.asynccontextmanager
    async def __call__(self) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        with self._guard:  # a dict insert from several threads, under a short lock
            local = self._loops.get(loop)
            if local is None:
                local = self._loops[loop] = anyio.Lock()
        async with local:
            pause = 0.0005
            while not self._thread.acquire(blocking=False):
                await anyio.sleep(pause)
                pause = min(pause * 2, 0.01)
            try:
                yield
            finally:
                self._thread.release()


def _default_settings() -> Any:
    try:
        from agents.memory import SessionSettings
    except ImportError:  # the SDK is not installed: the protocol still works, without a limit
        return None
    return SessionSettings()


def _coerce_settings(settings: Any) -> Any:
    """The SDK's own coercion: a dict with an unknown key raises ``TypeError: Unknown session
    settings``, like every SDK session."""
    if settings is None:
        return _default_settings()
    try:
        from agents.memory.session_settings import coerce_session_settings
    except ImportError as e:
        raise ImportError(
            f"session settings need the OpenAI Agents SDK: pip install 'redis-agent-session[openai-agents]'; {e}"
        ) from e

    return coerce_session_settings(settings)


def _as_item(item: Any, index: int) -> dict[str, Any]:
    """`item` as the JSON object it is stored as; ``TypeError`` when it is not one (the SDK's
    ``json.dumps`` raises ``TypeError`` too), before anything is written."""
    out: Any = None
    if isinstance(item, Mapping):
        out = dict(item)
    else:
        dump = getattr(item, "model_dump", None)  # a pydantic Responses type
        if callable(dump):
            out = dump(mode="json", exclude_unset=True)
    if not isinstance(out, dict):
        raise TypeError(f"a session item must be a JSON object (dict), got {type(item).__name__}")
    try:
        lossless_json(out, f"session item {index}")
    except InvalidEntryError as e:
        raise TypeError(str(e)) from None
    return out


def _items_of(items: Any) -> list[dict[str, Any]]:
    return [_as_item(item, i) for i, item in enumerate(items)]


def _store_of(store: Any, redis_client: Any, key_prefix: str | None) -> Any:
    """The store of a session: `store` (a store or a `Sessions`), or one over `redis_client`."""
    if redis_client is None:
        if store is None:
            raise TypeError("RedisEventSession needs a store (or a Sessions), or redis_client=")
        if key_prefix is not None:
            raise TypeError("key_prefix goes with redis_client=; a store has its own prefix")
        return resolve_store(store)
    if store is not None:
        raise TypeError("give a store or redis_client=, not both")
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster

    from ..redis.store import RedisSessionStore

    if not isinstance(redis_client, (aioredis.Redis, RedisCluster)):
        raise TypeError(f"redis_client must be a redis.asyncio client, got {type(redis_client).__name__}")
    return RedisSessionStore(redis_client, prefix="rs" if key_prefix is None else key_prefix)


class RedisEventSession:
    """The Agents SDK ``Session`` protocol over a redis-session log (see the module docstring).

    `store` is a `SessionStore` or a `Sessions` service; or, as in the SDK, `redis_client` (a
    ``redis.asyncio`` client the caller keeps and closes) with `key_prefix` (the store's prefix,
    ``rs`` by default). `session_settings` (an ``agents.memory.SessionSettings`` or a dict;
    ``SessionSettings()`` by default, as in the SDK) gives the default ``limit`` of `get_items`.
    `ttl` (seconds) makes a session this instance creates ephemeral (one that exists already
    keeps its own expiry). Calls on one instance are serialised, across tasks and threads;
    several instances (or pods) may share a session.
    """

    def __init__(
        self,
        session_id: str,
        store: Any = None,
        *,
        redis_client: Any = None,
        key_prefix: str | None = None,
        session_settings: SessionSettings | Mapping[str, Any] | None = None,
        ttl: int | None = None,
        origin: Any = None,
    ) -> None:
        store = _store_of(store, redis_client, key_prefix)
        self.session_id = session_id
        self.session_settings: SessionSettings | None = _coerce_settings(session_settings)
        if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or ttl <= 0):
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
        self.ttl = ttl
        self._owned: RedisSessionStore | None = None
        self._closed = False
        self._items: dict[int, dict[str, Any]] = {}  # n -> item, not popped (cut-hidden ones too)
        self._before = 0
        self._summary: list[dict[str, Any]] = []
        self._lock = _CallLock()
        # the log's n at the first get_items since this instance's last write: the history a
        # compaction that follows summarised (`_atomic_replace_items`)
        self._seen: int | None = None
        self._log = SessionLog(
            LoopStores(store),
            session_id,
            origin={"adapter": "openai-agents"} if origin is None else origin,
            fold=self._fold,
            reset=self._reset,
            mark_types=(ITEM, POP),
            ttl_ms=None if ttl is None else ttl * 1000,
        )

    @classmethod
    def from_url(
        cls,
        session_id: str,
        *,
        url: str | None = None,
        redis_kwargs: Mapping[str, Any] | None = None,
        key_prefix: str | None = None,
        prefix: str | None = None,
        session_settings: SessionSettings | Mapping[str, Any] | None = None,
        ttl: int | None = None,
    ) -> RedisEventSession:
        """Like the SDK's ``RedisSession.from_url``: a store of its own (`url`, else
        ``$REDIS_URL``, else the embedded server; `redis_kwargs` go to the client), closed by
        `close()`, after which every call raises ``RuntimeError``. `key_prefix` (the SDK's name)
        or `prefix` is the store's key prefix (``rs`` by default)."""
        from ..redis.connect import open_store

        if key_prefix is not None and prefix is not None and key_prefix != prefix:
            raise TypeError("give key_prefix or prefix, not both")
        chosen = key_prefix if key_prefix is not None else prefix if prefix is not None else "rs"
        store = open_store(url, prefix=chosen, client_options=dict(redis_kwargs or {}))
        # (a session that fails to build leaves a client that never connected: nothing to close)
        session = cls(session_id, store, session_settings=session_settings, ttl=ttl)
        session._owned = store
        return session

    @property
    def store(self) -> Any:
        """The store (the one given, or the one `from_url` or `redis_client` made; inside an
        event loop, its twin for that loop)."""
        try:
            return self._log.store
        except RuntimeError:  # no running loop
            return self._log._store

    @property
    def incarnation(self) -> str | None:
        """The life of the id this session belongs to (None until it first sees one)."""
        return self._log.incarnation

    # ------------------------------------------------------------------ the fold

    def _reset(self) -> None:
        self._items.clear()
        self._before = 0
        self._summary = []

    def _fold(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            if e.type == ITEM:
                self._items[e.n] = e.data
            elif e.type == POP:
                k = e.data.get("n")
                if isinstance(k, int):
                    self._items.pop(k, None)
            elif e.type == CUT:
                self._before = int(e.data.get("before", e.n))
                self._summary = [
                    {"role": m["role"], "content": m.get("content") or ""}
                    for m in e.data.get("summary") or ()
                    if isinstance(m, dict) and m.get("role") in _SUMMARY_ROLES
                ]

    def _visible(self) -> list[tuple[int, dict[str, Any]]]:
        before = self._before
        return [(n, item) for n, item in self._items.items() if n >= before]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RedisEventSession is closed")

    # ------------------------------------------------------------------ the protocol

    async def get_items(self, limit: int | None = None) -> list[TResponseInputItem]:
        """The history in chronological order; with `limit` (else ``session_settings.limit``),
        the latest `limit` items (none for a limit <= 0)."""
        if limit is None and self.session_settings is not None:
            limit = self.session_settings.limit
        async with self._lock():
            self._check_open()
            await self._log.catch_up()
            items = [*self._summary, *(item for _, item in self._visible())]
            if self._seen is None:
                self._seen = self._log.n
        if limit is not None:
            items = items[-limit:] if limit > 0 else []
        return cast("list[TResponseInputItem]", copy.deepcopy(items))

    async def add_items(self, items: list[TResponseInputItem]) -> None:
        """Append the items, in order (one expected-n batch per store batch)."""
        self._check_open()
        converted = _items_of(items)
        if not converted:
            return
        async with self._lock():
            self._check_open()
            await self._log.append(ITEM, converted)
            self._seen = None

    async def pop_item(self) -> TResponseInputItem | None:
        """Hide the most recent item (an ``openai/pop`` tombstone) and return it; None if empty."""
        popped: list[dict[str, Any]] = []

        def build() -> list[NewEntry]:
            popped.clear()
            visible = self._visible()
            if not visible:
                return []
            n, item = visible[-1]
            popped.append(item)
            return [NewEntry(POP, {"n": n})]

        async with self._lock():
            self._check_open()
            await finish_then_cancel(self._log.write(build, fresh=True))
            self._seen = None
        return cast("TResponseInputItem", copy.deepcopy(popped[0])) if popped else None

    async def clear_session(self) -> None:
        """Hide every item with a ``cut`` (the entries stay in the log)."""

        def build() -> list[NewEntry]:
            if not self._visible() and not self._summary:
                return []
            n = self._log.n
            return [NewEntry(CUT, {"before": n, "summary": [], "reason": CLEAR_REASON})]

        async with self._lock():
            self._check_open()
            await finish_then_cancel(self._log.write(build, fresh=True))
            self._seen = None

    async def _atomic_replace_items(self, items: list[TResponseInputItem]) -> bool:
        """The SDK's atomic replacement hook (``OpenAIResponsesCompactionSession`` calls it to
        swap the history for the compacted one): ONE batch, a ``cut`` hiding everything before
        it and then `items`. False (the SDK then clears and adds) when the items do not fit in
        one batch, and on a subclass (as the SDK's own sessions do: the subclass's overridden
        ``clear_session`` / ``add_items`` must run, so the replacement may not bypass them)."""
        if type(self) is not RedisEventSession:
            return False
        converted = _items_of(items)
        if len(converted) + 1 > self._log.max_batch:
            return False

        def build() -> list[NewEntry]:
            seen = self._seen
            # The history was summarised as read at `seen`: items other writers added since (on
            # the caught-up state) stay visible, after the summary, in their order.
            later = [] if seen is None else [item for n, item in self._visible() if n >= seen]
            cut = NewEntry(CUT, {"before": self._log.n, "summary": [], "reason": COMPACTION_REASON})
            return [cut, *(NewEntry(ITEM, item) for item in [*converted, *later])]

        async with self._lock():
            self._check_open()
            await finish_then_cancel(self._log.write(build, fresh=True))
            self._seen = None
        return True

    # ------------------------------------------------------------------ extras

    async def ping(self) -> bool:
        """Whether the store answers (``RuntimeError`` once closed)."""
        self._check_open()
        try:
            await self._log.store.head(self.session_id)
        except Exception:
            return False
        return True

    async def close(self) -> None:
        """Close the store if `from_url` opened it, and make every later call raise; a store
        passed in is the caller's to close (then this is a no-op, as in the SDK)."""
        async with self._lock():
            if self._owned is None:
                return
            self._closed = True
            self._owned = None
            stores = self._log._stores
            assert stores is not None
            await stores.aclose()
