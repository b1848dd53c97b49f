"""The rules every store runs, in one place, so that no two backends can drift: the checks of
every argument (writes, reads, lists, tails, drafts), the batch encoding, the log's sequence
problems, and branch segment planning (where a branch reads its prefix from)."""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterable, Sequence
from typing import Any

from ..checks import check_int, check_optional_int, shown
from ..errors import (
    AnswerTooLargeError,
    InvalidArgumentError,
    InvalidCursorError,
    InvalidEntryError,
    InvalidSessionIdError,
    SessionReplacedError,
    SessionRewoundError,
)
from ..keys import validate_new_session_id, validate_session_id
from ..model import (
    MAX_ORIGIN_BYTES,
    MAX_TITLE_BYTES,
    EncodedEntry,
    NewEntryLike,
    SessionHeader,
    Vocabulary,
    check_idempotency_key,
    encode_batch,
    lossless_json,
)
from ..projection.chunks import Delta, answer_budget, deltas_cost
from ..projection.invariants import Problem
from .protocol import MAX_CURSOR_LENGTH, MAX_LIST_LIMIT, MAX_READ_RANGE


def check_read_range(start: int, stop: int | None) -> None:
    check_int(start, "start")
    check_optional_int(stop, "stop")


def check_read(session_id: object, start: int, stop: int | None) -> None:
    """`read`'s arguments (and `tail`'s, with `stop` None)."""
    validate_session_id(session_id)
    check_read_range(start, stop)
    if stop is not None and stop - start > MAX_READ_RANGE:
        raise InvalidArgumentError(f"a read covers at most {MAX_READ_RANGE} entries; page through longer logs")


def tail_start(session_id: str, start: int, n: int, life: str, incarnation: str | None, resumed: bool) -> int:
    """The start of every tail (`tail`, `tail_live`, both stores), once the header (`n`, `life`)
    was read: the id must still name the life the reader follows (`incarnation`, None: any), and a
    reader that resumes (`resumed`: it was given what is before `start`) must not be past the log
    (a failover took entries back: `SessionRewoundError`). A fresh tail started ahead just waits.

    Returns ``given``, the n the log was seen at (its n now; with `resumed`, `start` too): a later
    header n below both it and the reader is a rollback."""
    if incarnation is not None and incarnation != life:
        raise SessionReplacedError(session_id)
    if resumed and start > n:
        raise SessionRewoundError(session_id, start, n)
    return max(start, n) if resumed else n


def check_list(parent: object, limit: object, cursor: object) -> None:
    """`list`'s arguments."""
    check_int(limit, "limit", minimum=1, maximum=MAX_LIST_LIMIT)
    check_cursor(cursor)
    if parent is not None:
        validate_session_id(parent)


_CURSOR = re.compile(r"[0-9]{13}:")


def check_cursor(cursor: object) -> None:
    """A `list` cursor is what a `list` returned: ``<13 digits>:<session id>`` (an index member,
    `keys.index_member`), or ``<13 digits>:`` (a tenant page's time bound); anything else raises
    `InvalidCursorError` (it read as the first page again, or as the end of the list)."""
    if cursor is None:
        return
    if not isinstance(cursor, str) or len(cursor) > MAX_CURSOR_LENGTH or _CURSOR.match(cursor) is None:
        raise InvalidCursorError(f"invalid cursor {str(cursor)[:80]!r}: pass back a Page.cursor as returned")
    if len(cursor) > 14:
        try:
            validate_session_id(cursor[14:])
        except InvalidSessionIdError:
            raise InvalidCursorError(f"invalid cursor {cursor[:80]!r}: pass back a Page.cursor as returned") from None


def check_expected_n(expected_n: object) -> None:
    if expected_n is not None and (not isinstance(expected_n, int) or isinstance(expected_n, bool) or expected_n < 0):
        raise InvalidEntryError(f"expected_n must be None or an int >= 0, got {shown(expected_n)}")


def check_incarnation(incarnation: object) -> None:
    if incarnation is not None and (not isinstance(incarnation, str) or not 1 <= len(incarnation) <= 64):
        raise InvalidEntryError("incarnation must be None or a str of 1-64 characters (SessionHeader.incarnation)")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_header(header: SessionHeader) -> None:
    """A header a create may write: the id is a valid *new* id (`validate_new_session_id`); the
    parent only needs to be a valid id (an existing session under an older rule may be branched);
    `title` and `origin` within `MAX_TITLE_BYTES` and `MAX_ORIGIN_BYTES` (every surface: a create,
    branch, fork or import; a list page of headers stays bounded)."""
    if not isinstance(header, SessionHeader):
        raise TypeError("header must be a SessionHeader")
    validate_new_session_id(header.id)
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
    if header.title is not None:
        if not isinstance(header.title, str):
            raise InvalidEntryError("title must be a str")
        size = len(header.title.encode("utf-8", "surrogatepass"))
        if size > MAX_TITLE_BYTES:
            raise InvalidEntryError(f"title is {size} bytes of UTF-8, over its limit of {MAX_TITLE_BYTES}")
    if header.origin is not None:
        size = len(lossless_json(header.origin, "origin"))
        if size > MAX_ORIGIN_BYTES:
            raise InvalidEntryError(f"origin is {size} bytes of JSON, over its limit of {MAX_ORIGIN_BYTES}")


def sequence_problems(ids: Sequence[int], at: int, n: int) -> list[Problem]:
    """The problems of a log whose own entries carry `ids`, in stored order, against the branch
    point `at` and the header's `n`: gaps, entries out of order, a log ahead of or behind `n`."""
    out: list[Problem] = []
    expected = at
    for k in ids:
        if k > expected:
            out.append(Problem(expected, "stream-gap", f"entries {expected}..{k - 1} are missing"))
        elif k < expected:
            out.append(Problem(k, "stream-order", f"entry n={k} appears where n={expected} was expected"))
            continue
        expected = k + 1
    if expected > n:
        out.append(
            Problem(n, "stream-ahead", f"the log holds entries up to n={expected - 1}, but the header says n={n}")
        )
    elif expected < n:
        out.append(Problem(expected, "stream-behind", f"the header says n={n}, but the log ends at n={expected}"))
    return out


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


class StoreRules:
    """The checks every store makes before a write, in one place, so that every backend rejects
    exactly the same input (and nothing of a rejected batch is ever sent). The read, tail and list
    checks are `check_read` and `check_list`."""

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

    def _batch_cost(self, session_id: str, answer: str, first: int, deltas: Sequence[Delta], log: bool) -> int:
        """The content cost a delta batch adds to its answer (`deltas_cost`, the answer protocol's
        size rule), 0 when it adds no row; a batch over the answer's budget on its own is
        refused here, before its row is made: a row over the entry limit would be refused as an
        entry instead, and the writer could not tell that the answer can still end with what it
        has (`AnswerTooLargeError` says so: deltas [0, first) stay)."""
        if not log or not deltas:
            return 0
        cost = deltas_cost(deltas)
        budget = answer_budget(self.max_entry_bytes)
        if cost > budget:
            raise AnswerTooLargeError(session_id, answer, cost, budget, first)
        return cost

    def _draft_bytes(self, draft: dict[str, Any] | None) -> bytes | None:
        """A draft as the stored JSON (None clears it), within `max_entry_bytes`."""
        if draft is None:
            return None
        raw = lossless_json(draft, "draft")
        if len(raw) > self.max_entry_bytes:
            raise InvalidEntryError(f"draft is {len(raw)} bytes; the limit is {self.max_entry_bytes}")
        return raw

    def _create_batch(
        self, header: SessionHeader, entries: Iterable[NewEntryLike], ttl_ms: int | None
    ) -> builtins.list[EncodedEntry]:
        check_header(header)
        if ttl_ms is not None and (not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms <= 0):
            raise InvalidArgumentError("ttl_ms must be a positive int")
        return self._encode(entries, header.at or 0)
