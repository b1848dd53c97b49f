"""What both adapters share: one session's log, read incrementally and appended with expected n.

`SessionLog` keeps the n it has folded up to. Reads fetch only the entries after it; writes go
through `store.put(session_id, n, entries)` and, on a conflict (another writer appended first),
catch up and rebuild the entries from the fresh state before retrying, so no write is ever lost
or interleaved silently. The session is created on the first write (reads of a missing session
see an empty log and create nothing).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import SessionAlreadyExistsError, SessionConflictError, SessionNotFoundError
from ..keys import validate_session_id
from ..model import Entry, NewEntry, SessionHeader
from ..retry import conflict_backoff
from ..store import SessionStore

#: Attempts of one write under contention before the last conflict is raised.
MAX_ATTEMPTS = 100


def resolve_store(store_or_sessions: Any) -> SessionStore:
    """A `SessionStore`, given a store or a `Sessions` service (anything with a `.store`)."""
    inner = getattr(store_or_sessions, "store", None)
    store = inner if inner is not None and hasattr(inner, "put") else store_or_sessions
    for attr in ("head", "read", "put", "create"):
        if not callable(getattr(store, attr, None)):
            raise TypeError(f"expected a SessionStore or a Sessions, got {type(store_or_sessions).__name__}")
    return store  # type: ignore[no-any-return]


class SessionLog:
    """One session's log as an adapter sees it: `fold` is called with every entry in order
    (contiguous n from 0), `reset` when the session turned out to be a new one (deleted and
    created again under the same id), after which everything is folded again from 0."""

    def __init__(
        self,
        store: SessionStore,
        session_id: str,
        *,
        origin: Any,
        fold: Callable[[Sequence[Entry]], None],
        reset: Callable[[], None],
        mark_types: Iterable[str] = (),
        ttl_ms: int | None = None,
    ) -> None:
        self.store = store
        self.ttl_ms = ttl_ms
        self.session_id = validate_session_id(session_id)
        self.n = 0
        self._origin = origin
        self._fold = fold
        self._reset = reset
        self._exists = False
        vocabulary = store.vocabulary
        for t in mark_types:
            # The adapter's own mark types, registered as "any JSON object" so a strict
            # vocabulary accepts them; a schema someone defined already is left alone.
            if t not in vocabulary:
                vocabulary.define(t, None)

    @property
    def max_batch(self) -> int:
        return self.store.max_batch

    def _restart(self) -> None:
        self.n = 0
        self._reset()

    async def catch_up(self) -> None:
        """Fold the entries other writers appended since we last looked."""
        try:
            entries = await self.store.read(self.session_id, self.n)
        except SessionNotFoundError:
            if self.n:
                self._restart()
            self._exists = False
            return
        self._exists = True
        if entries:
            self._apply(entries)

    def _apply(self, entries: Sequence[Entry]) -> None:
        self._fold(entries)
        self.n = entries[-1].n + 1

    async def _ensure_exists(self) -> None:
        if self._exists:
            return
        try:
            await self.store.create(SessionHeader(id=self.session_id, origin=self._origin), ttl_ms=self.ttl_ms)
        except SessionAlreadyExistsError:
            pass
        self._exists = True

    async def write(self, build: Callable[[], Sequence[NewEntry]], *, fresh: bool) -> list[Entry]:
        """Append what `build()` returns (called again after each conflict, against the caught-up
        state) at the current n. `fresh` catches up first (for entries that depend on the log);
        otherwise the first attempt is optimistic. An empty build writes nothing."""
        if fresh:
            await self.catch_up()
        key = uuid.uuid4().hex
        last: Exception | None = None
        for attempt in range(MAX_ATTEMPTS):
            entries = build()
            if not entries:
                return []
            await self._ensure_exists()
            try:
                stored = await self.store.put(self.session_id, self.n, entries, idempotency_key=key)
            except SessionConflictError as e:
                last = e
                if e.actual_n < self.n:
                    self._restart()  # a new session under the same id: our state is stale
                await self.catch_up()
                await conflict_backoff(attempt, base=0.0005, cap=0.05)
                continue
            except SessionNotFoundError as e:
                # Deleted since we looked: start over on a new session.
                last = e
                self._restart()
                self._exists = False
                continue
            self._apply(stored)
            return stored
        assert last is not None
        raise last
