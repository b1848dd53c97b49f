"""redis-session: a distributed event store for AI-agent sessions on Redis Streams.

>>> import redis_session
>>> sessions = await redis_session.connect()          # $REDIS_URL, else the embedded server
>>> s = await sessions.open("chat-1")
>>> await s.append("user/message", {"content": "hello"})
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .errors import (
    AccessDeniedError,
    DurabilityError,
    InvalidEntryError,
    InvalidSessionIdError,
    LeaseHeldError,
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
from .redis_store import RedisSessionStore
from .store import MemorySessionStore, SessionStore

if TYPE_CHECKING:
    from .sessions import Sessions

__version__ = "0.1.0"


def resolve_url(url: str | None = None) -> str:
    """`url`, else ``$REDIS_URL``, else the embedded server (started on first use)."""
    if url:
        return url
    env = os.environ.get("REDIS_URL")
    if env:
        return env
    from .embedded import ensure_server

    return ensure_server().url


def is_cluster(url: str, timeout: float = 3.0) -> bool:
    """Does `url` point at a Redis Cluster node? (``INFO cluster``; False when unreachable.)"""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.info("cluster").get("cluster_enabled"))
        finally:
            client.close()
    except redis.RedisError:
        return False


def open_store(
    url: str | None = None, *, prefix: str = "rs", cluster: bool | None = None, **kwargs: Any
) -> RedisSessionStore:
    """A `RedisSessionStore` for `url` (see `resolve_url`).

    `cluster=None` reads ``$REDIS_SESSION_CLUSTER`` (true/false) and otherwise asks the server."""
    resolved = resolve_url(url)
    if cluster is None:
        env = os.environ.get("REDIS_SESSION_CLUSTER", "").strip().lower()
        cluster = (
            env in ("1", "true", "yes") if env in ("1", "true", "yes", "0", "false", "no") else is_cluster(resolved)
        )
    return RedisSessionStore.from_url(resolved, prefix=prefix, cluster=cluster, **kwargs)


async def connect(
    url: str | None = None, *, prefix: str = "rs", cluster: bool | None = None, **kwargs: Any
) -> Sessions:
    """The `Sessions` service on Redis: `url`, else ``$REDIS_URL``, else the embedded server."""
    from .sessions import Sessions

    return Sessions(open_store(url, prefix=prefix, cluster=cluster, **kwargs))


_PROJECTION = {
    "project",
    "to_openai",
    "to_anthropic",
    "Message",
    "history",
    "ProjectionState",
    "check_surface",
    "needs_rebuild",
}
_REQUEST = {"reconstruct_request", "prompt_digest", "diff_header", "apply_header_delta", "fold_request_header"}
_INVARIANTS = {"check_invariants", "interrupted_turn_closers", "Problem"}


def __getattr__(name: str) -> Any:
    # The projection and service layers are imported on first use, keeping `import redis_session`
    # light for processes that only need the store.
    if name in _PROJECTION:
        from . import projection

        return getattr(projection, name)
    if name in _REQUEST:
        from . import request

        return getattr(request, name)
    if name in _INVARIANTS:
        from . import invariants

        return getattr(invariants, name)
    if name in {"Sessions", "Session"}:
        from . import sessions

        return getattr(sessions, name)
    raise AttributeError(name)


__all__ = [
    "AccessDeniedError",
    "DurabilityError",
    "Entry",
    "InvalidEntryError",
    "InvalidSessionIdError",
    "LeaseHeldError",
    "MemorySessionStore",
    "NewEntry",
    "Page",
    "RedisSessionStore",
    "SessionAlreadyExistsError",
    "SessionConflictError",
    "SessionError",
    "SessionForkError",
    "SessionHead",
    "SessionHeader",
    "SessionNotFoundError",
    "SessionReplacedError",
    "SessionStore",
    "StoreUnavailableError",
    "Surface",
    "SurfaceReplace",
    "Vocabulary",
    "connect",
    "open_store",
    "resolve_url",
]
