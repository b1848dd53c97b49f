"""Streamed answers (docs/design.md §8.2): the live path (deltas to tailing readers without a
script), the durable path (packed chunk rows), readers joining mid-answer and resuming, the SSE
`event: delta`, interruption, a writer that dies, repair and key cleanup. Memory, a real server
and the cluster where the API allows."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
import redis.asyncio
from test_gateway import path, sse

from redis_session import Delta, MemorySessionStore, RedisSessionStore, SessionHeader, Sessions, pack_chunks, project
from redis_session.live import follow_deltas
from redis_session.model import NewEntry
from redis_session.projection.chunks import CHUNK, INTERRUPTED, LiveRecord, replay, row_times, unpack_row

from support import running_gateway, wait_for

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[1]
WORDS = [f"w{i} " for i in range(60)]


async def _open(store: Any, sid: str = "chat") -> Any:
    s = await Sessions(store).open(sid)
    await s.append_many(
        [("turn/start", {"turn": 1}), ("user/message", {"content": "hi"}), ("step/start", {"turn": 1, "step": 1})]
    )
    return s


async def _stream(s: Any, words: list[str], pause: float = 0.002, **opts: Any) -> Any:
    async with s.stream(turn=1, step=1, **opts) as w:
        for word in words:
            await w.delta(word)
            await anyio.sleep(pause)
    return w


def _raw_records(rows: Any) -> list[LiveRecord]:
    """A live stream's rows as a plain client reads them (bytes field maps), as records."""
    return [LiveRecord.from_fields(rid.decode(), {k.decode(): v.decode() for k, v in f.items()}) for rid, f in rows]


def _texts(items: list[Any]) -> list[str]:
    return [d.text for d in items if isinstance(d, Delta)]


async def test_a_stream_lands_as_packed_rows_and_one_message(store: Any) -> None:
    s = await _open(store)
    w = await _stream(s, WORDS, max_chunks=16)
    entries = await s.read()
    rows = [e for e in entries if e.type == CHUNK]
    assert 4 <= len(rows) < len(WORDS)  # many deltas per row (max_chunks caps a row)
    assert all(len(r.data["chunks"]) <= 16 and r.data["answer"] == w.answer for r in rows)
    assert [c["text"] for c in replay(entries)[w.answer]] == WORDS  # every delta, in order
    assert [r.data["seq"] for r in rows] == sorted(r.data["seq"] for r in rows)
    message = entries[-1]
    assert message.type == "assistant/message" and message.meta == {"answer": w.answer}
    assert message.data["content"] == [{"type": "text", "text": "".join(WORDS)}]
    assert w.message == message and [e.n for e in entries] == list(range(len(entries)))  # n contiguous
    # the projection never sees chunks: the same with and without them
    marks = [msgspec.structs.replace(e, type="test/mark", data={}) if e.type == CHUNK else e for e in entries]
    assert project(entries) == project(marks)
    assert (await s.messages())[-1].text == "".join(WORDS)
    assert await s.draft() is None  # the answer is closed: no draft


async def test_reasoning_and_tool_call_deltas_assemble(store: Any) -> None:
    s = await _open(store)
    async with s.stream(turn=1, step=1) as w:
        await w.reasoning("think ")
        await w.reasoning("hard")
        await w.delta("Let me look.")
        await w.tool_call_delta("c1", "bash", '{"cmd"')
        await w.tool_call_delta("c1", None, ': "ls"}')
    assert w.message is not None
    assert w.message.data["content"] == [
        {"type": "reasoning", "text": "think hard"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool-call", "id": "c1", "name": "bash", "arguments": '{"cmd": "ls"}'},
    ]


async def test_a_reader_arriving_mid_answer_gets_it_all_once_then_the_message(store: Any) -> None:
    s = await _open(store)
    got: list[Any] = []
    half = anyio.Event()

    async def reader() -> None:
        await half.wait()
        async for item in follow_deltas(store, "chat", s.n):
            got.append(item)
            if not isinstance(item, Delta) and item.type == "assistant/message":
                return

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            async with s.stream(turn=1, step=1, flush_interval=0.01) as w:
                for i, word in enumerate(WORDS):
                    await w.delta(word)
                    if i == 30:
                        await anyio.sleep(0.1)  # rows of the first half are in the log by now
                        half.set()
                    await anyio.sleep(0.002)
    deltas = [d for d in got if isinstance(d, Delta)]
    assert [d.index for d in deltas] == list(range(len(WORDS)))
    assert _texts(got) == WORDS


async def test_a_reader_resumes_after_its_last_delta_without_gap_or_repeat(store: Any) -> None:
    s = await _open(store)
    first: list[Any] = []
    cut = anyio.Event()

    async def reader() -> None:
        async for item in follow_deltas(store, "chat", s.n):
            first.append(item)
            if sum(isinstance(x, Delta) for x in first) == 20:
                cut.set()
                return

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.sleep(0.05)
            async with s.stream(turn=1, step=1, flush_interval=0.01) as w:
                for i, word in enumerate(WORDS):
                    await w.delta(word)
                    await anyio.sleep(0.002)
                    if i == 40:
                        await cut.wait()
        last_n = max([e.n for e in first if not isinstance(e, Delta)], default=s.n - 1 - len(first))
        cursor = [d for d in first if isinstance(d, Delta)][-1].cursor
        rest: list[Any] = []
        async for item in follow_deltas(store, "chat", last_n + 1 if last_n >= 0 else 0, live_after=cursor):
            rest.append(item)
            if not isinstance(item, Delta) and item.type == "assistant/message":
                break
    assert _texts(first) + _texts(rest) == WORDS
    assert w.message is not None


async def test_a_cancelled_writer_leaves_an_interrupted_mark_and_its_chunks(store: Any) -> None:
    s = await _open(store)
    with anyio.move_on_after(0.3):
        async with s.stream(turn=1, step=1, flush_interval=0.02, grace=0.3) as w:
            for word in WORDS * 100:
                await w.delta(word)
                await anyio.sleep(0.005)
    assert w.message is None and w.interrupted is not None
    entries = await s.read()
    mark = entries[-1]
    assert mark.type == INTERRUPTED and mark.data["reason"] == "cancelled" and mark.meta == {"answer": w.answer}
    sent = [c["text"] for c in replay(entries)[w.answer]]
    assert len(sent) == mark.data["deltas"] == w.count > 0
    assert mark.data["content"] == [{"type": "text", "text": "".join(sent)}]
    assert await s.draft() is None
    if isinstance(store, RedisSessionStore):
        live = store.keys.live("chat")
        assert 0 < await store.client.pttl(live) <= 300  # gone within the grace
        await anyio.sleep(0.5)
        assert not await store.client.exists(live)
    await s.append_many([("step/end", {"turn": 1, "step": 1}), ("turn/end", {"turn": 1, "reason": "aborted"})])
    assert await s.check_invariants() == []


async def test_an_error_in_the_body_is_raised_after_the_mark(store: Any) -> None:
    s = await _open(store)
    with pytest.raises(ZeroDivisionError):
        async with s.stream(turn=1, step=1) as w:
            await w.delta("so far")
            1 / 0  # noqa: B018
    assert (await s.read())[-1].data["reason"] == "error"


async def test_get_draft_is_the_open_answer_and_set_draft_still_works(store: Any) -> None:
    s = await _open(store)
    await s.set_draft({"content": "legacy"})
    assert await s.draft() == {"content": "legacy"}
    async with s.stream(turn=1, step=1) as w:
        await w.delta("Hel")
        await w.delta("lo")
        await anyio.sleep(0.05)  # the sender pipelines in the background
        assert await s.draft() == {"answer": w.answer, "turn": 1, "step": 1, "content": "Hello"}
        assert await store.get_draft("chat", live=False) == {"content": "legacy"}
    assert await s.draft() == {"content": "legacy"}  # the answer closed: the legacy draft again
    await s.set_draft(None)
    assert await s.draft() is None


async def test_deleting_a_session_leaves_no_live_key(redis_store: RedisSessionStore) -> None:
    s = await _open(redis_store)
    live = redis_store.keys.live("chat")
    async with s.stream(turn=1, step=1) as w:
        await w.delta("x")
        await anyio.sleep(0.05)
        assert await redis_store.client.exists(live)
    assert await redis_store.delete("chat")
    # only the answer's state is left, and it expires by itself (within the grace); it names the
    # life it began in, so no later life of the id can take it for its own
    left = await redis_store.client.keys(f"{redis_store.prefix}:{{chat}}:*")
    assert [k.decode() for k in left] == [f"{live}:{w.answer}"]
    assert 0 < await redis_store.client.pttl(left[0]) <= 30_000
    # and a create never inherits a predecessor's live records
    await redis_store.live_add("again", [], expire_ms=1000)
    await redis_store.client.xadd(redis_store.keys.live("again"), {"a": "old", "i": "0", "t": "stale"})
    await redis_store.create(SessionHeader(id="again"))
    assert not await redis_store.client.exists(redis_store.keys.live("again"))


async def test_an_ephemeral_session_caps_the_live_expiry(redis_store: RedisSessionStore) -> None:
    s = await Sessions(redis_store).open("eph", ephemeral=True, ttl=2)
    async with s.stream(live_ttl=60) as w:
        await w.delta("x")
        await anyio.sleep(0.05)
        await s.enqueue("test/mark", {})  # any append refreshes the session TTL and caps the live one
        assert 0 < await redis_store.client.pttl(redis_store.keys.live("eph")) <= 2000


WRITER = """
import os, sys, anyio
from redis_session import RedisSessionStore, Sessions

from redis_session.projection.chunks import replay

async def main():
    store = RedisSessionStore.from_url(sys.argv[1], prefix=sys.argv[2])
    s = await Sessions(store).open("dead")
    await s.append_many([("turn/start", {"turn": 1}), ("step/start", {"turn": 1, "step": 1})])
    # rows go by count only (8 deltas each; the interval never comes): once the flusher waits
    # for a full row that never comes, the log holds what it flushed and the rest is only live,
    # whatever the machine's load
    async with s.stream(turn=1, step=1, flush_interval=3600, max_chunks=8) as w:
        total = 50
        for i in range(total):
            await w.delta(f"d{i} ")
        state = {}

        async def settled():
            nonlocal total
            pending = total - w._flushed
            logged = len(replay(await store.read("dead")).get(w.answer, []))
            live = sum(r.is_delta for r in await store.read_live("dead"))
            state.update(pending=pending, row=w._row, flushed=w._flushed, logged=logged, live=live)
            if w._row is not None or pending >= w.max_chunks or logged != w._flushed:
                return False
            if pending == 0:  # every delta is in a row: one more, which only the live stream holds
                await w.delta(f"d{total} ")
                total += 1
                return False
            return live == total

        try:
            with anyio.fail_after(120):
                while not await settled():
                    await anyio.sleep(0.01)
        except TimeoutError:
            print("never settled:", state, file=sys.stderr, flush=True)
            raise
        print(w.answer, total, flush=True)
        os._exit(9)              # the process dies: no exit, no close

anyio.run(main)
"""


async def test_a_writer_that_dies_is_closed_by_repair(redis_url: str, redis_store: RedisSessionStore) -> None:
    proc = await anyio.run_process(
        [sys.executable, "-c", WRITER, redis_url, redis_store.prefix],
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 9, proc.stderr
    answer, total_text = proc.stdout.decode().split()
    total = int(total_text)
    sessions = Sessions(redis_store)
    before = await redis_store.read("dead")
    flushed = len(replay(before).get(answer, []))
    assert 0 < flushed < total  # the last ones only on the live stream
    assert await sessions.repair("dead", stale_after=60) == []  # too fresh: its writer may be alive
    appended = await sessions.repair("dead", stale_after=0)
    types = [e.type for e in appended]
    assert types[-3:] == [INTERRUPTED, "step/end", "turn/end"] and CHUNK in types
    entries = await redis_store.read("dead")
    assert [c["text"] for c in replay(entries)[answer]] == [f"d{i} " for i in range(total)]
    mark = next(e for e in entries if e.type == INTERRUPTED)
    assert mark.data["reason"] == "crashed" and mark.data["deltas"] == total
    assert await redis_store.get_draft("dead") is None
    assert await sessions.repair("dead", stale_after=0) == []
    assert 0 < await redis_store.client.pttl(redis_store.keys.live("dead")) <= 60_000  # expires


async def test_sse_sends_deltas_and_resumes_them_with_last_event_id(redis_store: RedisSessionStore) -> None:
    s = await _open(redis_store)
    first: list[dict[str, Any]] = []
    with anyio.fail_after(30):
        async with (
            running_gateway(redis_store, heartbeat=5) as base,
            httpx.AsyncClient(base_url=base) as client,
            anyio.create_task_group() as tg,
        ):
            started = anyio.Event()

            async def write() -> None:
                await started.wait()
                await _stream(s, WORDS, pause=0.01, flush_interval=0.02)

            tg.start_soon(write)
            async with client.stream("GET", path("chat", "events") + "?deltas=1") as r:
                async for ev in sse(r):
                    if ev.get("comment") == "open":
                        started.set()
                    if "id" in ev:
                        first.append(ev)
                    if sum(e.get("event") == "delta" for e in first) == 25:
                        break
            last_id = first[-1]["id"]
            rest: list[dict[str, Any]] = []
            async with client.stream(
                "GET", path("chat", "events") + "?deltas=1", headers={"Last-Event-ID": last_id}
            ) as r:
                async for ev in sse(r):
                    if "id" in ev:
                        rest.append(ev)
                    if ev.get("event") is None and "data" in ev and ev["data"].get("type") == "assistant/message":
                        break
    deltas = [e["data"] for e in first + rest if e.get("event") == "delta"]
    assert [d["index"] for d in deltas] == list(range(len(WORDS)))
    assert "".join(d["text"] for d in deltas) == "".join(WORDS)
    entry_ns = [e["data"]["n"] for e in first + rest if e.get("event") is None]
    assert entry_ns == list(range(entry_ns[0], entry_ns[-1] + 1))  # entries: no gap, no repeat
    assert all("/" in e["id"] for e in rest)


async def test_the_cluster_keeps_the_live_stream_in_the_session_slot(cluster_url: str, prefix: str) -> None:
    store = RedisSessionStore.from_url(cluster_url, prefix=prefix, cluster=True)
    try:
        s = await _open(store, "clustered")
        got: list[Any] = []

        async def reader() -> None:
            async for item in follow_deltas(store, "clustered", s.n):
                got.append(item)
                if not isinstance(item, Delta) and item.type == "assistant/message":
                    return

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                await anyio.sleep(0.2)
                await _stream(s, WORDS)
        assert _texts(got) == WORDS
        assert await store.delete("clustered")
    finally:
        await store.aclose()


def test_pack_chunks_packs_runs_and_keeps_positions() -> None:
    chunk = {"type": "text-delta", "index": 0, "text": "a"}
    entries = [
        NewEntry("turn/start", {"turn": 1}),
        *[NewEntry(CHUNK, {"turn": 1, "step": 1, "chunk": {**chunk, "text": str(i)}}, time=100 + i) for i in range(5)],
        NewEntry(CHUNK, {"turn": 1, "step": 2, "chunk": {"type": "text-delta", "text": "x"}}),
        NewEntry("assistant/message", {"content": "01234"}),
    ]
    packed = pack_chunks(entries, max_chunks=3)
    types = [e.type for e in packed.entries]
    assert types == ["turn/start", CHUNK, CHUNK, CHUNK, "assistant/message"]
    assert packed.positions == [0, 1, 1, 1, 2, 2, 3, 4]
    rows = packed.entries[1:4]
    assert [r.data["seq"] for r in rows] == [1, 4, 6] and rows[0].time == 100
    assert [c["text"] for r in rows for c in unpack_row(r.data)] == ["0", "1", "2", "3", "4", "x"]
    assert rows[0].data["chunks"][0] == {**chunk, "text": "0"}  # kept as it was (index and all)
    assert rows[2].data["chunks"] == ["x"]  # a bare text delta packs to its string


def test_pack_chunks_keeps_times_and_leaves_marked_chunks_and_big_runs_apart() -> None:
    def c(text: str, time: int, **kw: object) -> NewEntry:
        return NewEntry(CHUNK, {"turn": 1, "step": 1, "chunk": {"type": "text-delta", "text": text}}, time=time, **kw)  # type: ignore[arg-type]

    entries = [c("a", 10), c("b", 13), c("c", 13), c("d", 20, meta={"ignorable": True}), c("e", 30), c("f", 30)]
    packed = pack_chunks(entries)
    assert [len(unpack_row(e.data)) for e in packed.entries] == [3, 1, 2]
    first, marked, last = packed.entries
    assert (first.time, first.data["dt"], row_times(first.time, first.data)) == (10, [3, 0], [10, 13, 13])
    assert marked is entries[3]  # a chunk with meta is no classic row: it stays as it is
    assert "dt" not in last.data and row_times(last.time, last.data) == [30, 30]
    big = [c("x" * 1000, 0) for _ in range(10)]
    assert [len(e.data["chunks"]) for e in pack_chunks(big, max_bytes=3000).entries] == [2, 2, 2, 2, 2]


async def test_memory_store_has_the_live_path_too() -> None:
    store = MemorySessionStore()
    s = await _open(store)
    w = await _stream(s, WORDS[:5])
    assert [c["text"] for c in replay(await s.read())[w.answer]] == WORDS[:5]
    assert (await store.read_live("chat"))[-1].kind == "end"


async def _cleanup(url: str, prefix: str) -> None:
    r = redis.asyncio.Redis.from_url(url)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await r.delete(*keys)
    finally:
        await r.aclose()


def test_the_short_bench_delivers_every_delta_once_and_replays_the_log(redis_url: str) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import streaming as bench  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    for way in ("raw", "stream"):
        prefix = f"benchtest{way}{uuid.uuid4().hex[:8]}"  # a shared server may hold an earlier run's keys
        try:
            res = anyio.run(bench.run_sessions, redis_url, prefix, way, [f"s{i}" for i in range(4)], 60, 200.0)
        finally:
            anyio.run(_cleanup, redis_url, prefix)
        assert res["complete"] and res["log_ok"], (way, res["incomplete"])
        assert res["deltas"] == 240


async def test_a_strict_vocabulary_accepts_the_interrupted_mark() -> None:
    """`assistant/interrupted` is part of the vocabulary: a strict store takes a cancelled answer's mark."""
    from redis_session import Sessions, Vocabulary

    store = MemorySessionStore(vocabulary=Vocabulary(strict=True))
    s = await Sessions(store).create("strict-1")
    with anyio.CancelScope() as scope:
        async with s.stream(turn=1, step=1) as w:
            await w.delta("partial")
            scope.cancel()
            await anyio.sleep(1)
    types = [e.type for e in await s.read()]
    assert types[-1] == "assistant/interrupted" and "assistant/chunk" in types


def test_a_gateway_stopped_with_sse_clients_open_stops_cleanly(redis_url: str, prefix: str) -> None:
    """SIGTERM with a viewer open (its store-wide ``/events`` and a session's
    ``?deltas=1`` stream) ends every stream and exits 0, with no 'Exception in ASGI application'."""
    import signal
    import socket
    import subprocess

    async def make() -> None:
        store = RedisSessionStore.from_url(redis_url, prefix=prefix)
        try:
            await store.create(SessionHeader(id="shut"))
        finally:
            await store.aclose()

    anyio.run(make)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from redis_session.cli.main import main; main()", "gateway", "--url", redis_url,
           "--prefix", prefix, "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the gateway did not start"
            time.sleep(0.1)
        with (
            httpx.Client(base_url=base, timeout=20) as c,
            c.stream("GET", "/events") as store_events,
            c.stream("GET", "/sessions/shut/events?deltas=1") as session_events,
        ):
            assert store_events.status_code == session_events.status_code == 200
            lines = store_events.iter_lines()
            next(lines)
            next(session_events.iter_lines())
            stopped_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for _ in lines:  # the server ends it (a browser would read on)
                pass
            _, err = proc.communicate(timeout=30)
            took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.decode()
    assert proc.returncode == 0, text[-3000:]
    assert "Exception in ASGI application" not in text and "Traceback" not in text, text[-3000:]
    assert took < 5, f"the streams were not ended at once ({took:.1f} s)"


async def test_a_delta_no_row_could_carry_is_refused_at_once_and_the_answer_closes(store: Any) -> None:
    from redis_session import InvalidEntryError

    await store.create(SessionHeader(id="bad"))
    s = await Sessions(store).open("bad")
    big = "x" * (store.max_entry_bytes + 1)
    async with s.stream(turn=1, step=1) as w:
        await w.delta("ok ")
        with pytest.raises(InvalidEntryError):
            await w.delta("a\ud800")  # a lone surrogate
        with pytest.raises(InvalidEntryError):
            await w.delta(big)
        await w.delta("done")
    assert w.message is not None and w.text == "ok done"
    types = [e.type for e in await store.read("bad")]
    assert types[-1] == "assistant/message" and INTERRUPTED not in types
    assert "\ud800" not in str([r.text for r in await store.read_live("bad") if r.is_delta])


async def test_a_chunk_row_the_store_refuses_closes_the_answer_interrupted() -> None:
    from redis_session import InvalidEntryError

    store = MemorySessionStore(max_entry_bytes=2000)
    await store.create(SessionHeader(id="rowbad"))
    s = await Sessions(store).open("rowbad")
    with pytest.raises(InvalidEntryError):
        async with s.stream(turn=1, step=1, flush_interval=0.05) as w:
            await w.delta("a" * 100)

            async def landed() -> bool:  # that row lands (alone: it waits up to 4 intervals for more)
                return [e.type for e in await store.read("rowbad")] == [CHUNK]

            await wait_for(landed)
            for _ in range(50):  # the answer fits its message (the size rule); their row does not
                await w.reasoning("b" * 10)
            with anyio.fail_after(5):
                while True:
                    await w.delta("")  # raises once the refused row is known
                    await anyio.sleep(0.02)
    types = [e.type for e in await store.read("rowbad")]
    assert types == [CHUNK, INTERRUPTED], types
    assert w.interrupted is not None
    assert any(r.kind == "end" for r in await store.read_live("rowbad"))


async def test_a_delta_is_written_to_the_server_by_delta_itself(redis_store: RedisSessionStore, redis_url: str) -> None:
    """`delta` writes the live record itself when no send is in flight: it is on the server while
    the event loop is held (no background task has run since), and every delta lands once, in
    order, whether sent by `delta` or queued behind a send in flight."""
    import redis as sync_redis

    s = await _open(redis_store)
    live = redis_store.keys.live("chat")
    probe = sync_redis.Redis.from_url(redis_url)
    try:
        async with s.stream(turn=1, step=1) as w:
            await w.delta("first ")
            # blocking the loop: only what `delta` wrote before returning can reach the server
            deadline = time.monotonic() + 10
            got: list[Any] = []
            while time.monotonic() < deadline:
                got = [r for r in _raw_records(probe.xrange(live)) if r.is_delta and r.index == 0]
                if got:
                    break
                time.sleep(0.01)  # noqa: ASYNC251 (the point: the loop is held)
            assert got and got[0].text == "first "
            for word in WORDS:  # back to back: most queue behind the send in flight
                await w.delta(word)
        records = [r for r in _raw_records(probe.xrange(live)) if r.is_delta]
    finally:
        probe.close()
    assert [r.index for r in records] == list(range(len(WORDS) + 1))
    assert "".join(r.text for r in records) == "first " + "".join(WORDS)
    assert w.message is not None and w.message.data["content"] == [{"type": "text", "text": "first " + "".join(WORDS)}]


async def test_a_small_row_waits_for_more_deltas_up_to_four_intervals(store: Any) -> None:
    """A row of fewer than half of max_chunks (32 at most) deltas is held for more, up to 4 flush
    intervals after the first: a slow answer's rows are not a few deltas each (a row costs the log
    ~120 B besides its deltas). Once that many are buffered the interval flushes as before."""
    s = await _open(store)
    async with s.stream(turn=1, step=1, flush_interval=0.25, max_chunks=64) as w:
        started = time.monotonic()
        for word in WORDS[:3]:
            await w.delta(word)

        async def one_row() -> bool:
            return any(e.type == CHUNK for e in await s.read())

        await wait_for(one_row)
        waited = time.monotonic() - started
        rows = [e for e in await s.read() if e.type == CHUNK]
        assert [len(r.data["chunks"]) for r in rows] == [3]
        assert waited >= 0.9, waited  # 4 x 0.25 s, not one interval (a loaded machine only waits longer)
        for word in WORDS[3:40]:  # 37 more at once: past the 32, the next interval flushes them
            await w.delta(word)

        async def two_rows() -> bool:
            return sum(e.type == CHUNK for e in await s.read()) >= 2

        await wait_for(two_rows)
    rows = [e for e in await s.read() if e.type == CHUNK]
    assert len(rows[1].data["chunks"]) >= 32
    assert [c["text"] for c in replay(await s.read())[w.answer]] == WORDS[:40]


@pytest.mark.parametrize("edited", ["log", "feed", "live"])
async def test_an_answer_on_a_key_of_another_kind_is_refused_before_it_writes(
    redis_store: RedisSessionStore, redis_url: str, edited: str
) -> None:
    """A log or a feed shard that is no stream (edited outside redis-session) refuses a streamed
    answer at its begin, before live records are written for nothing; a live stream replaced while the answer
    streams refuses its end before anything reaches the log (it stood after the log's rows)."""
    from redis_session import SessionError

    s = await _open(redis_store)
    keys = redis_store.keys
    name = {"log": keys.log("chat"), "feed": keys.feed(keys.feed_shard("chat")), "live": keys._k("chat", "live")}[
        edited
    ]
    raw = redis.asyncio.Redis.from_url(redis_url)
    try:
        if edited in ("log", "feed"):
            await raw.delete(name)
            await raw.set(name, "oops")
            with pytest.raises(SessionError, match="corrupt"):
                async with s.stream(turn=1, step=1) as w:
                    await w.delta("never")
            assert not await raw.exists(keys._k("chat", "live"))  # nothing of it was written
            await raw.delete(name)
            return
        with pytest.raises(SessionError, match="corrupt"):
            async with s.stream(turn=1, step=1) as w:
                await w.delta("hello")
                await raw.delete(name)
                await raw.set(name, "oops")
        assert [e.type for e in await redis_store.read("chat")] == ["turn/start", "user/message", "step/start"]
    finally:
        await raw.aclose()
