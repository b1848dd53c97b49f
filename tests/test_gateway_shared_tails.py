"""The SSE streams of one session share one live tail (`gateway.tails`): one XREAD BLOCK per
followed session, whatever the number of readers. Sharing must change nothing a reader gets:
every entry once and in order for a reader that joins at any moment, a slow reader that slows no
one else, a deleted or re-created id that ends every stream (never the new life's entries), a
killed Redis connection resumed without gap, and a pool limit that counts sessions, not readers."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest
import redis.asyncio as aioredis
from test_gateway import sse as events

from redis_session import RedisSessionStore, SessionHeader

from support import running_gateway, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


def path(session_id: str, sub: str = "events") -> str:
    return f"/sessions/{session_id}/{sub}"


@pytest.fixture
async def named_store(redis_url: str, prefix: str) -> AsyncIterator[tuple[RedisSessionStore, str]]:
    """A store whose connections carry a name of their own, so the test can count its XREADs."""
    name = f"rs-tails-{uuid.uuid4().hex[:10]}"
    store = RedisSessionStore.from_url(
        redis_url, prefix=prefix, client_options={"client_name": name, "max_connections": 40}
    )
    store.block_ms = 1000
    try:
        yield store, name
    finally:
        await store.aclose()


async def blocked_xreads(redis_url: str, name: str) -> list[int]:
    """The ids of this store's connections now in XREAD."""
    r = aioredis.Redis.from_url(redis_url)
    try:
        out = await r.execute_command("CLIENT", "LIST")
    finally:
        await r.aclose()
    text = out.decode() if isinstance(out, bytes) else str(out)
    ids = []
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("name") == name and fields.get("cmd") == "xread":
            ids.append(int(fields["id"]))
    return ids


async def read_until(client: httpx.AsyncClient, url: str, last: int, got: list[int], ended: list[str]) -> None:
    """Every entry's n into `got` until n == `last`, or how the stream ended into `ended`."""
    async with client.stream("GET", url) as r:
        assert r.status_code == 200, r.text
        async for ev in events(r):
            if ev.get("event") in ("end", "replaced", "error"):
                ended.append(ev["event"])
                return
            if "id" in ev and "event" not in ev:
                got.append(ev["data"]["n"])
                if got[-1] >= last:
                    return


def contiguous(got: list[int], start: int, last: int) -> bool:
    return got == list(range(start, last + 1))


async def test_the_streams_of_a_session_share_one_tail_and_each_gets_every_entry_once(
    named_store: tuple[RedisSessionStore, str], redis_url: str
) -> None:
    store, name = named_store
    sids = [f"share-{i}" for i in range(3)]
    for sid in sids:
        await store.create(SessionHeader(id=sid), [("user/message", {"content": "hi"})])
    total = 40
    async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        results: list[tuple[int, list[int], list[str]]] = []
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(30):
                    sid, start = sids[i % 3], i % 2  # half read the backlog, half start after it
                    got: list[int] = []
                    ended: list[str] = []
                    results.append((start, got, ended))
                    tg.start_soon(read_until, client, path(sid) + f"?start={start}", total, got, ended)
                # every stream open and past its backlog: one XREAD per session, not per reader
                await wait_for(lambda: all(r[1] or r[0] == 1 for r in results), within=60)
                await wait_for(lambda: _len(blocked_xreads(redis_url, name), 3), within=60)
                for k in range(1, total + 1):
                    for sid in sids:
                        await store.put(sid, k, [("test/mark", {"k": k})])
        for start, got, ended in results:
            assert ended == [] and contiguous(got, start, total), (start, got[:5], got[-5:], ended)
        # the last reader gone, its tail is stopped: no XREAD left behind
        await wait_for(lambda: _len(blocked_xreads(redis_url, name), 0), within=30)


async def _len(ids: Any, want: int) -> bool:
    return len(await ids) == want


async def test_a_stream_joining_while_entries_land_misses_none_and_repeats_none(
    named_store: tuple[RedisSessionStore, str],
) -> None:
    store, _ = named_store
    sid = "join-race"
    await store.create(SessionHeader(id=sid))
    total = 300
    async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        results: list[tuple[int, list[int], list[str]]] = []
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:

                async def writer() -> None:
                    for k in range(total + 1):
                        await store.put(sid, k, [("test/mark", {"k": k})])
                        if k % 7 == 0:
                            await anyio.sleep(0.002)

                tg.start_soon(writer)
                for i in range(24):  # joining all along the writes, from the start or from "now"
                    head = await store.head(sid)
                    start = 0 if i % 3 == 0 else (head.n if head else 0)
                    got: list[int] = []
                    ended: list[str] = []
                    results.append((start, got, ended))
                    tg.start_soon(read_until, client, path(sid) + f"?start={start}", total, got, ended)
                    await anyio.sleep(0.01 * (i % 4))
        for start, got, ended in results:
            assert ended == [] and contiguous(got, start, total), (start, got[:5], got[-5:], ended)


async def test_a_reader_that_stops_reading_slows_no_one_and_later_gets_everything(
    named_store: tuple[RedisSessionStore, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis_session.gateway import tails

    monkeypatch.setattr(tails.Tails, "QUEUE", 16)  # detach it early: the queue, not the socket, fills
    store, _ = named_store
    sid = "slow"
    await store.create(SessionHeader(id=sid))
    total, pad = 1200, "x" * 4000  # ~5 MB of events: more than the sockets of a stuck reader hold
    async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        port = int(base.rsplit(":", 1)[1])
        slow = await anyio.connect_tcp("127.0.0.1", port)
        await slow.send(f"GET {path(sid)} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        got: list[int] = []
        ended: list[str] = []
        with anyio.fail_after(180):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read_until, client, path(sid), total - 1, got, ended)
                await anyio.sleep(0.3)
                for k in range(0, total, 20):
                    await store.put(sid, k, [("test/mark", {"k": k + j, "pad": pad}) for j in range(20)])
            # the fast reader had it all while the slow one read nothing
            missing = sorted(set(range(total)) - set(got))[:10]
            assert ended == [] and contiguous(got, 0, total - 1), (len(got), len(set(got)), missing)
            # now the slow one reads: every entry, once, in order
            buf = b""
            seen: list[int] = []
            while not seen or seen[-1] < total - 1:
                buf += await slow.receive(1 << 20)
                *done, buf = buf.split(b"\n\n")
                for ev in done:
                    for line in ev.split(b"\n"):
                        if line.startswith(b"data: {") and b'"n":' in line:
                            seen.append(json.loads(line[6:])["n"])
        await slow.aclose()
        assert contiguous(seen, 0, total - 1), (seen[:5], seen[-5:], len(seen))


async def test_a_deleted_and_recreated_id_ends_every_shared_stream_and_a_new_one_follows_the_new_life(
    named_store: tuple[RedisSessionStore, str],
) -> None:
    store, _ = named_store
    sid = "relife"
    await store.create(SessionHeader(id=sid), [("user/message", {"content": "OLD-0"})])
    async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        contents: list[list[str]] = [[] for _ in range(8)]
        ends: list[list[str]] = [[] for _ in range(8)]

        async def reader(i: int) -> None:
            async with client.stream("GET", path(sid)) as r:
                async for ev in events(r):
                    if ev.get("event") in ("end", "replaced", "error"):
                        ends[i].append(ev["event"])
                        return
                    if "id" in ev and "event" not in ev:
                        contents[i].append(ev["data"]["data"]["content"])

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(reader, i)
                await wait_for(lambda: all(c == ["OLD-0"] for c in contents), within=30)
                await store.delete(sid)
                await store.create(SessionHeader(id=sid), [("user/message", {"content": f"NEW-{k}"}) for k in range(3)])
        for c, e in zip(contents, ends, strict=True):
            assert c == ["OLD-0"] and e in (["end"], ["replaced"]), (c, e)
        got: list[int] = []
        with anyio.fail_after(30):
            await read_until(client, path(sid), 2, got, [])
        assert got == [0, 1, 2]


async def test_a_killed_tail_connection_is_resumed_for_every_stream_without_gap(
    named_store: tuple[RedisSessionStore, str], redis_url: str
) -> None:
    store, name = named_store
    sid = "killed"
    await store.create(SessionHeader(id=sid))
    total = 60
    async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        results = [([], []) for _ in range(10)]  # type: list[tuple[list[int], list[str]]]
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for got, ended in results:
                    tg.start_soon(read_until, client, path(sid), total - 1, got, ended)
                await wait_for(lambda: _len(blocked_xreads(redis_url, name), 1), within=30)
                for k in range(total):
                    if k in (20, 40):
                        r = aioredis.Redis.from_url(redis_url)
                        for cid in await blocked_xreads(redis_url, name):
                            await r.execute_command("CLIENT", "KILL", "ID", cid)
                        await r.aclose()
                    await store.put(sid, k, [("test/mark", {"k": k})])
        for got, ended in results:
            assert ended == [] and contiguous(got, 0, total - 1), (got, ended)


async def test_the_pool_limit_counts_followed_sessions_not_readers(redis_url: str, prefix: str) -> None:
    store = RedisSessionStore.from_url(redis_url, prefix=prefix, client_options={"max_connections": 12})
    store.block_ms = 1000
    limit = 12 - 4  # the pool less a margin for the short commands
    try:
        for i in range(limit + 1):
            await store.create(SessionHeader(id=f"cap-{i}"))
        async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
            async with contextlib_stack() as stack:
                for i in range(limit):  # one stream per session, up to the limit
                    r = await stack.enter_async_context(client.stream("GET", path(f"cap-{i}")))
                    assert r.status_code == 200
                for _ in range(20):  # more readers of a followed session cost no connection
                    r = await stack.enter_async_context(client.stream("GET", path("cap-0")))
                    assert r.status_code == 200
                r = await client.get(path(f"cap-{limit}"))  # one more session would need one
                assert r.status_code == 503 and r.json()["error"] == "busy"
    finally:
        await store.aclose()


def contextlib_stack() -> Any:
    import contextlib

    return contextlib.AsyncExitStack()


async def test_the_streams_of_a_session_share_one_draft_poll_and_each_sees_the_draft(
    named_store: tuple[RedisSessionStore, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = named_store
    sid = "drafty"
    await store.create(SessionHeader(id=sid), [("user/message", {"content": "hi"})])
    polls = 0
    get_draft = store.get_draft

    async def counting(session_id: str, *, live: bool = True) -> Any:
        nonlocal polls
        polls += 1
        return await get_draft(session_id, live=live)

    monkeypatch.setattr(store, "get_draft", counting)
    readers, seconds = 40, 2.0
    async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as c:
        drafts: list[list[Any]] = [[] for _ in range(readers)]
        opened: list[int] = []

        async def reader(i: int) -> None:
            async with c.stream("GET", path(sid)) as r:
                opened.append(r.status_code)
                async for ev in events(r):
                    if ev.get("event") == "draft":
                        drafts[i].append(ev["data"]["draft"])

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(readers):
                    tg.start_soon(reader, i)
                await wait_for(lambda: opened == [200] * readers, within=30)
                polls = 0
                await anyio.sleep(seconds)
                await store.set_draft(sid, {"text": "thinking"})
                await wait_for(lambda: all(d == [{"text": "thinking"}] for d in drafts), within=30)
                tg.cancel_scope.cancel()
    # one poll per interval (0.25 s while active) for all of them; a poll each would be 40 x 8
    assert polls <= 3 * seconds / 0.25, polls


# --------------------------------------------------------------------------- ?deltas=1 streams


async def read_deltas(
    client: httpx.AsyncClient, url: str, answers: int, log: list[tuple[str, Any]], headers: dict[str, str] | None = None
) -> None:
    """Entries and deltas of a ``?deltas=1`` stream into `log` until `answers` answers closed."""
    closed = 0
    async with client.stream("GET", url, headers=headers) as r:
        assert r.status_code == 200, r.text
        async for ev in events(r):
            kind = ev.get("event", "message")
            if kind in ("end", "replaced", "error"):
                log.append((kind, None))
                return
            if kind == "delta":
                d = ev["data"]
                log.append(("delta", (d["answer"], d["index"], d["text"])))
            elif kind == "gap":
                log.append(("gap", ev["data"]))
            elif kind == "message" and "data" in ev:
                e = ev["data"]
                log.append(("entry", e["n"]))
                if e["type"] == "assistant/message":
                    closed += 1
                    if closed == answers:
                        return


async def deltas_readers(
    tg: Any, client: httpx.AsyncClient, sid: str, answers: int, logs: list[Any], redis_url: str, name: str
) -> None:
    """Start a `?deltas=1` reader per log; return once each has its backlog and they share one
    XREAD."""
    for log in logs:
        tg.start_soon(read_deltas, client, path(sid) + "?deltas=1", answers, log)
    await wait_for(lambda: all(log for log in logs), within=30)
    await wait_for(lambda: _len(blocked_xreads(redis_url, name), 1), within=30)


def check_deltas(log: list[tuple[str, Any]], texts: dict[str, list[str]]) -> None:
    """Each answer's deltas once and in order from index 0 (a fresh reader gets the answer so
    far), entries once and in order, nothing else."""
    kinds = {k for k, _ in log}
    assert kinds <= {"delta", "entry"}, log
    ns = [v for k, v in log if k == "entry"]
    assert ns == list(range(ns[0], ns[0] + len(ns))), ns
    by_answer: dict[str, list[tuple[int, str]]] = {}
    for k, v in log:
        if k == "delta":
            by_answer.setdefault(v[0], []).append((v[1], v[2]))
    for answer, got in by_answer.items():
        assert answer in texts
        assert got == list(enumerate(texts[answer][: len(got)])), (answer, got)


async def _answers(store: RedisSessionStore, sid: str, count: int, words: int, pause: float) -> dict[str, list[str]]:
    from redis_session import Sessions

    s = await Sessions(store).open(sid)
    texts: dict[str, list[str]] = {}
    for a in range(count):
        async with s.stream(turn=a + 1, step=1, flush_interval=0.005) as w:
            texts[w.answer] = []
            for i in range(words):
                t = f"a{a}w{i} "
                texts[w.answer].append(t)
                await w.delta(t)
                await anyio.sleep(pause)
    return texts


async def test_deltas_streams_of_a_session_share_one_live_tail_and_each_gets_every_delta_once(
    named_store: tuple[RedisSessionStore, str], redis_url: str
) -> None:
    store, name = named_store
    sid = "live-share"
    await store.create(SessionHeader(id=sid), [("user/message", {"content": "hi"})])
    async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        logs: list[list[tuple[str, Any]]] = [[] for _ in range(16)]
        texts: dict[str, list[str]] = {}
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                await deltas_readers(tg, client, sid, 3, logs[:8], redis_url, name)  # before the answers

                async def write() -> None:
                    texts.update(await _answers(store, sid, 3, 30, 0.003))

                tg.start_soon(write)
                for log in logs[8:]:  # joining mid-answer: the answer so far, then the rest
                    await anyio.sleep(0.02)
                    tg.start_soon(read_deltas, client, path(sid) + "?deltas=1", 3, log)
                await wait_for(lambda: bool(texts), within=60)
        for log in logs:
            check_deltas(log, texts)
        assert all(sum(1 for k, _ in log if k == "delta") >= 30 for log in logs[:8])  # every delta


async def test_a_slow_deltas_reader_is_detached_and_still_gets_every_delta_once(
    named_store: tuple[RedisSessionStore, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis_session.gateway import tails

    monkeypatch.setattr(tails.Tails, "QUEUE", 4)
    store, _ = named_store
    sid = "live-slow"
    await store.create(SessionHeader(id=sid), [("user/message", {"content": "hi"})])
    async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        fast: list[tuple[str, Any]] = []
        slow: list[tuple[str, Any]] = []
        texts: dict[str, list[str]] = {}

        async def slow_reader() -> None:
            async with client.stream("GET", path(sid) + "?deltas=1") as r:
                closed = 0
                async for ev in events(r):
                    await anyio.sleep(0.01)  # a reader slower than the writer
                    kind = ev.get("event", "message")
                    if kind == "delta":
                        d = ev["data"]
                        slow.append(("delta", (d["answer"], d["index"], d["text"])))
                    elif kind == "message" and "data" in ev:
                        e = ev["data"]
                        slow.append(("entry", e["n"]))
                        closed += e["type"] == "assistant/message"
                        if closed == 2:
                            return
                    elif kind in ("gap", "end", "replaced", "error"):
                        slow.append((kind, ev.get("data")))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read_deltas, client, path(sid) + "?deltas=1", 2, fast)
                tg.start_soon(slow_reader)
                await wait_for(lambda: bool(fast) and bool(slow), within=30)
                texts.update(await _answers(store, sid, 2, 60, 0.0))
        check_deltas(fast, texts)
        # the slow one: every delta once and in order too, or a gap it can repair from the log
        gaps = [v for k, v in slow if k == "gap"]
        check_deltas([x for x in slow if x[0] != "gap"], texts) if not gaps else None
        assert [v for k, v in slow if k == "entry"] == [v for k, v in fast if k == "entry"]


async def test_a_killed_live_tail_connection_is_resumed_for_every_deltas_stream(
    named_store: tuple[RedisSessionStore, str], redis_url: str
) -> None:
    store, name = named_store
    sid = "live-killed"
    await store.create(SessionHeader(id=sid), [("user/message", {"content": "hi"})])
    async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        logs: list[list[tuple[str, Any]]] = [[] for _ in range(6)]
        texts: dict[str, list[str]] = {}
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                await deltas_readers(tg, client, sid, 2, logs, redis_url, name)

                async def killer() -> None:
                    r = aioredis.Redis.from_url(redis_url)
                    try:
                        for _ in range(3):
                            await anyio.sleep(0.15)
                            for cid in await blocked_xreads(redis_url, name):
                                await r.execute_command("CLIENT", "KILL", "ID", cid)
                    finally:
                        await r.aclose()

                tg.start_soon(killer)
                texts.update(await _answers(store, sid, 2, 40, 0.01))
        for log in logs:
            check_deltas(log, texts)


# --------------------------------------------------------------------------- the pool under bursts


@pytest.fixture
def gateway_process(tmp_path: Any) -> Iterator[tuple[str, str]]:
    """`redis-session gateway` as deployed (its own process, uvloop), on a private server with a
    pool of 8 connections; yields (its base URL, the server's URL)."""
    import socket
    import subprocess
    import sys
    import time

    from redis_session.redis.embedded import start_server

    server = start_server(str(tmp_path), appendonly=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_SESSION_TOKEN", "REDIS_URL"))}
    cmd = [sys.executable, "-m", "redis_session.cli", "gateway", "--url", server.url + "?max_connections=8"]
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the gateway did not start"
            time.sleep(0.1)
        yield base, server.url
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
        server.stop()
        assert b"Traceback" not in stderr, stderr.decode()[-2000:]


async def test_readers_hanging_up_in_bursts_leave_the_pool_whole(gateway_process: tuple[str, str]) -> None:
    """Readers (four per session, sixteen sessions, past the pool of 8) connect at once and hang
    up at random moments. Each cancelled tail or draft poll must give its connection back: it
    leaked when one cancellation was lost (Python 3.11's wait_for) or landed while a connection
    was taken from the pool, until every later read and write answered 503 unavailable."""
    import random

    base, server_url = gateway_process
    store = RedisSessionStore.from_url(server_url, prefix="rs")
    try:
        for s in range(17):
            await store.create(SessionHeader(id=f"p{s}"))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(60), limits=limits) as client:
            for round_ in range(3):
                statuses: list[int] = []

                async def reader(s: int, k: int, statuses: list[int] = statuses) -> None:
                    params = {"deltas": "1"} if k % 2 else {}
                    async with client.stream("GET", path(f"p{s}"), params=params) as r:
                        statuses.append(r.status_code)
                        if r.status_code == 200:
                            await anyio.sleep(random.random() * 1.5)
                            async for _ in r.aiter_bytes():
                                break
                        else:  # past the pool: the documented answer, never "unavailable"
                            assert r.status_code == 503 and json.loads(await r.aread())["error"] == "busy"

                with anyio.fail_after(120):
                    async with anyio.create_task_group() as tg:
                        for s in range(16):
                            for k in range(4):
                                tg.start_soon(reader, s, k)
                assert 200 in statuses, round_
                # every tail gone from the server, and the pool serves reads and writes again
                await wait_for(lambda: _len(all_xreads(server_url), 0), within=30)
                for s in range(8):
                    async with client.stream("GET", path(f"p{s}")) as r:
                        assert r.status_code == 200
                r = await client.post(path("p16", "entries"), json={"type": "test/mark", "data": {"round": round_}})
                assert r.status_code == 201, r.text
    finally:
        await store.aclose()


async def all_xreads(redis_url: str) -> list[str]:
    r = aioredis.Redis.from_url(redis_url)
    try:
        out = await r.execute_command("CLIENT", "LIST")
    finally:
        await r.aclose()
    text = out.decode() if isinstance(out, bytes) else str(out)
    return [line for line in text.splitlines() if " cmd=xread " in f" {line} "]


async def test_a_hundred_and_fifty_readers_joining_at_once_all_get_in_and_writes_go_on(
    redis_url: str, prefix: str
) -> None:
    """More readers joining at the same moment than the pool holds (100): their first reads
    wait for a connection instead of failing with "Too many connections" (503 unavailable), and
    the writes of the same moment go through."""
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    store.block_ms = 1000
    sid = "crowd"
    try:
        await store.create(SessionHeader(id=sid))
        limits = httpx.Limits(max_connections=None)
        async with (
            running_gateway(store) as base,
            httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as c,
        ):
            results: list[tuple[int, list[int], list[str]]] = []
            written: list[int] = []
            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for i in range(150):
                        got: list[int] = []
                        ended: list[str] = []
                        results.append((i, got, ended))
                        tg.start_soon(read_until, c, path(sid) + ("?deltas=1&start=0" if i % 2 else "?start=0"),
                                      9, got, ended)  # fmt: skip
                    for k in range(10):
                        r = await c.post(path(sid, "entries"), json={"type": "test/mark", "data": {"k": k}})
                        written.append(r.status_code)
            assert written == [201] * 10
            for _, got, ended in results:
                assert ended == [] and contiguous(got, 0, 9), (got, ended)
    finally:
        await store.aclose()


@pytest.mark.parametrize(("size", "limit"), [(1, 0), (2, 1), (4, 2), (5, 3), (8, 4), (12, 8), (100, 90)])
async def test_the_stream_limit_leaves_the_short_commands_a_connection(redis_url: str, size: int, limit: int) -> None:
    """A tenth of the pool kept for appends, reads and /readyz (at least 4, at most half of a small
    pool, never none): a pool of 1 has no connection to spare for a stream."""
    store = RedisSessionStore.from_url(redis_url, prefix="unused", client_options={"max_connections": size})
    try:
        from redis_session.gateway import create_app

        assert create_app(store).state.tails.connection_limit == limit
    finally:
        await store.aclose()


async def test_a_gateway_on_a_pool_of_one_refuses_streams_and_keeps_writing(redis_url: str, prefix: str) -> None:
    """With one connection, a stream holding it would leave every append and /readyz waiting
    out the pool's timeout: the stream answers 503 busy and the writes go on."""
    store = RedisSessionStore.from_url(redis_url, prefix=prefix, client_options={"max_connections": 1})
    try:
        await store.create(SessionHeader(id="one"))
        async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
            for url in (path("one"), "/events"):
                r = await client.get(url)
                assert r.status_code == 503 and r.json()["error"] == "busy", url
            await _writes_go_on(client, "one", 3)
    finally:
        await store.aclose()


async def test_the_events_streams_share_one_subscription_and_writes_go_on(redis_url: str, prefix: str) -> None:
    """Ten viewers' ``/events`` streams on a pool of 8 hold one connection between them, not
    ten: appends and /readyz keep answering at once, and a branch's notification reaches all ten.
    Counted as one more followed session: with the pool's streams all taken, /events is busy."""
    store = RedisSessionStore.from_url(
        redis_url, prefix=prefix, client_options={"max_connections": 8, "pool_timeout": 2}
    )
    store.block_ms = 1000
    try:
        await store.create(SessionHeader(id="main"))
        async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
            async with contextlib_stack() as stack:
                opened = []
                for _ in range(10):
                    r = await stack.enter_async_context(client.stream("GET", "/events"))
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    while (await anext(lines)) != ": open":  # subscribed before the branch below
                        pass
                    opened.append(lines)
                await _writes_go_on(client, "main", 5)  # a pool of 8 less ten held connections would fail
                await wait_for(lambda: _subscribed(redis_url, f"{prefix}:events"))
                r = await client.post(path("main", "branch"), json={"at": 2, "id": "main-b"})
                assert r.status_code == 201, r.text
                for lines in opened:
                    with anyio.fail_after(30):
                        while not (line := await anext(lines)).startswith("data:"):
                            pass
                    assert json.loads(line[5:]) == {"parent": "main", "session": "main-b", "at": 2}
                # the four streams the pool spares: the subscription holds one, three sessions more
                for i in range(3):
                    await store.create(SessionHeader(id=f"s{i}"))
                    r = await stack.enter_async_context(client.stream("GET", path(f"s{i}")))
                    assert r.status_code == 200
                await store.create(SessionHeader(id="s3"))
                r = await client.get(path("s3"))
                assert r.status_code == 503 and r.json()["error"] == "busy"
    finally:
        await store.aclose()


async def _subscribed(redis_url: str, channel: str) -> bool:
    r = aioredis.Redis.from_url(redis_url)
    try:
        counts = await r.pubsub_numsub(channel)
    finally:
        await r.aclose()
    return bool(counts and counts[0][1] >= 1)


async def test_a_reader_that_stops_reading_a_backlog_of_large_entries_holds_little_of_it(
    redis_store_for_backlog: RedisSessionStore,
) -> None:
    """A stream opened on a long backlog of large entries by a client that never reads: the
    stream reads the store a page at a time, each written before the next is read, and the server
    stops taking writes the client does not read, so it has read a few MiB of it, not the whole
    backlog (a page of 1 000 entries near the entry limit held a GiB per such reader). The same
    stream, read at last, gets every entry once and in order."""
    store = redis_store_for_backlog
    total, pad = 120, "x" * 250_000  # 30 MB of backlog
    await store.create(SessionHeader(id="big"))
    for k in range(0, total, 10):
        await store.put("big", k, [("test/mark", {"k": k + j, "pad": pad}) for j in range(10)])
    read_bytes: list[int] = []
    original = store.read

    async def counted(*args: Any, **kwargs: Any) -> Any:
        page = await original(*args, **kwargs)
        read_bytes.append(sum(len(e.data.get("pad", "")) for e in page))
        return page

    store.read = counted  # type: ignore[method-assign]
    async with running_gateway(store) as base:
        port = int(base.rsplit(":", 1)[1])
        stalled = await anyio.connect_tcp("127.0.0.1", port)
        try:
            await stalled.send(f"GET {path('big')}?start=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            settled: list[int] = []

            def reads_stopped() -> bool:  # the same total twice, half a second apart
                settled.append(sum(read_bytes))
                return len(settled) > 1 and settled[-1] == settled[-2] > 0

            await wait_for(reads_stopped, interval=0.5)
            assert sum(read_bytes) < 16 << 20, (len(read_bytes), sum(read_bytes))  # of 30 MB
            buf, seen = b"", []
            with anyio.fail_after(120):
                while not seen or seen[-1] < total - 1:
                    buf += await stalled.receive(1 << 20)
                    *done, buf = buf.split(b"\n\n")
                    for ev in done:
                        for line in ev.split(b"\n"):
                            if line.startswith(b"data: {") and b'"n":' in line:
                                seen.append(json.loads(line[6:])["n"])
            assert seen == list(range(total))
        finally:
            await stalled.aclose()


@pytest.fixture
async def redis_store_for_backlog(redis_url: str, prefix: str) -> AsyncIterator[RedisSessionStore]:
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        yield store
    finally:
        await store.aclose()


async def test_events_streams_end_when_their_subscription_drops_and_new_ones_miss_nothing(
    redis_url: str, prefix: str
) -> None:
    """The shared subscription of /events drops (an idle timeout, a failover, CLIENT KILL): what is
    published until it is made again is lost, so every open stream ends (its browser reconnects
    and re-reads the list) instead of staying open with a silent gap; a stream opened after that
    opens once subscribed again and gets every notification from then on."""
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        await store.create(SessionHeader(id="p"))
        async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
            async with client.stream("GET", "/events") as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                while (await anext(lines)) != ": open":
                    pass
                await wait_for(lambda: _subscribed(redis_url, f"{prefix}:events"))
                await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                with anyio.fail_after(30):  # the stream ends: no more lines
                    rest = [line async for line in lines if line and not line.startswith(":")]
                assert rest == []
            async with client.stream("GET", "/events") as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                while (await anext(lines)) != ": open":
                    pass
                for i in range(3):  # published right after the open: none missed
                    r2 = await client.post(path("p", "branch"), json={"at": 0, "id": f"p-{i}"})
                    assert r2.status_code == 201, r2.text
                got = []
                with anyio.fail_after(30):
                    while len(got) < 3:
                        line = await anext(lines)
                        if line.startswith("data:"):
                            got.append(json.loads(line[5:])["session"])
                assert got == ["p-0", "p-1", "p-2"]
    finally:
        await admin.aclose()
        await store.aclose()


async def test_an_events_stream_asked_while_the_store_is_down_opens_when_it_is_back(tmp_path: Any) -> None:
    """/events asked while Redis is down: the subscription fails and is tried again each second;
    the stream waits for it (up to 5 s), then opens and stays open, and gets what is published
    after. (It waited on the readiness of a subscription that had dropped meanwhile, till the
    5 s were out, then opened and ended at once.)"""
    from redis_session.redis.embedded import start_server

    server = start_server(tmp_path / "srv", appendonly=False)
    port = server.port
    store = RedisSessionStore.from_url(server.url, prefix="ev")
    try:
        await store.create(SessionHeader(id="p"))
        async with running_gateway(store) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
            server.stop()
            async with anyio.create_task_group() as tg:

                async def back_soon() -> None:
                    await anyio.sleep(1.5)
                    nonlocal server
                    server = start_server(tmp_path / "srv", port=port, appendonly=False)

                tg.start_soon(back_soon)
                async with client.stream("GET", "/events") as r:
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    while (await anext(lines)) != ": open":
                        pass
                    await store.create(SessionHeader(id="p"))  # the restart kept nothing
                    r2 = await client.post(path("p", "branch"), json={"at": 0, "id": "p-b"})
                    assert r2.status_code == 201, r2.text
                    with anyio.fail_after(30):
                        while not (line := await anext(lines)).startswith("data:"):
                            pass
                    assert json.loads(line[5:])["session"] == "p-b"
    finally:
        await store.aclose()
        server.stop()


async def _writes_go_on(client: httpx.AsyncClient, sid: str, count: int) -> None:
    """`count` appends to `sid` (from n = 0) and /readyz, each answered at once."""
    for n in range(count):
        r = await client.post(
            path(sid, "entries"),
            json={"type": "user/message", "data": {"content": str(n)}},
            headers={"If-Match": f'"{n}"'},
        )
        assert r.status_code == 201, r.text
    assert (await client.get("/readyz")).status_code == 200
