"""Edges of the one answer protocol (``lua/answer.lua``, the memory store's twin, the gateway's
answer routes): an answer of an earlier life of the id is refused as *replaced* whatever else is
wrong with the request (the life is checked first), and an answer whose text would outgrow the
entry limit is refused at the batch that would do it, so it can always end with what it has."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from redis_session import (
    Delta,
    RedisSessionStore,
    SessionHeader,
    SessionReplacedError,
)
from redis_session.projection.chunks import LiveRecord, replay

from support import running_gateway

pytestmark = pytest.mark.anyio


def path(session_id: str, sub: str = "") -> str:
    return "/sessions/" + quote(session_id, safe="") + (f"/{sub}" if sub else "")


def _batch(first: int, texts: str | list[str]) -> dict[str, Any]:
    return {"first_index": first, "deltas": [{"text": t} for t in texts]}


def _deltas(answer: str, first: int, texts: str | list[str]) -> list[Delta]:
    return [Delta(answer=answer, index=first + i, kind="text", text=t) for i, t in enumerate(texts)]


@pytest.fixture
async def client(redis_store: RedisSessionStore) -> AsyncIterator[httpx.AsyncClient]:
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=20) as c:
        yield c


# --------------------------------------------------------------------------- the life comes first


async def test_http_end_of_an_earlier_lifes_answer_is_replaced_not_incomplete(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    # the old life had entries before the answer began, so its state names an n beyond the new
    # life's log: the end used to read nothing there and answer 409 incomplete (missing [0, 2))
    three = [("user/message", {"content": "u"})] * 3
    await redis_store.create(SessionHeader(id="old"), three)
    r = await client.post(path("old", "answers"), json={"turn": 1, "step": 1})
    assert r.status_code == 201, r.text
    a, inc = r.json()["answer"], r.json()["incarnation"]
    assert (await client.post(path("old", f"answers/{a}/deltas"), json=_batch(0, "ab"))).status_code == 201
    await redis_store.delete("old")
    await redis_store.create(SessionHeader(id="old"))  # the new life: an empty log
    end = path("old", f"answers/{a}/end")
    for body, headers in [
        ({"reason": "committed"}, {}),  # no life pinned: the answer's own life decides
        ({"reason": "committed", "deltas": 2}, {}),
        ({"reason": "committed", "deltas": 7}, {}),  # incomplete too: the life still comes first
        ({"reason": "interrupted"}, {}),
        ({"reason": "committed"}, {"X-Session-Incarnation": inc}),  # pinned to the old life
        ({"reason": "committed"}, {"If-Match": '"0"'}),
    ]:
        r = await client.post(end, json=body, headers=headers)
        assert r.status_code == 409 and r.json()["error"] == "session_replaced", (body, headers, r.text)
    for body in [_batch(2, "cd"), _batch(9, "zz"), _batch(0, "xy"), _batch(0, "ab"), _batch(0, [])]:
        r = await client.post(path("old", f"answers/{a}/deltas"), json=body)
        assert r.status_code == 409 and r.json()["error"] == "session_replaced", (body, r.text)
    assert await redis_store.read("old") == [] and await redis_store.read_live("old") == []


async def test_every_op_of_an_earlier_lifes_answer_is_replaced_first(store: Any) -> None:
    # the store ops themselves (answer.lua and the memory twin): whatever else the request gets
    # wrong (an index out of order, a row at a landed index with other deltas, a count the log
    # lacks, a stale expected n), an answer of another life is refused as replaced
    await store.create(SessionHeader(id="lv"), [("user/message", {"content": "u"})] * 4)
    begun = await store.answer_begin("lv", "a1", turn=1, step=1, ttl_ms=60_000)
    await store.answer_deltas("lv", "a1", 0, _deltas("a1", 0, "ab"), turn=1, step=1, ttl_ms=60_000)
    await store.delete("lv")
    await store.create(SessionHeader(id="lv"))
    calls = [
        lambda: store.answer_deltas("lv", "a1", 2, _deltas("a1", 2, "cd"), ttl_ms=60_000),
        lambda: store.answer_deltas("lv", "a1", 5, _deltas("a1", 5, "x"), ttl_ms=60_000),  # out of order
        lambda: store.answer_deltas("lv", "a1", 0, _deltas("a1", 0, "zz"), ttl_ms=60_000),  # other deltas
        lambda: store.answer_deltas("lv", "a1", 0, _deltas("a1", 0, "ab"), turn=1, step=1, ttl_ms=60_000),
        lambda: store.answer_deltas("lv", "a1", 2, _deltas("a1", 2, "c"), live=False, ttl_ms=60_000),
        lambda: store.answer_beat("lv", "a1", ttl_ms=60_000),
        lambda: store.answer_end("lv", "a1", deltas=9, reason="committed", grace_ms=1000),  # incomplete
        lambda: store.answer_end("lv", "a1", deltas=2, reason="committed", grace_ms=1000, expected=17),
        lambda: store.answer_end("lv", "a1", deltas=2, reason="interrupted", grace_ms=1000, stale_ms=10**9),
        lambda: store.answer_end(
            "lv", "a1", deltas=4, reason="committed", rest_first=7, rest=_deltas("a1", 7, "xy"), grace_ms=1000
        ),  # a rest row out of order
        lambda: store.answer_end(
            "lv", "a1", deltas=2, reason="committed", grace_ms=1000, incarnation=begun.incarnation
        ),  # the old life pinned
        lambda: store.answer_begin("lv", "a1", turn=1, step=1, incarnation=begun.incarnation, ttl_ms=60_000),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(SessionReplacedError):
            await call()
            pytest.fail(f"call {i} was not refused")
    assert await store.read("lv") == []
    assert [r for r in await store.read_live("lv") if r.answer == "a1"] == []


# --------------------------------------------------------------------------- the size rule


def _budget(store: Any) -> int:
    from redis_session.projection.chunks import answer_budget

    return answer_budget(store.max_entry_bytes)


async def test_a_python_answer_that_would_outgrow_its_message_is_refused_at_the_delta_and_ends(store: Any) -> None:
    from redis_session import AnswerTooLargeError, InvalidEntryError, Sessions

    await store.create(SessionHeader(id="big"))
    s = await Sessions(store).open("big")
    piece = "x" * (100 << 10)
    async with s.stream(turn=1, step=1) as w:
        with pytest.raises(AnswerTooLargeError) as got:
            for _ in range(20):  # 2 MiB: far over an entry
                await w.delta(piece)
        e = got.value
        assert isinstance(e, InvalidEntryError)  # bad input: a typed error, nothing of it queued
        assert e.limit == _budget(store) and e.size > e.limit and e.logged == w.count == e.limit // len(piece)
        with pytest.raises(AnswerTooLargeError):
            await w.delta(piece)
        await w.delta("!")  # what still fits is taken
    text = piece * e.logged + "!"
    assert w.message is not None and w.message.data["content"] == [{"type": "text", "text": text}]
    entries = await store.read("big")
    assert entries[-1].type == "assistant/message"
    assert "".join(c["text"] for c in replay(entries)[w.answer]) == text
    live = await store.read_live("big")
    assert [r.index for r in live if r.is_delta] == list(range(e.logged + 1))
    assert live[-1].kind == "end" and live[-1].n == w.message.n


async def test_an_uncaught_too_large_delta_ends_the_answer_interrupted(store: Any) -> None:
    from redis_session import AnswerTooLargeError, Sessions

    await store.create(SessionHeader(id="big2"))
    s = await Sessions(store).open("big2")
    with pytest.raises(AnswerTooLargeError):
        async with s.stream(turn=1, step=1) as w:
            while True:
                await w.reasoning("r" * (300 << 10))
    assert w.interrupted is not None and w.interrupted.data["reason"] == "error"
    assert w.interrupted.data["deltas"] == 3 and not w.interrupted.data.get("truncated")
    assert w.interrupted.data["content"] == [{"type": "reasoning", "text": "r" * (900 << 10)}]
    assert (await store.read_live("big2"))[-1].kind == "end"


async def test_a_closing_message_whose_meta_is_too_big_ends_interrupted_not_stuck() -> None:
    from redis_session import InvalidEntryError, MemorySessionStore, Sessions

    store = MemorySessionStore(max_entry_bytes=64 << 10)
    await store.create(SessionHeader(id="meta"))
    s = await Sessions(store).open("meta")
    with pytest.raises(InvalidEntryError):
        async with s.stream(turn=1, step=1, meta={"blob": "m" * (60 << 10)}) as w:
            await w.delta("a" * (40 << 10))
    assert w.message is None and w.interrupted is not None
    assert w.interrupted.data["truncated"] is True and w.interrupted.data["content"] == []
    assert w.interrupted.meta is not None and w.interrupted.meta["answer"] == w.answer  # the rows hold the answer
    entries = await store.read("meta")
    assert "".join(c["text"] for c in replay(entries)[w.answer]) == "a" * (40 << 10)
    assert await Sessions(store).repair("meta", stale_after=0) is not None  # nothing left open
    assert [e.type for e in await store.read("meta")].count("assistant/interrupted") == 1


async def test_http_a_batch_over_the_answers_budget_is_413_and_the_answer_still_ends(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await redis_store.create(SessionHeader(id="hbig"))
    r = await client.post(path("hbig", "answers"), json={"turn": 1, "step": 1})
    a = r.json()["answer"]
    url = path("hbig", f"answers/{a}/deltas")
    piece = "y" * (200 << 10)
    sent = 0
    while True:
        r = await client.post(url, json=_batch(sent, [piece] * 2))
        if r.status_code != 201:
            break
        sent += 2
    body = r.json()
    assert r.status_code == 413 and body["error"] == "answer_too_large", r.text
    assert body["limit"] == _budget(redis_store) and body["size"] > body["limit"]
    assert body["next_index"] == sent == 4 and body["answer"] == a
    before = await redis_store.read("hbig")
    live_before = await redis_store.read_live("hbig")
    assert len(before) == 2 and [x.index for x in live_before if x.is_delta] == [0, 1, 2, 3]  # nothing of it
    r = await client.post(url, json=_batch(sent, ["tail"]))  # what fits still goes
    assert r.status_code == 201, r.text
    r = await client.post(path("hbig", f"answers/{a}/end"), json={"reason": "committed", "deltas": 5})
    assert r.status_code == 201, r.text
    msg = (await redis_store.read("hbig"))[-1]
    assert msg.type == "assistant/message" and msg.data["content"] == [{"type": "text", "text": piece * 4 + "tail"}]
    assert (await redis_store.read_live("hbig"))[-1].kind == "end"


async def test_http_one_batch_over_the_budget_on_its_own_is_answer_too_large_not_entry_too_large(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    """A batch whose content alone exceeds what an answer may hold (a delta of 1.1 MB) was refused
    as an entry over the limit (413 entry_too_large, no next_index): a writer could not tell that
    the answer can still end with what it has, and the TypeScript writer never could end it."""
    await redis_store.create(SessionHeader(id="hhuge"))
    a = (await client.post(path("hhuge", "answers"), json={"turn": 1, "step": 1})).json()["answer"]
    url = path("hhuge", f"answers/{a}/deltas")
    assert (await client.post(url, json=_batch(0, ["kept "]))).status_code == 201
    before, live_before = await redis_store.read("hhuge"), await redis_store.read_live("hhuge")
    for size in (1_100_000, 2_000_000):
        r = await client.post(url, json=_batch(1, ["z" * size]))
        body = r.json()
        assert r.status_code == 413 and body["error"] == "answer_too_large", r.text
        assert body["next_index"] == 1 and body["size"] > body["limit"] == _budget(redis_store)
    assert await redis_store.read("hhuge") == before and await redis_store.read_live("hhuge") == live_before
    r = await client.post(path("hhuge", f"answers/{a}/end"), json={"reason": "committed", "deltas": 1})
    assert r.status_code == 201, r.text
    assert (await redis_store.read("hhuge"))[-1].data["content"] == [{"type": "text", "text": "kept "}]


async def test_a_store_refuses_one_batch_over_the_budget_as_answer_too_large() -> None:
    from redis_session import AnswerTooLargeError, MemorySessionStore
    from redis_session.projection.chunks import Delta

    store = MemorySessionStore(max_entry_bytes=64 << 10)
    await store.create(SessionHeader(id="mhuge"))
    begun = await store.answer_begin("mhuge", "ans1", ttl_ms=30_000)
    huge = [Delta(answer="ans1", index=0, kind="text", text="q" * (70 << 10))]
    with pytest.raises(AnswerTooLargeError) as caught:
        await store.answer_deltas("mhuge", "ans1", 0, huge, incarnation=begun.incarnation, ttl_ms=30_000)
    assert caught.value.logged == 0 and caught.value.size > caught.value.limit
    assert [e.type for e in await store.read("mhuge")] == []


async def test_http_an_interrupted_end_always_fits(client: httpx.AsyncClient, redis_store: RedisSessionStore) -> None:
    await redis_store.create(SessionHeader(id="hcut"))
    a = (await client.post(path("hcut", "answers"), json={})).json()["answer"]
    assert (await client.post(path("hcut", f"answers/{a}/deltas"), json=_batch(0, "ab"))).status_code == 201
    huge = [{"type": "text", "text": "z" * (1 << 20)}]
    end = path("hcut", f"answers/{a}/end")
    r = await client.post(end, json={"reason": "committed", "content": huge})  # the caller's own content
    assert r.status_code == 413 and r.json()["error"] == "entry_too_large", r.text
    r = await client.post(end, json={"reason": "interrupted", "content": huge})
    assert r.status_code == 201, r.text
    mark = (await redis_store.read("hcut"))[-1]
    assert mark.type == "assistant/interrupted" and mark.data["truncated"] is True and mark.data["deltas"] == 2


async def test_repair_closes_an_answer_whose_live_deltas_outgrow_an_entry() -> None:
    # a writer that died with more on the live stream than one row holds: repair closes it with
    # what fits, never stuck on an entry it cannot write
    from redis_session import MemorySessionStore, Sessions

    store = MemorySessionStore(max_entry_bytes=64 << 10)
    await store.create(SessionHeader(id="dead"))
    begun = await store.answer_begin("dead", "a1", turn=1, step=1, ttl_ms=60_000)
    await store.answer_live("dead", "a1", 0, _deltas("a1", 0, ["q" * (20 << 10)] * 5), incarnation=begun.incarnation)  # type: ignore[arg-type]
    await Sessions(store).repair("dead", stale_after=0)
    entries = await store.read("dead")
    mark = [e for e in entries if e.type == "assistant/interrupted"]
    assert len(mark) == 1 and mark[0].data["reason"] == "crashed"
    rows = replay(entries)["a1"]
    assert 0 < len(rows) < 5 and mark[0].data["deltas"] == len(rows)
    assert (await store.read_live("dead"))[-1].kind == "end"


# --------------------------------------------------------------------------- rows lost in a failover


@pytest.mark.parametrize("found_by", ["a later row", "the end"])
async def test_rows_a_failover_lost_are_sent_again_never_twice(
    redis_store: RedisSessionStore, redis_url: str, found_by: str
) -> None:
    # replication is asynchronous: a promoted replica may lack the last row whose reply came
    # back (its WAIT timed out: DurabilityError, "landed"). Emulated on one server: the row,
    # the header's n and the answer's state go back as the replica has them; the writer resends
    import redis.asyncio as aioredis

    from redis_session import Sessions
    from redis_session.projection.chunks import deltas_cost

    from support import wait_for

    await redis_store.create(SessionHeader(id="lost"))
    s = await Sessions(redis_store).open("lost")
    sent = [f"t{i} " for i in range(16 if found_by == "a later row" else 8)]
    raw = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        async with s.stream(turn=1, step=1, flush_interval=0.02, max_chunks=4) as w:
            for t in sent[:8]:
                await w.delta(t)

            async def logged() -> int:
                st = (await redis_store.answer_states("lost", [w.answer]))[w.answer]
                return st.logged

            await wait_for(lambda: w._flushed == 8, within=30)
            assert await logged() == 8 and s.n == 2  # two rows, the handle past them
            state = f"{redis_store.keys.live('lost')}:{w.answer}"
            log_key = redis_store.keys.log("lost")
            [(_, first_row)] = await raw.xrange(log_key, "0-1", "0-1")
            await raw.delete(log_key)  # the replica's stream: the first row only, its last id 0-1
            await raw.xadd(log_key, first_row, id="0-1")
            await raw.hset(redis_store.keys.hdr("lost"), "n", 1)
            cost = deltas_cost(_deltas(w.answer, 0, sent[:4]))
            await raw.hset(state, mapping={"log": 4, "ln": 1, "sz": cost, "rn": 0})
            for t in sent[8:]:
                await w.delta(t)
    finally:
        await raw.aclose()
    assert w.message is not None
    entries = await redis_store.read("lost")
    assert "".join(c["text"] for c in replay(entries)[w.answer]) == "".join(sent)  # once each, in order
    assert [e.type for e in entries].count("assistant/message") == 1
    assert entries[-1].data["content"] == [{"type": "text", "text": "".join(sent)}]
    assert (await redis_store.read_live("lost"))[-1].kind == "end"


async def test_a_delta_a_failover_lost_and_its_writer_sent_again_reaches_a_resumed_reader_once(
    redis_url: str, prefix: str, redis_store: RedisSessionStore
) -> None:
    # a reader got delta 9; the failover lost its live record (asynchronous replication) and the
    # writer sent it again, under an id later than the reader's cursor; the reader's connection
    # dropped meanwhile: its resumed tail must not give 9 a second time
    import anyio
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from redis_session import DeltaGap, Sessions
    from redis_session.live import follow_deltas

    name = f"reader-{prefix}"
    reader_store = RedisSessionStore.from_url(
        redis_url, prefix=prefix, client_options={"client_name": name, "retry": Retry(NoBackoff(), 0)}
    )
    raw = aioredis.Redis.from_url(redis_url, decode_responses=True)
    await redis_store.create(SessionHeader(id="fo"))
    s = await Sessions(redis_store).open("fo")
    sent = [f"d{i} " for i in range(14)]
    got: list[Delta | DeltaGap] = []
    have_ten = anyio.Event()
    resumed: list[int] = []

    async def read() -> None:
        async for item in follow_deltas(
            reader_store, "fo", 0, max_backoff=0.1, on_retry=lambda exc, wait, at: resumed.append(at)
        ):
            if isinstance(item, (Delta, DeltaGap)):
                got.append(item)
                if isinstance(item, Delta) and item.index == 9:
                    have_ten.set()
            elif item.type == "assistant/message":
                return

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                async with s.stream(turn=1, step=1, flush_interval=5, max_chunks=100) as w:
                    for t in sent[:10]:
                        await w.delta(t)
                    await have_ten.wait()
                    live = redis_store.keys.live("fo")
                    [(rid, fields)] = await raw.xrevrange(live, count=1)
                    assert LiveRecord.from_fields(rid, fields).index == 9, fields
                    await raw.xdel(live, rid)
                    await raw.xadd(live, fields)  # sent again, under a later id
                    with anyio.fail_after(10):
                        while not resumed:  # the store retries a dropped read once by itself
                            for c in await raw.client_list():
                                if c.get("name") == name:
                                    await raw.client_kill_filter(_id=c["id"])
                            await anyio.sleep(0.02)
                    for t in sent[10:]:
                        await w.delta(t)
    finally:
        await raw.aclose()
        await reader_store.aclose()
    assert resumed, "the reader's tail never resumed"
    indexes = [d.index for d in got if isinstance(d, Delta)]
    assert indexes == list(range(len(sent))), indexes
    assert not [g for g in got if isinstance(g, DeltaGap)]


# --------------------------------------------------------------------------- repair after the live TTL


async def test_repair_after_the_answers_state_expired_still_leaves_its_partial_answer(
    client: httpx.AsyncClient, redis_store: RedisSessionStore, redis_url: str
) -> None:
    # a writer that died and was repaired only after the live TTL: its state and live stream
    # expired (emulated: deleted, as the expiry does), its rows are in the log. The repair
    # closes the answer from them (the interrupted mark with their content, once) before the
    # turn's closers, so the projection keeps the partial answer
    import redis.asyncio as aioredis

    from redis_session import Sessions

    await redis_store.create(
        SessionHeader(id="late"),
        [("turn/start", {"turn": 1}), ("user/message", {"content": "hi"}), ("step/start", {"turn": 1, "step": 1})],
    )
    r = await client.post(path("late", "answers"), json={"turn": 1, "step": 1})
    a = r.json()["answer"]
    for first, texts in ((0, ["one ", "two "]), (2, ["three"])):
        b = await client.post(path("late", f"answers/{a}/deltas"), json={**_batch(first, texts), "turn": 1, "step": 1})
        assert b.status_code == 201, b.text
    raw = aioredis.Redis.from_url(redis_url)
    try:
        live = redis_store.keys.live("late")
        await raw.delete(f"{live}:{a}", live, f"{live}:+open")
    finally:
        await raw.aclose()
    assert await redis_store.answer_states("late", [a]) == {}
    repaired = await Sessions(redis_store).repair("late", stale_after=0)
    assert [e.type for e in repaired] == ["assistant/interrupted", "step/end", "turn/end"]
    mark = repaired[0]
    assert mark.data["reason"] == "crashed" and mark.data["answer"] == a and mark.data["deltas"] == 3
    assert mark.data["content"] == [{"type": "text", "text": "one two three"}]
    assert await Sessions(redis_store).repair("late", stale_after=0) == []  # once
    # an answer quiet for less than stale_after is left to its writer: only the turn is closed
    # when a second turn's answer is fresh (its rows just written)
    s = await Sessions(redis_store).open("late")
    await s.append_many([("turn/start", {"turn": 2}), ("step/start", {"turn": 2, "step": 1})])
    r = await client.post(path("late", "answers"), json={"turn": 2, "step": 1})
    a2 = r.json()["answer"]
    b = await client.post(path("late", f"answers/{a2}/deltas"), json={"first_index": 0, "turn": 2, "step": 1,
                                                                       "deltas": [{"text": "fresh"}]})  # fmt: skip
    assert b.status_code == 201, b.text
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await raw.delete(f"{live}:{a2}", live, f"{live}:+open")
    finally:
        await raw.aclose()
    repaired = await Sessions(redis_store).repair("late", stale_after=600)
    assert [e.type for e in repaired] == ["step/end", "turn/end"]


@pytest.mark.parametrize(
    "bad",
    [
        {"grace": 10**20},
        {"live_ttl": 10**20},
        {"turn": "5", "step": 1},
        {"turn": True},
        {"step": 1.5},
        {"flush_interval": None},
        {"max_chunks": None},
        {"heartbeat": float("nan")},
        {"grace": float("inf")},
        {"meta": 3 + 0j},
        {"meta": {"x": {1, 2}}},
    ],
)
async def test_a_streamed_answer_with_a_bad_argument_writes_nothing(redis_store: Any, bad: dict[str, Any]) -> None:
    """`stream(grace=10**20)` raised Redis's "Invalid stream ID" after the header, the log, the feed
    and the live stream were written; `stream(turn="5")` refused the begin's entry after its live
    records were; a `None` interval a bare TypeError. Each is `InvalidArgumentError`, nothing written."""
    from redis_session import InvalidArgumentError, Sessions

    s = await Sessions(redis_store).create()
    await s.append("user/message", {"content": "hi"})

    async def snapshot() -> dict[bytes, Any]:
        keys = [k async for k in redis_store.client.scan_iter(match=f"{redis_store.prefix}*")]
        return {k: await redis_store.client.dump(k) for k in sorted(keys)}

    before = await snapshot()
    with pytest.raises(InvalidArgumentError):
        async with s.stream(**bad) as w:
            await w.delta("never")
    assert await snapshot() == before
