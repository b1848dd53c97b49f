"""Following a session live: `follow`, a `SessionStore.tail` that survives dropped connections.

Every live reader uses it (the terminal tail, the gateway's SSE streams, adapters): when the
connection to the store drops it waits (exponential backoff with jitter) and resumes at the last
delivered n + 1, so a reader never loses or repeats an entry.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar, cast

import anyio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import SessionNotFoundError, SessionReplacedError
from .model import Entry
from .projection.chunks import Delta, DeltaGap, LiveRecord
from .store import SessionStore
from .streaming import tail_deltas

# StoreUnavailableError is an OSError (ConnectionError); redis-py's own errors are listed for
# stores that let one through (a cluster client's MOVED storm, a pool at its limit).
RETRYABLE: tuple[type[BaseException], ...] = (OSError, RedisConnectionError, RedisTimeoutError)

T = TypeVar("T")

RetryHook = Callable[[BaseException, float, int], None]
"""Called before each wait: (the error, seconds it will wait, the n it will resume at)."""


@contextlib.asynccontextmanager
async def _closing(it: AsyncIterator[T]) -> AsyncGenerator[AsyncIterator[T], None]:
    """`contextlib.aclosing` for any async iterator (the store protocol promises no `aclose`)."""
    try:
        yield it
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


def follow(
    store: SessionStore,
    session_id: str,
    start: int = 0,
    *,
    on_retry: RetryHook | None = None,
    min_backoff: float = 0.05,
    max_backoff: float = 5.0,
    incarnation: str | None = None,
    resumed: bool = False,
) -> AsyncGenerator[Entry, None]:
    """Every entry with n >= `start`, then each new one as it lands, across connection drops.

    Ends when the session is deleted. Raises `SessionNotFoundError` when it does not exist at the
    start, and `SessionReplacedError` when the id names another incarnation than `incarnation`
    (default: the one at the start) — also when that happened during a drop: a resumed tail
    never continues on a session that took the id. Delivery is exactly once and in order: after a
    drop the tail resumes at the last delivered n + 1, and a gap (never expected from a store) is
    filled by a read. A `start` beyond the log waits for it, unless `resumed` (it is the cursor of
    a reader given the entries before it, e.g. in an earlier process): once this reader was given
    entries, a log that ends before its cursor (a failover took entries back) raises
    `SessionRewoundError` instead of waiting silently for entries it would never be given.

    >>> async with contextlib.aclosing(follow(store, "chat-1")) as entries:
    ...     async for e in entries:
    ...         print(e.n, e.type)
    """
    return cast(
        AsyncGenerator[Entry, None],
        _resume(store, session_id, start, deltas=False, live_after=None, on_retry=on_retry,
                min_backoff=min_backoff, max_backoff=max_backoff, incarnation=incarnation, resumed=resumed),
    )  # fmt: skip


def follow_deltas(
    store: SessionStore,
    session_id: str,
    start: int = 0,
    *,
    live_after: str | None = None,
    on_retry: RetryHook | None = None,
    min_backoff: float = 0.05,
    max_backoff: float = 5.0,
    incarnation: str | None = None,
    resumed: bool = False,
) -> AsyncGenerator[Entry | Delta | DeltaGap, None]:
    """`follow`, plus the deltas of streamed answers (`Delta`) as they are streamed
    (`streaming.tail_deltas`): a reader arriving mid-answer gets the answer so far, then the rest.

    Across connection drops it resumes at the last delivered n + 1 and right after the last
    delivered delta's `cursor`, so entries and deltas both arrive exactly once and in order; a
    delta the live stream no longer holds comes as a `DeltaGap` (re-read the answer's chunk rows
    from the log), never silently missing. A begin of another life raises `SessionReplacedError`.
    Pass `live_after` (a `Delta.cursor`) with `start` to resume a reader of an earlier call (that
    is `resumed`, as in `follow`: a log rolled back behind `start` raises `SessionRewoundError`).

    >>> async for item in follow_deltas(store, "chat-1", start=s.n):
    ...     if isinstance(item, Delta):
    ...         print(item.text, end="")
    """
    return cast(AsyncGenerator[Entry | Delta | DeltaGap, None], _resume(
        store, session_id, start, deltas=True, live_after=live_after, on_retry=on_retry,
        min_backoff=min_backoff, max_backoff=max_backoff, incarnation=incarnation,
        resumed=resumed or live_after is not None,
    ))  # fmt: skip


def follow_live(
    store: SessionStore,
    session_id: str,
    start: int,
    *,
    live_after: str,
    incarnation: str,
    on_retry: RetryHook | None = None,
) -> AsyncGenerator[Entry | LiveRecord, None]:
    """`follow` plus the live stream's raw records after `live_after` (`store.tail_live`), for a
    reader that decides itself what it is owed of them (`streaming.LiveReader`: the gateway's
    shared tails); resumed across drops after the last entry and the last record delivered."""
    return cast(
        AsyncGenerator[Entry | LiveRecord, None],
        _resume(store, session_id, start, deltas=False, records=True, live_after=live_after, on_retry=on_retry,
                min_backoff=0.05, max_backoff=5.0, incarnation=incarnation),
    )  # fmt: skip


def _open(
    store: SessionStore,
    session_id: str,
    nxt: int,
    deltas: bool,
    records: bool,
    incarnation: str,
    live_after: str | None,
    delivered: dict[str, int],
    resumed: bool,
) -> AsyncIterator[Entry | Delta | DeltaGap | LiveRecord]:
    if deltas:
        return tail_deltas(
            store, session_id, nxt, incarnation=incarnation, live_after=live_after, delivered=delivered, resumed=resumed
        )
    if records:
        return store.tail_live(
            session_id, nxt, live_after=live_after or "0-0", incarnation=incarnation, resumed=resumed
        )
    return store.tail(session_id, nxt, incarnation=incarnation, resumed=resumed)


async def _resume(
    store: SessionStore,
    session_id: str,
    start: int,
    *,
    deltas: bool,
    records: bool = False,
    live_after: str | None,
    on_retry: RetryHook | None,
    min_backoff: float,
    max_backoff: float,
    incarnation: str | None,
    resumed: bool = False,
) -> AsyncGenerator[Entry | Delta | DeltaGap | LiveRecord, None]:
    """The one reconnecting reader behind `follow`, `follow_deltas` and `follow_live`: entries from `start`
    exactly once and in order (a gap, never expected, is filled by a read), and with `deltas` the
    live deltas after `live_after`; a drop waits (backoff with jitter) and resumes after the last
    item delivered; a replaced id raises, a deleted one ends it."""
    nxt = start
    delay = min_backoff
    dropped = False
    delivered: dict[str, int] = {}  # answer -> next index owed, across connections
    while True:
        try:
            if incarnation is None:
                head = await store.head(session_id)
                if head is None:
                    raise SessionNotFoundError(session_id)
                incarnation = head.header.incarnation
            # past `start`, `nxt` follows entries this reader was given: a log behind it was rolled back
            tail = _open(
                store, session_id, nxt, deltas, records, incarnation, live_after, delivered, resumed or nxt > start
            )
            async with _closing(tail) as items:
                async for item in items:
                    if isinstance(item, (Delta, DeltaGap, LiveRecord)):
                        live_after = (item.id if isinstance(item, LiveRecord) else item.cursor) or live_after
                        yield item
                        continue
                    if item.n < nxt:
                        continue
                    if item.n > nxt:
                        for missing in await store.read(session_id, nxt, item.n, incarnation=incarnation):
                            yield missing
                            nxt = missing.n + 1
                    yield item
                    nxt = item.n + 1
                    delay = min_backoff
            return
        except SessionReplacedError:
            raise
        except SessionNotFoundError:
            if dropped:  # deleted while we were away: the same end as a tail that sees it go
                return
            raise
        except RETRYABLE as exc:
            dropped = True
            wait = delay * (0.5 + random.random())  # jitter: many readers must not reconnect in step
            if on_retry is not None:
                on_retry(exc, wait, nxt)
            await anyio.sleep(wait)
            delay = min(delay * 2, max_backoff)
