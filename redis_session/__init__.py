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

from importlib.metadata import PackageNotFoundError, version

from .errors import (
    AccessDeniedError,
    AnswerAliveError,
    AnswerBatchMismatchError,
    AnswerClosedError,
    AnswerError,
    AnswerIncompleteError,
    AnswerNotFoundError,
    AnswerOrderError,
    DurabilityError,
    IdempotencyKeyReusedError,
    ImportFormatError,
    InvalidEntryError,
    InvalidSessionIdError,
    LeaseHeldError,
    LeaseLostError,
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionError,
    SessionForkError,
    SessionNotFoundError,
    SessionReplacedError,
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

try:
    __version__ = version("redis-session")
except PackageNotFoundError:  # pragma: no cover - a source tree that was never installed
    __version__ = "0+unknown"

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
    "Delta",
    "DeltaGap",
    "DoctorReport",
    "DurabilityError",
    "Entry",
    "IdempotencyKeyReusedError",
    "ImportFormatError",
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
    "Session",
    "SessionAlreadyExistsError",
    "SessionConflictError",
    "SessionError",
    "SessionForkError",
    "SessionHead",
    "SessionHeader",
    "SessionLease",
    "SessionNotFoundError",
    "SessionReplacedError",
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
