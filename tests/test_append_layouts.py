"""append.lua's two layouts: the short one for a plain put (hdr, log and feed keys; the feed
entry's ID as the clock) and the long one (every session key) must store the same thing.

A store with ``_short_puts = False`` sends every put in the long layout; the same writes through
both are compared key by key on one server (docs/design.md §3, "Scripts").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from redis_session import (
    NewEntry,
    RedisSessionStore,
    SessionConflictError,
    SessionError,
    SessionHeader,
    SessionNotFoundError,
    SessionReplacedError,
)

from support import cleanup_prefix

pytestmark = pytest.mark.anyio


def um(text: str, time: int | None = None) -> NewEntry:
    return NewEntry("user/message", {"content": text}, time=time)


def chunk(text: str) -> NewEntry:
    return NewEntry("assistant/chunk", {"answer": "a1", "text": text})


@pytest.fixture
async def pair(redis_url: str) -> AsyncIterator[tuple[RedisSessionStore, RedisSessionStore]]:
    """A store that sends plain puts in the short layout and one that never does."""
    import uuid

    p1, p2 = f"t{uuid.uuid4().hex[:10]}", f"t{uuid.uuid4().hex[:10]}"
    short = RedisSessionStore.from_url(redis_url, prefix=p1)
    long = RedisSessionStore.from_url(redis_url, prefix=p2)
    long._short_puts = False
    try:
        yield short, long
    finally:
        await short.aclose()
        await long.aclose()
        await cleanup_prefix(redis_url, p1)
        await cleanup_prefix(redis_url, p2)


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield r
    finally:
        await r.aclose()


async def writes(store: RedisSessionStore) -> list[str]:
    """The same writes through either layout; what each refused, by error type."""
    refused = []
    await store.create(SessionHeader(id="s"))
    await store.put("s", 0, [um("one")])
    await store.put("s", 1, [um("two"), um("three", time=1_700_000_000_123)])
    await store.put("s", None, [chunk("x"), chunk("y")])  # chunk rows only: no feed hint
    await store.put("s", 5, [chunk("z"), um("four")])
    head = await store.head("s")
    assert head is not None
    await store.put("s", 7, [um("five")], incarnation=head.header.incarnation)
    for bad in (
        store.put("s", 3, [um("stale")]),
        store.put("s", None, [um("other life")], incarnation="0123456789abcdef"),
        store.put("missing", 0, [um("nobody")]),
    ):
        try:
            await bad
        except (SessionConflictError, SessionReplacedError, SessionNotFoundError) as e:
            refused.append(type(e).__name__)
    return refused


def _rows(rows: list[Any]) -> list[tuple[str, dict[str, str]]]:
    return [(rid, {k: ("<t>" if k == "time" and v != "1700000000123" else v) for k, v in f.items()}) for rid, f in rows]


async def test_short_and_long_layout_store_the_same(
    pair: tuple[RedisSessionStore, RedisSessionStore], raw: aioredis.Redis
) -> None:
    short, long = pair
    refused = [await writes(short), await writes(long)]
    assert refused[0] == refused[1] == ["SessionConflictError", "SessionReplacedError", "SessionNotFoundError"]
    logs = [_rows(await raw.xrange(s.keys.log("s"))) for s in pair]
    assert logs[0] == logs[1]
    assert [rid for rid, _ in logs[0]] == [f"{i}-1" for i in range(8)]
    hdrs = [await raw.hgetall(s.keys.hdr("s")) for s in pair]
    assert set(hdrs[0]) == set(hdrs[1])
    assert hdrs[0]["n"] == hdrs[1]["n"] == "8"
    for h in hdrs:
        assert int(h["created_at"]) <= int(h["updated_at"])
    feeds = [[f for _, f in await raw.xrange(s.keys.feed(s.keys.feed_shard("s"))) if f.get("s") == "s"] for s in pair]
    # one hint per put that held a row other than a chunk, "session reached n"
    assert feeds[0] == feeds[1] == [{"s": "s", "n": str(n)} for n in (1, 3, 7, 8)]
    read = [await s.read("s") for s in pair]
    assert [(e.n, e.type, e.data) for e in read[0]] == [(e.n, e.type, e.data) for e in read[1]]
    assert read[0][2].time == read[1][2].time == 1_700_000_000_123


async def test_short_layout_takes_its_time_from_the_feed_entry(
    pair: tuple[RedisSessionStore, RedisSessionStore], raw: aioredis.Redis
) -> None:
    short, _ = pair
    await short.create(SessionHeader(id="c"))
    before = await raw.time()
    [e] = await short.put("c", 0, [um("hello")])
    after = await raw.time()
    feed = await raw.xrange(short.keys.feed(short.keys.feed_shard("c")))
    [(fid, fields)] = [(i, f) for i, f in feed if f["s"] == "c"]
    assert fields == {"s": "c", "n": "1"}
    assert e.time == int(fid.split("-")[0])  # the feed entry's ID is the batch's clock
    assert before[0] * 1000 + before[1] // 1000 <= e.time <= after[0] * 1000 + after[1] // 1000
    hdr = await raw.hgetall(short.keys.hdr("c"))
    [(_, row)] = await raw.xrange(short.keys.log("c"))
    assert int(hdr["updated_at"]) == int(row["time"]) == e.time
    assert (await short.read("c")) == [e]
    # chunk rows give no hint: the script asks the server's clock instead
    [c] = await short.put("c", 1, [chunk("x")])
    assert c.time >= e.time
    assert len([f for _, f in await raw.xrange(short.keys.feed(short.keys.feed_shard("c"))) if f["s"] == "c"]) == 1


async def test_ephemeral_session_falls_back_to_the_long_layout(
    pair: tuple[RedisSessionStore, RedisSessionStore], raw: aioredis.Redis, redis_url: str
) -> None:
    short, _ = pair
    # created by another store, so `short` does not know the session is ephemeral: its first put
    # is answered {9} by the short layout and sent again in the long one, which refreshes every TTL
    creator = RedisSessionStore.from_url(redis_url, prefix=short.prefix)
    try:
        await creator.create(SessionHeader(id="e"), [um("zero")], ttl_ms=600_000)
        await creator.set_draft("e", {"text": "draft"})
    finally:
        await creator.aclose()
    for key in (short.keys.hdr("e"), short.keys.log("e"), short.keys.draft("e")):
        await raw.pexpire(key, 50_000)
    [e] = await short.put("e", 1, [um("one")])
    assert e.n == 1
    assert [rid for rid, _ in await raw.xrange(short.keys.log("e"))] == ["0-1", "1-1"]  # landed once
    assert (await raw.hgetall(short.keys.hdr("e")))["n"] == "2"
    for key in (short.keys.hdr("e"), short.keys.log("e"), short.keys.draft("e")):
        assert await raw.pttl(key) > 500_000, key
    await short.put("e", 2, [um("two")])  # known now: the long layout at once
    assert (await raw.hgetall(short.keys.hdr("e")))["n"] == "3"


async def test_idempotent_retry_lands_once(pair: tuple[RedisSessionStore, RedisSessionStore]) -> None:
    for store in pair:
        await store.create(SessionHeader(id="i"))
        await store.put("i", 0, [um("zero")])
        first = await store.put("i", 1, [um("one"), um("two")], idempotency_key="k1")
        again = await store.put("i", 1, [um("one"), um("two")], idempotency_key="k1")
        later = await store.put("i", None, [um("one"), um("two")], idempotency_key="k1")
        assert [e.n for e in first] == [e.n for e in again] == [e.n for e in later] == [1, 2]
        assert [(e.n, e.data) for e in again] == [(e.n, e.data) for e in first]
        head = await store.head("i")
        assert head is not None and head.n == 3
        await store.put("i", 3, [um("three")])  # a plain put after it: the short layout again
        assert [e.n for e in await store.read("i")] == [0, 1, 2, 3]


async def test_legacy_header_without_incarnation(
    pair: tuple[RedisSessionStore, RedisSessionStore], raw: aioredis.Redis
) -> None:
    for store in pair:
        await store.create(SessionHeader(id="old", created_at=1_600_000_000_000))
        await raw.hdel(store.keys.hdr("old"), "incarnation")  # a header written before incarnations
        head = await store.head("old")
        assert head is not None and head.header.incarnation == "legacy-1600000000000"
        [e] = await store.put("old", 0, [um("a")], incarnation="legacy-1600000000000")
        assert e.n == 0
        with pytest.raises(SessionReplacedError):
            await store.put("old", 1, [um("b")], incarnation="legacy-1600000000001")
        await store.put("old", 1, [um("c")])  # no incarnation given: any
        assert [x.data["content"] for x in await store.read("old")] == ["a", "c"]


async def test_stream_ahead_of_header_writes_nothing(
    pair: tuple[RedisSessionStore, RedisSessionStore], raw: aioredis.Redis
) -> None:
    for store in pair:
        await store.create(SessionHeader(id="bad"))
        await store.put("bad", 0, [um("zero")])
        await raw.xadd(store.keys.log("bad"), {"type": "user/message", "time": "1", "data": "{}"}, id="5-1")
        feed = store.keys.feed(store.keys.feed_shard("bad"))
        before = await raw.xrange(feed)
        with pytest.raises(SessionError, match="doctor"):
            await store.put("bad", 1, [um("one")])
        assert await raw.xrange(feed) == before  # the short layout took its feed entry back
        assert (await raw.hgetall(store.keys.hdr("bad")))["n"] == "1"
        assert [rid for rid, _ in await raw.xrange(store.keys.log("bad"))] == ["0-1", "5-1"]
