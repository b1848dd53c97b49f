"""A reader that falls behind a fast writer for longer than the answers' grace, and stays
connected, gets every delta of every answer that ended meanwhile, or a `DeltaGap` naming that
answer and the range it missed — never a silent hole. The log's entries are the check: an
answer's closing entry comes after all its deltas, and its chunk rows say how many it had.

It used to get the answers' messages and chunk rows with no deltas and no gap (the live records
were gone when it read on, and only a reader that reconnected was told). Python's
`follow_deltas` consumer that stops pulling, and an SSE ``?deltas=1`` stream whose client stops
reading (detached from the shared tail, then catching up alone), both. Real servers."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from redis_session import Delta, DeltaGap, RedisSessionStore, Sessions
from redis_session.live import follow_deltas
from redis_session.model import Entry

from support import running_gateway, unchunked, wait_blocked_in_xread, wait_for, watch_detachment

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

GRACE = 0.2  # the live records of an ended answer are gone this long after its end


def covered(indexes: list[int], gaps: list[tuple[int, int | None]], total: int) -> bool:
    """Every index below `total` was given once, or named by a gap; none given twice."""
    if len(indexes) != len(set(indexes)):
        return False
    seen = set(indexes)
    for start, stop in gaps:
        seen.update(range(start, total if stop is None else stop))
    return seen >= set(range(total))


async def live_gone(store: RedisSessionStore, sid: str) -> bool:
    return not await store.read_live(sid)


async def test_a_follow_deltas_consumer_that_lags_past_the_grace_gets_every_delta_or_a_named_gap(
    redis_store: RedisSessionStore,
) -> None:
    S = Sessions(redis_store)
    s = await S.create("lag-py")
    await s.append("turn/start", {"turn": 1})
    per, answers = 30, 4
    got: dict[str, list[int]] = {}
    gaps: dict[str, list[tuple[int, int | None]]] = {}
    unnamed: list[DeltaGap] = []
    closed: list[str] = []
    paused, resume = anyio.Event(), anyio.Event()

    async def reader() -> None:
        async for item in follow_deltas(redis_store, "lag-py", start=s.n):
            if isinstance(item, Delta):
                got.setdefault(item.answer, []).append(item.index)
                if len(got) == 1 and item.index == per - 1 and not paused.is_set():
                    paused.set()  # the first answer whole, then the consumer stops pulling
                    await resume.wait()
            elif isinstance(item, DeltaGap):
                if item.answer:
                    gaps.setdefault(item.answer, []).append((item.start, item.stop))
                else:
                    unnamed.append(item)
            elif isinstance(item, Entry) and item.type == "assistant/message":
                closed.append(item.meta["answer"] if item.meta else "")
                if len(closed) == answers:
                    return

    ids: list[str] = []
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            for k in range(answers):
                async with s.stream(turn=1, step=k + 1, grace=GRACE) as w:
                    for i in range(per):
                        await w.delta(f"{k}.{i} ")
                ids.append(w.message.meta["answer"])
                if k == 0:
                    await paused.wait()
            # every answer ended, and their live records are gone while the consumer lags
            await wait_for(lambda: live_gone(redis_store, "lag-py"), within=60)
            resume.set()
    assert closed == ids
    assert got[ids[0]] == list(range(per))
    for a in ids[1:]:
        assert a in gaps, f"answer {a}: {len(got.get(a, []))} of {per} deltas and no gap naming it"
        assert covered(got.get(a, []), gaps[a], per), (a, got.get(a), gaps[a])


async def test_an_sse_reader_that_stops_reading_past_the_grace_gets_every_delta_or_a_named_gap(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream's writes are held (as a client that stops reading holds them once its sockets
    are full) while answers stream and their live records expire: it is detached from the shared
    tail, then catches up alone from what the store still holds."""
    from redis_session.gateway import sse

    detached = watch_detachment(monkeypatch, 4)  # detached early
    gate = anyio.Event()
    held: list[bool] = []
    flush = sse._flush

    async def held_flush(write: Any, out: list[bytes]) -> None:
        if held and not gate.is_set():
            await gate.wait()
        await flush(write, out)

    monkeypatch.setattr(sse, "_flush", held_flush)
    S = Sessions(redis_store)
    s = await S.create("lag-sse")
    await s.append("turn/start", {"turn": 1})
    start = s.n
    count, answers = 30, 4
    ids: list[str] = []
    async with running_gateway(redis_store) as base:
        port = int(base.rsplit(":", 1)[1])
        stuck = await anyio.connect_tcp("127.0.0.1", port)
        url = f"/sessions/lag-sse/events?deltas=1&start={start}"
        await stuck.send(f"GET {url} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        with anyio.fail_after(180):
            await wait_blocked_in_xread(redis_url, prefix)  # the shared tail is live
            held.append(True)  # from now on the stream's writes wait
            for k in range(answers):
                async with s.stream(turn=1, step=k + 1, grace=GRACE) as w:
                    for i in range(count):
                        await w.delta(f"{k}.{i} ")
                ids.append(w.message.meta["answer"])
            await wait_for(lambda: bool(detached), within=60)
            await wait_for(lambda: live_gone(redis_store, "lag-sse"), within=60)
            gate.set()
            raw = b""
            while raw.count(b'"type":"assistant/message"') < len(ids) or not raw.endswith((b"\n\n", b"\n\n\r\n")):
                raw += await stuck.receive(1 << 20)
        await stuck.aclose()
    got: dict[str, list[int]] = {}
    gaps: dict[str, list[tuple[int, int | None]]] = {}
    for block in unchunked(raw).split("\n\n"):
        kind = next((ln[7:] for ln in block.split("\n") if ln.startswith("event: ")), "")
        data = next((ln[6:] for ln in block.split("\n") if ln.startswith("data: ")), "")
        if kind == "delta":
            d = json.loads(data)
            got.setdefault(d["answer"], []).append(d["index"])
        elif kind == "gap":
            d = json.loads(data)
            if d["answer"]:
                gaps.setdefault(d["answer"], []).append((d["start"], d["stop"]))
    silent = [a for a in ids if sorted(got.get(a, [])) != list(range(count)) and a not in gaps]
    assert not silent, f"{len(silent)} of {len(ids)} answers lost deltas with no gap naming them"
    for a in ids:
        assert covered(got.get(a, []), gaps.get(a, []), count), (a, len(got.get(a, [])), gaps.get(a))
