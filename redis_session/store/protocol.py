"""The `SessionStore` contract: the protocol every backend implements, and its limits.

The behaviour behind each method is docs/design.md §4; `MemorySessionStore` is the reference, and
`redis_session.testing.contract` is the suite every backend passes.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from ..cold.segments import ColdSegment, ColdTier
from ..model import Entry, NewEntryLike, Page, SessionHead, SessionHeader, Vocabulary
from ..projection.chunks import AnswerAck, AnswerBegun, AnswerEnded, AnswerState, Delta, LiveRecord
from ..projection.invariants import Problem

#: how many idempotency keys a session remembers (the oldest go first)
IDEMPOTENCY_WINDOW = 1024
#: the most entries one `read` may cover (page through longer logs)
MAX_READ_RANGE = 100_000
#: `list`'s page size bounds, and the longest cursor it accepts
MAX_LIST_LIMIT = 1000
MAX_CURSOR_LENGTH = 400


@runtime_checkable
class SessionStore(Protocol):
    """Where sessions live. See docs/design.md §4; `MemorySessionStore` is the reference behaviour."""

    vocabulary: Vocabulary
    #: the most entries one write may carry (`InvalidEntryError` beyond)
    max_batch: int
    #: the most bytes one entry's encoded data (and a draft) may take (`InvalidEntryError` beyond)
    max_entry_bytes: int

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
        self,
        header: SessionHeader,
        entries: Sequence[NewEntryLike] = (),
        *,
        ttl_ms: int | None = None,
        parent_incarnation: str | None = None,
    ) -> SessionHead:
        """Create `header.id` (a branch when `header.parent` is set); with `parent_incarnation`,
        only from that life of the parent (else `SessionReplacedError`, checked atomically with
        the branch's link: nothing is created)."""
        ...

    async def list(
        self, *, parent: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[SessionHeader]: ...

    async def delete(self, session_id: str, *, incarnation: str | None = None) -> bool:
        """Delete the session (False: absent); with `incarnation`, only that life of the id
        (else `SessionReplacedError`, checked atomically: nothing is deleted)."""
        ...

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

    def tail(
        self, session_id: str, start: int = 0, *, incarnation: str | None = None, resumed: bool = False
    ) -> AsyncIterator[Entry]:
        """Entries from `start`, live. Ends when the session is deleted; raises
        `SessionReplacedError` when the id names another incarnation than the tail began on
        (or than `incarnation`). A `start` beyond the log waits for it; with `resumed` (`start` is
        the cursor of a reader that was given the entries before it), and once the tail gave
        entries, a log that ends before the reader raises `SessionRewoundError`."""
        ...

    async def get_draft(
        self, session_id: str, *, live: bool = True, incarnation: str | None = None
    ) -> dict[str, Any] | None:
        """The open streamed answer so far (`live_draft` of the live stream), else the draft
        `set_draft` left; with ``live=False`` only the latter. With `incarnation`, only of that
        life of the id (else `SessionReplacedError`: the header and the draft are read together)."""
        ...

    async def set_draft(self, session_id: str, draft: dict[str, Any] | None, *, incarnation: str | None = None) -> None:
        """Set (None: clear) the legacy draft; with `incarnation`, only in that life of the id
        (else `SessionReplacedError`, checked atomically: nothing is written)."""
        ...

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

    # A streamed answer's one protocol (``lua/answer.lua``; the memory store keeps the same rules).
    # Every op after the begin is checked against the life the answer began in; refusals are
    # typed (`AnswerOrderError`, `AnswerIncompleteError`, `AnswerClosedError`,
    # `AnswerNotFoundError`, `SessionReplacedError`, `SessionConflictError`) and write nothing.

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
        """Open `answer` (a ``begin`` live record naming the life); a retry gets the same begin."""
        ...

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
        """Deltas `first`.. of `answer`: with `log`, one packed chunk row (it must start at the
        answer's next logged index); with `live`, the live records not live yet (they must not
        start past the next live index). A retry of what landed is a no-op."""
        ...

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
        """One sender's live deltas, the cheap way (no script; each record names the life; no
        stream is made); their ids. Never resent blindly: after a lost reply the sender reads
        what landed (`read_live`) and sends the rest."""
        ...

    async def answer_beat(self, session_id: str, answer: str, *, incarnation: str | None = None, ttl_ms: int) -> None:
        """The writer of `answer` is alive (refreshes its state and the live stream's expiry)."""
        ...

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
        """Close `answer` of `deltas` deltas: the last row (`rest` from `rest_first`), the
        `closing` entry and the live ``end``, atomically; refused while the log lacks any of its
        deltas. `expected`: an n, or ``"answer"`` (nobody else wrote since the answer's last row)."""
        ...

    async def answer_states(self, session_id: str, answers: Sequence[str]) -> dict[str, AnswerState]:
        """The server's state of each of `answers` it still holds."""
        ...

    async def read_live(self, session_id: str, after: str | None = None) -> builtins.list[LiveRecord]:
        """The live stream's records after stream id `after` (else all), oldest first."""
        ...

    def tail_live(
        self,
        session_id: str,
        start: int = 0,
        *,
        live_after: str = "0-0",
        incarnation: str | None = None,
        resumed: bool = False,
    ) -> AsyncIterator[Entry | LiveRecord]:
        """`tail`, interleaved with the live records after `live_after` as they land."""
        ...

    async def acquire_lease(self, session_id: str, token: str, ttl_ms: int, *, incarnation: str | None = None) -> bool:
        """Take (or renew) the writer lease; False when another token holds it. With
        `incarnation`, only in that life of the id (else `SessionReplacedError`, nothing set)."""
        ...

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


class StorageCheck(NamedTuple):
    """What a store found below `read` in a session's own log [at, n) (`InspectableStore`)."""

    problems: list[Problem]
    # the session's own entries that decode, in n order; None: the store has nothing below
    # `read`, so the reader takes them from `read`
    entries: list[Entry] | None = None


@runtime_checkable
class InspectableStore(Protocol):
    """A store that can check a session's stored form below `read` (what `doctor` runs).

    Optional: `doctor` checks a store without it through `read` (contiguous n, against the
    header's n). Storage codes: ``stream-id``, ``stream-gap``, ``stream-order``, ``stream-ahead``,
    ``stream-behind``, ``decode``, and for archived ranges ``segment-missing``, ``segment-corrupt``,
    ``segment-gap`` (see `redis_session.doctor`)."""

    async def storage_problems(self, session_id: str, n: int, at: int) -> StorageCheck:
        """The problems of the session's own log [at, n) as stored (`n` and `at` from the head
        the caller read), and its entries that decode."""
        ...


class ColdState(NamedTuple):
    """What an archiver reads of a session before it moves a range out (`ArchivableStore`)."""

    incarnation: str
    n: int
    own_start: int  # the branch point (0 for a root): the session's own log is [own_start, n)
    cold: list[ColdSegment]  # archived ranges, in order; the hot stream starts at the last one's hi
    cold_raw: bytes  # the header's `cold` field as stored: the commit's compare-and-set value
    updated_at: int
    last_cut: int | None
    ephemeral: bool
    deleted: bool = False  # hidden: deleted, its entries kept for its branches (never archived)

    @property
    def hot_start(self) -> int:
        return self.cold[-1].hi if self.cold else self.own_start


@runtime_checkable
class ArchivableStore(SessionStore, Protocol):
    """A store whose sessions can keep a prefix of their own log in the cold tier (`cold`).

    `commit_archive` and `commit_restore` are each one atomic step, guarded by the incarnation
    and the ``cold`` field read in `cold_state` (compare-and-set); they return "done", or
    "moved" when another archiver or a restore changed the cold list meanwhile (nothing done),
    or "unconfirmed" when it was done but the store's durability wait fell short (the objects
    it replaced are left to the sweep: a failover may bring back the header naming them), and
    raise `SessionNotFoundError` / `SessionReplacedError` for a session gone or replaced."""

    cold: ColdTier | None

    async def cold_state(self, session_id: str) -> ColdState | None:
        """The session's archive state (a hidden one's too, ``deleted``); None when absent."""
        ...

    async def begin_upload(self, session_id: str, segment: ColdSegment) -> None:
        """Record that `segment`'s object is about to be uploaded (before the upload): the sweep
        never deletes a pending object, and `commit_archive` takes the pending record (refusing
        with "expired" when a sweep released it first), so one of the two always wins."""
        ...

    async def pending_upload(self, session_id: str, name: str) -> int | None:
        """When the upload of the object named `name` (its last key part) began, if pending."""
        ...

    async def release_upload(self, session_id: str, name: str) -> bool:
        """Drop a pending record (a sweep taking a stale upload, or an archiver giving up): True
        if this call removed it (its archiver can no longer commit that segment)."""
        ...

    async def commit_archive(self, session_id: str, state: ColdState, segment: ColdSegment) -> str:
        """Name `segment` (written, read back and verified, its upload pending) in the header and
        drop its entries from the hot log. `segment` starts at the hot start, or at the start of
        an archived segment it merges with the hot range (those it covers leave the cold list;
        the caller deletes their objects after). "expired": its pending record was released."""
        ...

    async def commit_restore(self, session_id: str, state: ColdState, entries: list[Entry]) -> str:
        """Put the archived `entries` (all of [own_start, hot_start)) back in the hot log and
        clear the cold list; the caller deletes the objects after."""
        ...
