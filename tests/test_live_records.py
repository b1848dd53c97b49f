"""The live stream's record format (projection.chunks.LiveRecord): a text or reasoning delta is one
field, its kind code -> ``"<answer> <index> <life> <text>"``; every other record, and the deltas of
older writers (``a i t l``), are fields. Both are read, in any mix, with any text; the writers that
cannot put a delta in one field (a space in the answer id or the life) write fields. And
`tail_live` holds one pooled connection for its loop and gives it back when it ends."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest
import redis.asyncio as aioredis

from redis_session import Delta, DeltaGap, RedisSessionStore, SessionHeader
from redis_session.live import follow_deltas
from redis_session.projection.chunks import LiveRecord, compact_value, live_draft
from redis_session.redis.store import _live_records
from redis_session.redis.wire import held

from support import wait_blocked_in_xread

pytestmark = pytest.mark.anyio

HOSTILE = [
    "plain",
    "",
    " ",
    "   three leading, two trailing  ",
    "a 1 b 2 c",  # looks like the value's own head
    "line\nbreak\r\nand\ttab",
    "unicode: héllo 世界 🙂 \u00a0nbsp",
    "\x00nul inside\x00",
    "x" * 200_000,  # very long
    " ".join(["w"] * 5000),  # very many spaces
]


def _rows(records: list[list[str]]) -> list[tuple[bytes, list[bytes]]]:
    """Records as an XRANGE reply gives them to the store (raw RESP2: a flat field list)."""
    return [(f"{i + 1}-0".encode(), [x.encode() for x in f]) for i, f in enumerate(records)]


# --------------------------------------------------------------------------- the format, pure


@pytest.mark.parametrize("kind,code", [("text", "t"), ("reasoning", "r")])
@pytest.mark.parametrize("text", HOSTILE)
def test_a_text_or_reasoning_delta_is_one_field_and_reads_back(kind: str, code: str, text: str) -> None:
    r = LiveRecord(answer="a1b2c3d4e5", kind=kind, index=7, text=text, incarnation="0123abcd0123abcd")
    f = r.fields()
    assert f == [code, f"a1b2c3d4e5 7 0123abcd0123abcd {text}"]
    back = _live_records(_rows([f]))
    assert back == [LiveRecord(answer="a1b2c3d4e5", kind=kind, id="1-0", index=7, text=text,
                               incarnation="0123abcd0123abcd")]  # fmt: skip
    assert LiveRecord.from_fields("1-0", dict([f])) == back[0]  # a map-shaped reply (RESP3)


@pytest.mark.parametrize("text", HOSTILE)
def test_the_fields_of_older_writers_still_read(text: str) -> None:
    old = [
        ["a", "ans", "i", "3", "t", text, "l", "life1"],  # a text delta, as answer.lua and live_add wrote it
        ["a", "ans", "k", "r", "i", "4", "t", text, "l", "life1"],  # reasoning
        ["a", "ans", "i", "5", "t", text],  # no life (live_add of a record without one)
    ]
    got = _live_records(_rows(old))
    assert [(r.kind, r.index, r.text, r.incarnation) for r in got] == [
        ("text", 3, text, "life1"),
        ("reasoning", 4, text, "life1"),
        ("text", 5, text, None),
    ]
    assert [
        LiveRecord.from_fields(r.id, dict(zip(f[::2], f[1::2], strict=True))) for r, f in zip(got, old, strict=True)
    ] == got


@pytest.mark.parametrize(
    "answer,life",
    [("has space", "life1"), ("", "life1"), ("ans", "life with space"), ("ans", "")],
)
def test_an_answer_id_or_life_with_a_space_goes_as_fields(answer: str, life: str) -> None:
    r = LiveRecord(answer=answer, kind="text", index=2, text="x y", incarnation=life)
    f = r.fields()
    if life == "":  # an empty life splits back fine: one field
        assert f == ["t", "ans 2  x y"]
    else:
        assert compact_value(answer, 2, life, "x y") is None
        assert f[:2] == ["a", answer] and len(f) == 8
    [back] = _live_records(_rows([f]))
    assert (back.answer, back.kind, back.index, back.text, back.incarnation) == (answer, "text", 2, "x y", life)


def test_records_that_are_not_text_deltas_keep_their_fields() -> None:
    call = LiveRecord(answer="ans", kind="tool-call", index=0, text='{"q":', call_id="c1", name="search",
                      incarnation="L")  # fmt: skip
    begin = LiveRecord(answer="ans", kind="begin", turn=1, step=2, n=5, incarnation="L")
    end = LiveRecord(answer="ans", kind="end", index=3, n=9, incarnation="L", reason="committed")
    got = _live_records(_rows([call.fields(), begin.fields(), end.fields()]))
    assert got == [msgspec.structs.replace(x, id=f"{i + 1}-0") for i, x in enumerate([call, begin, end])]


def test_a_malformed_one_field_record_is_no_delta() -> None:
    # a one-field record whose head does not parse (no index) is read by its fields: never a
    # delta with a wrong index
    [r] = _live_records(_rows([["t", "ans notanumber L text"]]))
    assert r.index is None
    # nor does it break the draft (it raised AssertionError there: `Delta` needs an index)
    good = _live_records(_rows([LiveRecord(answer="ans", kind="text", index=0, text="ok", incarnation="L").fields()]))
    assert live_draft([*good, r]) == {"answer": "ans", "content": "ok"}


# --------------------------------------------------------------------------- on a server


async def _begun(store: RedisSessionStore, sid: str) -> tuple[str, str]:
    await store.create(SessionHeader(id=sid))
    begun = await store.answer_begin(sid, "a1b2c3d4e5", turn=1, step=1, ttl_ms=60_000)
    return begun.answer, begun.incarnation


async def test_both_writers_write_one_field_and_every_text_reads_back(
    redis_store: RedisSessionStore, raw_redis: aioredis.Redis
) -> None:
    answer, life = await _begun(redis_store, "w")
    direct = [Delta(answer=answer, index=i, kind="text", text=t) for i, t in enumerate(HOSTILE)]
    await redis_store.answer_live("w", answer, 0, direct, incarnation=life)
    # the script's path (the gateway's, the TypeScript client's through it): another answer
    other = (await redis_store.answer_begin("w", "f6e5d4c3b2", turn=1, step=2, ttl_ms=60_000)).answer
    kinds = [("reasoning", x) for x in HOSTILE[:4]] + [("text", x) for x in HOSTILE]
    scripted = [Delta(answer=other, index=i, kind=k, text=t) for i, (k, t) in enumerate(kinds)]
    await redis_store.answer_deltas("w", other, 0, scripted, log=False, ttl_ms=60_000)
    raw = await raw_redis.xrange(redis_store.keys.live("w"))
    deltas = [f for _, f in raw if "k" not in f]  # the begins have a kind: "k" "b"
    assert [len(f) for f in deltas] == [1] * (len(direct) + len(scripted))  # one field each
    got = [r for r in await redis_store.read_live("w") if r.is_delta]
    want = direct + scripted
    assert [(r.answer, r.index, r.kind, r.text, r.incarnation) for r in got] == [
        (d.answer, d.index, d.kind, d.text, life) for d in want
    ]


async def test_a_mixed_stream_of_old_and_new_records_is_delivered_once_in_order(
    redis_store: RedisSessionStore, raw_redis: aioredis.Redis, redis_url: str, prefix: str
) -> None:
    """An answer whose deltas an older writer (fields) and this one (one field) wrote in turn, as
    in a rolling upgrade: a reader from the start and a reader that is live get every delta once,
    in order, with its text."""
    answer, life = await _begun(redis_store, "mix")
    live = redis_store.keys.live("mix")
    texts = [f"{HOSTILE[i % len(HOSTILE)][:50]}|{i}" for i in range(40)]
    got: list[Delta] = []
    done = anyio.Event()

    async def follower() -> None:
        async for item in follow_deltas(redis_store, "mix", 0):
            assert not isinstance(item, DeltaGap), item
            if isinstance(item, Delta):
                got.append(item)
                if len(got) == len(texts):
                    done.set()
                    return

    async def write(i: int) -> None:
        if i % 2:
            await redis_store.answer_live("mix", answer, i, [Delta(answer=answer, index=i, kind="text", text=texts[i])],
                                          incarnation=life)  # fmt: skip
        else:
            await raw_redis.xadd(live, {"a": answer, "i": str(i), "t": texts[i], "l": life})

    for i in range(20):  # half before any reader: read from the start
        await write(i)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower)
            await wait_blocked_in_xread(redis_url, prefix)
            for i in range(20, 40):  # the rest while it is live
                await write(i)
            await done.wait()
    assert [(d.index, d.text) for d in got] == list(enumerate(texts))
    assert {d.answer for d in got} == {answer}


async def test_a_life_with_a_space_is_written_as_fields_by_the_script(
    redis_store: RedisSessionStore, raw_redis: aioredis.Redis
) -> None:
    # a header whose incarnation holds a space (not one this library makes: written by hand):
    # the script's one-field record would be misread, so it writes the fields
    await redis_store.create(SessionHeader(id="sp"))
    await raw_redis.hset(redis_store.keys.hdr("sp"), "incarnation", "odd life")
    begun = await redis_store.answer_begin("sp", "ans", ttl_ms=60_000)
    assert begun.incarnation == "odd life"
    deltas = [
        Delta(answer="ans", index=0, kind="text", text="a b"),
        Delta(answer="ans", index=1, kind="reasoning", text=" c "),
    ]
    await redis_store.answer_deltas("sp", "ans", 0, deltas, log=False, ttl_ms=60_000)
    raw = await raw_redis.xrange(redis_store.keys.live("sp"))
    assert [f.get("l") for _, f in raw[1:]] == ["odd life", "odd life"]
    got = [r for r in await redis_store.read_live("sp") if r.is_delta]
    assert [(r.index, r.kind, r.text, r.incarnation) for r in got] == [
        (0, "text", "a b", "odd life"),
        (1, "reasoning", " c ", "odd life"),
    ]


async def test_a_tail_holds_one_connection_and_gives_it_back(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    answer, life = await _begun(redis_store, "held")
    pool: Any = redis_store.client.connection_pool
    seen: list[set[int]] = []
    got = 0
    tail = redis_store.tail_live("held", 0)
    with anyio.fail_after(60):
        async for r in tail:
            if isinstance(r, LiveRecord) and r.is_delta:
                got += 1
                seen.append({id(c) for c in held(pool)})  # the one kept for the next put aside
                if got == 5:
                    break
            if isinstance(r, LiveRecord) and (r.kind == "begin" or r.is_delta):
                # the next one, written while the tail waits for us: its next XREAD gets it
                one = [Delta(answer=answer, index=got, kind="text", text="x")]
                await redis_store.answer_live("held", answer, got, one, incarnation=life)
    # between its XREADs the tail keeps the same connection taken (it is not given back each time)
    assert len(seen) == 5 and all(len(s) == 1 for s in seen) and len(set.union(*seen)) == 1
    await tail.aclose()
    assert not held(pool)  # closed: given back

    # cancelled while blocked in its XREAD: given back too (redis-py drops a connection cut short)
    async def follow() -> None:
        async for _ in redis_store.tail_live("held", 0, live_after="$"):
            pass

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            await wait_blocked_in_xread(redis_url, prefix)
            tg.cancel_scope.cancel()
    assert not held(pool)
