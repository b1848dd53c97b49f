"""Typed errors. Every failure a caller can act on has its own class under `SessionError`."""

from __future__ import annotations

import os
from collections.abc import Sequence


class SessionError(Exception):
    """Base class of every error this package raises on purpose."""


class SessionNotFoundError(SessionError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} not found")
        self.session_id = session_id


class SessionReplacedError(SessionNotFoundError):
    """The session this handle, tail or snapshot belongs to is gone: its id was deleted and
    created again (or replaced by an import), so it now names another incarnation. Nothing was
    written; open the id again to work on the new session."""

    def __init__(self, session_id: str, detail: str = "") -> None:
        super().__init__(session_id)
        msg = f"session {session_id!r} was replaced (deleted and created again)"
        self.args = (f"{msg}: {detail}" if detail else msg,)

    @classmethod
    def created_and_deleted(cls, session_id: str) -> SessionReplacedError:
        """A keyed create retried (its reply lost) after the session it made was deleted: the
        retry is refused, not made again (the key is remembered for `keys.GONE_TTL_MS`)."""
        e = cls(session_id)
        e.args = (
            f"session {session_id!r} was made by this create (its idempotency key) and deleted since: "
            "nothing was written; create it under another key to make it again",
        )
        return e


class SessionRewoundError(SessionError):
    """A reader is ahead of the session's log: it was given entries up to `cursor` - 1, and the
    log now ends at `n` (< `cursor`) — a failover to a replica that had not got the last entries
    yet (replication is asynchronous) took them back, and what lands next takes their places.
    Raised by every tail (`tail`, `tail_live`, `live.follow`, `live.follow_deltas`) when it
    (re)starts or re-reads the header, instead of waiting silently for entries it would never
    be given; the gateway's SSE streams send ``event: rewound``. Re-read the session (from n=0,
    or from an n the reader trusts) and follow it again from there."""

    def __init__(self, session_id: str, cursor: int, n: int) -> None:
        super().__init__(
            f"session {session_id!r} was rewound: the reader is at n={cursor}, the log ends at n={n} "
            "(a failover lost its last entries); re-read it"
        )
        self.session_id = session_id
        self.cursor = cursor
        self.n = n


class SessionCorruptError(SessionError):
    """A session's stored keys were edited outside redis-session (a row deleted or rewritten, a
    key replaced by another kind of value): what is stored is not what was written, so it is
    never read with a guess. `redis-session doctor` names what is wrong."""

    @classmethod
    def because(cls, why: str) -> SessionCorruptError:
        return cls(f"stored entries are corrupt (edited outside redis-session?): {why}")

    @classmethod
    def header_field(cls, session_id: str, field: str) -> SessionCorruptError:
        """A header field a script found unusable (an ``n`` that is no count): nothing written."""
        return cls.because(
            f"session {session_id!r}: the header's {field} is not what redis-session writes; nothing was written"
        )


class SessionAlreadyExistsError(SessionError):
    def __init__(self, session_id: str, detail: str = "") -> None:
        msg = f"session {session_id!r} already exists"
        super().__init__(f"{msg}: {detail}" if detail else msg)
        self.session_id = session_id

    @classmethod
    def held_by_branches(cls, session_id: str, branches: Sequence[str]) -> SessionAlreadyExistsError:
        """The id of a deleted session that live branches still read (it is hidden: `head` is
        None, but the id stays taken until the last of them is deleted)."""
        more = f" and {len(branches) - 5} more" if len(branches) > 5 else ""
        shown = ", ".join(repr(b) for b in branches[:5]) + more
        return cls(
            session_id,
            f"it was deleted, but its branches ({shown}) still read its entries, so the id stays taken "
            "until they are deleted; use another id",
        )


class SessionConflictError(SessionError):
    """A writer's `expected_n` was stale: another writer appended first. Nothing was written.

    Reload (``Session.refresh()``), rebuild the entries if they depend on the log, and retry.
    """

    def __init__(self, session_id: str, expected_n: int, actual_n: int) -> None:
        super().__init__(f"session {session_id!r}: expected n={expected_n}, but the log is at n={actual_n}")
        self.session_id = session_id
        self.expected_n = expected_n
        self.actual_n = actual_n


class IdempotencyKeyReusedError(SessionError):
    """An idempotency key that already landed one batch was sent with a different batch.

    Nothing was written. The same batch retried with its key returns the entries it wrote; a new
    batch needs a new key."""

    def __init__(self, session_id: str, idempotency_key: str) -> None:
        super().__init__(
            f"session {session_id!r}: idempotency key {idempotency_key[:80]!r} already landed a different batch"
        )
        self.session_id = session_id
        self.idempotency_key = idempotency_key


class InvalidEntryError(SessionError, ValueError):
    """An entry (or a batch) was rejected before anything was written.

    `index` is the position of the offending entry in its batch, when there is one.
    """

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message if index is None else f"entry {index}: {message}")
        self.index = index


class InvalidArgumentError(SessionError, ValueError):
    """An argument of a read or a call is out of its range (a negative or too large n, a stop
    before the start, a range too long): refused before Redis is asked, nothing read or written.
    A `ValueError` too, as such arguments were before."""


class InvalidSessionIdError(SessionError, ValueError):
    """A session id that could move a session's keys to another hash slot, or is unusable."""


class InvalidCursorError(InvalidArgumentError):
    """A `list` cursor that no `list` returned (`Page.cursor` is ``<13 digits>:<session id>``, or
    ``<13 digits>:`` from a tenant's gateway page): refused, not read as the start or the end."""


class SessionForkError(SessionError):
    """A fork that cannot be made; `code` is one of the dsh codes
    (INVALID_BOUNDARY, OPEN_TURN, SESSION_NOT_FOUND, SESSION_ALREADY_EXISTS)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class LeaseHeldError(SessionError):
    """Another holder owns the session's lease."""


class AccessDeniedError(SessionError):
    """The Redis ACL user may not run this command or touch these keys; nothing was written."""


class StoreUnavailableError(SessionError, ConnectionError):
    """The server could not be reached or did not answer in time."""


class DurabilityError(SessionError):
    """The entries landed on the primary, but the store's durability wait (WAIT for a replica,
    or WAITAOF for the AOF fsync) was not satisfied within its timeout.

    They may be lost if the primary fails now. Retrying the put with the same idempotency key
    returns the same entries (nothing is written twice) and waits again."""

    def __init__(
        self, session_id: str, entries: Sequence[object], durability: str, timeout_ms: int, detail: str = ""
    ) -> None:
        why = f"the server refused the wait: {detail}" if detail else f"was not confirmed within {timeout_ms} ms"
        super().__init__(
            f"session {session_id!r}: {len(entries)} entries landed on the primary, but durability={durability!r} {why}"
        )
        self.session_id = session_id
        self.entries = list(entries)
        self.durability = durability


class LeaseLostError(LeaseHeldError):
    """This handle's lease expired or was taken over: its writes are refused until it leases again."""


class ImportFormatError(SessionError, ValueError):
    """A file (or one of its lines) cannot be imported; nothing of its session was written.

    `path` is the file, `line` the 1-based line number (None when the problem is the file as a
    whole), `message` what is wrong, `session_id` the session's id when it was known.
    """

    def __init__(
        self, path: str | os.PathLike[str], line: int | None, message: str, *, session_id: str | None = None
    ) -> None:
        self.path = str(path)
        self.line = line
        self.message = message
        self.session_id = session_id
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {message}")


class ColdSegmentError(SessionError):
    """An archived range of a session (a cold segment in object storage) could not be read:
    `session_id`, the range [`lo`, `hi`) and the object `key` name it. Nothing was returned."""

    def __init__(self, session_id: str, lo: int, hi: int, key: str, detail: str) -> None:
        super().__init__(f"session {session_id!r}: archived entries [{lo}, {hi}) ({key}): {detail}")
        self.session_id, self.lo, self.hi, self.key = session_id, lo, hi, key


class SegmentMissingError(ColdSegmentError):
    """The header names a cold segment the object store does not hold (or no store is set)."""


class SegmentCorruptError(ColdSegmentError):
    """A cold segment's bytes fail their checksum, do not decompress, or hold other entries."""


# --------------------------------------------------------------------------- streamed answers


class AnswerError(SessionError):
    """A streamed answer's protocol refused a write (nothing was written). `answer` names it."""

    def __init__(self, session_id: str, answer: str, message: str) -> None:
        super().__init__(f"session {session_id!r}, answer {answer!r}: {message}")
        self.session_id = session_id
        self.answer = answer


class AnswerNotFoundError(AnswerError):
    """No such answer in this session's life: never begun, or ended longer ago than its grace."""

    def __init__(self, session_id: str, answer: str) -> None:
        super().__init__(session_id, answer, "no such answer (never begun, or expired)")


class AnswerClosedError(AnswerError):
    """The answer has ended (committed, interrupted, or closed by `repair`): `n` is the entry
    that closed it (None when none landed)."""

    def __init__(self, session_id: str, answer: str, n: int | None) -> None:
        super().__init__(session_id, answer, f"the answer has ended (closing entry {n})")
        self.n = n


class AnswerOrderError(AnswerError):
    """A delta batch did not start at the answer's next index (`expected`): refused, never
    reordered. Send the batch starting at `expected` (or the missing ones first)."""

    def __init__(self, session_id: str, answer: str, expected: int, got: int) -> None:
        super().__init__(session_id, answer, f"a batch must start at index {expected}; this one starts at {got}")
        self.expected = expected
        self.got = got


class AnswerIncompleteError(AnswerError):
    """The end of an answer was refused: the log holds deltas [0, `logged`) and the end names
    `deltas`; `missing` is the range to send first (empty when the end names fewer)."""

    def __init__(self, session_id: str, answer: str, logged: int, deltas: int) -> None:
        what = f"deltas {logged}..{deltas - 1} are missing" if deltas > logged else f"the log holds {logged} deltas"
        super().__init__(session_id, answer, f"cannot end with {deltas} deltas: {what}")
        self.logged = logged
        self.deltas = deltas
        self.missing = (logged, max(logged, deltas))


class AnswerTooLargeError(AnswerError, InvalidEntryError):
    """A delta batch would make the answer's content (what its closing message holds) `size`
    bytes, over `limit` (the entry limit less room for the message's other fields): refused,
    nothing of it written. The answer stays open with deltas [0, `logged`): end it with what it
    has (its message fits), or interrupt it."""

    def __init__(self, session_id: str, answer: str, size: int, limit: int, logged: int) -> None:
        SessionError.__init__(
            self,
            f"session {session_id!r}, answer {answer!r}: its content would be {size} bytes, over the "
            f"{limit} an answer may hold (its message must fit the entry limit); end it with its "
            f"{logged} deltas",
        )
        self.session_id = session_id
        self.answer = answer
        self.index = None
        self.size = size
        self.limit = limit
        self.logged = logged


class AnswerAliveError(AnswerError):
    """`repair` would close an answer whose writer wrote or beat less than `stale_after` ago."""

    def __init__(self, session_id: str, answer: str) -> None:
        super().__init__(session_id, answer, "its writer is alive (recent write or heartbeat)")


class AnswerBatchMismatchError(AnswerError):
    """A batch at index `first` landed already with other deltas: this is no retry of it."""

    def __init__(self, session_id: str, answer: str, first: int) -> None:
        super().__init__(session_id, answer, f"the batch at index {first} landed with other deltas")
        self.first = first
