"""A streamed answer cancelled while one of its writes is in flight: the write runs to its end
and the writer knows what it did. Cancelled during the begin, an answer that began is closed at
once as interrupted (no begun answer is left open for a repair to find after its turn ended);
cancelled during the close, the handle still moves past the entry that landed.

The pause is injected after the real write (the server has it, the reply is "in flight" for the
caller), so the cancellation lands at that await every time, not by luck of timing."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from redis_session import RedisSessionStore, Sessions
from redis_session.projection.chunks import open_answers

pytestmark = pytest.mark.anyio


class _PausingStore(RedisSessionStore):
    """The real store; after `pause_after`'s write has run, its reply waits for `release`."""

    pause_after: str = ""
    landed: asyncio.Event
    release: asyncio.Event

    async def _paused(self, name: str, result: Any) -> Any:
        if name == self.pause_after:
            self.landed.set()
            await self.release.wait()
        return result

    async def answer_begin(self, *args: Any, **kwargs: Any) -> Any:
        return await self._paused("begin", await super().answer_begin(*args, **kwargs))

    async def answer_end(self, *args: Any, **kwargs: Any) -> Any:
        return await self._paused("end", await super().answer_end(*args, **kwargs))


def _store(url: str, prefix: str, pause_after: str) -> _PausingStore:
    store = _PausingStore.from_url(url, prefix=prefix)
    assert isinstance(store, _PausingStore)
    store.pause_after, store.landed, store.release = pause_after, asyncio.Event(), asyncio.Event()
    return store


async def test_cancelled_during_its_begin_the_answer_is_closed_interrupted_at_once(redis_url: str, prefix: str) -> None:
    store = _store(redis_url, prefix, "begin")
    async with Sessions(store) as sessions:
        s = await sessions.open("c-begin")
        await s.append("turn/start", {"turn": 1})

        async def writer() -> None:
            async with s.stream(turn=1, step=1) as w:
                await w.delta("never sent")

        task = asyncio.create_task(writer())
        await store.landed.wait()  # the begin is on the server; its reply is in flight
        task.cancel()
        await asyncio.sleep(0)
        store.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

        records = await store.read_live("c-begin")
        assert [r.kind for r in records if r.kind in ("begin", "end")] == ["begin", "end"]
        assert open_answers(records) == {}
        log = await store.read("c-begin")
        assert [e.type for e in log] == ["turn/start", "assistant/interrupted"]
        assert log[-1].data["reason"] == "cancelled"
        assert await store.get_draft("c-begin") is None
        assert s.n == len(log)  # the handle is past the mark
        await s.append("turn/end", {"turn": 1, "reason": "completed"})  # and writes on
        assert await s.repair() == []  # nothing left for a repair


async def test_cancelled_during_its_close_the_handle_is_past_the_message(redis_url: str, prefix: str) -> None:
    store = _store(redis_url, prefix, "end")
    async with Sessions(store) as sessions:
        s = await sessions.open("c-end")
        await s.append("turn/start", {"turn": 1})
        entered = anyio.Event()

        async def writer() -> None:
            async with s.stream(turn=1, step=1) as w:
                await w.delta("Hel")
                await w.delta("lo")
                entered.set()

        task = asyncio.create_task(writer())
        await store.landed.wait()  # the message is on the server; the end's reply is in flight
        assert entered.is_set()
        task.cancel()
        await asyncio.sleep(0)
        store.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

        log = await store.read("c-end")
        assert log[-1].type == "assistant/message"
        assert log[-1].data["content"] == [{"type": "text", "text": "Hello"}]
        assert s.n == len(log)  # the handle moved past the message that landed
        [after] = await s.append("turn/end", {"turn": 1, "reason": "completed"})  # no SessionConflictError
        assert after.n == len(log)


async def test_an_anyio_cancel_scope_around_the_block_does_not_cut_its_close_short(redis_url: str, prefix: str) -> None:
    # an anyio scope re-delivers its cancellation at every await: the close still runs to its end
    store = _store(redis_url, prefix, "end")
    async with Sessions(store) as sessions:
        s = await sessions.open("c-scope")
        with anyio.CancelScope() as scope:
            async with s.stream() as w:
                await w.delta("partial")
                scope.cancel()
                store.release.set()  # no pause: the scope's cancellation hits the close itself
                await anyio.sleep(1)
        assert scope.cancelled_caught
        log = await store.read("c-scope")
        assert log[-1].type == "assistant/interrupted"
        assert s.n == len(log)
        await s.append("user/message", {"content": "next"})


async def test_a_writer_that_never_yields_still_gets_rows_and_a_close(redis_url: str, prefix: str) -> None:
    """A caller that sends deltas in a tight loop (tokens from memory: nothing else awaited) used
    to starve the sender and the rows' flusher: no chunk row was written, the deltas piled up in
    memory, and the close (one row of everything, over the entry limit) failed, leaving the
    answer open. Now each delta gives the loop a turn, a log that trails by a few rows holds the
    caller, and the close carries at most one row: the answer closes, every delta in its rows."""
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    async with Sessions(store) as sessions:
        s = await sessions.open("tight")
        async with s.stream(turn=1, step=1) as w:
            for i in range(3000):
                await w.delta(f"d{i}.")
        log = await store.read("tight")
        rows = [e for e in log if e.type == "assistant/chunk"]
        assert len(rows) >= 3000 // 64  # written along the way, each within the row size
        assert log[-1].type == "assistant/message"
        assert log[-1].data["content"][0]["text"] == "".join(f"d{i}." for i in range(3000))


async def test_a_tight_writer_refused_at_the_budget_ends_interrupted_with_what_it_has(
    redis_url: str, prefix: str
) -> None:
    from redis_session import AnswerTooLargeError

    store = RedisSessionStore.from_url(redis_url, prefix=prefix, max_entry_bytes=64 * 1024)
    async with Sessions(store) as sessions:
        s = await sessions.open("budget")
        sent = 0
        with pytest.raises(AnswerTooLargeError):
            async with s.stream(turn=1, step=1) as w:
                while True:
                    await w.delta(f"delta {sent:06d} ")
                    sent += 1
        log = await store.read("budget")
        assert log[-1].type == "assistant/interrupted"
        chunks = sum(len(e.data["chunks"]) for e in log if e.type == "assistant/chunk")
        assert chunks == sent  # every delta the writer was not refused is in the rows
        assert open_answers(await store.read_live("budget")) == {}
