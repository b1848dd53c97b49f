"""Raw replies of the store's Redis connections, typed: connection failures as
`StoreUnavailableError`, ACL refusals as `AccessDeniedError`, bulk strings as text or ints,
a durability wait's reply as confirmed or not, and an entry as the stream fields append.lua
writes. Shared by the store (`store.py`) and its cold-tier half (`coldtier.py`)."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec
from redis.exceptions import AuthenticationError, NoPermissionError, RedisClusterException, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import AccessDeniedError, StoreUnavailableError
from ..model import Entry
from .rows import corrupt

_json = msgspec.json.Encoder()

# RedisClusterException: redis-py's "Redis Cluster cannot be connected" when no node answers.
IO_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, RedisClusterException)


def unavailable(e: BaseException) -> StoreUnavailableError:
    if isinstance(e, AuthenticationError):
        return StoreUnavailableError(f"Redis refused the credentials: {e}")
    return StoreUnavailableError(f"Redis is unreachable: {e}")


def typed_reply_error(error: ResponseError) -> Exception:
    """An ACL refusal as `AccessDeniedError` (nothing was written); a key of the session that
    holds another kind of value than the layout's (``WRONGTYPE``: a log replaced by a string
    outside redis-session) as the corruption `SessionError` reads raise; other replies as they are."""
    text = str(error)
    if isinstance(error, NoPermissionError) or text.startswith(("NOPERM", "ACL failure")) or "NOPERM" in text[:80]:
        return AccessDeniedError(f"the Redis user may not do this: {text}")
    if text.startswith("WRONGTYPE") or "WRONGTYPE" in text[:80]:
        return corrupt(f"a key holds another kind of value: {text}")
    return error


def leaked_close_race(e: BaseException) -> bool:
    """Whether `e` is redis-py's asyncio connection written to while its transport closes (a peer
    reset, a failover): it leaks AttributeError/TypeError from the transport instead of
    ConnectionError (redis/redis-py#4287, #3546). Only an error raised in the connection or the
    asyncio transport itself counts; any other AttributeError is a bug and stays one."""
    if not isinstance(e, (AttributeError, TypeError)):
        return False
    tb, last = e.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return False
    name = last.tb_frame.f_code.co_filename.replace("\\", "/")
    return name.endswith(_TRANSPORT_FILES)


_TRANSPORT_FILES = ("/redis/asyncio/connection.py", "/asyncio/streams.py", "/asyncio/selector_events.py")


@contextlib.contextmanager
def io_guard() -> Iterator[None]:
    """Map the client's connection failures to one typed error (a connection closed under a
    write that redis-py leaks as AttributeError/TypeError too)."""
    try:
        yield
    except IO_ERRORS as e:
        raise unavailable(e) from e
    except ResponseError as e:  # the typed ones, on every path (a cluster's commands too)
        typed = typed_reply_error(e)
        if typed is e:
            raise
        raise typed from None
    except (AttributeError, TypeError) as e:
        if leaked_close_race(e):
            raise StoreUnavailableError(f"the Redis connection closed under a write: {e!r}") from e
        raise


def as_str(b: bytes | str | None) -> str | None:
    if b is None:
        return None
    return b.decode() if isinstance(b, bytes) else b


def as_int(b: bytes | str | None) -> int | None:
    return None if b is None else int(b)


def confirmed(acks: Any) -> bool:
    """Whether a durability wait's reply (None: none was sent) confirms the write before it."""
    if acks is None:
        return True
    if isinstance(acks, ResponseError):
        return False
    if isinstance(acks, builtins.list):  # WAITAOF: [local fsynced, replicas fsynced]
        return int(acks[0]) >= 1
    return int(acks) >= 1


def stream_fields(e: Entry) -> builtins.list[bytes]:
    """An entry's stream fields as append.lua writes them (type, time, data, meta?, surface?)."""
    f = [b"type", e.type.encode(), b"time", b"%d" % e.time, b"data", _json.encode(e.data)]
    if e.meta is not None:
        f += [b"meta", _json.encode(e.meta)]
    if e.surface is not None:
        f += [b"surface", _json.encode(e.surface)]
    return f
