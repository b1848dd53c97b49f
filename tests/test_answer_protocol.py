"""The one answer protocol (``lua/answer.lua``), attacked from Python, HTTP and readers where a
reply is lost, a request retried, a reader resumed or a replica gone (docs/design.md, streaming), on
a real server.

1 a DurabilityError (WAIT for a replica that is not there) never kills the answer;
2 lost replies (tests/reliability/_proxy.py) never duplicate or lose a row;
3 HTTP batches out of order or with holes are refused (409 naming the expected index), never
  reordered; the end names the missing range;
4 a retried HTTP batch after a lost reply still goes live, once;
5 two concurrent copies of a batch go live once;
6 a resumed reader gets the rest of an answer, or an explicit gap;
7 a live but quiet writer (heartbeat) is never repaired; a dead one is, once.
8 an answer, a tail and an SSE resume never cross into another life of the id.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import pytest
import redis.asyncio as aioredis

from redis_session import (
    Delta,
    DeltaGap,
    DurabilityError,
    RedisSessionStore,
    SessionConflictError,
    SessionHeader,
    SessionNotFoundError,
    SessionReplacedError,
    Sessions,
)
from redis_session.live import follow_deltas
from redis_session.projection.chunks import CHUNK, INTERRUPTED, replay

from support import running_gateway, wait_for

sys.path.insert(0, str(Path(__file__).parent / "reliability"))
from _proxy import FaultProxy

pytestmark = pytest.mark.anyio


def path(session_id: str, sub: str = "") -> str:
    return "/sessions/" + quote(session_id, safe="") + (f"/{sub}" if sub else "")


def _batch(first: int, texts: str) -> dict[str, Any]:
    return {"first_index": first, "deltas": [{"text": t} for t in texts]}


async def _texts(store: Any, sid: str) -> dict[str, str]:
    return {a: "".join(c["text"] for c in chunks) for a, chunks in replay(await store.read(sid)).items()}


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


# --------------------------------------------------------------------------- 1 DurabilityError


async def test_a_durability_error_never_kills_the_answer(redis_url: str, prefix: str) -> None:
    # durability="replica" on a server with no replica: every WAIT comes back 0 (the replica is gone)
    store = RedisSessionStore.from_url(redis_url, prefix=prefix, durability="replica", wait_timeout_ms=20)
    try:
        with pytest.raises(DurabilityError):  # it lands, unconfirmed
            await store.create(SessionHeader(id="dur"))
        s = await Sessions(store).open("dur")
        sent = [f"d{i} " for i in range(60)]
        w = s.stream(turn=1, step=1, flush_interval=0.01, max_chunks=8)
        with pytest.raises(DurabilityError):
            async with w:
                for t in sent:
                    await w.delta(t)
                    await anyio.sleep(0.001)
        assert w.message is not None and w.message.type == "assistant/message"  # it landed
        entries = await store.read("dur")
        assert "".join(c["text"] for c in replay(entries)[w.answer]) == "".join(sent)  # 60, not 62
        assert [e.type for e in entries].count("assistant/message") == 1
        live = await store.read_live("dur")
        assert [r.index for r in live if r.is_delta] == list(range(60))
        assert live[-1].kind == "end" and live[-1].n == w.message.n
    finally:
        await store.aclose()


# --------------------------------------------------------------------------- 2 lost replies


async def test_lost_replies_never_duplicate_or_lose_a_row(redis_url: str, prefix: str) -> None:
    with FaultProxy(_port(redis_url), seed=7) as proxy:
        store = RedisSessionStore.from_url(proxy.url, prefix=prefix)
        try:
            await store.create(SessionHeader(id="lost"))
            s = await Sessions(store).open("lost")
            sent = [f"t{i} " for i in range(40)]
            proxy.cut_up = False  # every command reaches the server; some replies never come back
            proxy.cut_rate = 0.08
            async with s.stream(turn=1, step=1, flush_interval=0.01, max_chunks=4) as w:
                for t in sent:
                    await w.delta(t)
                    await anyio.sleep(0.002)
            proxy.cut_rate = 0.0
            assert proxy.stats.cuts > 0
            entries = await store.read("lost")
            rows = [e for e in entries if e.type == CHUNK]
            assert [c["text"] for c in replay(entries)[w.answer]] == sent  # 40 deltas, not 42
            seqs = [e.data["seq"] for e in rows]
            assert seqs == sorted(set(seqs))  # no row twice
            assert [e.type for e in entries].count("assistant/message") == 1
            live = await store.read_live("lost")
            assert [r.index for r in live if r.is_delta] == list(range(40))  # live once, in order
        finally:
            await store.aclose()


# --------------------------------------------------------------------------- 3..5 over HTTP


@pytest.fixture
async def client(redis_store: RedisSessionStore) -> Any:
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=20) as c:
        yield c


async def _begin(client: httpx.AsyncClient, sid: str) -> str:
    r = await client.post(path(sid, "answers"), json={})
    assert r.status_code == 201, r.text
    return str(r.json()["answer"])


async def test_http_batches_out_of_order_or_with_holes_are_refused(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await redis_store.create(SessionHeader(id="ooo"))
    a = await _begin(client, "ooo")
    url = path("ooo", f"answers/{a}/deltas")
    r = await client.post(url, json=_batch(3, "def"))  # 3..5 before 0..2
    assert r.status_code == 409 and r.json()["error"] == "out_of_order" and r.json()["expected_index"] == 0
    assert (await client.post(url, json=_batch(0, "abc"))).status_code == 201
    r = await client.post(url, json=_batch(6, "ghi"))  # 3..5 never sent: a hole
    assert r.status_code == 409 and r.json()["expected_index"] == 3
    end = path("ooo", f"answers/{a}/end")
    r = await client.post(end, json={"reason": "committed", "deltas": 9})
    assert r.status_code == 409 and r.json()["error"] == "incomplete" and r.json()["missing"] == [3, 9]
    assert (await client.post(url, json=_batch(3, "def"))).status_code == 201
    assert (await client.post(end, json={"reason": "committed", "deltas": 6})).status_code == 201
    msg = (await redis_store.read("ooo"))[-1]
    assert msg.type == "assistant/message" and msg.data["content"] == [{"type": "text", "text": "abcdef"}]
    live = await redis_store.read_live("ooo")
    assert [r.text for r in live if r.is_delta] == list("abcdef")


async def test_a_retried_http_batch_after_a_lost_reply_goes_live_once(redis_url: str, prefix: str) -> None:
    with FaultProxy(_port(redis_url), seed=3) as proxy:
        store = RedisSessionStore.from_url(proxy.url, prefix=prefix)
        try:
            await store.create(SessionHeader(id="retry"))
            async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=20) as client:
                a = await _begin(client, "retry")
                url = path("retry", f"answers/{a}/deltas")
                assert (await client.post(url, json=_batch(0, "abc"))).status_code == 201
                proxy.cut_up, proxy.cut_rate = False, 1.0  # the script runs; its reply never comes back
                r = await client.post(url, json=_batch(3, "def"))
                proxy.cut_rate = 0.0
                assert r.status_code == 503
                assert (await client.post(url, json=_batch(3, "def"))).status_code == 201  # the retry
            live = await store.read_live("retry")
            assert [(r.index, r.text) for r in live if r.is_delta] == list(enumerate("abcdef"))
            assert await _texts(store, "retry") == {a: "abcdef"}
        finally:
            await store.aclose()


async def test_two_concurrent_copies_of_a_batch_go_live_once(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await redis_store.create(SessionHeader(id="twice"))
    for trial in range(10):
        a = await _begin(client, "twice")
        url = path("twice", f"answers/{a}/deltas")
        body = {"first_index": 0, "deltas": [{"text": "Hello "}, {"text": "world"}]}

        async def post(url: str = url, body: dict[str, Any] = body) -> None:
            await client.post(url, json=body)

        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(post)
        live = [r for r in await redis_store.read_live("twice") if r.answer == a and r.is_delta]
        assert [r.text for r in live] == ["Hello ", "world"], trial
        assert (await redis_store.get_draft("twice") or {}).get("content") == "Hello world"
        r = await client.post(path("twice", f"answers/{a}/end"), json={"reason": "committed"})
        assert r.status_code == 201
    assert set((await _texts(redis_store, "twice")).values()) == {"Hello world"}


# --------------------------------------------------------------------------- 6 resumed readers


async def _stream(s: Any, texts: list[str], **kw: Any) -> Any:
    async with s.stream(**kw) as w:
        for t in texts:
            await w.delta(t)
    return w


async def test_a_resumed_reader_gets_the_rest_after_another_answer_ended(redis_store: RedisSessionStore) -> None:
    await redis_store.create(SessionHeader(id="resume"))
    s = await Sessions(redis_store).open("resume")
    first: list[Delta] = []
    w = s.stream(turn=1, step=1)
    async with w:
        for i in range(5):
            await w.delta(f"a{i} ")
        async with anyio.create_task_group() as tg:

            async def read_five() -> None:
                async for item in s.tail_deltas(0):
                    if isinstance(item, Delta):
                        first.append(item)
                        if len(first) == 5:
                            tg.cancel_scope.cancel()  # the reader drops here

            tg.start_soon(read_five)
        for i in range(5, 20):
            await w.delta(f"a{i} ")
    await _stream(s, ["b0 ", "b1 "], turn=2, step=1)  # a later answer ends meanwhile
    rest: list[Any] = []
    with anyio.fail_after(10):
        async for item in s.tail_deltas(0, live_after=first[-1].cursor):
            if isinstance(item, (Delta, DeltaGap)):
                rest.append(item)
                if isinstance(item, Delta) and item.answer != w.answer and item.index == 1:
                    break
    got = [d.text for d in rest if isinstance(d, Delta) and d.answer == w.answer]
    assert got == [f"a{i} " for i in range(5, 20)] and not [g for g in rest if isinstance(g, DeltaGap)]


async def test_a_reader_resuming_past_the_grace_is_told_of_the_gap(redis_store: RedisSessionStore) -> None:
    await redis_store.create(SessionHeader(id="gap"))
    s = await Sessions(redis_store).open("gap")
    a = await _stream(s, ["x0", "x1", "x2"], grace=0.2)
    cursor = next(r for r in await redis_store.read_live("gap") if r.is_delta).id  # read x0, then left
    await anyio.sleep(0.3)
    await _stream(s, ["y0"], grace=0.2)  # its end trims what is older than the grace
    got: list[Any] = []
    with anyio.fail_after(10):
        async for item in s.tail_deltas(0, live_after=cursor):
            got.append(item)
            if isinstance(item, Delta):
                break
    assert isinstance(got[0], DeltaGap) and got[0].answer == ""  # told, not silent
    assert [c["text"] for c in replay(await s.read())[a.answer]] == ["x0", "x1", "x2"]  # the log has it


async def test_a_trimmed_start_of_an_answer_is_a_gap_for_a_fresh_reader() -> None:
    from redis_session import MemorySessionStore
    from redis_session.projection.chunks import LiveRecord
    from redis_session.streaming import tail_deltas

    store = MemorySessionStore()
    await store.create(SessionHeader(id="m"))
    await store.live_add("m", [LiveRecord(answer="q", kind="text", index=4, text="e")], expire_ms=10_000)
    items: list[Any] = []
    with anyio.move_on_after(0.3):
        async for item in tail_deltas(store, "m", 0):
            items.append(item)
    assert items[0] == DeltaGap(answer="q", start=0, stop=4, cursor=items[1].cursor)
    assert isinstance(items[1], Delta) and items[1].index == 4


async def test_one_answers_end_never_trims_another_open_answer(store: Any) -> None:
    await store.create(SessionHeader(id="trimo"), [("turn/start", {"turn": 1})])
    s = await Sessions(store).open("trimo")
    wa = s.stream(turn=1, step=1, flush_interval=60)
    await wa.__aenter__()
    try:
        await wa.delta("a0")
        await wa.delta("a1")
        await anyio.sleep(0.5)  # A's records grow older than B's grace
        await _stream(await Sessions(store).open("trimo"), ["b0"], turn=1, step=2, grace=0.2, flush_interval=0.05)
        assert await store.get_draft("trimo") is not None  # A is still open
        got: list[Any] = []
        with anyio.move_on_after(3):
            async with contextlib.aclosing(follow_deltas(store, "trimo", 1)) as items:
                async for item in items:
                    if isinstance(item, (Delta, DeltaGap)) and item.answer == wa.answer:
                        got.append(item)
                    if len(got) >= 2:
                        break
        assert [g.text for g in got if isinstance(g, Delta)] == ["a0", "a1"], got
    finally:
        with contextlib.suppress(SessionConflictError):  # B wrote since A began: A's end conflicts
            await wa.__aexit__(None, None, None)


# --------------------------------------------------------------------------- 7 quiet and dead writers


async def test_a_quiet_writer_that_beats_is_never_repaired(store: Any) -> None:
    await store.create(SessionHeader(id="quiet"))
    s = await Sessions(store).open("quiet")
    await s.append_many([("turn/start", {"turn": 1}), ("step/start", {"turn": 1, "step": 1})])
    async with s.stream(turn=1, step=1, heartbeat=0.05) as w:
        await w.delta("thinking ")
        await anyio.sleep(0.6)  # a slow model: nothing sent, but the writer beats
        assert await Sessions(store).repair("quiet", stale_after=0.4) == []
        await w.delta("done")
    assert w.message is not None
    types = [e.type for e in await store.read("quiet")]
    assert INTERRUPTED not in types and "turn/end" not in types


async def test_a_dead_writer_is_repaired_once(redis_store: RedisSessionStore) -> None:
    await redis_store.create(SessionHeader(id="dead2"))
    s = await Sessions(redis_store).open("dead2")
    await s.append_many([("turn/start", {"turn": 1}), ("step/start", {"turn": 1, "step": 1})])
    begun = await redis_store.answer_begin("dead2", "zzz", turn=1, step=1, ttl_ms=60_000)
    d = [Delta(answer="zzz", index=i, kind="text", text=t) for i, t in enumerate("abc")]
    await redis_store.answer_deltas("dead2", "zzz", 0, d[:2], turn=1, step=1, ttl_ms=60_000)
    await redis_store.answer_deltas("dead2", "zzz", 2, d[2:], log=False, ttl_ms=60_000)  # live only
    assert begun.n == 2  # ... and the writer dies
    results: list[Any] = []

    async def repair() -> None:
        try:
            results.append(await Sessions(redis_store).repair("dead2", stale_after=0))
        except Exception as e:  # the other repair holds the lease
            results.append(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(repair)
        tg.start_soon(repair)
    entries = await redis_store.read("dead2")
    marks = [e for e in entries if e.type == INTERRUPTED]
    assert len(marks) == 1 and marks[0].data["content"] == [{"type": "text", "text": "abc"}]
    assert [e.type for e in entries].count("turn/end") == 1
    assert await Sessions(redis_store).repair("dead2", stale_after=0) == []


# --------------------------------------------------------------------------- 21: another life


async def test_an_answer_in_flight_never_crosses_into_the_new_life(redis_store: RedisSessionStore) -> None:
    await redis_store.create(SessionHeader(id="life"))
    old = await Sessions(redis_store).open("life")
    w = old.stream(turn=1, step=1, flush_interval=0.01)
    # replaced; or not found, when the writer's flush lands between the delete and the create
    with pytest.raises(SessionNotFoundError):
        async with w:
            await w.delta("old-0 ")
            await wait_for(lambda: w._live == 1, within=30)
            await redis_store.delete("life")
            await redis_store.create(SessionHeader(id="life"), [("user/message", {"content": "new"})])
            new = await Sessions(redis_store).open("life")
            for i in range(1, 50):
                await w.delta(f"old-{i} ")  # raises once the protocol refused the old life
                await anyio.sleep(0.01)
    assert await redis_store.read_live("life") == []
    assert await redis_store.get_draft("life") is None
    assert [e.type for e in await new.read()] == ["user/message"]


async def test_http_deltas_and_end_of_an_old_life_answer_are_refused(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await redis_store.create(SessionHeader(id="life2"))
    a = await _begin(client, "life2")
    assert (await client.post(path("life2", f"answers/{a}/deltas"), json=_batch(0, "ab"))).status_code == 201
    await redis_store.delete("life2")
    await redis_store.create(SessionHeader(id="life2"), [("user/message", {"content": "new"})] * 3)
    r = await client.post(path("life2", f"answers/{a}/deltas"), json=_batch(2, "cd"))  # no incarnation header
    assert r.status_code == 409 and r.json()["error"] == "session_replaced"
    r = await client.post(path("life2", f"answers/{a}/end"), json={"reason": "committed"})
    assert r.status_code in (404, 409)
    assert [e.type for e in await redis_store.read("life2")] == ["user/message"] * 3
    assert await redis_store.read_live("life2") == []


async def test_a_keyed_begin_in_a_new_life_never_takes_the_old_lifes_answer(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    key = {"Idempotency-Key": "turn1-step1"}
    await redis_store.create(SessionHeader(id="life3"))
    r = await client.post(path("life3", "answers"), json={"turn": 1, "step": 1}, headers=key)
    old = r.json()["answer"]
    again = await client.post(path("life3", "answers"), json={"turn": 1, "step": 1}, headers=key)
    assert again.status_code == 201 and again.json()["answer"] == old  # a retry: the same answer
    other = await client.post(path("life3", "answers"), json={"turn": 2, "step": 1}, headers=key)
    assert other.status_code == 422 and other.json()["error"] == "idempotency_key_reused"
    assert (await client.post(path("life3", f"answers/{old}/deltas"), json=_batch(0, ["OLD0 "]))).status_code == 201
    await redis_store.delete("life3")
    await redis_store.create(SessionHeader(id="life3"))
    r = await client.post(path("life3", "answers"), json={"turn": 1, "step": 1}, headers=key)
    new = r.json()["answer"]
    assert r.status_code == 201 and new != old
    assert (await client.post(path("life3", f"answers/{new}/deltas"), json=_batch(0, ["NEW0 "]))).status_code == 201
    # the old writer (no incarnation header) goes on: refused, nothing of it in the new life
    r = await client.post(path("life3", f"answers/{old}/deltas"), json=_batch(1, ["OLD1"]))
    assert r.status_code in (404, 409)
    r = await client.post(path("life3", f"answers/{old}/end"), json={"reason": "committed", "deltas": 2})
    assert r.status_code in (404, 409)
    r = await client.post(path("life3", f"answers/{new}/end"), json={"reason": "committed"})
    assert r.status_code == 201, r.text
    msg = (await redis_store.read("life3"))[-1]
    assert msg.type == "assistant/message" and msg.data["content"] == [{"type": "text", "text": "NEW0 "}]


async def test_a_follower_of_the_old_life_is_told_it_was_replaced(redis_store: RedisSessionStore) -> None:
    await redis_store.create(SessionHeader(id="life3"))
    s = await Sessions(redis_store).open("life3")
    got: list[Any] = []
    raised: list[BaseException] = []

    async def follower() -> None:
        try:
            async for item in follow_deltas(redis_store, "life3", 0, incarnation=s.header.incarnation):
                if isinstance(item, Delta):
                    got.append(item.text)
            raised.append(SessionNotFoundError("life3"))  # it saw the deletion: the end of the tail
        except SessionReplacedError as e:
            raised.append(e)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower)
            await _stream(s, ["o1", "o2"])
            await wait_for(lambda: len(got) == 2, within=30)
            await redis_store.delete("life3")
            await redis_store.create(SessionHeader(id="life3"))
            await _stream(await Sessions(redis_store).open("life3"), ["NEW"])
            await wait_for(lambda: bool(raised), within=30)
    # told it was replaced, or ended at the deletion when it looked between the two calls; never NEW
    assert got == ["o1", "o2"] and len(raised) == 1


async def test_an_sse_resume_into_another_life_answers_replaced(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await redis_store.create(SessionHeader(id="life4"), [("user/message", {"content": "old"})] * 3)
    inc = (await redis_store.head("life4")).header.incarnation  # type: ignore[union-attr]

    async def events(last_id: str) -> list[str]:
        seen: list[str] = []
        with anyio.fail_after(20):
            async with client.stream("GET", path("life4", "events"), headers={"Last-Event-ID": last_id}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith(("event:", "id:")):
                        seen.append(line)
                    if seen:
                        break
        return seen

    assert (await events(f"{inc}:1"))[0] == f"id: {inc}:2"  # the same life: resumes
    await redis_store.delete("life4")
    await redis_store.create(SessionHeader(id="life4"), [("user/message", {"content": "new"})] * 5)
    assert (await events(f"{inc}:2"))[0] == "event: replaced"  # not n=3 of the new life
    assert (await events("2"))[0] == "event: replaced"  # a plain n names no life: never misread
    new_inc = (await redis_store.head("life4")).header.incarnation  # type: ignore[union-attr]
    r = await client.get(path("life4", "events"), headers={"Last-Event-ID": "x:y:z"})
    assert r.status_code == 400
    assert (await events(f"{new_inc}:3"))[0] == f"id: {new_inc}:4"


async def test_an_sse_resume_after_the_answer_ended_gets_the_rest(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await redis_store.create(SessionHeader(id="sser"), [("turn/start", {"turn": 1})])
    a = await _begin(client, "sser")
    assert (await client.post(path("sser", f"answers/{a}/deltas"), json=_batch(0, ["d0", "d1"]))).status_code == 201

    async def events(headers: dict[str, str], until: Any) -> list[tuple[str, str, str]]:
        seen: list[tuple[str, str, str]] = []
        ev, eid = "message", ""
        with anyio.fail_after(20):
            async with client.stream("GET", path("sser", "events"), params={"deltas": "1"}, headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("event:"):
                        ev = line[6:].strip()
                    elif line.startswith("id:"):
                        eid = line[3:].strip()
                    elif line.startswith("data:"):
                        seen.append((ev, eid, line[5:].strip()))
                        ev = "message"
                        if until(seen):
                            break
        return seen

    first = await events({}, lambda seen: any(e[0] == "delta" for e in seen))
    last = next(e[1] for e in first if e[0] == "delta")  # the reader leaves after d0
    assert (await client.post(path("sser", f"answers/{a}/deltas"), json=_batch(2, ["d2"]))).status_code == 201
    assert (await client.post(path("sser", f"answers/{a}/end"), json={"reason": "committed"})).status_code == 201

    def done(seen: list[tuple[str, str, str]]) -> bool:
        return any(e[0] == "gap" for e in seen) or sum(e[0] == "delta" for e in seen) >= 2

    again = await events({"Last-Event-ID": last}, done)
    deltas = [json.loads(e[2])["text"] for e in again if e[0] == "delta"]
    assert deltas == ["d1", "d2"] or any(e[0] == "gap" for e in again), again
    # and exactly as follow_deltas with that cursor
    cursor = last.split("/", 1)[1]
    got: list[str] = []
    with anyio.fail_after(20):
        async with contextlib.aclosing(follow_deltas(redis_store, "sser", 1, live_after=cursor)) as items:
            async for item in items:
                if isinstance(item, Delta):
                    got.append(item.text)
                if len(got) == 2:
                    break
    assert got == deltas


async def test_the_raw_answer_script_refuses_a_state_of_another_life(raw_redis: aioredis.Redis) -> None:
    # the rule is in the script: even a caller that passes no incarnation cannot write into a new life
    store = RedisSessionStore(raw_redis, prefix="rawlife")
    await store.create(SessionHeader(id="x"))
    await store.answer_begin("x", "a1", ttl_ms=10_000)
    await store.delete("x")
    await store.create(SessionHeader(id="x"))
    with pytest.raises(SessionReplacedError):
        await store.answer_deltas("x", "a1", 0, [Delta(answer="a1", index=0, kind="text", text="z")], ttl_ms=10_000)
    assert await store.read("x") == [] and await store.read_live("x") == []
    await raw_redis.delete(*[k async for k in raw_redis.scan_iter("rawlife:*")])
