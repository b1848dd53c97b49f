"""What an operator sees with `redis-cli`: the key layout the README documents, exactly.

`HGETALL {prefix}:{chat-1}:hdr` and `XRANGE {prefix}:{chat-1}:log 5 9` are read through a raw
client (and, when `redis-cli`/`valkey-cli` is installed, through that very tool).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import anyio
import pytest
import redis.asyncio as aioredis

from redis_session import NewEntry, RedisSessionStore, SessionError, SessionHeader
from redis_session.redis.rows import rows_to_entries

pytestmark = pytest.mark.anyio

REPLACE = {"surfaceOp": {"op": "replace", "start": 6, "end": 6}, "sourceEventSeqs": [6]}
BASE_FIELDS = {"id", "format_version", "created_at", "delegation_depth", "incarnation", "n", "updated_at"}


def um(text: str) -> NewEntry:
    return NewEntry("user/message", {"content": text})


async def fill_chat(store: RedisSessionStore) -> float:
    """chat-1: 12 entries; 6 carries meta, 7 a surface (replacing 6), 8 is a plain chat `message`."""
    t0 = time.time() * 1000
    await store.create(SessionHeader(id="chat-1"))
    await store.put("chat-1", 0, [um(f"m{i}") for i in range(6)])
    await store.put("chat-1", 6, [NewEntry("assistant/message", {"content": "a6"}, {"turn": 1, "step": 1})])
    await store.put(
        "chat-1",
        7,
        [NewEntry("assistant/message", {"content": "a7"}, None, REPLACE)],
    )
    await store.put("chat-1", 8, [NewEntry("message", {"role": "user", "content": "plain"})])
    await store.put("chat-1", None, [um(f"m{i}") for i in range(9, 12)])
    return t0


def check_hdr(hdr: dict[str, str], *, n: int, since_ms: float) -> None:
    assert set(hdr) == BASE_FIELDS
    assert hdr["id"] == "chat-1"
    assert hdr["format_version"] == "1"
    assert hdr["delegation_depth"] == "0"
    assert hdr["n"] == str(n)
    assert re.fullmatch(r"[0-9a-f]{16}", hdr["incarnation"])  # one per creation, readable in redis-cli
    created, updated = int(hdr["created_at"]), int(hdr["updated_at"])
    assert since_ms - 5_000 <= created <= updated <= time.time() * 1000 + 5_000


def check_rows(rows: list[tuple[str, dict[str, str]]]) -> None:
    assert [rid for rid, _ in rows] == ["5-1", "6-1", "7-1", "8-1", "9-1"]
    by_id = dict(rows)
    for rid, fields in rows:
        assert list(fields)[:3] == ["type", "time", "data"], rid  # in this order: readable
        assert fields["time"].isdigit()
        json.loads(fields["data"])
    assert set(by_id["5-1"]) == {"type", "time", "data"}
    assert by_id["5-1"]["type"] == "user/message"
    assert json.loads(by_id["5-1"]["data"]) == {"content": "m5"}
    assert set(by_id["6-1"]) == {"type", "time", "data", "meta"}
    assert json.loads(by_id["6-1"]["meta"]) == {"turn": 1, "step": 1}
    assert set(by_id["7-1"]) == {"type", "time", "data", "surface"}
    assert json.loads(by_id["7-1"]["surface"]) == REPLACE
    assert by_id["8-1"]["type"] == "message"
    assert json.loads(by_id["8-1"]["data"]) == {"role": "user", "content": "plain"}
    assert json.loads(by_id["9-1"]["data"]) == {"content": "m9"}


async def test_layout_through_a_raw_client(
    redis_store: RedisSessionStore, raw_redis: aioredis.Redis, prefix: str
) -> None:
    t0 = await fill_chat(redis_store)
    hdr = await raw_redis.hgetall(f"{prefix}:{{chat-1}}:hdr")
    check_hdr(hdr, n=12, since_ms=t0)
    rows = await raw_redis.xrange(f"{prefix}:{{chat-1}}:log", "5", "9")
    check_rows([(rid, fields) for rid, fields in rows])
    # the sequence lives in the header; the stream holds exactly the entries
    assert await raw_redis.xlen(f"{prefix}:{{chat-1}}:log") == 12
    first = await raw_redis.xrange(f"{prefix}:{{chat-1}}:log", "-", "+", count=1)
    assert first[0][0] == "0-1"
    # and what the store reads back is what redis-cli shows
    entries = await redis_store.read("chat-1", 5, 10)
    assert [e.n for e in entries] == [5, 6, 7, 8, 9]
    assert [str(e.time) for e in entries] == [f["time"] for _, f in rows]


async def test_optional_header_fields(redis_store: RedisSessionStore, raw_redis: aioredis.Redis, prefix: str) -> None:
    origin = {"platform": "qq", "guild": 42, "tags": ["a", "b"]}
    await redis_store.create(SessionHeader(id="p", title="Trip planning", origin=origin), [um("a"), um("b"), um("c")])
    await redis_store.put(
        "p", 3, [NewEntry("cut", {"before": 2, "summary": [{"role": "user", "content": "s"}], "reason": "budget"})]
    )
    hdr = await raw_redis.hgetall(f"{prefix}:{{p}}:hdr")
    assert set(hdr) == BASE_FIELDS | {"title", "origin", "last_cut"}
    assert hdr["title"] == "Trip planning"
    assert json.loads(hdr["origin"]) == origin
    assert hdr["last_cut"] == "3" and hdr["n"] == "4"

    await redis_store.create(SessionHeader(id="child", parent="p", at=2, delegation_depth=1))
    child = await raw_redis.hgetall(f"{prefix}:{{child}}:hdr")
    assert set(child) == BASE_FIELDS | {"parent", "at", "segments"}
    assert child["parent"] == "p" and child["at"] == "2" and child["n"] == "2"
    assert child["delegation_depth"] == "1"
    assert json.loads(child["segments"]) == [["p", 0, 2]]
    # a branch's own stream starts empty: its prefix is stitched from the parent on read
    assert await raw_redis.exists(f"{prefix}:{{child}}:log") == 0


def _cli() -> str | None:
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


def _run_cli(cli: str, url: str, *args: str) -> list[str]:
    out = subprocess.run([cli, "-u", url, *args], capture_output=True, text=True, timeout=20, check=True)
    return out.stdout.splitlines()  # not a tty: one value per line, unquoted


async def test_layout_through_redis_cli(redis_store: RedisSessionStore, redis_url: str, prefix: str) -> None:
    cli = _cli()
    if cli is None:
        pytest.skip("neither redis-cli nor valkey-cli is on PATH")
    t0 = await fill_chat(redis_store)
    lines = await anyio.to_thread.run_sync(_run_cli, cli, redis_url, "HGETALL", f"{prefix}:{{chat-1}}:hdr")
    check_hdr(dict(zip(lines[::2], lines[1::2], strict=True)), n=12, since_ms=t0)

    lines = await anyio.to_thread.run_sync(_run_cli, cli, redis_url, "XRANGE", f"{prefix}:{{chat-1}}:log", "5", "9")
    rows: list[tuple[str, list[str]]] = []
    for line in lines:  # flattened: an ID, then its field/value pairs
        if (rows and len(rows[-1][1]) % 2 == 1) or not (line.endswith("-1") and line[:-2].isdigit()):
            rows[-1][1].append(line)
        else:
            rows.append((line, []))
    check_rows([(rid, dict(zip(f[::2], f[1::2], strict=True))) for rid, f in rows])


async def test_long_reads_decode_every_row_in_order(
    redis_store: RedisSessionStore, raw_redis: aioredis.Redis, redis_url: str, prefix: str
) -> None:
    """A read of a long log is decoded a chunk of rows at a time: every entry comes back once, in
    order, with its own fields (plain rows and rows with meta between them), whichever chunk edge
    a range starts or stops at; a row edited outside redis-session fails the read, not silently."""
    await redis_store.create(SessionHeader(id="long"))
    batch = [
        NewEntry("assistant/message", {"content": f"a{i}"}, {"turn": i}) if i % 97 == 0 else um(f"m{i}")
        for i in range(1000)
    ]
    await redis_store.put("long", 0, batch)
    got = await redis_store.read("long")
    assert [e.n for e in got] == list(range(1000))
    assert [(e.type, e.data, e.meta) for e in got] == [(b.type, b.data, b.meta) for b in batch]
    for start, stop in [(0, 256), (255, 257), (1, 999), (743, 1000), (512, 513)]:
        assert [e.n for e in await redis_store.read("long", start, stop)] == list(range(start, stop))
    # the doctor's and the archive's decoder (the rows left as they are) reads the same entries
    raw = aioredis.Redis.from_url(redis_url)
    try:
        rows = [[rid, [x for kv in f.items() for x in kv]] for rid, f in await raw.xrange(f"{prefix}:{{long}}:log")]
    finally:
        await raw.aclose()
    assert rows_to_entries(rows) == got
    await raw_redis.xadd(f"{prefix}:{{long}}:log", {"type": "user/message", "time": "1", "data": "{oops"}, id="1000-1")
    await raw_redis.hset(f"{prefix}:{{long}}:hdr", "n", 1001)
    with pytest.raises(SessionError, match="corrupt"):
        await redis_store.read("long")


@pytest.mark.parametrize(
    "edit",
    [
        "gap",
        "last row deleted",
        "stray row",
        "no type",
        "empty type",
        "no time",
        "no data",
        "type not UTF-8",
        "data twice",
        "log not a stream",
    ],
)
async def test_a_log_edited_outside_fails_the_read(
    redis_store: RedisSessionStore, raw_redis: aioredis.Redis, redis_url: str, prefix: str, edit: str
) -> None:
    """A row deleted or added outside redis-session, one without its type, time or data or with a
    field twice, or a log that is no stream, fails the read with the corruption error: never a
    shorter log, a second entry n, an entry read with a default in place of what is missing, or a
    raw WRONGTYPE. (Data that no longer fits its
    type's schema is `redis-session doctor`'s to report: a read does not re-validate every entry.)"""
    await redis_store.create(SessionHeader(id="e"))
    await redis_store.put("e", 0, [um(f"m{i}") for i in range(9)])
    log, hdr = f"{prefix}:{{e}}:log", f"{prefix}:{{e}}:hdr"
    raw = aioredis.Redis.from_url(redis_url)  # bytes, for a value that is not UTF-8
    try:
        fields: dict[str, str | bytes] = {"type": "user/message", "time": "1", "data": '{"content":"m9"}'}
        if edit == "gap":
            await redis_store.put("e", 9, [um("m9")])
            await raw.xdel(log, "5-1")
        elif edit == "last row deleted":
            await redis_store.put("e", 9, [um("m9")])
            await raw.xdel(log, "9-1")
        elif edit == "stray row":
            await raw.xadd(log, {"type": "user/message", "time": "1", "data": '{"content":"stray"}'}, id="8-2")
        elif edit == "data twice":
            await raw.execute_command(
                "XADD", log, "9-1", "type", "user/message", "time", "1", "data", "{}", "data", '{"a":1}'
            )
            await raw.hset(hdr, "n", 10)
        elif edit == "log not a stream":
            await raw.delete(log)
            await raw.set(log, "oops")
        else:
            if edit == "empty type":
                fields["type"] = ""
            elif edit == "type not UTF-8":
                fields["type"] = b"user/\xff"
            else:
                fields.pop(edit.split()[1])
            await raw.xadd(log, fields, id="9-1")  # type: ignore[arg-type]
            await raw.hset(hdr, "n", 10)
        with pytest.raises(SessionError, match="corrupt"):
            await redis_store.read("e")
        if edit in ("gap", "last row deleted"):  # a range over the hole, too
            with pytest.raises(SessionError, match="corrupt"):
                await redis_store.read("e", 4, 10)
        if edit == "log not a stream":
            with pytest.raises(SessionError, match="corrupt"):  # a write too, and nothing is written
                await redis_store.put("e", 9, [um("m9")])
            assert await raw.get(log) == b"oops"
            return
        assert [e.n for e in await redis_store.read("e", 0, 4)] == [0, 1, 2, 3]  # the sound part reads
    finally:
        await raw.aclose()


@pytest.mark.parametrize("key", ["feed", "idem"])
@pytest.mark.parametrize("keyed", [True, False])
async def test_a_shared_key_of_another_kind_fails_a_write_before_it_writes(
    redis_store: RedisSessionStore, redis_url: str, key: str, keyed: bool
) -> None:
    """The change feed's shard or the idempotency set holding another kind of value (edited
    outside redis-session) fails an append with the corruption error and nothing written: not the
    entries in the log and an error after them (a caller retrying with a new key wrote twice)."""
    await redis_store.create(SessionHeader(id="k"), [um("m0")])
    name = redis_store.keys.feed(redis_store.keys.feed_shard("k")) if key == "feed" else redis_store.keys.idem("k")
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await raw.delete(name)
        await raw.set(name, "oops")
        if key == "idem" and not keyed:  # the set is only looked at by a keyed append
            await redis_store.put("k", 1, [um("m1")])
            assert [e.data["content"] for e in await redis_store.read("k")] == ["m0", "m1"]
            return
        with pytest.raises(SessionError, match="corrupt"):
            await redis_store.put("k", 1, [um("m1")], idempotency_key="pay-1" if keyed else None)
        assert [e.data["content"] for e in await redis_store.read("k")] == ["m0"]
        assert (await redis_store.head("k")).n == 1  # type: ignore[union-attr]
    finally:
        await raw.delete(name)
        await raw.aclose()


async def test_a_branch_of_a_log_of_another_kind_is_not_made(redis_store: RedisSessionStore, redis_url: str) -> None:
    """A parent whose log is no stream (edited outside redis-session): its branch, every read of
    which would fail, is refused with the corruption error, and nothing of it is written (no link
    in the parent, no header)."""
    from redis_session import Sessions

    await redis_store.create(SessionHeader(id="p"), [um("a"), um("b")])
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await raw.delete(redis_store.keys.log("p"))
        await raw.set(redis_store.keys.log("p"), "oops")
        with pytest.raises(SessionError, match="corrupt"):
            await Sessions(redis_store).branch("p", 1, branch_id="p-b")
        assert await redis_store.head("p-b") is None
        assert await raw.zcard(redis_store.keys.kids("p")) == 0
    finally:
        await raw.aclose()


@pytest.mark.parametrize("edit", ["header not a hash", "n not a number"])
async def test_one_unreadable_header_never_ends_a_listing(
    redis_store: RedisSessionStore, redis_url: str, edit: str
) -> None:
    """One session's header edited outside redis-session (another kind of value, or a field that
    is no number) used to make every listing raise — `ls`, `doctor --all` and `GET /sessions`
    with it. The listing goes on: the others are listed, that one is named in `unreadable`, on a
    parent's branch listing too."""
    from redis_session import SessionCorruptError, Sessions

    for sid in ("a", "b", "c"):
        await redis_store.create(SessionHeader(id=sid), [um("x")])
    await Sessions(redis_store).branch("a", 1, branch_id="a-1")
    await Sessions(redis_store).branch("a", 1, branch_id="a-2")
    raw = aioredis.Redis.from_url(redis_url)
    try:
        for sid in ("b", "a-1"):
            hdr = redis_store.keys.hdr(sid)
            if edit == "header not a hash":
                await raw.delete(hdr)
                await raw.set(hdr, "oops")
            else:
                await raw.hset(hdr, "n", "twelve")
        page = await redis_store.list()
        assert [h.id for h in page.items] == ["a-2", "c", "a"]  # newest first, as always
        assert page.unreadable == ["a-1", "b"]
        kids = await redis_store.list(parent="a")
        assert [h.id for h in kids.items] == ["a-2"] and kids.unreadable == ["a-1"]
        small = await redis_store.list(limit=1)  # a page of one: the unreadable one does not count
        assert len(small.items) == 1
        with pytest.raises(SessionCorruptError):  # a typed error of its own, a SessionError
            await redis_store.head("b")
        assert await raw.type(redis_store.keys.hdr("b")) in (b"string", b"hash")  # nothing was "healed"
    finally:
        await raw.aclose()


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 7])
async def test_paging_past_unreadable_and_stale_members_loses_none(
    redis_store: RedisSessionStore, redis_url: str, limit: int
) -> None:
    """Pages of a listing with unreadable headers and stale index members (a header gone, its
    member left: an expiry) among the sessions: every readable session is listed once, in order,
    whatever the page size. A page used to read more members than it had room for once it had
    skipped one, and its cursor passed over the rest (`limit=4` over 8 sessions, one unreadable:
    one page of 4, cursor None, three sessions never listed)."""
    ids = [f"s{i}" for i in range(10)]
    for i, sid in enumerate(ids):
        await redis_store.create(SessionHeader(id=sid, created_at=1_700_000_000_000 + 1000 * (10 - i)), [um("x")])
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await raw.hset(redis_store.keys.hdr("s3"), "n", "abc")  # unreadable
        await raw.delete(redis_store.keys.hdr("s5"))  # stale: its member is healed away
        await raw.hset(redis_store.keys.hdr("s6"), "n", "abc")
    finally:
        await raw.aclose()
    seen: list[str] = []
    unreadable: list[str] = []
    cursor = None
    for _ in range(40):
        page = await redis_store.list(limit=limit, cursor=cursor)
        assert len(page.items) <= limit
        seen += [h.id for h in page.items]
        unreadable += page.unreadable
        cursor = page.cursor
        if cursor is None:
            break
    assert seen == [sid for sid in ids if sid not in ("s3", "s5", "s6")]  # each once, newest first
    assert unreadable == ["s3", "s6"]


async def test_the_gone_set_holds_deleted_create_keys_for_a_day_after_the_last_delete(
    redis_store: RedisSessionStore, redis_url: str
) -> None:
    """`rs:{<id>}:gone` (README, Redis key layout): the create key of each deleted life of the id,
    a SET expiring 24 h after the last delete of the id — any delete, a life created without a
    key too (it used to restart only on a keyed life's delete)."""
    from redis_session.keys import GONE_TTL_MS

    gone = redis_store.keys.gone("g")
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await redis_store.create(SessionHeader(id="g", create_key="k1"))
        assert not await raw.exists(gone)  # nothing until a delete
        await redis_store.delete("g")
        assert await raw.smembers(gone) == {b"k1"}
        assert GONE_TTL_MS - 60_000 < await raw.pttl(gone) <= GONE_TTL_MS
        await raw.pexpire(gone, 5000)  # as if most of the day had passed
        await redis_store.create(SessionHeader(id="g"))  # a life without a key
        await redis_store.delete("g")
        assert await raw.smembers(gone) == {b"k1"}
        assert GONE_TTL_MS - 60_000 < await raw.pttl(gone) <= GONE_TTL_MS
    finally:
        await raw.aclose()


HEADER_EDITS = {
    "n not a number": ("n", "abc"),
    "n empty": ("n", ""),
    "n negative": ("n", "-1"),
    "n a fraction": ("n", "1.5"),
    "n with a space": ("n", " 2"),
    "n past 2^53": ("n", str(2**53)),
    "n missing": ("n", None),
    "ttl_ms not a number": ("ttl_ms", "x"),
    "ttl_ms negative": ("ttl_ms", "-1"),
    "ttl_ms zero": ("ttl_ms", "0"),
    "created_at not a number": ("created_at", "x"),
    "created_at missing": ("created_at", None),
    "id of another session": ("id", "someone-else"),
}


@pytest.mark.parametrize("edit", list(HEADER_EDITS))
async def test_a_header_field_edited_outside_is_corrupt_everywhere_and_nothing_is_written(
    redis_store: RedisSessionStore, redis_url: str, edit: str
) -> None:
    """A header field that is not what redis-session writes (r19): `head`, `read` and every kind
    of append raise `SessionCorruptError` and write nothing — an append used to write its rows and
    then fail on a bare Lua error (so its retry wrote them twice), or, with a `ttl_ms` of 0 or
    below, to answer success and expire the whole session at once; `n=-1` read as an empty log,
    `n=2^53` took another entry, an `id` of another session was answered as that one. The
    listing names it unreadable; a delete still deletes it."""
    from redis_session import SessionCorruptError

    await redis_store.create(SessionHeader(id="e"), [um("a"), um("b")])
    await redis_store.create(SessionHeader(id="ok"), [um("x")])
    field, value = HEADER_EDITS[edit]
    hdr, log = redis_store.keys.hdr("e"), redis_store.keys.log("e")
    feed = redis_store.keys.feed(redis_store.keys.feed_shard("e"))
    raw = aioredis.Redis.from_url(redis_url)
    try:
        if value is None:
            await raw.hdel(hdr, field)
        else:
            await raw.hset(hdr, field, value)
        before = (await raw.xlen(log), await raw.xlen(feed), await raw.hgetall(hdr))
        with pytest.raises(SessionCorruptError):
            await redis_store.head("e")
        if field == "n":
            with pytest.raises(SessionCorruptError):
                await redis_store.read("e")
        else:  # a field the read does not use: the entries, which are sound, are read
            assert [e.data["content"] for e in await redis_store.read("e")] == ["a", "b"]
        writes = [
            lambda: redis_store.put("e", None, [um("c")]),  # the short layout
            lambda: redis_store.put("e", 2, [um("c")], idempotency_key="k"),  # the long one
            lambda: redis_store.put("e", None, [NewEntry("user/message", {"content": "c"}, {"m": 1})]),
        ]
        for write in writes:
            if field in ("created_at", "id"):  # not used by an append: the read and head refuse it
                continue
            with pytest.raises(SessionCorruptError):
                await write()
            assert (await raw.xlen(log), await raw.xlen(feed), await raw.hgetall(hdr)) == before
            assert await raw.pttl(log) == -1  # no expiry set
        if field == "ttl_ms":  # the draft's expiry is the session's: refused too, nothing written
            with pytest.raises(SessionCorruptError):
                await redis_store.set_draft("e", {"content": "x"})
            assert not await raw.exists(redis_store.keys.draft("e"))
        page = await redis_store.list()
        assert [h.id for h in page.items] == ["ok"] and page.unreadable == ["e"]
        assert await redis_store.delete("e") is True  # an operator can still delete it
        assert not await raw.exists(hdr) and not await raw.exists(log)
        assert [h.id for h in (await redis_store.list()).items] == ["ok"]
    finally:
        await raw.aclose()


async def test_an_earlier_lifes_index_member_never_lists_a_session_twice(
    redis_store: RedisSessionStore, redis_url: str
) -> None:
    """An ephemeral session expires (its index member stays: healed lazily), and its id is
    created again: the index holds a member of each life, both naming the live header. It was
    listed twice (r20 26), by `list()`, `ls` and `GET /sessions`. The earlier life's member is
    healed; a header whose only member names another created_at (written by another client) is
    still listed, once."""
    from redis_session.keys import index_member

    await redis_store.create(SessionHeader(id="other", created_at=1_700_000_000_000))
    now = await redis_store.create(SessionHeader(id="eph", created_at=1_700_000_005_000))
    shard = redis_store.keys.sessions("eph")
    earlier = index_member(1_700_000_001_000, "eph")  # the expired life's member
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await raw.zadd(shard, {earlier: 0})
        for limit in (1, 2, 3, 100):
            seen, cursor = [], None
            while True:
                page = await redis_store.list(limit=limit, cursor=cursor)
                seen += [h.id for h in page.items]
                cursor = page.cursor
                if cursor is None:
                    break
            assert seen == ["eph", "other"], limit
        assert await raw.zscore(shard, earlier) is None  # healed
        # a header whose only member is not its own (another client wrote it): listed, once
        own = index_member(now.header.created_at, "eph")
        await raw.zrem(shard, own)
        await raw.zadd(shard, {earlier: 0})
        assert [h.id for h in (await redis_store.list()).items] == ["eph", "other"]
        assert await raw.zscore(shard, earlier) is not None  # not healed away: it is the only one
    finally:
        await raw.aclose()


@pytest.mark.parametrize("field, value", [("n", "abc"), ("n", "-1"), ("ttl_ms", "x"), ("ttl_ms", "0")])
async def test_a_branch_of_a_parent_whose_header_was_edited_is_not_made(
    redis_store: RedisSessionStore, redis_url: str, field: str, value: str
) -> None:
    """A branch made by the store directly (no `Sessions` head read first) of a parent whose `n`
    or `ttl_ms` is no count: `link.lua` refuses it (the corruption error), nothing linked or made;
    it raised a bare Lua comparison error."""
    from redis_session import SessionCorruptError

    await redis_store.create(SessionHeader(id="p"), [um("a")])
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await raw.hset(redis_store.keys.hdr("p"), field, value)
        with pytest.raises(SessionCorruptError):
            await redis_store.create(SessionHeader(id="p-b", parent="p", at=0))
        assert await raw.zcard(redis_store.keys.kids("p")) == 0
        assert not await raw.exists(redis_store.keys.hdr("p-b"))
    finally:
        await raw.aclose()
