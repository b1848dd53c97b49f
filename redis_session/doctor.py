"""The doctor: one session checked end to end, on any store — the log's invariants
(`check_invariants`), each entry's schema, the header's last cut, stale branch links, and what
the store can see below `read` (`InspectableStore.storage_problems`: on Redis, `redis.doctor`
walks the stream itself).
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

import anyio
import msgspec
from msgspec import Struct

from .errors import (
    AccessDeniedError,
    ColdSegmentError,
    InvalidEntryError,
    SessionError,
    SessionNotFoundError,
    StoreUnavailableError,
)
from .keys import is_staging_id, validate_session_id
from .model import CUT, Entry, SessionHead, Vocabulary
from .projection.invariants import Problem, check_invariants
from .snapshots import read_range
from .store import InspectableStore, SessionStore, StorageCheck, sequence_problems


class DoctorReport(Struct, frozen=True):
    """What `doctor` found: the log's invariant problems and the storage problems, in n order."""

    session_id: str
    n: int
    problems: builtins.list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems


async def doctor(store: SessionStore, session_id: str) -> DoctorReport:
    """Check one session: `check_invariants` on its log, plus storage checks.

    Storage codes: ``header`` (the header does not parse), ``stream-id`` (an ID not of the form
    ``<n>-1``), ``stream-gap`` (IDs skip entries), ``stream-order`` (an ID at or below the previous
    one, or below the branch point), ``stream-ahead`` / ``stream-behind`` (header n ≠ last ID + 1,
    or ≠ `at` for an empty branch), ``decode`` (an entry does not decode), ``schema`` (an entry's
    data fails its type's schema), ``last-cut`` (the header's last_cut is not the last cut entry),
    ``stale-link`` (a child link whose branch does not exist: it keeps the session's keys, and an
    ephemeral one's TTL, for nothing; `Sessions.repair` / ``doctor --repair`` removes it),
    ``key-type`` (a key of the session holds another kind of value than the layout's: a log
    replaced by a string, a snapshot by a list), ``staging-copy`` (the id is a replacing
    import's staging copy, `keys.is_staging_id`: one an import died building, or still builds;
    ``doctor --repair`` deletes it).
    A store that can look below `read` (`InspectableStore.storage_problems`: the Redis store walks
    the stream itself) reports the storage codes; on other stores the same is checked through
    `read`. Raises `SessionNotFoundError` for a missing session.
    """
    validate_session_id(session_id)
    report, seen = await _doctor_once(store, session_id)
    for _attempt in range(4):
        # a session written while it was checked (an append past the n read first) is looked at
        # again: a problem is one of a session that stood still while it was checked
        if report.ok or seen is None or await _head_or_none(store, session_id) == seen:
            break
        report, seen = await _doctor_once(store, session_id)
    return report


async def _lasting_stale_links(store: SessionStore, session_id: str) -> builtins.list[str]:
    """The branches linked to the session that do not exist, and still do not after
    `STALE_LINK_GRACE`: one between its two steps is not one of them."""
    stale = (await store.links(session_id))[1]
    if not stale:
        return stale
    await anyio.sleep(STALE_LINK_GRACE)
    still = set((await store.links(session_id))[1])
    return [child for child in stale if child in still]


STALE_LINK_GRACE = 0.25
"""Seconds a stale link must last to be reported: a branch is made in two steps (linked in the
parent, then created) and deleted in two (removed, then unlinked), and one between its steps
looks like a stale link for that moment."""


async def _header_of(store: SessionStore, session_id: str) -> tuple[SessionHead | None, str | None]:
    """(the head, None), or (None, why the header cannot be read): it does not parse, or its key
    holds another kind of value (WRONGTYPE)."""
    try:
        return await store.head(session_id), None
    except (ValueError, TypeError, msgspec.DecodeError) as e:
        return None, f"the header does not parse: {e}"
    except SessionError as e:
        if isinstance(e, _NOT_THE_SESSIONS):
            raise
        return None, f"the header cannot be read: {e}"


async def _head_or_none(store: SessionStore, session_id: str) -> SessionHead | None:
    return (await _header_of(store, session_id))[0]


_NOT_THE_SESSIONS = (StoreUnavailableError, AccessDeniedError, SessionNotFoundError)
"""Errors of reaching the store, not of what it holds: raised, never reported as a problem."""


async def _doctor_once(store: SessionStore, session_id: str) -> tuple[DoctorReport, SessionHead | None]:
    problems: builtins.list[Problem] = []

    def add(n: int | None, code: str, message: str) -> None:
        problems.append(Problem(n, code, message))

    head, unreadable = await _header_of(store, session_id)
    if unreadable is not None:
        add(None, "header", unreadable)
        return DoctorReport(session_id, -1, problems), None
    if head is None:
        raise SessionNotFoundError(session_id)
    n, at = head.n, head.header.at or 0

    walked = True
    try:
        check = await store.storage_problems(session_id, n, at) if isinstance(store, InspectableStore) else None
    except SessionError as e:  # a key of another kind than the layout's (a log replaced by a string)
        if isinstance(e, _NOT_THE_SESSIONS):
            raise
        add(None, "decode", f"the log cannot be read: {e}")
        check, walked = None, False
    if check is not None:
        problems.extend(check.problems)
    try:
        entries = await read_range(store, session_id, 0, n)
    except SessionError as e:
        if walked and not _explained(e, check):
            add(None, "decode", f"the log cannot be read: {e}")
        entries = []
        complete = False
    else:
        complete = True
        if check is None:  # nothing below read(): check the stored shape through read()
            problems.extend(sequence_problems([e.n for e in entries], 0, n))
    own = check.entries if check is not None and check.entries is not None else [e for e in entries if e.n >= at]
    problems.extend(_schema_problems(store.vocabulary, own))
    problems.extend(_last_cut_problems(head, own, entries if complete else None))
    if complete and len(entries) == n and all(e.n == i for i, e in enumerate(entries)):
        problems.extend(check_invariants(entries))
    if is_staging_id(session_id):
        add(
            None,
            "staging-copy",
            "a replacing import's staging copy: an import is building it, or one died part-way (this "
            "release's copies expire by themselves; a listed one was left by an older release): "
            "`redis-session doctor --repair` or `redis-session delete` removes it",
        )
    for child in await _lasting_stale_links(store, session_id):
        add(None, "stale-link", f"branch {child!r} is linked but does not exist: `redis-session doctor --repair`")
    problems.sort(key=lambda p: -1 if p.n is None else p.n)
    return DoctorReport(session_id, n, problems), head


def _explained(e: SessionError, check: StorageCheck | None) -> bool:
    """Whether the storage walk reported what made the read fail already, and named the row: a
    row that does not decode, a gap, a stray or misplaced row, a log ahead of or behind the
    header (the read's "not every entry of the range" is one of those), a missing or corrupt
    segment. A failure it cannot see (a branch's prefix in its parent's log) is reported."""
    if check is None:
        return False
    if isinstance(e, ColdSegmentError):
        return any(p.code in ("segment-missing", "segment-corrupt") for p in check.problems)
    return any(p.code in _STREAM_SHAPE for p in check.problems)


_STREAM_SHAPE = frozenset(
    {"decode", "stream-id", "stream-gap", "stream-order", "stream-ahead", "stream-behind", "key-type"}
)


def _schema_problems(vocabulary: Vocabulary, own: Sequence[Entry]) -> builtins.list[Problem]:
    """A ``schema`` problem for each of the session's own entries whose data fails its schema."""
    out: builtins.list[Problem] = []
    for entry in own:
        try:
            vocabulary.check(entry.type, msgspec.json.encode(entry.data), None)
        except InvalidEntryError as err:
            out.append(Problem(entry.n, "schema", str(err)))
    return out


def _last_cut_problems(
    head: SessionHead, own: Sequence[Entry], entries: Sequence[Entry] | None
) -> builtins.list[Problem]:
    """Whether the header's last_cut names the session's last cut entry (`entries`: the whole
    log, or None when it could not be read)."""
    last_cut, at = head.last_cut, head.header.at or 0
    own_cuts = [e.n for e in own if e.type == CUT]
    if last_cut is not None and at <= last_cut < head.n and (not own_cuts or last_cut > own_cuts[-1]):
        if all(e.n != last_cut for e in own):
            return []  # its entry could not be read (a missing segment, a bad row): reported as that
    if own_cuts:
        if last_cut != own_cuts[-1]:
            message = f"header last_cut={last_cut}, the last cut entry is n={own_cuts[-1]}"
            return [Problem(last_cut, "last-cut", message)]
    elif last_cut is not None and last_cut >= at:
        return [Problem(last_cut, "last-cut", f"header last_cut={last_cut}, but the session has no cut there")]
    elif last_cut is not None and entries is not None:
        inherited = entries[last_cut] if last_cut < len(entries) else None
        if inherited is None or inherited.type != CUT:
            return [Problem(last_cut, "last-cut", f"header last_cut={last_cut} is not a cut entry")]
    return []
