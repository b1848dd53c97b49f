"""Readers that give entries and live deltas together give them in the order they happened
(`projection.chunks.merge_live`, the one rule behind `tail_live`, `tail_deltas`, `follow_deltas`
and the gateway's SSE catch-up), and a reader ahead of a log a failover rolled back is told so
(`SessionRewoundError`, SSE ``event: rewound``) instead of waiting silently. Real servers."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
import redis.asyncio as aioredis
from test_gateway import path, sse

from redis_session import Delta, DeltaGap, RedisSessionStore, SessionRewoundError, Sessions
from redis_session.live import follow, follow_deltas
from redis_session.model import Entry
from redis_session.projection.chunks import CHUNK, LiveRecord, merge_live

from support import running_gateway, unchunked, wait_blocked_in_xread, wait_for, watch_detachment

pytestmark = pytest.mark.anyio


# --------------------------------------------------------------------------- merge_live (pure)


def _e(n: int, time: int, type_: str = "user/message", answer: str | None = None) -> Entry:
    if type_ == CHUNK:
        return Entry(n=n, time=time, type=CHUNK, data={"answer": answer, "seq": 0, "chunks": ["x"]})
    return Entry(n=n, time=time, type=type_, data={}, meta=None if answer is None else {"answer": answer})


def _r(ms: int, seq: int, answer: str, kind: str = "text", index: int | None = 0) -> LiveRecord:
    return LiveRecord(answer=answer, kind=kind, id=f"{ms}-{seq}", index=index)


def _names(items: list[Any]) -> list[str]:
    return [f"e{x.n}" if isinstance(x, Entry) else f"{x.answer}:{x.kind}@{x.id}" for x in items]


def test_merge_orders_by_server_time() -> None:
    entries = [_e(0, 100), _e(1, 300)]
    records = [_r(50, 0, "A"), _r(200, 0, "A"), _r(400, 0, "A")]
    got = merge_live(entries, records)
    assert _names(got.items) == ["A:text@50-0", "e0", "A:text@200-0", "e1", "A:text@400-0"]
    assert (got.entries, got.records) == (2, 3)


def test_merge_ties_own_deltas_first_other_answers_and_end_records_after() -> None:
    # A's last deltas, its row, its message, its end record and B's begin, all in one ms
    entries = [_e(5, 100, CHUNK, "A"), _e(6, 100, "assistant/message", "A")]
    records = [
        _r(100, 0, "A"),
        _r(100, 1, "A", index=1),
        _r(100, 2, "A", kind="end", index=2),
        _r(100, 3, "B", kind="begin", index=None),
        _r(100, 4, "B"),
    ]
    got = merge_live(entries, records)
    assert _names(got.items) == [
        "A:text@100-0",
        "A:text@100-1",
        "e5",
        "e6",
        "A:end@100-2",
        "B:begin@100-3",
        "B:text@100-4",
    ]


def test_merge_keeps_an_answers_deltas_before_its_closing_entry_whatever_the_clocks_say() -> None:
    # a live stream whose ids run ahead of the clock (a failover to a server whose clock is behind)
    entries = [_e(7, 100, "assistant/message", "A"), _e(8, 101, "user/message")]
    records = [_r(90, 0, "B"), _r(150, 0, "A", index=4), _r(150, 1, "C")]
    got = merge_live(entries, records)
    assert _names(got.items) == ["B:text@90-0", "A:text@150-0", "e7", "e8", "C:text@150-1"]


def test_merge_holds_back_what_may_come_after_a_side_cut_short() -> None:
    entries = [_e(0, 100), _e(1, 200)]
    records = [_r(150, 0, "A"), _r(250, 0, "A"), _r(300, 0, "A")]
    # the log's read was cut at its COUNT: records after its last entry wait for the next read
    got = merge_live(entries, records, more_entries=True)
    assert _names(got.items) == ["e0", "A:text@150-0", "e1"]
    assert (got.entries, got.records) == (2, 1)
    # the live stream's read was cut: entries after its last record wait
    got = merge_live([_e(0, 100), _e(1, 400)], records, more_records=True)
    assert _names(got.items) == ["e0", "A:text@150-0", "A:text@250-0", "A:text@300-0"]
    assert (got.entries, got.records) == (1, 3)
    # both cut: at least one side is taken whole, so a reader always moves on
    got = merge_live(entries, records, more_entries=True, more_records=True)
    assert (got.entries, got.records) == (2, 1)
    assert merge_live([], []).items == []


# --------------------------------------------------------------------------- end to end


def _label(item: Any, a: str, b: str) -> str:
    if isinstance(item, Delta):
        return f"{'A' if item.answer == a else 'B'}{item.index}"
    if isinstance(item, DeltaGap):
        return f"gap({item.answer},{item.start},{item.stop})"
    ans = (item.meta or {}).get("answer") or item.data.get("answer")
    tag = {a: "A", b: "B"}.get(ans, "")
    return f"{item.type}({tag})" if tag else item.type


@pytest.mark.parametrize("resumed", [True, False])
async def test_a_later_answers_deltas_never_overtake_an_earlier_answers_message(
    redis_store: RedisSessionStore, resumed: bool
) -> None:
    """A reader leaves mid-answer A; A ends, answer B streams and ends; the reader comes back
    (resumed after its last delta, or fresh at the same n): A's rest, A's row and message, then
    B. It used to get B's deltas before A's message (the live records of one read went first)."""
    S = Sessions(redis_store)
    s = await S.open("order")
    await s.append("turn/start", {"turn": 1})
    start = s.n
    cursor: str | None = None
    left = anyio.Event()

    async def first_reader() -> None:
        nonlocal cursor
        async for item in follow_deltas(redis_store, "order", start=start):
            if isinstance(item, Delta):
                cursor = item.cursor
                if item.index == 4:
                    left.set()
                    return

    async with anyio.create_task_group() as tg:
        tg.start_soon(first_reader)
        async with s.stream(turn=1, step=1) as w:
            for i in range(10):
                await w.delta(f"a{i}.")
                if i == 4:
                    with anyio.fail_after(60):
                        await left.wait()
    a = w.message.meta["answer"]
    async with s.stream(turn=1, step=2) as w2:
        for i in range(3):
            await w2.delta(f"b{i}.")
    b = w2.message.meta["answer"]

    got: list[str] = []
    kw = {"live_after": cursor} if resumed else {}
    with anyio.fail_after(60):
        async for item in follow_deltas(redis_store, "order", start=start, **kw):
            got.append(_label(item, a, b))
            if got[-1] == "assistant/message(B)":
                break
    first = [] if resumed else ["A0", "A1", "A2", "A3", "A4"]
    assert got == [
        *first,
        *["A5", "A6", "A7", "A8", "A9"],
        "assistant/chunk(A)",
        "assistant/message(A)",
        *["B0", "B1", "B2"],
        "assistant/chunk(B)",
        "assistant/message(B)",
    ]


async def test_entries_and_live_records_of_tail_live_come_in_the_order_they_happened(
    redis_store: RedisSessionStore,
) -> None:
    """`tail_live` itself (what the gateway's shared tails follow): an entry appended between
    deltas comes between them."""
    S = Sessions(redis_store)
    s = await S.open("mixed")
    await s.append("turn/start", {"turn": 1})
    start = s.n

    async def one_live() -> bool:
        return sum(r.is_delta for r in await redis_store.read_live("mixed")) == 1

    async with s.stream(turn=1, step=1, flush_interval=3600) as w:
        await w.delta("one ")
        await wait_for(one_live)  # the first delta is on the live stream
        await s.append("note/mark", {"k": 1})
        await w.delta("two ")
    order: list[str] = []
    with anyio.fail_after(60):
        async for item in redis_store.tail_live("mixed", start):
            if isinstance(item, LiveRecord):
                order.append(f"{item.kind}{'' if item.index is None else item.index}")
            else:
                order.append(item.type)
                if item.type == "assistant/message":
                    break
    assert order[: order.index("note/mark") + 2] == ["begin", "text0", "note/mark", "text1"], order


# --------------------------------------------------------------------------- rewound logs


async def _roll_back(url: str, prefix: str, sid: str, n: int) -> None:
    """What a failover to a replica that had not got the last entries leaves: the session's log
    and header end at `n` (a fresh stream, so the next append lands at n as on a promoted
    replica)."""
    r = aioredis.Redis.from_url(url)
    log, hdr, tmp = f"{prefix}:{{{sid}}}:log", f"{prefix}:{{{sid}}}:hdr", f"{prefix}:{{{sid}}}:rollback"
    try:
        assert await r.exists(log, hdr) == 2, "key layout"
        rows = await r.xrange(log, "-", f"{n - 1}-1")
        await r.delete(tmp)
        for rid, fields in rows:
            await r.xadd(tmp, fields, id=rid)
        await r.rename(tmp, log)
        await r.hset(hdr, "n", n)
    finally:
        await r.aclose()


async def test_a_reader_ahead_of_a_rolled_back_log_is_told_at_its_restart(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    S = Sessions(redis_store)
    s = await S.open("rb")
    for i in range(14):
        await s.append("user/message", {"content": f"m{i}"})
    seen = [e.n async for e in _take(follow(redis_store, "rb"), 14)]
    assert seen[-1] == 13
    await _roll_back(redis_url, prefix, "rb", 11)
    for tail in (
        follow(redis_store, "rb", start=14, resumed=True),
        follow_deltas(redis_store, "rb", start=14, live_after="0-1"),
    ):
        with pytest.raises(SessionRewoundError) as got, anyio.fail_after(60):
            async for _ in tail:
                pass
        assert (got.value.session_id, got.value.cursor, got.value.n) == ("rb", 14, 11)
    # a reader at the end of what the log holds now is not ahead of it
    s2 = await S.open("rb")
    assert s2.n == 11


async def _take(it: Any, count: int) -> Any:
    k = 0
    async for x in it:
        yield x
        k += 1
        if k == count:
            await it.aclose()
            return


async def test_a_waiting_tail_ahead_of_a_rolled_back_log_is_told_on_its_next_wake_up(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    """A tail blocked for the next entry when the log is rolled back under it re-reads the
    header on its idle wake-up and raises (`follow_deltas` and `follow`), instead of waiting for
    entries it would never be given (the new n=11.. are other entries than the ones it saw)."""
    redis_store.block_ms = 200
    S = Sessions(redis_store)
    s = await S.open("rbw")
    for i in range(14):
        await s.append("user/message", {"content": f"m{i}"})
    raised: list[BaseException] = []

    async def reader(tail: Any) -> None:
        try:
            async for _ in tail:
                pass
        except SessionRewoundError as exc:
            raised.append(exc)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader, follow_deltas(redis_store, "rbw", start=14, resumed=True))
            tg.start_soon(reader, follow(redis_store, "rbw", start=14, resumed=True))
            await wait_blocked_in_xread(redis_url, prefix, 2)
            await _roll_back(redis_url, prefix, "rbw", 11)
    assert [(e.cursor, e.n) for e in raised] == [(14, 11), (14, 11)]  # type: ignore[attr-defined]


async def test_sse_streams_ahead_of_a_rolled_back_log_get_event_rewound(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    """SSE: a stream resumed past the log's end gets ``event: rewound`` (and ``end``) at once; a
    live one (shared tail) gets it when the rollback happens; so a browser re-reads."""
    redis_store.block_ms = 200
    S = Sessions(redis_store)
    s = await S.open("rbs")
    for i in range(14):
        await s.append("user/message", {"content": f"m{i}"})
    inc = (await redis_store.head("rbs")).header.incarnation  # type: ignore[union-attr]

    async def events(client: httpx.AsyncClient, headers: dict[str, str], query: str = "") -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        async with client.stream("GET", path("rbs", "events") + query, headers=headers) as r:
            async for ev in sse(r):
                if "event" in ev or "data" in ev:
                    out.append(ev)
                if ev.get("event") == "end":
                    break
        return out

    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=60) as c:
        live: dict[str, list[dict[str, Any]]] = {}

        async def follow_sse(name: str, query: str) -> None:
            live[name] = await events(c, {"Last-Event-ID": f"{inc}:13"}, query)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(follow_sse, "entries", "")
                tg.start_soon(follow_sse, "deltas", "?deltas=1")
                await wait_blocked_in_xread(redis_url, prefix, 2)
                await _roll_back(redis_url, prefix, "rbs", 11)
            resumed = await events(c, {"Last-Event-ID": f"{inc}:13"}, "?deltas=1")
    for got in (live["entries"], live["deltas"], resumed):
        kinds = [ev.get("event") for ev in got]
        assert kinds[-2:] == ["rewound", "end"], got
        assert got[-2]["data"] == {"session": "rbs", "cursor": 14, "n": 11}
    assert json.dumps(live["entries"]).count('"m13"') == 0  # nothing was sent past the cursor


async def test_an_sse_reader_that_fell_behind_catches_up_in_the_order_things_happened(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ``?deltas=1`` streams of one session; one reads nothing while answers stream, so it is
    detached from the shared tail and catches up from the store alone. Both get every answer's
    deltas once and in order, each answer's before its message. The caught-up one used to get
    the messages of the later answers before their deltas (the catch-up sent the log's entries,
    then the live records)."""
    detached = watch_detachment(monkeypatch, 16)  # detached early: the queue, not the socket, fills
    S = Sessions(redis_store)
    s = await S.open("slowd")
    await s.append("turn/start", {"turn": 1})
    # answers of ~120 KB of deltas each, streamed until the stuck reader is detached (at least 6;
    # how many it takes depends on how the deltas were batched and how much its sockets hold)
    least, most, count, pad = 6, 30, 400, "x" * 300

    def parse(text: str, got: list[Any]) -> None:
        for block in text.split("\n\n"):
            kind = next((ln[7:] for ln in block.split("\n") if ln.startswith("event: ")), "")
            data = next((ln[6:] for ln in block.split("\n") if ln.startswith("data: ")), "")
            if kind == "delta":
                got.append(json.loads(data)["index"])
            elif kind == "gap":
                got.append(("gap", data))
            elif not kind and data.startswith("{") and json.loads(data).get("type") == "assistant/message":
                got.append("END")

    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        port = int(base.rsplit(":", 1)[1])
        slow = await anyio.connect_tcp("127.0.0.1", port)
        await slow.send(f"GET {path('slowd', 'events')}?deltas=1&start=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        fast: list[Any] = []

        async def fast_reader() -> None:
            async with client.stream("GET", path("slowd", "events") + "?deltas=1&start=1") as r:
                async for ev in sse(r):
                    if ev.get("event") == "delta":
                        fast.append(ev["data"]["index"])
                    elif ev.get("event") == "gap":
                        fast.append(("gap", ev["data"]))
                    elif isinstance(ev.get("data"), dict) and ev["data"].get("type") == "assistant/message":
                        fast.append("END")

        with anyio.fail_after(180):
            async with anyio.create_task_group() as tg:
                tg.start_soon(fast_reader)
                await wait_blocked_in_xread(redis_url, prefix)  # the shared tail is live
                k = 0
                while k < least or (not detached and k < most):
                    async with s.stream(turn=1, step=k + 1) as w:
                        for i in range(count):
                            await w.delta(f"{i}:{pad}")
                    k += 1
                await wait_for(lambda: fast.count("END") >= k, within=120)
                tg.cancel_scope.cancel()  # the fast reader has every answer
            answers = k
            expected = ([*range(count), "END"]) * answers
            assert fast == expected
            assert detached, "the slow stream was never detached: the test did not test the catch-up"
            raw = b""
            while raw.count(b'"type":"assistant/message"') < answers or not raw.endswith((b"\n\n", b"\n\n\r\n")):
                raw += await slow.receive(1 << 20)
        await slow.aclose()
    body = unchunked(raw)
    slow_got: list[Any] = []
    parse(body, slow_got)
    assert slow_got == expected, [x for x in slow_got if not isinstance(x, int)][:20]


async def test_a_reader_that_fails_over_to_a_replica_behind_it_is_told(tmp_path: Any) -> None:
    """A real master and replica: the replica is promoted (REPLICAOF NO ONE) while the master
    takes entries n=11..13 a reader follows; the reader then reaches the promoted replica (the
    failover) and resumes after n=13: `SessionRewoundError` naming its cursor and the replica's n,
    not a silent wait (the entries landing at 11.. there are others than those it saw)."""
    import subprocess

    from redis_session.redis.embedded import free_port, server_binary

    def start(port: int, d: Any, *extra: str) -> subprocess.Popen[bytes]:
        d.mkdir()
        return subprocess.Popen(
            [server_binary(), "--port", str(port), "--dir", str(d), "--save", "", "--appendonly", "no", *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    pm, pr = free_port(), free_port()
    procs = [start(pm, tmp_path / "m")]
    try:
        procs.append(start(pr, tmp_path / "r", "--replicaof", "127.0.0.1", str(pm)))
        m = RedisSessionStore.from_url(f"redis://127.0.0.1:{pm}/0", prefix="fo")
        r = RedisSessionStore.from_url(f"redis://127.0.0.1:{pr}/0", prefix="fo")
        raw_r = aioredis.Redis(port=pr)

        async def linked() -> bool:
            try:
                return (await raw_r.info("replication")).get("master_link_status") == "up"
            except OSError:
                return False

        with anyio.fail_after(60):
            await wait_for(linked)
            s = await Sessions(m).open("fo")
            for i in range(11):
                await s.append("user/message", {"content": f"m{i}"})
            raw_m = aioredis.Redis(port=pm)
            assert await raw_m.execute_command("WAIT", 1, 10000) == 1  # the replica has n=0..10
            await raw_r.execute_command("REPLICAOF", "NO", "ONE")  # promoted: it gets no more
            for i in range(11, 14):
                await s.append("user/message", {"content": f"m{i}"})
            seen = [e.n async for e in _take(follow_deltas(m, "fo"), 14)]
            assert seen[-1] == 13
            with pytest.raises(SessionRewoundError) as got:
                async for _ in follow_deltas(r, "fo", start=14, resumed=True):
                    pass
        assert (got.value.cursor, got.value.n) == (14, 11)
        await raw_m.aclose()
        await raw_r.aclose()
        await m.aclose()
        await r.aclose()
    finally:
        for p in procs:
            p.kill()
            p.wait()


async def test_a_protocol_batch_gives_its_deltas_before_the_row_that_holds_them(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    """A delta batch written through the answer protocol (the gateway's route, the TypeScript
    writer) puts its live records and its chunk row in one script call. A reader blocked on both
    streams is woken by the key written first, and Redis 7.0 serves it that key alone: the row
    came to every live reader before the deltas it holds. The records go first now."""
    from redis_session import SessionHeader
    from redis_session.model import NewEntry
    from redis_session.projection.chunks import Delta as D

    await redis_store.create(SessionHeader(id="rows"), [("turn/start", {"turn": 1})])
    got: list[str] = []

    async def reader() -> None:
        async for it in follow_deltas(redis_store, "rows", start=0):
            got.append(f"d{it.index}" if isinstance(it, Delta) else f"{it.type}" if isinstance(it, Entry) else "gap")
            if isinstance(it, Entry) and it.type == "assistant/message":
                return

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await wait_blocked_in_xread(redis_url, prefix)
            b = await redis_store.answer_begin("rows", "ans1", ttl_ms=30_000)
            for i in range(5):
                await redis_store.answer_deltas(
                    "rows", "ans1", i, [D(answer="ans1", index=i, kind="text", text=f"x{i}")],
                    incarnation=b.incarnation, ttl_ms=30_000,
                )  # fmt: skip
                await wait_for(lambda i=i: len(got) >= 3 + 2 * i, within=30)  # the batch reached the reader
            message = NewEntry("assistant/message", {"content": "x0x1x2x3x4"}, {"answer": "ans1"})
            await redis_store.answer_end(
                "rows", "ans1", deltas=5, reason="committed", closing=message, expected=None, rest_first=5,
                rest=[], grace_ms=30_000, turn=None, step=None, incarnation=b.incarnation,
            )  # fmt: skip
    assert got == ["turn/start", *[x for i in range(5) for x in (f"d{i}", "assistant/chunk")], "assistant/message"]


async def test_a_protocol_row_is_never_timed_before_its_own_live_records(redis_store: RedisSessionStore) -> None:
    """A batch's live records are written before its row, and a record's id can fall a ms past
    the TIME the script began with: a row timed by that TIME went before its own deltas in a
    catch-up read (which orders by time). The row takes its last record's ms."""
    from redis_session import SessionHeader
    from redis_session.projection.chunks import Delta as D

    await redis_store.create(SessionHeader(id="timed"))
    b = await redis_store.answer_begin("timed", "ans1", ttl_ms=30_000)
    for i in range(300):
        batch = [D(answer="ans1", index=i * 3 + k, kind="text", text="x" * 500) for k in range(3)]
        await redis_store.answer_deltas("timed", "ans1", i * 3, batch, incarnation=b.incarnation, ttl_ms=30_000)
    rows = {e.data["seq"]: e.time for e in await redis_store.read("timed") if e.type == "assistant/chunk"}
    records = [r for r in await redis_store.read_live("timed") if r.is_delta]
    late = [
        (r.index, r.id, rows[r.index - r.index % 3])
        for r in records
        if int(r.id.split("-")[0]) > rows[r.index - r.index % 3]
    ]
    assert not late, late[:5]
