"""The `SessionStore` contract and `MemorySessionStore`, its in-process implementation.

Every backend passes one contract suite (tests/test_store_contract.py). The memory store is the reference:
it is what the Redis store must behave like, and what tests and stateless runs use.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import anyio
import msgspec

from ..errors import (
    IdempotencyKeyReusedError,
    InvalidEntryError,
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionNotFoundError,
    SessionReplacedError,
)
from ..keys import index_member, validate_session_id
from ..model import (
    CUT,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_ENTRY_BYTES,
    EncodedEntry,
    Entry,
    NewEntryLike,
    Page,
    SessionHead,
    SessionHeader,
    Vocabulary,
    batch_digest,
    check_against_n,
    encode_batch,
    new_incarnation,
    now_ms,
)
from ..projection.chunks import LiveRecord, live_draft

IDEMPOTENCY_WINDOW = 1024
MAX_READ_RANGE = 100_000


@runtime_checkable
class SessionStore(Protocol):
    """Where sessions live. See docs/design.md §4; `MemorySessionStore` is the reference behaviour."""

    vocabulary: Vocabulary

    async def head(self, session_id: str) -> SessionHead | None: ...

    async def read(
        self, session_id: str, start: int = 0, stop: int | None = None, *, incarnation: str | None = None
    ) -> list[Entry]:
        """Entries [start, stop) of one incarnation (raises `SessionReplacedError` when the id
        names another one than `incarnation`; None: whichever is current)."""
        ...

    async def put(
        self,
        session_id: str,
        expected_n: int | None,
        entries: Sequence[NewEntryLike],
        *,
        idempotency_key: str | None = None,
        incarnation: str | None = None,
    ) -> list[Entry]:
        """Append; with `incarnation`, only to that life of the id (else `SessionReplacedError`,
        checked atomically with the write: nothing is written)."""
        ...

    async def create(
        self, header: SessionHeader, entries: Sequence[NewEntryLike] = (), *, ttl_ms: int | None = None
    ) -> SessionHead: ...

    async def list(
        self, *, parent: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[SessionHeader]: ...

    async def delete(self, session_id: str) -> bool: ...

    async def links(self, session_id: str) -> tuple[builtins.list[str], builtins.list[str]]:
        """The branches linked to a session, live or deleted: ``(live, stale)`` child ids.

        A live link keeps the session's entries (a deleted session stays hidden for it); a stale one
        (its child does not exist, or is another life of that id: a branch cut short between its
        two steps, or expired) keeps them for nothing. Works on a deleted (hidden) session too."""
        ...

    async def repair_links(self, session_id: str) -> builtins.list[str]:
        """Drop a session's stale child links (see `links`); returns their child ids. A hidden
        session left without links is purged, and an ephemeral one expires again."""
        ...

    def tail(self, session_id: str, start: int = 0, *, incarnation: str | None = None) -> AsyncIterator[Entry]:
        """Entries from `start`, live. Ends when the session is deleted; raises
        `SessionReplacedError` when the id names another incarnation than the tail began on
        (or than `incarnation`)."""
        ...

    async def get_draft(self, session_id: str, *, live: bool = True) -> dict[str, Any] | None:
        """The open streamed answer so far (`live_draft` of the live stream), else the draft
        `set_draft` left; with ``live=False`` only the latter."""
        ...

    async def set_draft(self, session_id: str, draft: dict[str, Any] | None) -> None: ...

    async def live_add(
        self,
        session_id: str,
        records: Sequence[LiveRecord],
        *,
        expire_ms: int | None = None,
        trim_before: str | None = None,
    ) -> builtins.list[str]:
        """Add records to the session's live stream (no log write, no script); drop records
        before stream id `trim_before`; the stream expires `expire_ms` from now. Their ids."""
        ...

    async def read_live(self, session_id: str, after: str | None = None) -> builtins.list[LiveRecord]:
        """The live stream's records after stream id `after` (else all), oldest first."""
        ...

    def tail_live(
        self, session_id: str, start: int = 0, *, live_after: str = "0-0", incarnation: str | None = None
    ) -> AsyncIterator[Entry | LiveRecord]:
        """`tail`, interleaved with the live records after `live_after` as they land."""
        ...

    async def acquire_lease(self, session_id: str, token: str, ttl_ms: int) -> bool: ...

    async def release_lease(self, session_id: str, token: str) -> bool: ...

    async def publish(self, event: str, payload: dict[str, Any]) -> None: ...

    async def get_projection(self, session_id: str, *, incarnation: str | None = None) -> tuple[int, bytes] | None:
        """The projector's cached snapshot: (n it covers, serialized state), or None (also when
        it is not a snapshot of `incarnation`, if given)."""
        ...

    async def put_projection(self, session_id: str, n: int, state: bytes, *, incarnation: str | None = None) -> bool:
        """Store a snapshot covering [0, n) unless one at >= n is there already; with
        `incarnation`, refused (`SessionReplacedError`) when the session is another one now."""
        ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------- shared rules


def check_read_range(start: int, stop: int | None) -> None:
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    if stop is not None and (not isinstance(stop, int) or isinstance(stop, bool) or stop < 0):
        raise ValueError(f"stop must be None or an int >= 0, got {stop!r}")


def check_expected_n(expected_n: object) -> None:
    if expected_n is not None and (not isinstance(expected_n, int) or isinstance(expected_n, bool) or expected_n < 0):
        raise InvalidEntryError(f"expected_n must be None or an int >= 0, got {expected_n!r}")


def check_idempotency_key(key: object) -> None:
    if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= 256 or "\x00" in key):
        raise InvalidEntryError("idempotency_key must be a str of 1-256 characters (no NUL)")


def check_incarnation(incarnation: object) -> None:
    if incarnation is not None and (not isinstance(incarnation, str) or not 1 <= len(incarnation) <= 64):
        raise InvalidEntryError("incarnation must be None or a str of 1-64 characters (SessionHeader.incarnation)")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_header(header: SessionHeader) -> None:
    if not isinstance(header, SessionHeader):
        raise TypeError("header must be a SessionHeader")
    validate_session_id(header.id)
    if not _is_int(header.created_at) or not 0 <= header.created_at < 10**13:
        raise InvalidEntryError(f"created_at must be ms since the epoch (an int), got {header.created_at!r}")
    if not _is_int(header.format_version) or header.format_version < 1:
        raise InvalidEntryError(f"format_version must be an int >= 1, got {header.format_version!r}")
    if (header.parent is None) != (header.at is None):
        raise InvalidEntryError("a branch header needs both `parent` and `at`")
    if header.at is not None and (not _is_int(header.at) or header.at < 0):
        raise InvalidEntryError(f"at must be an int >= 0, got {header.at!r}")
    if header.parent is not None:
        validate_session_id(header.parent)
        if header.parent == header.id:
            raise InvalidEntryError("a session cannot be its own parent")
    if not _is_int(header.delegation_depth) or header.delegation_depth < 0:
        raise InvalidEntryError("delegation_depth must be an int >= 0")
    if header.title is not None and not isinstance(header.title, str):
        raise InvalidEntryError("title must be a str")
    if header.origin is not None:
        from ..model import lossless_json

        lossless_json(header.origin, "origin")


Segment = tuple[str, int, int]  # (ancestor id, lo, hi): entries [lo, hi) come from that ancestor's log


def lineage_for(parent_id: str, parent_at: int | None, parent_segments: Sequence[Segment], at: int) -> list[Segment]:
    """Where a branch at `at` of `parent` reads its prefix [0, at) from.

    A branch stores these few segments instead of a copy: reads stitch them, so a branch of a
    100 000-entry parent costs what a branch of a 10-entry parent costs.
    """
    own_start = parent_at or 0
    out: list[Segment] = []
    if at > own_start:
        out.append((parent_id, own_start, at))
    for anc, lo, hi in parent_segments:
        hi = min(hi, at)
        if hi > lo:
            out.append((anc, lo, hi))
    return out


def plan_read(segments: Sequence[Segment], own_start: int, n: int, start: int, stop: int | None) -> list[Segment]:
    """Which (session, lo, hi) ranges make up entries [start, stop) of a session, in order."""
    stop = n if stop is None else min(stop, n)
    out: list[Segment] = []
    for anc, lo, hi in sorted(segments, key=lambda s: s[1]):
        lo2, hi2 = max(lo, start), min(hi, stop)
        if hi2 > lo2:
            out.append((anc, lo2, hi2))
    lo2 = max(own_start, start)
    if stop > lo2:
        out.append(("", lo2, stop))  # "" is the session itself
    return out


# --------------------------------------------------------------------------- memory store


class _MemSession:
    __slots__ = (
        "changed",
        "deleted",
        "draft",
        "entries",
        "expires_at",
        "header",
        "idem",
        "kids",
        "last_cut",
        "lease",
        "live",
        "live_expires_at",
        "live_seq",
        "n",
        "proj",
        "segments",
        "ttl_ms",
        "updated_at",
    )

    def __init__(self, header: SessionHeader, segments: list[Segment], ttl_ms: int | None) -> None:
        self.header = header
        self.segments = segments
        self.entries: dict[int, Entry] = {}
        self.n = header.at or 0
        self.updated_at = header.created_at
        self.last_cut: int | None = None
        self.idem: dict[str, tuple[int, int, bytes]] = {}  # key -> first n, count, batch digest
        self.kids: set[str] = set()
        self.deleted = False
        self.draft: dict[str, Any] | None = None
        self.lease: tuple[str, float] | None = None
        self.ttl_ms = ttl_ms
        self.expires_at: float | None = None
        self.proj: tuple[int, bytes] | None = None
        self.live: list[LiveRecord] = []
        self.live_seq = 0
        self.live_expires_at: float | None = None
        self.changed = anyio.Event()

    def live_records(self) -> list[LiveRecord]:
        if self.live_expires_at is not None and self.live_expires_at <= anyio.current_time():
            self.live, self.live_expires_at = [], None
        return self.live

    def head(self) -> SessionHead:
        return SessionHead(header=self.header, n=self.n, updated_at=self.updated_at, last_cut=self.last_cut)


class StoreRules:
    """The checks every store makes before a write, in one place, so that every backend rejects
    exactly the same input (and nothing of a rejected batch is ever sent)."""

    vocabulary: Vocabulary
    max_entry_bytes: int
    max_batch: int

    def _encode(self, entries: Iterable[NewEntryLike], first_n: int | None) -> builtins.list[EncodedEntry]:
        return encode_batch(
            entries,
            self.vocabulary,
            first_n=first_n,
            max_entry_bytes=self.max_entry_bytes,
            max_batch=self.max_batch,
        )

    def _put_batch(
        self,
        expected_n: int | None,
        entries: Iterable[NewEntryLike],
        idempotency_key: str | None,
        incarnation: str | None = None,
    ) -> builtins.list[EncodedEntry]:
        check_expected_n(expected_n)
        check_idempotency_key(idempotency_key)
        check_incarnation(incarnation)
        return self._encode(entries, expected_n)

    def _create_batch(
        self, header: SessionHeader, entries: Iterable[NewEntryLike], ttl_ms: int | None
    ) -> builtins.list[EncodedEntry]:
        check_header(header)
        if ttl_ms is not None and (not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms <= 0):
            raise ValueError("ttl_ms must be a positive int")
        return self._encode(entries, header.at or 0)


def _live_seq(rid: str) -> int:
    """A live stream id "<ms>-<seq>" as one comparable int; anything else reads as the start."""
    ms, _, seq = rid.partition("-")
    if not ms.isdigit():
        return 0
    return (int(ms) << 20) + (int(seq) if seq.isdigit() else 0)


class MemorySessionStore(StoreRules):
    """An in-process `SessionStore` with exactly the Redis store's behaviour.

    >>> store = MemorySessionStore()
    """

    def __init__(
        self,
        *,
        vocabulary: Vocabulary | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        self.vocabulary = vocabulary if vocabulary is not None else Vocabulary()
        self.max_entry_bytes = max_entry_bytes
        self.max_batch = max_batch
        self._sessions: dict[str, _MemSession] = {}
        self._lock = anyio.Lock()
        self._subscribers: builtins.list[Any] = []
        self.events: builtins.list[tuple[str, dict[str, Any]]] = []

    # -- helpers
    def _get(self, session_id: str, *, include_deleted: bool = False) -> _MemSession | None:
        s = self._sessions.get(session_id)
        if s is None:
            return None
        if s.expires_at is not None and s.expires_at <= anyio.current_time():
            # A session with live branches does not expire (they read its entries), as on Redis;
            # its expired branches go first, and the last one gone restarts its clock.
            for kid in builtins.list(s.kids):
                self._get(kid, include_deleted=True)
            if session_id not in self._sessions:
                return None  # a hidden parent purged with its last branch
            if not s.kids and s.expires_at is not None and s.expires_at <= anyio.current_time():
                self._purge(session_id)
                return None
        if s.deleted and not include_deleted:
            return None
        return s

    def _touch(self, s: _MemSession) -> None:
        if s.ttl_ms is not None:
            s.expires_at = anyio.current_time() + s.ttl_ms / 1000

    def _purge(self, session_id: str) -> None:
        s = self._sessions.pop(session_id, None)
        if s is None:
            return
        s.changed.set()
        parent_id = s.header.parent
        if parent_id is not None:
            parent = self._sessions.get(parent_id)
            if parent is not None:
                parent.kids.discard(session_id)
                if parent.deleted and not parent.kids:
                    self._purge(parent_id)
                elif not parent.kids:
                    self._touch(parent)  # an ephemeral parent kept for its branches expires again

    def _entries_of(self, session_id: str, lo: int, hi: int) -> builtins.list[Entry]:
        s = self._sessions[session_id]
        return [s.entries[i] for i in range(lo, hi)]

    # -- contract
    async def head(self, session_id: str) -> SessionHead | None:
        validate_session_id(session_id)
        s = self._get(session_id)
        return None if s is None else s.head()

    async def read(
        self, session_id: str, start: int = 0, stop: int | None = None, *, incarnation: str | None = None
    ) -> builtins.list[Entry]:
        validate_session_id(session_id)
        check_read_range(start, stop)
        if stop is not None and stop - start > MAX_READ_RANGE:
            raise ValueError(f"a read covers at most {MAX_READ_RANGE} entries; page through longer logs")
        s = self._get(session_id)
        if s is None:
            raise SessionNotFoundError(session_id)
        if incarnation is not None and incarnation != s.header.incarnation:
            raise SessionReplacedError(session_id)
        out: builtins.list[Entry] = []
        for anc, lo, hi in plan_read(s.segments, s.header.at or 0, s.n, start, stop):
            out.extend(self._entries_of(anc or session_id, lo, hi))
        return out

    async def put(
        self,
        session_id: str,
        expected_n: int | None,
        entries: Sequence[NewEntryLike],
        *,
        idempotency_key: str | None = None,
        incarnation: str | None = None,
    ) -> builtins.list[Entry]:
        validate_session_id(session_id)
        batch = self._put_batch(expected_n, entries, idempotency_key, incarnation)
        async with self._lock:
            s = self._get(session_id)
            if s is None:
                raise SessionNotFoundError(session_id)
            if incarnation is not None and incarnation != s.header.incarnation:
                raise SessionReplacedError(session_id, "this write was meant for the session before")
            if idempotency_key is not None and idempotency_key in s.idem:
                first, count, digest = s.idem[idempotency_key]
                if digest != batch_digest(batch):
                    raise IdempotencyKeyReusedError(session_id, idempotency_key)
                return [s.entries[i] for i in range(first, first + count)]
            if expected_n is not None and expected_n != s.n:
                raise SessionConflictError(session_id, expected_n, s.n)
            for i, enc in enumerate(batch):
                check_against_n(enc, s.n + i, i)
            return self._append(s, batch, idempotency_key)

    def _append(
        self, s: _MemSession, batch: Sequence[EncodedEntry], idempotency_key: str | None
    ) -> builtins.list[Entry]:
        now = now_ms()
        stored = [enc.stored(s.n + i, now) for i, enc in enumerate(batch)]
        for e in stored:
            s.entries[e.n] = e
            if e.type == CUT:
                s.last_cut = e.n
        if idempotency_key is not None and stored:
            s.idem[idempotency_key] = (s.n, len(stored), batch_digest(batch))
            while len(s.idem) > IDEMPOTENCY_WINDOW:
                del s.idem[next(iter(s.idem))]
        s.n += len(stored)
        if stored:
            s.updated_at = now
        self._touch(s)
        old, s.changed = s.changed, anyio.Event()
        old.set()
        return stored

    async def create(
        self, header: SessionHeader, entries: Sequence[NewEntryLike] = (), *, ttl_ms: int | None = None
    ) -> SessionHead:
        batch = self._create_batch(header, entries, ttl_ms)
        async with self._lock:
            existing = self._get(header.id, include_deleted=True)
            if existing is not None:
                detail = "a deleted session with live branches holds this id" if existing.deleted else ""
                raise SessionAlreadyExistsError(header.id, detail)
            segments: builtins.list[Segment] = []
            parent: _MemSession | None = None
            if header.parent is not None:
                parent = self._get(header.parent)
                if parent is None:
                    raise SessionNotFoundError(header.parent)
                assert header.at is not None
                if header.at > parent.n:
                    raise InvalidEntryError(f"branch point at={header.at} is beyond the parent's n={parent.n}")
                segments = lineage_for(parent.header.id, parent.header.at, parent.segments, header.at)
            if header.created_at == 0:
                header = msgspec.structs.replace(header, created_at=now_ms())
            header = msgspec.structs.replace(header, incarnation=new_incarnation())  # every create: a new life
            s = _MemSession(header, segments, ttl_ms)
            self._sessions[header.id] = s
            if parent is not None:
                parent.kids.add(header.id)
            self._append(s, batch, None)
            if not batch:
                self._touch(s)
            return s.head()

    async def list(
        self, *, parent: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[SessionHeader]:
        if not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise ValueError("limit must be an int in [1, 1000]")
        if parent is not None:
            validate_session_id(parent)
        members = []
        for sid in builtins.list(self._sessions):
            s = self._get(sid)
            if s is None or (parent is not None and s.header.parent != parent):
                continue
            members.append((index_member(s.header.created_at, sid), s.header))
        members.sort(key=lambda m: m[0])
        if cursor is not None:
            members = [m for m in members if m[0] > cursor]
        page = members[:limit]
        next_cursor = page[-1][0] if len(members) > limit else None
        return Page(items=[h for _, h in page], cursor=next_cursor)

    async def delete(self, session_id: str) -> bool:
        validate_session_id(session_id)
        async with self._lock:
            s = self._get(session_id)
            if s is None:
                return False
            if s.kids:
                s.deleted = True
                s.draft = None
                s.proj = None
                s.lease = None
                s.live = []
                old, s.changed = s.changed, anyio.Event()
                old.set()
            else:
                self._purge(session_id)
            return True

    async def links(self, session_id: str) -> tuple[builtins.list[str], builtins.list[str]]:
        validate_session_id(session_id)
        s = self._get(session_id, include_deleted=True)
        if s is None:
            return [], []
        # kids change under the store's lock only, so they are never stale here; expired ones go now
        return [k for k in sorted(s.kids) if self._get(k, include_deleted=True) is not None], []

    async def repair_links(self, session_id: str) -> builtins.list[str]:
        await self.links(session_id)
        return []

    async def tail(self, session_id: str, start: int = 0, *, incarnation: str | None = None) -> AsyncIterator[Entry]:
        """Every entry with n >= start, then each new one as it lands; ends if the session is
        deleted, raises `SessionReplacedError` once the id names another incarnation."""
        validate_session_id(session_id)
        check_read_range(start, None)
        s = self._get(session_id)
        if s is None:
            raise SessionNotFoundError(session_id)
        if incarnation is not None and incarnation != s.header.incarnation:
            raise SessionReplacedError(session_id)
        nxt = start
        while True:
            s2 = self._get(session_id)
            if s2 is None:
                return
            if s2 is not s:
                raise SessionReplacedError(session_id)
            changed = s.changed
            if nxt < s.n:
                batch = await self.read(session_id, nxt, min(s.n, nxt + 1000))
                for e in batch:
                    yield e
                nxt = batch[-1].n + 1 if batch else s.n
                continue
            await changed.wait()

    async def get_draft(self, session_id: str, *, live: bool = True) -> dict[str, Any] | None:
        s = self._get(validate_session_id(session_id))
        if s is None:
            raise SessionNotFoundError(session_id)
        if live:
            streamed = live_draft(s.live_records())
            if streamed is not None:
                return streamed
        return s.draft

    async def live_add(
        self,
        session_id: str,
        records: Sequence[LiveRecord],
        *,
        expire_ms: int | None = None,
        trim_before: str | None = None,
    ) -> builtins.list[str]:
        validate_session_id(session_id)
        s = self._sessions.get(session_id)
        if s is None or s.deleted:
            return []  # Redis would keep them in an orphan key until it expires: nobody reads it
        live = s.live_records()
        ids = []
        for r in records:
            # ids as Redis makes them: "<ms>-<seq>", increasing
            ms = max(now_ms(), s.live_seq >> 20)
            s.live_seq = max(s.live_seq + 1, ms << 20)
            rid = f"{s.live_seq >> 20}-{s.live_seq & 0xFFFFF}"
            live.append(msgspec.structs.replace(r, id=rid))
            ids.append(rid)
        if trim_before is not None:
            floor = _live_seq(trim_before)
            s.live = [r for r in live if _live_seq(r.id) >= floor]
        if expire_ms is not None:
            s.live_expires_at = anyio.current_time() + expire_ms / 1000
        if records:
            old, s.changed = s.changed, anyio.Event()
            old.set()
        return ids

    async def read_live(self, session_id: str, after: str | None = None) -> builtins.list[LiveRecord]:
        validate_session_id(session_id)
        s = self._get(session_id)
        if s is None:
            return []
        floor = -1 if after is None else _live_seq(after)
        return [r for r in s.live_records() if _live_seq(r.id) > floor]

    async def tail_live(
        self, session_id: str, start: int = 0, *, live_after: str = "0-0", incarnation: str | None = None
    ) -> AsyncIterator[Entry | LiveRecord]:
        validate_session_id(session_id)
        check_read_range(start, None)
        s = self._get(session_id)
        if s is None:
            raise SessionNotFoundError(session_id)
        if incarnation is not None and incarnation != s.header.incarnation:
            raise SessionReplacedError(session_id)
        nxt, seen = start, _live_seq(live_after)
        while True:
            s2 = self._get(session_id)
            if s2 is None:
                return
            if s2 is not s:
                raise SessionReplacedError(session_id)
            changed = s.changed
            fresh = [r for r in s.live_records() if _live_seq(r.id) > seen]
            for r in fresh:
                seen = _live_seq(r.id)
                yield r
            if nxt < s.n:
                batch = await self.read(session_id, nxt, min(s.n, nxt + 1000))
                for e in batch:
                    yield e
                nxt = batch[-1].n + 1 if batch else s.n
                continue
            if not fresh:
                await changed.wait()

    async def set_draft(self, session_id: str, draft: dict[str, Any] | None) -> None:
        s = self._get(validate_session_id(session_id))
        if s is None:
            raise SessionNotFoundError(session_id)
        if draft is not None:
            from ..model import lossless_json

            raw = lossless_json(draft, "draft")
            if len(raw) > self.max_entry_bytes:
                raise InvalidEntryError(f"draft is {len(raw)} bytes; the limit is {self.max_entry_bytes}")
            draft = msgspec.json.decode(raw)
        s.draft = draft
        self._touch(s)

    async def acquire_lease(self, session_id: str, token: str, ttl_ms: int) -> bool:
        s = self._get(validate_session_id(session_id))
        if s is None:
            raise SessionNotFoundError(session_id)
        now = anyio.current_time()
        if s.lease is not None and s.lease[1] > now and s.lease[0] != token:
            return False
        s.lease = (token, now + ttl_ms / 1000)
        return True

    async def release_lease(self, session_id: str, token: str) -> bool:
        s = self._get(validate_session_id(session_id))
        if s is None or s.lease is None or s.lease[0] != token:
            return False
        s.lease = None
        return True

    async def publish(self, event: str, payload: dict[str, Any]) -> None:
        self.events.append((event, payload))

    async def get_projection(self, session_id: str, *, incarnation: str | None = None) -> tuple[int, bytes] | None:
        s = self._get(validate_session_id(session_id))
        if s is None or (incarnation is not None and incarnation != s.header.incarnation):
            return None
        return s.proj

    async def put_projection(self, session_id: str, n: int, state: bytes, *, incarnation: str | None = None) -> bool:
        s = self._get(validate_session_id(session_id))
        if s is None:
            raise SessionNotFoundError(session_id)
        if incarnation is not None and incarnation != s.header.incarnation:
            raise SessionReplacedError(session_id, "the snapshot was folded from the session before")
        if n > s.n:
            raise ValueError(f"snapshot n={n} is beyond the session's n={s.n}")
        if s.proj is not None and s.proj[0] >= n:
            return False
        s.proj = (n, bytes(state))
        return True

    async def aclose(self) -> None:
        return None
