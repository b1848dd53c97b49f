"""Writer leases (acquire, renew, release, fencing) and dsh crash repair, in one process and
across OS processes (a holder killed with SIGKILL, a writer killed mid-turn)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import anyio
import pytest

from redis_session import LeaseHeldError, NewEntry, RedisSessionStore, SessionConflictError
from redis_session.projection import project
from redis_session.projection.invariants import INTERRUPTED_TEXT
from redis_session.sessions import LeaseLostError, Session, Sessions

from support import wait_for

pytestmark = pytest.mark.anyio


def open_turn_entries() -> list[NewEntry]:
    """A turn cut off after the assistant asked for two tools and one answered."""
    return [
        NewEntry("turn/start", {"turn": 1}),
        NewEntry("user/message", {"content": "list and count"}),
        NewEntry("step/start", {"turn": 1, "step": 1}),
        NewEntry(
            "assistant/message",
            {
                "turn": 1,
                "step": 1,
                "content": [
                    {"type": "text", "text": "calling"},
                    {"type": "tool-call", "id": "c1", "name": "ls", "arguments": "{}"},
                    {"type": "tool-call", "id": "c2", "name": "wc", "arguments": "{}"},
                ],
            },
        ),
        NewEntry("tool/call", {"turn": 1, "step": 1, "callId": "c1", "name": "ls", "arguments": "{}"}),
        NewEntry("tool/call", {"turn": 1, "step": 1, "callId": "c2", "name": "wc", "arguments": "{}"}),
        NewEntry(
            "tool/result",
            {"turn": 1, "step": 1, "callId": "c1", "content": "a.txt", "isError": False},
            None,
            {"surfaceOp": "append"},
        ),
    ]


async def full(store: Any, sid: str) -> list[Any]:
    head = await store.head(sid)
    return await store.read(sid, 0, head.n)


# --------------------------------------------------------------------------- lease


async def test_lease_is_exclusive_and_released_on_exit(store: Any) -> None:
    sessions = Sessions(store)
    a = await sessions.open("l")
    b = await sessions.open("l")
    async with a.lease(ttl=5) as lease:
        assert a.lease_held and lease.held and not b.lease_held
        started = time.monotonic()
        with pytest.raises(LeaseHeldError):
            async with b.lease(ttl=5):
                pytest.fail("two holders")
        assert time.monotonic() - started < 1  # fails fast, no waiting
        with pytest.raises(RuntimeError):
            async with a.lease():
                pass
        await a.append("user/message", {"content": "held"})
    assert not a.lease_held
    async with b.lease(ttl=5):
        await b.refresh()
        await b.append("user/message", {"content": "next holder"})
    assert [e.data["content"] for e in await full(store, "l")] == ["held", "next holder"]


async def test_lease_is_renewed_while_held(store: Any) -> None:
    sessions = Sessions(store)
    a = await sessions.open("renew")
    b = await sessions.open("renew")
    async with a.lease(ttl=2) as lease:
        # four renewals (one every ttl/3) are well past one ttl: only renewal keeps it. Counted,
        # not slept for: a loaded machine renews late, and the check is right after a renewal.
        seen = {lease._valid_until}

        def renewed_four_times() -> bool:
            seen.add(lease._valid_until)
            return len(seen) > 4

        await wait_for(renewed_four_times, interval=0.005)
        assert a.lease_held
        with pytest.raises(LeaseHeldError):
            async with b.lease(ttl=2):
                pass
        await a.append("user/message", {"content": "still mine"})


async def test_lease_is_released_when_the_body_fails(store: Any) -> None:
    sessions = Sessions(store)
    a = await sessions.open("fail")
    with pytest.raises(KeyError):  # the body's own exception, not an exception group
        async with a.lease(ttl=5):
            raise KeyError("boom")
    with anyio.CancelScope() as outside:
        async with a.lease(ttl=5):
            outside.cancel()  # cancelled from outside, while held
            await anyio.sleep_forever()
    async with (await sessions.open("fail")).lease(ttl=5):
        pass


async def test_writes_are_fenced_once_the_lease_is_lost(store: Any) -> None:
    sessions = Sessions(store)
    a = await sessions.open("fence")
    b = await sessions.open("fence")
    async with a.lease(ttl=3) as lease:
        await a.append("user/message", {"content": "1"})
        # the lease runs out (e.g. a long GC pause) and another writer takes it
        assert await store.release_lease("fence", lease.token)
        async with b.lease(ttl=5):
            await b.refresh()
            await wait_for(lambda: not a.lease_held)  # the renewal task notices the takeover
            with pytest.raises(LeaseLostError):
                await a.append("user/message", {"content": "zombie"})
            await b.append("user/message", {"content": "2"})
    assert [e.data["content"] for e in await full(store, "fence")] == ["1", "2"]
    # a lease that merely ran past its validity window fences too (checked locally, no round trip)
    async with a.lease(ttl=5) as lease:
        await a.refresh()
        lease._valid_until = 0.0
        with pytest.raises(LeaseLostError):
            await a.append("user/message", {"content": "late"})
    assert (await store.head("fence")).n == 2


async def test_expected_n_is_the_real_fence(store: Any) -> None:
    """A stale holder whose write slips past the local check still cannot interleave."""
    sessions = Sessions(store)
    old = await sessions.open("real")
    new = await sessions.open("real")
    async with new.lease(ttl=5):
        await new.append("user/message", {"content": "new holder"})
    with pytest.raises(SessionConflictError):
        await old.append("user/message", {"content": "stale"})


LEASE_HOLDER = """
import sys, anyio
from redis_session import RedisSessionStore
from redis_session.sessions import Sessions
url, prefix, sid, ttl = sys.argv[1:5]
async def main():
    store = RedisSessionStore.from_url(url, prefix=prefix)
    s = await Sessions(store).open(sid)
    async with s.lease(ttl=float(ttl)):
        print("held", flush=True)
        line = await anyio.to_thread.run_sync(sys.stdin.readline)
        if line.strip() == "die":
            import os, signal
            os.kill(os.getpid(), signal.SIGKILL)
    print("released", flush=True)
    await store.aclose()
anyio.run(main)
"""


async def _start(script: str, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(  # noqa: ASYNC220 - a long-lived child we talk to line by line
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc


async def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    with anyio.fail_after(60):
        return (await anyio.to_thread.run_sync(proc.stdout.readline)).strip()


async def _tell(proc: subprocess.Popen[str], text: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(text + "\n")
    proc.stdin.flush()


async def _wait(proc: subprocess.Popen[str]) -> int:
    with anyio.fail_after(60):
        return await anyio.to_thread.run_sync(proc.wait)


async def test_lease_contention_between_two_processes(redis_url: str, prefix: str) -> None:
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    sessions = Sessions(store)
    try:
        me = await sessions.open("contended")
        # ttls long enough that a loaded machine's child process renews in time
        proc = await _start(LEASE_HOLDER, redis_url, prefix, "contended", "1.5")
        try:
            assert await _line(proc) == "held"
            for _ in range(4):  # across two of its ttls: it keeps renewing from its process
                with pytest.raises(LeaseHeldError):
                    async with me.lease(ttl=1):
                        pass
                await anyio.sleep(0.8)  # time passing is what is tested
            await _tell(proc, "release")
            assert await _line(proc) == "released"
            assert await _wait(proc) == 0
        finally:
            proc.kill()
        async with me.lease(ttl=1):
            await me.append("user/message", {"content": "mine now"})
        # a holder killed outright stops renewing: its lease lapses after its ttl
        proc = await _start(LEASE_HOLDER, redis_url, prefix, "contended", "3.0")
        try:
            assert await _line(proc) == "held"
            await _tell(proc, "die")
            assert await _wait(proc) == -signal.SIGKILL
        finally:
            proc.kill()
        with pytest.raises(LeaseHeldError):
            async with me.lease(ttl=1):
                pass
        with anyio.fail_after(60):
            while True:
                try:
                    async with me.lease(ttl=1):
                        break
                except LeaseHeldError:
                    await anyio.sleep(0.05)
    finally:
        await store.aclose()


# --------------------------------------------------------------------------- repair


def _check_closers(appended: list[Any], first_n: int, call2_n: int) -> None:
    assert [e.type for e in appended] == ["tool/result", "step/end", "turn/end"]
    assert [e.n for e in appended] == [first_n, first_n + 1, first_n + 2]
    result = appended[0]
    assert result.data["callId"] == "c2" and result.data["isError"] is True
    assert result.data["error"] == {"name": "InterruptedError", "code": "interrupted"}
    assert result.data["content"] == [{"type": "text", "text": INTERRUPTED_TEXT}]
    assert result.surface is not None and result.surface.source_event_seqs == [call2_n]
    assert appended[2].data == {"turn": 1, "reason": {"kind": "interrupted"}}
    assert len({e.time for e in appended}) == 1


async def test_repair_closes_an_open_turn(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("crash")
    await s.append_many(open_turn_entries())
    assert await sessions.repair("crash") != []
    log = await full(store, "crash")
    _check_closers(log[7:], 7, 5)
    assert log[7].time == log[6].time
    fresh = await sessions.open("crash")
    assert await fresh.check_invariants() == []
    assert await fresh.messages() == project(log)
    assert await sessions.repair("crash") == []  # balanced now
    await s.refresh()
    assert await s.repair() == []


async def test_repair_of_a_balanced_or_empty_session_is_a_no_op(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("fine")
    assert await sessions.repair("fine") == []
    await s.append_many([("turn/start", {"turn": 1}), ("turn/end", {"turn": 1, "reason": "completed"})])
    other = await sessions.open("fine")
    async with other.lease(ttl=5):  # even with a live writer: nothing to close, nothing refused
        assert await sessions.repair("fine") == []


async def test_repair_never_touches_a_live_writer(store: Any) -> None:
    sessions = Sessions(store)
    writer = await sessions.open("live")
    async with writer.lease(ttl=5):
        await writer.append_many(open_turn_entries())
        with pytest.raises(LeaseHeldError):
            await sessions.repair("live")
        assert (await store.head("live")).n == 7
        # the holder itself (a restarted writer that re-took its lease) may close its own turn
        closed = await writer.repair()
        _check_closers(closed, 7, 5)
        assert writer.n == 10 and await writer.check_invariants() == []


async def test_repair_rechecks_after_a_conflict(store: Any) -> None:
    """The writer comes back between repair's read and its append: repair sees the turn closed."""
    sessions = Sessions(store)
    s = await sessions.open("race")
    await s.append_many(open_turn_entries())
    writer = await sessions.open("race")
    acquired = 0

    class Racy:
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        async def acquire_lease(self, session_id: str, token: str, ttl_ms: int, **kw: Any) -> bool:
            nonlocal acquired
            acquired += 1
            if acquired == 1:
                await writer.append_many(
                    [
                        NewEntry("tool/result", {"turn": 1, "step": 1, "callId": "c2", "content": "3"}),
                        NewEntry("step/end", {"turn": 1, "step": 1}),
                        NewEntry("turn/end", {"turn": 1, "reason": "completed"}),
                    ]
                )
            ok: bool = await store.acquire_lease(session_id, token, ttl_ms)
            return ok

    assert await Sessions(Racy()).repair("race") == []  # type: ignore[arg-type]
    log = await full(store, "race")
    assert [e.type for e in log[7:]] == ["tool/result", "step/end", "turn/end"]
    assert log[-1].data["reason"] == "completed"
    assert acquired == 1


KILLED_WRITER = """
import os, signal, sys, anyio
from redis_session import RedisSessionStore
from redis_session.sessions import Sessions
url, prefix, sid = sys.argv[1:4]
async def main():
    store = RedisSessionStore.from_url(url, prefix=prefix)
    s = await Sessions(store).open(sid)
    async with s.lease(ttl=3.0):  # long enough to be renewed on a loaded machine, short to lapse
        await s.append("turn/start", {"turn": 1})
        await s.append("user/message", {"content": "list and count"})
        await s.append("step/start", {"turn": 1, "step": 1})
        await s.commit({"turn": 1, "step": 1, "content": [
            {"type": "tool-call", "id": "c1", "name": "ls", "arguments": "{}"},
            {"type": "tool-call", "id": "c2", "name": "wc", "arguments": "{}"}]})
        await s.append("tool/call", {"turn": 1, "step": 1, "callId": "c1", "name": "ls", "arguments": "{}"})
        await s.set_draft({"content": "half a tho"})
        print(s.n, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the pod dies mid-turn, lease and all
anyio.run(main)
"""


async def test_repair_after_the_writer_process_is_killed(redis_url: str, prefix: str) -> None:
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    sessions = Sessions(store)
    try:
        proc = await _start(KILLED_WRITER, redis_url, prefix, "killed")
        try:
            assert await _line(proc) == "5"
            assert await _wait(proc) == -signal.SIGKILL
        finally:
            proc.kill()
        assert (await store.head("killed")).n == 5
        with pytest.raises(LeaseHeldError):  # its lease has not lapsed yet: it might be alive
            await sessions.repair("killed")
        with anyio.fail_after(60):
            while True:
                try:
                    closed = await sessions.repair("killed")
                    break
                except LeaseHeldError:
                    await anyio.sleep(0.05)
        types = [e.type for e in closed]
        assert types == ["tool/result", "tool/result", "step/end", "turn/end"]
        assert [e.data["callId"] for e in closed[:2]] == ["c1", "c2"]
        assert closed[0].surface is not None and closed[0].surface.source_event_seqs == [4]
        assert closed[1].surface is not None and closed[1].surface.source_event_seqs is None  # no tool/call logged
        s = await sessions.open("killed")
        assert s.n == 9 and await s.check_invariants() == []
        msgs = await s.messages()
        assert [m.role for m in msgs] == ["user", "assistant", "tool", "tool"]
        assert msgs[-1].content[0]["isError"] is True
        async with s.lease(ttl=5):  # the session is writable again, from the next n
            await s.append("turn/start", {"turn": 2})
        assert [e.n for e in await full(store, "killed")] == list(range(10))
    finally:
        await store.aclose()


async def test_session_handle_repair_with_a_transient_lease(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("h")
    await s.append_many(open_turn_entries())
    stale: Session = await sessions.open("h")
    await s.append("assistant/chunk", {"turn": 1, "step": 1, "chunk": {"text": "x"}})
    closed = await stale.repair()  # refreshes first, so the stale handle does not conflict
    _check_closers(closed, 8, 5)
    assert stale.n == 11
    # the repair's lease is gone: a writer can take the session at once
    async with s.lease(ttl=5):
        pass
