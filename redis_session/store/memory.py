"""`MemorySessionStore`: the `SessionStore` contract in process, the reference behaviour.

Every backend passes one contract suite (`redis_session.testing.contract`); this store is what the
Redis store must behave like, and what tests and stateless runs use.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import msgspec

from ..cold.segments import ColdSegment, ColdTier, cold_end, encode_cold, segment_name
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
from ..keys import GONE_TTL_MS, index_member, is_staging_id, validate_session_id
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
from ..projection.chunks import (
    AnswerAck,
    AnswerBegun,
    AnswerEnded,
    AnswerState,
    Delta,
    LiveRecord,
    answer_budget,
    answer_refusal,
    chunk_row,
    deltas_cost,
    live_draft,
    merge_live,
)
from .protocol import IDEMPOTENCY_WINDOW, ColdState, StorageCheck
from .protocol import SessionStore as SessionStore  # re-exported: modules import it from here
from .rules import Segment, StoreRules, check_list, check_read, lineage_for, plan_read, tail_start
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
        #: id -> (the create keys of its deleted lives, when they are forgotten): `Keys.gone`
        self._gone: dict[str, tuple[set[str], int]] = {}
        #: where archived segments live (`redis_session.archiver`); None: nothing can be archived
        self.cold: ColdTier | None = ColdTier(cold, prefix="memory") if isinstance(cold, str) else cold
        if self.cold is not None and self.cold._prefix is None:
            self.cold.bind("memory")
        self.vocabulary = vocabulary if vocabulary is not None else Vocabulary()
        self.max_entry_bytes = max_entry_bytes
        self.max_batch = max_batch
        self._sessions: dict[str, _MemSession] = {}
        self._lock = anyio.Lock()
        self._pending: dict[tuple[str, str], int] = {}  # (session, object name) -> upload start
        self._subscribers: builtins.list[Any] = []
        self.events: builtins.list[tuple[str, dict[str, Any]]] = []
        # streamed answers' state, as lua/answer.lua keeps it: (session, answer) -> fields, expiry
        self._answers: dict[tuple[str, str], tuple[dict[str, Any], int]] = {}

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

    def _purge(self, session_id: str) -> builtins.list[tuple[str, _MemSession]]:
        """Remove a session (and the hidden ancestors it was the last branch of): those removed."""
        s = self._sessions.pop(session_id, None)
        if s is None:
            return []
        s.changed.set()
        gone = [(session_id, s)]
        parent_id = s.header.parent
        if parent_id is not None:
            parent = self._sessions.get(parent_id)
            if parent is not None:
                parent.kids.discard(session_id)
                if parent.deleted and not parent.kids:
                    gone += self._purge(parent_id)
                elif not parent.kids:
                    self._touch(parent)  # an ephemeral parent kept for its branches expires again
        return gone

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
        self,
        header: SessionHeader,
        entries: Sequence[NewEntryLike] = (),
        *,
        ttl_ms: int | None = None,
        parent_incarnation: str | None = None,
    ) -> SessionHead:
        batch = self._create_batch(header, entries, ttl_ms)
        async with self._lock:
            if header.create_key is not None and header.create_key.partition(".")[0] in self._gone_keys(header.id):
                raise SessionReplacedError.created_and_deleted(header.id)  # as append.lua: before the id
            existing = self._get(header.id, include_deleted=True)
            if existing is not None:
                if existing.deleted:
                    raise SessionAlreadyExistsError.held_by_branches(header.id, sorted(existing.kids))
                raise SessionAlreadyExistsError(header.id)
            segments: builtins.list[Segment] = []
            parent: _MemSession | None = None
            if header.parent is not None:
                parent = self._get(header.parent)
                if parent is None:
                    raise SessionNotFoundError(header.parent)
                if parent_incarnation is not None and parent.header.incarnation != parent_incarnation:
                    raise SessionReplacedError(header.parent, "the parent is another incarnation now: not branched")
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

    def _forget_life(self, session_id: str, s: _MemSession) -> None:
        """As delete.lua and swap.lua: the ending life's create key remembered, and every end of a
        life of the id restarts the clock of all of them."""
        own = {s.header.create_key.partition(".")[0]} if s.header.create_key else set()  # the key's part
        keys = self._gone_keys(session_id) | own
        if keys:
            self._gone[session_id] = (keys, self.clock() + GONE_TTL_MS)

    def _gone_keys(self, session_id: str) -> set[str]:
        """The create keys of `session_id`'s deleted lives not forgotten yet."""
        keys, until = self._gone.get(session_id, (set(), 0))
        if until <= self.clock():
            self._gone.pop(session_id, None)
            return set()
        return keys

    async def list(
        self, *, parent: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[SessionHeader]:
        check_list(parent, limit, cursor)
        members = []
        for sid in builtins.list(self._sessions):
            s = self._get(sid)
            if s is None or (parent is not None and s.header.parent != parent) or is_staging_id(sid):
                continue
            members.append((index_member(s.header.created_at, sid), s.header))
        members.sort(key=lambda m: m[0])
        if cursor is not None:
            members = [m for m in members if m[0] > cursor]
        page = members[:limit]
        next_cursor = page[-1][0] if len(members) > limit else None
        return Page(items=[h for _, h in page], cursor=next_cursor)

    async def delete(self, session_id: str, *, incarnation: str | None = None) -> bool:
        validate_session_id(session_id)
        async with self._lock:
            s = self._get(session_id)
            if s is None:
                return False
            if incarnation is not None and s.header.incarnation != incarnation:
                raise SessionReplacedError(
                    session_id, f"it is incarnation {s.header.incarnation} now; nothing was deleted"
                )
            self._forget_life(session_id, s)
            if s.kids:
                s.deleted = True
                s.draft = None
                s.proj = None
                s.lease = None
                s.live = []
                old, s.changed = s.changed, anyio.Event()
                old.set()
            else:
                # its segments, and those of the hidden parents purged with it, go with them
                for sid, gone in self._purge(session_id):
                    if gone.cold and self.cold is not None:
                        with contextlib.suppress(Exception):  # what fails is left to the sweep
                            await self.cold.drop(sid, gone.header.incarnation, gone.cold)
            return True

    async def drop_life_segments(self, session_id: str, incarnation: str) -> int:
        """As `RedisSessionStore.drop_life_segments`: every segment object of a life that is over."""
        validate_session_id(session_id)
        s = self._sessions.get(session_id)
        if s is not None and s.header.incarnation == incarnation:
            raise ValueError(f"session {session_id!r}: the life {incarnation!r} is still there")
        if self.cold is None:
            return 0
        keys = [info.key async for info in self.cold.objects.list(self.cold.life_dir(session_id, incarnation))]
        for key in keys:
            await self.cold.objects.delete(key)
        return len(keys)

    async def swap_session(
        self,
        session_id: str,
        staged_id: str,
        *,
        incarnation: str,
        staged_incarnation: str | None = None,
        replaced_created_at: int | None = None,
        replaced_parent: str | None = None,
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
            self._forget_life(session_id, old)  # as swap.lua: the replaced life's create key is remembered
            self._purge(session_id)
            self._sessions.pop(staged_id)
            new.header = msgspec.structs.replace(new.header, id=session_id)
            new.ttl_ms = new.expires_at = None  # the staging copy's expiry ends: it is the session now
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

    async def tail(
        self, session_id: str, start: int = 0, *, incarnation: str | None = None, resumed: bool = False
    ) -> AsyncIterator[Entry]:
        """Every entry with n >= start, then each new one as it lands; ends if the session is
        deleted, raises `SessionReplacedError` once the id names another incarnation."""
        check_read(session_id, start, None)
        s = self._get(session_id)
        if s is None:
            raise SessionNotFoundError(session_id)
        tail_start(session_id, start, s.n, s.header.incarnation, incarnation, resumed)
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

    async def get_draft(
        self, session_id: str, *, live: bool = True, incarnation: str | None = None
    ) -> dict[str, Any] | None:
        s = self._get(validate_session_id(session_id))
        if s is None:
            raise SessionNotFoundError(session_id)
        if incarnation is not None and s.header.incarnation != incarnation:
            raise SessionReplacedError(session_id)
        if live:
            streamed = live_draft(s.live_records(self.clock()), s.header.incarnation)
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

    # -- streamed answers: the rules of lua/answer.lua (the same replies, the same refusals)

    def _live_xadd(self, s: _MemSession, r: LiveRecord) -> str:
        live = s.live_records(self.clock())
        ms = max(self.clock(), s.live_seq >> 20)
        s.live_seq = max(s.live_seq + 1, ms << 20)
        rid = f"{s.live_seq >> 20}-{s.live_seq & 0xFFFFF}"
        live.append(msgspec.structs.replace(r, id=rid))
        return rid

    def _answer_prelude(
        self, session_id: str, answer: str, incarnation: str | None, ttl_ms: int
    ) -> tuple[_MemSession, int, dict[str, Any] | None]:
        s = self._get(validate_session_id(session_id))
        if s is None:
            raise SessionNotFoundError(session_id)
        cur = s.header.incarnation
        if incarnation and incarnation != cur:
            raise SessionReplacedError(session_id, f"answer {answer!r} belongs to another life of the id")
        ttl = ttl_ms if s.ttl_ms is None else min(ttl_ms, s.ttl_ms)
        got = self._answers.get((session_id, answer))
        st = None if got is None or got[1] <= self.clock() else got[0]
        return s, ttl, st

    def _answer_expire(self, s: _MemSession, key: tuple[str, str], st: dict[str, Any], ttl: int) -> None:
        self._answers[key] = (st, self.clock() + ttl)
        s.live_expires_at = self.clock() + ttl
        old, s.changed = s.changed, anyio.Event()
        old.set()

    def _answer_state(self, session_id: str, answer: str, s: _MemSession, st: dict[str, Any] | None) -> dict[str, Any]:
        if st is None:
            raise answer_refusal(9, [9], session_id, answer)
        if st["inc"] != s.header.incarnation:
            raise answer_refusal(8, [8], session_id, answer)
        return st

    def _row_rule(
        self, session_id: str, answer: str, st: dict[str, Any], first: int, count: int, row: EncodedEntry | None
    ) -> bool:
        """Whether to write the row (False: none, or a retry of the one that landed); raises the
        refusal otherwise."""
        if row is None:
            return False
        nxt = int(st["log"])
        if first > nxt or (first < nxt and first + count > nxt):
            raise answer_refusal(11, [11, nxt], session_id, answer, first)
        if first < nxt:
            if st.get(f"d{first}") != hashlib.sha1(row.data_raw).hexdigest():
                raise answer_refusal(14, [14, first], session_id, answer, first)
            return False
        return True

    def _size_rule(
        self, session_id: str, answer: str, st: dict[str, Any], write: bool, rest: Sequence[Delta], budget: bool
    ) -> int:
        """The answer's content cost once the row lands (as answer.lua's size rule); raises the
        refusal when it would pass the answer's budget."""
        sz = int(st.get("sz", 0))
        if not write:
            return sz
        sz += deltas_cost(rest)
        limit = answer_budget(self.max_entry_bytes)
        if budget and sz > limit:
            raise answer_refusal(16, [16, sz, limit, st["log"]], session_id, answer)
        return sz

    def _chunk_entry(
        self, answer: str, first: int, deltas: Sequence[Delta], turn: int | None, step: int | None
    ) -> EncodedEntry:
        row = chunk_row([d.chunk() for d in deltas], turn=turn, step=step, answer=answer, seq=first)
        return self._put_batch(None, [row], None)[0]

    async def answer_begin(
        self,
        session_id: str,
        answer: str,
        *,
        turn: int | None = None,
        step: int | None = None,
        n: int | None = None,
        incarnation: str | None = None,
        ttl_ms: int,
    ) -> AnswerBegun:
        s, ttl, st = self._answer_prelude(session_id, answer, incarnation, ttl_ms)
        cur = s.header.incarnation
        if st is not None and st["inc"] == cur:
            if (st.get("tu"), st.get("st")) != (turn, step):
                raise answer_refusal(15, [15], session_id, answer)
            return AnswerBegun(answer=answer, n=st["n"], begin_id=st["bid"], incarnation=cur, retry=True)
        at = s.n if n is None else n
        bid = self._live_xadd(s, LiveRecord(answer=answer, kind="begin", turn=turn, step=step, n=at, incarnation=cur))
        st = {"inc": cur, "n": at, "ln": at, "live": 0, "log": 0, "t": self.clock(), "bid": bid, "e": None, "r": None}
        st.update(tu=turn, st=step)
        self._answer_expire(s, (session_id, answer), st, ttl)
        return AnswerBegun(answer=answer, n=at, begin_id=bid, incarnation=cur)

    async def answer_deltas(
        self,
        session_id: str,
        answer: str,
        first: int,
        deltas: Sequence[Delta],
        *,
        live: bool = True,
        log: bool = True,
        turn: int | None = None,
        step: int | None = None,
        incarnation: str | None = None,
        ttl_ms: int,
    ) -> AnswerAck:
        self._batch_cost(session_id, answer, first, deltas, log)
        enc = self._chunk_entry(answer, first, deltas, turn, step) if log and deltas else None
        async with self._lock:
            s, ttl, st0 = self._answer_prelude(session_id, answer, incarnation, ttl_ms)
            st = self._answer_state(session_id, answer, s, st0)
            if st["e"] is not None:
                raise answer_refusal(10, [10, st["e"]], session_id, answer)
            write_row = self._row_rule(session_id, answer, st, first, len(deltas), enc)
            sz = self._size_rule(session_id, answer, st, write_row, deltas, True)
            if live and deltas and first > st["live"]:
                raise answer_refusal(11, [11, st["live"]], session_id, answer, first)
            row_n = None
            if write_row:
                assert enc is not None
                row_n = s.n
                if st["ln"] == s.n:
                    st["ln"] = s.n + 1
                self._append(s, [enc], None)
                st["log"] = first + len(deltas)
            sent = 0
            if live:
                for i, d in enumerate(deltas):
                    if first + i >= st["live"]:
                        self._live_xadd(s, LiveRecord(
                            answer=answer, kind=d.kind, index=first + i, text=d.text, call_id=d.call_id, name=d.name,
                            incarnation=s.header.incarnation,
                        ))  # fmt: skip
                        sent += 1
                st["live"] = max(st["live"], first + len(deltas))
            st["t"] = self.clock()
            if not write_row and not sent:
                return AnswerAck(logged=st["log"], live=st["live"], row_n=st.get("rn"), retry=True)
            if write_row:
                assert enc is not None
                st["rn"] = row_n
                st[f"d{first}"] = hashlib.sha1(enc.data_raw).hexdigest()
                st["sz"] = sz
            self._answer_expire(s, (session_id, answer), st, ttl)
            return AnswerAck(logged=st["log"], live=st["live"], row_n=row_n)

    async def answer_live(
        self,
        session_id: str,
        answer: str,
        first: int,
        deltas: Sequence[Delta],
        *,
        incarnation: str,
        expire_ms: int | None = None,
    ) -> builtins.list[str]:
        s = self._get(validate_session_id(session_id))
        if s is None or s.header.incarnation != incarnation:
            return []  # NOMKSTREAM on Redis: a stream of another life gets no straggler either
        live = s.live_records(self.clock())
        before = len(live)
        for i, d in enumerate(deltas):
            self._live_xadd(s, LiveRecord(
                answer=answer, kind=d.kind, index=first + i, text=d.text, call_id=d.call_id, name=d.name,
                incarnation=incarnation,
            ))  # fmt: skip
        if expire_ms is not None:
            s.live_expires_at = self.clock() + expire_ms
        old, s.changed = s.changed, anyio.Event()
        old.set()
        return [r.id for r in s.live[before:]]

    async def answer_beat(self, session_id: str, answer: str, *, incarnation: str | None = None, ttl_ms: int) -> None:
        s, ttl, st0 = self._answer_prelude(session_id, answer, incarnation, ttl_ms)
        st = self._answer_state(session_id, answer, s, st0)
        if st["e"] is not None:
            raise answer_refusal(10, [10, st["e"]], session_id, answer)
        st["t"] = self.clock()
        self._answer_expire(s, (session_id, answer), st, ttl)

    async def answer_end(
        self,
        session_id: str,
        answer: str,
        *,
        deltas: int,
        reason: str,
        closing: NewEntryLike | None = None,
        expected: int | str | None = None,
        rest_first: int = 0,
        rest: Sequence[Delta] = (),
        turn: int | None = None,
        step: int | None = None,
        incarnation: str | None = None,
        grace_ms: int,
        stale_ms: int | None = None,
    ) -> AnswerEnded:
        enc = self._chunk_entry(answer, rest_first, rest, turn, step) if rest else None
        cenc = self._put_batch(None, [closing], None)[0] if closing is not None else None
        async with self._lock:
            s, ttl, st0 = self._answer_prelude(session_id, answer, incarnation, grace_ms)
            st = self._answer_state(session_id, answer, s, st0)
            if st["e"] is not None:
                return AnswerEnded(n=None if st["e"] < 0 else st["e"], reason=st["r"] or reason, retry=True)
            write_row = self._row_rule(session_id, answer, st, rest_first, len(rest), enc)
            sz = self._size_rule(session_id, answer, st, write_row, rest, stale_ms is None)
            logged = rest_first + len(rest) if write_row else st["log"]
            if logged != deltas:
                raise answer_refusal(12, [12, logged, deltas], session_id, answer)
            now = self.clock()
            if stale_ms is not None and now - st["t"] < stale_ms:
                raise answer_refusal(13, [13], session_id, answer)
            mine = s.n + 1 if write_row and st["ln"] == s.n else st["ln"]
            if (expected == "answer" and mine != s.n + (1 if write_row else 0)) or (
                isinstance(expected, int) and expected != s.n
            ):
                exp = expected if isinstance(expected, int) else -1
                raise answer_refusal(2, [2, s.n], session_id, answer, expected=exp)
            if write_row:
                assert enc is not None
                st[f"d{rest_first}"] = hashlib.sha1(enc.data_raw).hexdigest()
                st["sz"] = sz
            batch = [e for e in (enc if write_row else None, cenc) if e is not None]
            stored = self._append(s, batch, None) if batch else []
            closing_n = stored[-1].n if cenc is not None else -1
            self._live_xadd(s, LiveRecord(
                answer=answer, kind="end", index=deltas, n=None if closing_n < 0 else closing_n, reason=reason,
                incarnation=s.header.incarnation,
            ))  # fmt: skip
            st.update(log=logged, e=closing_n, r=reason, t=now)
            floor = (now - ttl) << 20
            for r in s.live:  # never from the begin of another answer still open (as answer.lua)
                if _live_seq(r.id) >= floor:
                    break
                if r.kind == "begin" and r.answer != answer:
                    got = self._answers.get((session_id, r.answer))
                    o = None if got is None or got[1] <= now else got[0]
                    if o is not None and o["inc"] == s.header.incarnation and o["e"] is None:
                        floor = _live_seq(r.id)
                        break
            s.live = [r for r in s.live if _live_seq(r.id) >= floor]
            self._answer_expire(s, (session_id, answer), st, ttl)
            return AnswerEnded(n=None if closing_n < 0 else closing_n, reason=reason)

    async def answer_states(self, session_id: str, answers: Sequence[str]) -> dict[str, AnswerState]:
        validate_session_id(session_id)
        out: dict[str, AnswerState] = {}
        for a in answers:
            got = self._answers.get((session_id, a))
            if got is None or got[1] <= self.clock():
                continue
            st = got[0]
            out[a] = AnswerState(
                answer=a, incarnation=st["inc"], n=st["n"], live=st["live"], logged=st["log"], beat_ms=st["t"],
                ended=st["e"], reason=st["r"],
            )  # fmt: skip
        return out

    async def read_live(self, session_id: str, after: str | None = None) -> builtins.list[LiveRecord]:
        validate_session_id(session_id)
        s = self._get(session_id)
        if s is None:
            return []
        floor = -1 if after is None else _live_seq(after)
        return [r for r in s.live_records(self.clock()) if _live_seq(r.id) > floor]

    async def tail_live(
        self,
        session_id: str,
        start: int = 0,
        *,
        live_after: str = "0-0",
        incarnation: str | None = None,
        resumed: bool = False,
    ) -> AsyncIterator[Entry | LiveRecord]:
        validate_session_id(session_id)
        check_read(session_id, start, None)
        s = self._get(session_id)
        if s is None:
            raise SessionNotFoundError(session_id)
        tail_start(session_id, start, s.n, s.header.incarnation, incarnation, resumed)
        nxt, seen = start, _live_seq(live_after)
        while True:
            s2 = self._get(session_id)
            if s2 is None:
                return
            if s2 is not s:
                raise SessionReplacedError(session_id)
            changed = s.changed
            fresh = [r for r in s.live_records(self.clock()) if _live_seq(r.id) > seen]
            batch = await self.read(session_id, nxt, min(s.n, nxt + 1000)) if nxt < s.n else []
            merged = merge_live(batch, fresh, more_entries=len(batch) >= 1000)  # in the order they happened
            for item in merged.items:
                yield item
            if merged.records:
                seen = _live_seq(fresh[merged.records - 1].id)
            if merged.entries:
                nxt = batch[merged.entries - 1].n + 1
            if not fresh and not batch:
                await changed.wait()

    async def set_draft(self, session_id: str, draft: dict[str, Any] | None, *, incarnation: str | None = None) -> None:
        validate_session_id(session_id)
        raw = self._draft_bytes(draft)
        s = self._get(session_id)
        if s is None:
            raise SessionNotFoundError(session_id)
        if incarnation is not None and incarnation != s.header.incarnation:
            raise SessionReplacedError(session_id, "this draft was meant for the session before")
        s.draft = None if raw is None else msgspec.json.decode(raw)
        self._touch(s)

    async def acquire_lease(self, session_id: str, token: str, ttl_ms: int, *, incarnation: str | None = None) -> bool:
        s = self._get(validate_session_id(session_id))
        if s is None:
            raise SessionNotFoundError(session_id)
        if incarnation is not None and s.header.incarnation != incarnation:
            raise SessionReplacedError(session_id, "the lease was asked for an earlier life of the id")
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

    async def begin_upload(self, session_id: str, segment: ColdSegment) -> None:
        validate_session_id(session_id)
        self._pending[(session_id, segment_name(segment))] = now_ms()

    async def pending_upload(self, session_id: str, name: str) -> int | None:
        return self._pending.get((session_id, name))

    async def release_upload(self, session_id: str, name: str) -> bool:
        return self._pending.pop((session_id, name), None) is not None

    async def commit_archive(self, session_id: str, state: ColdState, segment: ColdSegment) -> str:
        validate_session_id(session_id)
        async with self._lock:
            s = self._committing(session_id, state)
            if s is None:
                return "moved"
            hot = cold_end(s.cold, s.header.at or 0)
            kept = [c for c in s.cold if c.hi <= segment.lo]  # a merge replaces those after
            if segment.hi > s.n or segment.hi <= hot or segment.lo != cold_end(kept, s.header.at or 0):
                raise SessionError(f"session {session_id!r}: the archived range is not the hot log's start")
            if self._pending.pop((session_id, segment_name(segment)), None) is None:
                return "expired"  # a sweep released the upload: it may delete the object
            s.cold = [*kept, segment]  # a new list: a read in flight keeps the one it took
            for i in range(hot, segment.hi):
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
