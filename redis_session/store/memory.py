"""`MemorySessionStore`: the `SessionStore` contract in process, the reference behaviour.

Every backend passes one contract suite (`redis_session.testing.contract`); this store is what the
Redis store must behave like, and what tests and stateless runs use.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import msgspec

from ..cold.segments import ColdSegment, ColdTier, cold_end, encode_cold
from ..errors import (
    IdempotencyKeyReusedError,
    InvalidEntryError,
    SegmentMissingError,
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionError,
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
    new_incarnation,
    now_ms,
)
from ..projection.chunks import LiveRecord, live_draft
from .protocol import IDEMPOTENCY_WINDOW, ColdState, StorageCheck
from .protocol import SessionStore as SessionStore  # re-exported: modules import it from here
from .rules import Segment, StoreRules, check_list, check_read, lineage_for, plan_read
from .rules import check_header as check_header  # re-exported: modules import it from here


class _MemSession:
    __slots__ = (
        "changed",
        "cold",
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
        self.lease: tuple[str, int] | None = None  # token, expiry (ms on the store's clock)
        self.ttl_ms = ttl_ms
        self.expires_at: int | None = None  # ms on the store's clock
        self.proj: tuple[int, bytes] | None = None
        self.live: list[LiveRecord] = []
        self.live_seq = 0
        self.live_expires_at: int | None = None  # ms on the store's clock
        self.changed = anyio.Event()
        self.cold: list[ColdSegment] = []  # archived ranges of the own log (gone from `entries`)

    def live_records(self, now: int) -> list[LiveRecord]:
        """The live stream's records, as of `now` (ms on the store's clock): gone once expired."""
        if self.live_expires_at is not None and self.live_expires_at <= now:
            self.live, self.live_expires_at = [], None
        return self.live

    def head(self) -> SessionHead:
        return SessionHead(header=self.header, n=self.n, updated_at=self.updated_at, last_cut=self.last_cut)


def _live_seq(rid: str) -> int:
    """A live stream id "<ms>-<seq>" as one comparable int; anything else reads as the start."""
    ms, _, seq = rid.partition("-")
    if not ms.isdigit():
        return 0
    return (int(ms) << 20) + (int(seq) if seq.isdigit() else 0)


class MemorySessionStore(StoreRules):
    """An in-process `SessionStore` with exactly the Redis store's behaviour.

    `clock` (a callable returning ms since the epoch; default the wall clock) stamps entries and
    new headers and runs TTLs and leases, as the server's clock does on Redis.

    >>> store = MemorySessionStore()
    """

    def __init__(
        self,
        *,
        vocabulary: Vocabulary | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        max_batch: int = DEFAULT_MAX_BATCH,
        clock: Callable[[], int] = now_ms,
        cold: ColdTier | str | None = None,
    ) -> None:
        #: the store's clock, ms since the epoch: entry times, created_at, TTLs and leases (a
        #: test passes one it can move forward instead of sleeping)
        self.clock = clock
        #: where archived segments live (`redis_session.archiver`); None: nothing can be archived
        self.cold: ColdTier | None = ColdTier(cold, prefix="memory") if isinstance(cold, str) else cold
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
        if s.expires_at is not None and s.expires_at <= self.clock():
            # A session with live branches does not expire (they read its entries), as on Redis;
            # its expired branches go first, and the last one gone restarts its clock.
            for kid in builtins.list(s.kids):
                self._get(kid, include_deleted=True)
            if session_id not in self._sessions:
                return None  # a hidden parent purged with its last branch
            if not s.kids and s.expires_at is not None and s.expires_at <= self.clock():
                self._purge(session_id)
                return None
        if s.deleted and not include_deleted:
            return None
        return s

    def _touch(self, s: _MemSession) -> None:
        if s.ttl_ms is not None:
            s.expires_at = self.clock() + s.ttl_ms

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
        check_read(session_id, start, stop)
        s = self._get(session_id)
        if s is None:
            raise SessionNotFoundError(session_id)
        if incarnation is not None and incarnation != s.header.incarnation:
            raise SessionReplacedError(session_id)
        out: builtins.list[Entry] = []
        for anc, lo, hi in plan_read(s.segments, s.header.at or 0, s.n, start, stop):
            out.extend(await self._own_entries(anc or session_id, lo, hi))
        return out

    async def _own_entries(self, session_id: str, lo: int, hi: int) -> builtins.list[Entry]:
        """Entries [lo, hi) of a session's own log: the archived ones from the cold tier."""
        s = self._sessions[session_id]
        cold = s.cold
        top = min(hi, cold_end(cold, lo))
        hot = self._entries_of(session_id, max(lo, top), hi)  # taken now: an archive may move them
        if top <= lo:
            return hot
        if self.cold is None:
            seg = cold[0]
            raise SegmentMissingError(session_id, seg.lo, seg.hi, "?", "no cold tier: MemorySessionStore(cold=…)")
        try:
            return await self.cold.read(session_id, s.header.incarnation, cold, lo, top) + hot
        except SegmentMissingError:
            if self._sessions.get(session_id) is s and s.cold is cold:
                raise
            if self._sessions.get(session_id) is not s:  # deleted meanwhile
                raise SessionNotFoundError(session_id) from None
            return await self._own_entries(session_id, lo, hi)  # restored meanwhile

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
                return await self._own_entries(session_id, first, first + count)
            if expected_n is not None and expected_n != s.n:
                raise SessionConflictError(session_id, expected_n, s.n)
            for i, enc in enumerate(batch):
                check_against_n(enc, s.n + i, i)
            return self._append(s, batch, idempotency_key)

    def _append(
        self, s: _MemSession, batch: Sequence[EncodedEntry], idempotency_key: str | None
    ) -> builtins.list[Entry]:
        now = self.clock()
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
                header = msgspec.structs.replace(header, created_at=self.clock())
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
        check_list(parent, limit, cursor)
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
            if not s.kids and s.cold and self.cold is not None:
                with contextlib.suppress(Exception):  # what fails is left to the sweep
                    await self.cold.drop(session_id, s.header.incarnation, s.cold)
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

    async def swap_session(
        self,
        session_id: str,
        staged_id: str,
        *,
        incarnation: str,
        staged_incarnation: str | None = None,
        replaced_created_at: int | None = None,
    ) -> SessionHead:
        """As `RedisSessionStore.swap_session`: the complete session `staged_id` becomes the
        session `session_id` (life `incarnation`) in one step; `staged_id` is gone after (a retry
        that finds it done answers the head)."""
        validate_session_id(session_id)
        validate_session_id(staged_id)
        async with self._lock:
            old = self._get(session_id)
            if old is None:
                raise SessionNotFoundError(session_id)
            if staged_incarnation and old.header.incarnation == staged_incarnation and self._get(staged_id) is None:
                return old.head()
            if old.header.incarnation != incarnation:
                raise SessionReplacedError(session_id, "it was replaced while the import ran")
            if old.kids:
                raise SessionAlreadyExistsError(session_id, "it has live branches, so it cannot be replaced")
            new = self._get(staged_id)
            if new is None:
                raise SessionNotFoundError(staged_id)
            self._purge(session_id)
            self._sessions.pop(staged_id)
            new.header = msgspec.structs.replace(new.header, id=session_id)
            self._sessions[session_id] = new
            new.changed.set()
            new.changed = anyio.Event()
            return new.head()

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
        check_read(session_id, start, None)
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
            streamed = live_draft(s.live_records(self.clock()))
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
        live = s.live_records(self.clock())
        ids = []
        for r in records:
            # ids as Redis makes them: "<ms>-<seq>", increasing
            ms = max(self.clock(), s.live_seq >> 20)
            s.live_seq = max(s.live_seq + 1, ms << 20)
            rid = f"{s.live_seq >> 20}-{s.live_seq & 0xFFFFF}"
            live.append(msgspec.structs.replace(r, id=rid))
            ids.append(rid)
        if trim_before is not None:
            floor = _live_seq(trim_before)
            s.live = [r for r in live if _live_seq(r.id) >= floor]
        if expire_ms is not None:
            s.live_expires_at = self.clock() + expire_ms
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
        return [r for r in s.live_records(self.clock()) if _live_seq(r.id) > floor]

    async def tail_live(
        self, session_id: str, start: int = 0, *, live_after: str = "0-0", incarnation: str | None = None
    ) -> AsyncIterator[Entry | LiveRecord]:
        validate_session_id(session_id)
        check_read(session_id, start, None)
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
            fresh = [r for r in s.live_records(self.clock()) if _live_seq(r.id) > seen]
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
        validate_session_id(session_id)
        raw = self._draft_bytes(draft)
        s = self._get(session_id)
        if s is None:
            raise SessionNotFoundError(session_id)
        s.draft = None if raw is None else msgspec.json.decode(raw)
        self._touch(s)

    async def acquire_lease(self, session_id: str, token: str, ttl_ms: int) -> bool:
        s = self._get(validate_session_id(session_id))
        if s is None:
            raise SessionNotFoundError(session_id)
        now = self.clock()
        if s.lease is not None and s.lease[1] > now and s.lease[0] != token:
            return False
        s.lease = (token, now + ttl_ms)
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

    async def storage_problems(self, session_id: str, n: int, at: int) -> StorageCheck:
        """Nothing is stored below `read` here: no storage problems (see `InspectableStore`)."""
        validate_session_id(session_id)
        return StorageCheck([])

    # -- cold tier (`ArchivableStore`)
    async def cold_state(self, session_id: str) -> ColdState | None:
        validate_session_id(session_id)
        s = self._get(session_id, include_deleted=True)
        if s is None:
            return None
        return ColdState(
            incarnation=s.header.incarnation,
            n=s.n,
            own_start=s.header.at or 0,
            cold=builtins.list(s.cold),
            cold_raw=encode_cold(s.cold) if s.cold else b"",
            updated_at=s.updated_at,
            last_cut=s.last_cut,
            ephemeral=s.ttl_ms is not None,
            deleted=s.deleted,
        )

    def _committing(self, session_id: str, state: ColdState) -> _MemSession | None:
        s = self._get(session_id)
        if s is None:
            raise SessionNotFoundError(session_id)
        if s.header.incarnation != state.incarnation:
            raise SessionReplacedError(session_id, "archived while the session was replaced")
        return s if (encode_cold(s.cold) if s.cold else b"") == state.cold_raw else None

    async def commit_archive(self, session_id: str, state: ColdState, segment: ColdSegment) -> str:
        validate_session_id(session_id)
        async with self._lock:
            s = self._committing(session_id, state)
            if s is None:
                return "moved"
            if segment.hi > s.n or segment.lo != cold_end(s.cold, s.header.at or 0):
                raise SessionError(f"session {session_id!r}: the archived range is not the hot log's start")
            s.cold = [*s.cold, segment]  # a new list: a read in flight keeps the one it took
            for i in range(segment.lo, segment.hi):
                del s.entries[i]
            return "done"

    async def commit_restore(self, session_id: str, state: ColdState, entries: builtins.list[Entry]) -> str:
        validate_session_id(session_id)
        async with self._lock:
            s = self._committing(session_id, state)
            if s is None:
                return "moved"
            for e in entries:
                s.entries[e.n] = e
            s.cold = []
            return "done"

    async def aclose(self) -> None:
        return None
