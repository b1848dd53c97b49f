"""redis-session: a distributed event store for AI-agent sessions on Redis Streams.

The public API is exactly `__all__` (see the README's API section); every other module and name
is internal. The layers, bottom up, and the one-way import rule are in docs/design.md §0
(enforced by import-linter: `lint-imports`).

>>> import redis_session
>>> sessions = await redis_session.connect()          # $REDIS_URL, else the embedded server
>>> s = await sessions.open("chat-1")
>>> await s.append("user/message", {"content": "hello"})
"""

from __future__ import annotations

from . import _startup as _startup  # first: a Ctrl-C while the `redis-session` command imports is quiet
from . import live as live  # `redis_session.live.follow` / `follow_deltas` after a plain `import redis_session`
from .errors import (
    AccessDeniedError,
    AnswerAliveError,
    AnswerBatchMismatchError,
    AnswerClosedError,
    AnswerError,
    AnswerIncompleteError,
    AnswerNotFoundError,
    AnswerOrderError,
    AnswerTooLargeError,
    ColdSegmentError,
    DurabilityError,
    IdempotencyKeyReusedError,
    ImportFormatError,
    InvalidArgumentError,
    InvalidCursorError,
    InvalidEntryError,
    InvalidSessionIdError,
    LeaseHeldError,
    LeaseLostError,
    SegmentCorruptError,
    SegmentMissingError,
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionCorruptError,
    SessionError,
    SessionForkError,
    SessionNotFoundError,
    SessionReplacedError,
    SessionRewoundError,
    StoreUnavailableError,
)
from .model import (
    Entry,
    NewEntry,
    Page,
    SessionHead,
    SessionHeader,
    Surface,
    SurfaceReplace,
    Vocabulary,
)
from .projection import Message, history, project, to_anthropic, to_openai
from .projection.chunks import Delta, DeltaGap, pack_chunks
from .projection.invariants import Problem, check_invariants
from .projection.request import ReconstructedRequest, reconstruct_request
from .redis import RedisSessionStore, open_store, resolve_url
from .sessions import DoctorReport, Session, SessionLease, Sessions, connect
from .store import MemorySessionStore, SessionStore
from .streaming import AnswerStream

# The one home of the version: pyproject.toml reads it from here (hatch's dynamic version), so an
# installed copy, a source tree and `redis-session --version` always agree.
__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "AnswerAliveError",
    "AnswerBatchMismatchError",
    "AnswerClosedError",
    "AnswerError",
    "AnswerIncompleteError",
    "AnswerNotFoundError",
    "AnswerOrderError",
    "AnswerStream",
    "AnswerTooLargeError",
    "ColdSegmentError",
    "Delta",
    "DeltaGap",
    "DoctorReport",
    "DurabilityError",
    "Entry",
    "IdempotencyKeyReusedError",
    "ImportFormatError",
    "InvalidArgumentError",
    "InvalidCursorError",
    "InvalidEntryError",
    "InvalidSessionIdError",
    "LeaseHeldError",
    "LeaseLostError",
    "MemorySessionStore",
    "Message",
    "NewEntry",
    "Page",
    "Problem",
    "ReconstructedRequest",
    "RedisSessionStore",
    "SegmentCorruptError",
    "SegmentMissingError",
    "Session",
    "SessionAlreadyExistsError",
    "SessionConflictError",
    "SessionCorruptError",
    "SessionError",
    "SessionForkError",
    "SessionHead",
    "SessionHeader",
    "SessionLease",
    "SessionNotFoundError",
    "SessionReplacedError",
    "SessionRewoundError",
    "SessionStore",
    "Sessions",
    "StoreUnavailableError",
    "Surface",
    "SurfaceReplace",
    "Vocabulary",
    "__version__",
    "check_invariants",
    "connect",
    "history",
    "open_store",
    "pack_chunks",
    "project",
    "reconstruct_request",
    "resolve_url",
    "to_anthropic",
    "to_openai",
]
