"""The ADK session service against ADK 2.13's own RedisSessionService, on one server.

    python bench/adk.py [--url URL] [--seconds N] [--events 1000]

Sides: `RedisAdkSessionService` on a `RedisSessionStore`, and
``google.adk.integrations.redis.RedisSessionService`` (a ``redis.asyncio`` client with
``decode_responses=True``, as it builds its own), both on the same private valkey-server (AOF off;
or --url), in interleaved rounds so load drift hits both alike. Each side gets sessions of
`--events` ADK events (user and model text of ~250 bytes, a state delta every tenth event).

- append_event: one more event on a session that already holds `--events` (the session object
  the previous append returned, as the Runner holds it);
- get_session: the whole session (every event, merged state) by a service that did not write it
  (ours also with ``shared_events``: a warm reader that validated the events once and reads only
  what is new);
- memory: ``MEMORY USAGE`` summed over the keys each side keeps for one such session (ours: the
  header hash and the log stream; theirs: one JSON string).

A bench prints numbers; it asserts nothing. Needs the ``adk`` extra.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
import redis.asyncio as aioredis
from _common import Timer, bench_args, drop_prefix, interleave, print_table, server, settle_gc, unique_prefix
from google.adk.events.event import Event
from google.adk.events.event_actions import EventActions
from google.adk.integrations.redis import RedisSessionService, RedisSessionServiceConfig
from google.genai import types

from redis_session import RedisSessionStore
from redis_session.adapters.adk import RedisAdkSessionService

APP, USER = "bench-app", "bench-user"
TEXT = "The quick brown fox jumps over the lazy dog, and then it asks the model about the weather. " * 3


def _event(i: int) -> Event:
    author = "user" if i % 2 == 0 else "forecaster"
    return Event(
        invocation_id=f"inv-{i // 2}",
        author=author,
        content=types.Content(role="user" if author == "user" else "model", parts=[types.Part(text=f"{i} {TEXT}")]),
        actions=EventActions(state_delta={"turn": i} if i % 10 == 0 else {}),
    )


async def _fill(service: Any, session_id: str, events: int) -> Any:
    s = await service.create_session(app_name=APP, user_id=USER, session_id=session_id)
    for i in range(events):
        await service.append_event(s, _event(i))
    return s


async def _memory(r: aioredis.Redis, pattern: str) -> tuple[int, int]:
    keys = [k async for k in r.scan_iter(match=pattern, count=1000)]
    total = 0
    for k in keys:
        total += int(await r.memory_usage(k, samples=0) or 0)
    return total, len(keys)


async def main(url: str, seconds: float, events: int) -> None:
    prefix = unique_prefix()
    theirs_prefix = f"{prefix}-adk:session:"
    store = RedisSessionStore.from_url(url, prefix=prefix)
    reader_store = RedisSessionStore.from_url(url, prefix=prefix)
    client = aioredis.Redis.from_url(url, decode_responses=True)
    reader_client = aioredis.Redis.from_url(url, decode_responses=True)
    raw = aioredis.Redis.from_url(url)
    try:
        ours = RedisAdkSessionService(store)
        theirs = RedisSessionService(
            config=RedisSessionServiceConfig(key_prefix=theirs_prefix, ttl_seconds=0), redis_client=client
        )
        sides: dict[str, Any] = {"redis-session": ours, "adk RedisSessionService": theirs}
        shared = RedisAdkSessionService(reader_store, shared_events=16)
        readers: dict[str, Any] = {
            "redis-session": RedisAdkSessionService(reader_store),
            "adk RedisSessionService": RedisSessionService(
                config=RedisSessionServiceConfig(key_prefix=theirs_prefix, ttl_seconds=0), redis_client=reader_client
            ),
        }
        fixed = {name: await _fill(svc, "fixed", events) for name, svc in sides.items()}
        growing = {name: await _fill(svc, "growing", events) for name, svc in sides.items()}
        counters = dict.fromkeys(sides, events)
        settle_gc()

        def appender(name: str) -> Any:
            async def op() -> None:
                counters[name] += 1
                await sides[name].append_event(growing[name], _event(counters[name]))

            return op

        def getter(name: str) -> Any:
            async def op() -> None:
                got = await readers[name].get_session(app_name=APP, user_id=USER, session_id="fixed")
                assert got is not None and len(got.events) == events

            return op

        rows = []
        for label, make in [(f"append_event ({events}+ events)", appender), (f"get_session ({events} events)", getter)]:
            ts = {name: Timer(f"{label} {name}") for name in sides}
            await interleave([(ts[name], make(name)) for name in sides], seconds / 2, warmup_ops=5)
            o, t = ts["redis-session"], ts["adk RedisSessionService"]
            rows.append((label, o.ops_per_s, t.ops_per_s, o.ops_per_s / t.ops_per_s, o.median_ms, t.median_ms))
        ts = {"shared": Timer("get shared"), "theirs": Timer("get theirs")}

        async def get_shared() -> None:
            got = await shared.get_session(app_name=APP, user_id=USER, session_id="fixed")
            assert got is not None and len(got.events) == events

        await interleave(
            [(ts["shared"], get_shared), (ts["theirs"], getter("adk RedisSessionService"))], seconds / 2, warmup_ops=5
        )
        o, t = ts["shared"], ts["theirs"]
        label = f"get_session ({events}), shared_events"
        rows.append((label, o.ops_per_s, t.ops_per_s, o.ops_per_s / t.ops_per_s, o.median_ms, t.median_ms))
        print_table(["op", "ours ops/s", "ADK's ops/s", "ratio", "ours p50 ms", "ADK's p50 ms"], rows)

        sid = ours.session_store_id(APP, USER, "fixed")
        ours_bytes, ours_keys = await _memory(raw, f"{prefix}:{{{sid}}}:*")
        theirs_bytes, theirs_keys = await _memory(raw, f"{theirs_prefix}{APP}:{USER}:fixed")
        print_table(
            ["memory of one session", "ours", "ADK's", "ours/ADK's"],
            [
                (f"bytes ({events} events)", ours_bytes, theirs_bytes, ours_bytes / max(theirs_bytes, 1)),
                ("keys", ours_keys, theirs_keys, ours_keys / max(theirs_keys, 1)),
            ],
        )
        del fixed
    finally:
        await store.aclose()
        await reader_store.aclose()
        for c in (client, reader_client):
            await c.aclose()
        r = aioredis.Redis.from_url(url)
        try:
            keys = [k async for k in r.scan_iter(match=f"{theirs_prefix}*", count=1000)]
            if keys:
                await r.delete(*keys)
        finally:
            await r.aclose()
        await raw.aclose()
        await drop_prefix(url, prefix)


if __name__ == "__main__":
    parser = bench_args("ADK session service: RedisAdkSessionService vs ADK's RedisSessionService", seconds=8.0)
    parser.add_argument("--events", type=int, default=1000, help="events per session")
    args = parser.parse_args()
    with server(args.url) as url:
        anyio.run(main, url, args.seconds, args.events)
