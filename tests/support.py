"""Small helpers shared by the test modules (imported as ``support``: pytest puts tests/ on the path)."""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import ModuleType
from typing import Any

import anyio
import redis.asyncio as aioredis

from redis_session import NewEntry
from redis_session.model import now_ms


def require_extra(module: str, extra: str) -> ModuleType:
    """`module`, from an optional extra. Locally a missing extra skips (with the install line);
    in CI ($CI set: `.ci/run` installs every extra) it fails, so no adapter test skips silently."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    import pytest

    return pytest.importorskip(module, reason=f"needs the {extra} extra: pip install -e '.[{extra}]'")


def um(text: str) -> NewEntry:
    """A dsh user message."""
    return NewEntry("user/message", {"content": text})


def am(text: str) -> NewEntry:
    """A dsh assistant message."""
    return NewEntry("assistant/message", {"content": text})


@contextlib.asynccontextmanager
async def running_gateway(store: Any, **options: Any) -> AsyncIterator[str]:
    """The gateway on a free port of 127.0.0.1, for the duration of the block; yields its base URL."""
    from redis_session.gateway import serve

    async with anyio.create_task_group() as tg:
        port = await tg.start(lambda task_status: serve(store, "127.0.0.1", 0, task_status=task_status, **options))
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            tg.cancel_scope.cancel()


class SkewClock:
    """A clock for `MemorySessionStore(clock=...)`: the wall clock plus an offset that a test moves
    forward (`advance`) instead of sleeping until a TTL or a lease runs out."""

    def __init__(self) -> None:
        self.offset_ms = 0

    def __call__(self) -> int:
        return now_ms() + self.offset_ms

    def advance(self, seconds: float) -> None:
        self.offset_ms += round(seconds * 1000)


async def let_pass(store: Any, seconds: float) -> None:
    """Let `seconds` of the store's time pass: a memory store on a `SkewClock` jumps at once; a
    server's TTLs run on its own clock, so that is waited for (real expiry is what is tested)."""
    clock = getattr(store, "clock", None)
    if isinstance(clock, SkewClock):
        clock.advance(seconds)
        return
    await anyio.sleep(seconds)


async def wait_for(
    condition: Callable[[], Awaitable[bool] | bool], *, within: float = 60.0, interval: float = 0.01
) -> None:
    """Poll `condition` (sync or async) until it is true; fail after `within` seconds. The deadline
    is a hang guard, not a measurement: generous, so a loaded machine never trips it."""
    deadline = time.monotonic() + within
    while True:
        got = condition()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {within} s")
        await anyio.sleep(interval)


def wait_until(
    condition: Callable[[], bool], *, within: float = 60.0, interval: float = 0.02, what: str = "condition"
) -> None:
    """`wait_for` from a thread or a synchronous test: poll `condition` until it is true."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not met within {within} s")
        time.sleep(interval)


async def client_list(url: str) -> list[dict[str, str]]:
    """CLIENT LIST of the server at `url`, one dict of fields per connection."""
    r = aioredis.Redis.from_url(url)
    try:
        out = await r.execute_command("CLIENT", "LIST")
    finally:
        await r.aclose()
    text = out.decode() if isinstance(out, bytes) else str(out)
    return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in text.splitlines()]


async def blocked_in_xread(url: str, name: str) -> list[int]:
    """The ids of the connections named `name` that are blocked in XREAD right now (the server's
    own word: ``cmd=xread`` with flag ``b``). The conftest's stores name theirs by the test's prefix."""
    return [
        int(c["id"])
        for c in await client_list(url)
        if c.get("name") == name and c.get("cmd") == "xread" and "b" in c.get("flags", "")
    ]


async def wait_blocked_in_xread(url: str, name: str, count: int = 1, *, within: float = 60.0) -> None:
    """Wait until at least `count` connections named `name` are blocked in XREAD: a tail (an SSE
    stream, a follower) is live and waiting for the next entry, so what is written now is new to it."""

    async def enough() -> bool:
        return len(await blocked_in_xread(url, name)) >= count

    await wait_for(enough, within=within, interval=0.02)


async def wait_subscribed(url: str, channel: str, *, within: float = 60.0) -> None:
    """Wait until someone is subscribed to `channel` (PUBSUB NUMSUB): a store-wide event stream
    is connected, so what is published now reaches it."""
    r = aioredis.Redis.from_url(url)

    async def subscribed() -> bool:
        [(_, count)] = await r.pubsub_numsub(channel)
        return int(count) > 0

    try:
        await wait_for(subscribed, within=within, interval=0.02)
    finally:
        await r.aclose()


async def cleanup_prefix(url: str, prefix: str) -> None:
    """Delete every key under `prefix` (never a FLUSHDB: the server may be shared)."""
    r = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}:*", count=1000)]
        for i in range(0, len(keys), 500):
            await r.delete(*keys[i : i + 500])
    finally:
        await r.aclose()


async def cleanup_cluster_prefix(url: str, prefix: str) -> None:
    from redis.asyncio.cluster import RedisCluster

    rc = RedisCluster.from_url(url)
    try:
        for node in rc.get_primaries():
            r = rc.get_redis_connection(node)
            keys = [k async for k in r.scan_iter(match=f"{prefix}:*", count=1000)]
            for k in keys:
                await rc.delete(k)
    finally:
        await rc.aclose()


def watch_detachment(monkeypatch: Any, queue: int) -> list[bool]:
    """The gateway's shared tails hold `queue` items per reader (a small one detaches a stuck
    reader early: the queue, not its socket, fills); the list gets True once one is detached."""
    from redis_session.gateway import tails

    monkeypatch.setattr(tails.Tails, "QUEUE", queue)
    detached: list[bool] = []
    hand = tails.Tails._hand

    def watched(hub: Any, sub: Any, item: Any, max_bytes: int | None) -> None:
        hand(hub, sub, item, max_bytes)
        if sub.lagged and not detached:
            detached.append(True)

    monkeypatch.setattr(tails.Tails, "_hand", staticmethod(watched))
    return detached


def unchunked(raw: bytes) -> str:
    """The body of a raw HTTP/1.1 response read off a socket, its chunked framing undone."""
    head, _, body = raw.decode().partition("\r\n\r\n")
    if "chunked" not in head.lower():
        return body
    parts, rest = [], body
    while rest:
        size_line, _, rest = rest.partition("\r\n")
        size = int(size_line.strip() or "0", 16)
        if size == 0:
            break
        parts.append(rest[:size])
        rest = rest[size + 2 :]
    return "".join(parts)
