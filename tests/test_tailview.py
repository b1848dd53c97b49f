"""The terminal tail on a real store: readable output, chunks forming the text inline, and no
entry lost or repeated across dropped connections (killed clients, a restarted server)."""

from __future__ import annotations

import re
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from rich.console import Console

from redis_session import RedisSessionStore, SessionHeader, SessionNotFoundError
from redis_session.cli.tailview import chunk_text, follow, run_tail
from redis_session.redis.embedded import start_server

from support import blocked_in_xread, wait_blocked_in_xread, wait_for

pytestmark = pytest.mark.anyio


def console() -> Console:
    return Console(record=True, width=160, color_system=None)


def marks_in_order(text: str, count: int) -> None:
    """Each mark {"i": k} printed exactly once, in order."""
    found = [int(m) for m in re.findall(r'\{"i":(\d+)\}', text)]
    assert found == list(range(count)), found


async def write_marks(store: Any, sid: str, count: int, pause: float = 0.0, first: int = 0) -> None:
    for i in range(first, first + count):
        await store.put(sid, None, [("test/mark", {"i": i})])
        if pause:
            await anyio.sleep(pause)


CONVERSATION: list[tuple[str, dict[str, Any]]] = [
    ("turn/start", {"turn": 1}),
    ("user/message", {"content": "what is 1+1?"}),
    ("assistant/chunk", {"turn": 1, "step": 1, "chunk": {"type": "text-delta", "text": "It is"}}),
    ("assistant/chunk", {"turn": 1, "step": 1, "chunk": {"type": "text-delta", "text": " 2"}}),
    ("assistant/chunk", {"turn": 1, "step": 1, "chunk": {"type": "text-delta", "text": ", surely."}}),
    ("assistant/message", {"content": [{"type": "text", "text": "It is 2, surely."}]}),
    ("tool/call", {"callId": "c1", "name": "calc", "arguments": '{"x":"1+1"}'}),
    ("tool/result", {"callId": "c1", "content": "2"}),
    ("turn/end", {"turn": 1, "reason": "completed"}),
    (
        "cut",
        {"before": 9, "reason": "compaction", "summary": [{"role": "user", "content": "asked for 1+1; got 2"}]},
    ),
]


async def test_renders_entries_with_chunks_inline(redis_store: RedisSessionStore) -> None:
    await redis_store.create(SessionHeader(id="c", title="arith"), CONVERSATION)
    out = console()
    with anyio.fail_after(60):
        nxt = await run_tail(redis_store, "c", start=0, console=out, stop_after=len(CONVERSATION))
    assert nxt == len(CONVERSATION)
    text = out.export_text()
    assert "following c — arith: n=10, from 0" in text
    lines = text.splitlines()
    stream = next(line for line in lines if "assistant ▸" in line)
    assert stream.endswith("assistant ▸ It is 2, surely.")  # three chunks, one line
    assert re.search(r"\s1 \S+ user/message\s+what is 1\+1\?", text)
    assert re.search(r"assistant/message\s+✓ 16 chars streamed", text)
    assert re.search(r"tool/call\s+calc\(\{\"x\":\"1\+1\"\}\)\s+\[c1\]", text)
    assert re.search(r"tool/result\s+c1: 2", text)
    assert re.search(r"cut\s+before=9 reason=compaction summary=1 message", text)


async def test_messages_mode_shows_the_conversation(redis_store: RedisSessionStore) -> None:
    await redis_store.create(SessionHeader(id="m"), CONVERSATION)
    out = console()
    with anyio.fail_after(60):
        await run_tail(redis_store, "m", start=0, messages=True, console=out, stop_after=len(CONVERSATION))
    text = out.export_text()
    assert re.search(r"user what is 1\+1\?", text)
    assert "assistant ▸ It is 2, surely." in text
    assert re.search(r"assistant → calc", text) is None  # the tool call rides on the tool/call mark only
    assert re.search(r"tool ← 2", text)
    assert "compacted at n=9" in text and re.search(r"user asked for 1\+1; got 2", text)
    assert "turn/start" not in text and "test/mark" not in text


async def test_follows_live_appends_from_the_end(redis_store: RedisSessionStore, redis_url: str, prefix: str) -> None:
    await redis_store.create(SessionHeader(id="live"), [("test/old", {"old": True})])
    out = console()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_tail(redis_store, "live", console=out, stop_after=30))
            await wait_blocked_in_xread(redis_url, prefix)  # the tail is at the end and waiting
            await write_marks(redis_store, "live", 30, pause=0.002)
    text = out.export_text()
    assert "from 1" in text and "test/old" not in text  # default: the end
    marks_in_order(text, 30)


async def test_resumes_after_killed_connections_without_gap_or_repeat(
    redis_url: str, prefix: str, redis_store: RedisSessionStore, raw_redis: aioredis.Redis
) -> None:
    """The tail's client is killed server-side (CLIENT KILL) several times while a writer appends;
    redis-py's own retries are off, so the tail sees every drop and must resume by itself."""
    name = f"tail-{prefix}"
    tail_store = RedisSessionStore.from_url(
        redis_url, prefix=prefix, client_options={"client_name": name, "retry": Retry(NoBackoff(), 0)}
    )
    await redis_store.create(SessionHeader(id="k"))
    total, kills = 80, 0
    out = console()
    try:
        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    lambda: run_tail(tail_store, "k", start=0, console=out, stop_after=total, max_backoff=0.2)
                )
                for i in range(total):
                    await redis_store.put("k", None, [("test/mark", {"i": i})])
                    if i % 20 == 10:
                        await wait_blocked_in_xread(redis_url, name)  # the tail caught up, in XREAD again
                        for cid in await blocked_in_xread(redis_url, name):
                            await raw_redis.client_kill_filter(_id=str(cid))
                            kills += 1
                    await anyio.sleep(0.003)  # a pace, not a synchronisation
    finally:
        await tail_store.aclose()
    text = out.export_text()
    assert kills >= 4
    # each drop is absorbed either by the store's one retry on a fresh connection or by the
    # tail's own reconnect ("connection lost"): either way nothing is lost or repeated
    marks_in_order(text, total)


async def test_follow_survives_a_server_restart(tmp_path: Any) -> None:
    server = await anyio.to_thread.run_sync(lambda: start_server(tmp_path, appendonly=True, appendfsync="always"))
    store = RedisSessionStore.from_url(server.url, prefix="t")
    retries: list[int] = []
    got: list[int] = []
    caught_up = anyio.Event()
    try:
        await store.create(SessionHeader(id="r"))
        await write_marks(store, "r", 5)

        async def read() -> None:
            async for e in follow(store, "r", 0, on_retry=lambda exc, wait, at: retries.append(at), max_backoff=0.3):
                got.append(e.n)
                if e.n == 4:
                    caught_up.set()
                if e.n == 9:
                    return

        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await caught_up.wait()
                await anyio.to_thread.run_sync(server.stop)
                await wait_for(lambda: bool(retries))  # the tail is retrying against a dead port now
                server = await anyio.to_thread.run_sync(
                    lambda: start_server(tmp_path, port=server.port, appendonly=True, appendfsync="always")
                )
                await write_marks(store, "r", 5, first=5)
    finally:
        await store.aclose()
        await anyio.to_thread.run_sync(server.stop)
    assert got == list(range(10))
    assert retries and set(retries) == {5}


async def test_ends_when_the_session_is_deleted(redis_store: RedisSessionStore, redis_url: str, prefix: str) -> None:
    redis_store.block_ms = 100
    await redis_store.create(SessionHeader(id="gone"), [("test/mark", {"i": 0})])
    out = console()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_tail(redis_store, "gone", start=0, console=out))
            await wait_blocked_in_xread(redis_url, prefix)  # following, past the backlog
            await redis_store.delete("gone")
    assert "session gone was deleted" in out.export_text()


async def test_unknown_session_raises(redis_store: RedisSessionStore) -> None:
    with pytest.raises(SessionNotFoundError):
        await run_tail(redis_store, "nope", console=console())


def test_chunk_shapes() -> None:
    assert chunk_text({"chunk": "a"}) == ("a", False)
    assert chunk_text({"turn": 1, "step": 1, "chunk": {"type": "text-delta", "text": "b"}}) == ("b", False)
    assert chunk_text({"chunk": {"type": "text-delta", "textDelta": "c"}}) == ("c", False)
    assert chunk_text({"chunk": {"type": "reasoning-delta", "text": "r"}}) == ("r", True)
    assert chunk_text({"delta": {"content": "d"}}) == ("d", False)  # the tutorial harness
    assert chunk_text({"chunk": {"choices": [{"delta": {"content": "e"}}]}}) == ("e", False)
    assert chunk_text({"chunk": {"choices": [{"delta": {"reasoning_content": "f"}}]}}) == ("f", True)
    assert chunk_text({"chunk": {"type": "tool-call-delta", "id": "x"}}) is None
    assert chunk_text({"chunk": None}) is None


async def test_a_change_to_block_ms_takes_effect_on_the_next_block(tmp_path: Any) -> None:
    """`store.block_ms` set after the store was made is what the next XREAD blocks for: a tail on a
    store made to block 50 s, told 100 ms, returns to the server again and again (its own
    server's INFO commandstats counts the XREADs), not once in 50 s."""
    server = await anyio.to_thread.run_sync(lambda: start_server(tmp_path, appendonly=False))
    store = RedisSessionStore.from_url(server.url, prefix="t", block_ms=50_000, client_options={"socket_timeout": 60})
    admin = aioredis.Redis.from_url(server.url)

    async def xreads() -> int:
        return int((await admin.info("commandstats")).get("cmdstat_xread", {}).get("calls", 0))

    try:
        await store.create(SessionHeader(id="b"))
        store.block_ms = 100

        async def read() -> None:
            async for _ in store.tail("b", 0):
                pass

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await wait_for(lambda: _at_least(xreads(), 5), within=40)  # 50 s blocks: one call
                tg.cancel_scope.cancel()
    finally:
        await admin.aclose()
        await store.aclose()
        await anyio.to_thread.run_sync(server.stop)


async def _at_least(value: Any, want: int) -> bool:
    return int(await value) >= want
