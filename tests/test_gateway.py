"""The gateway on a real uvicorn server and a real Redis: SSE delivery, resume, fan-out to many
clients, auth on every route, and bad input answered as JSON 4xx, never a 500."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redis_session import MemorySessionStore, RedisSessionStore, SessionHeader
from redis_session.gateway import body as body_mod
from redis_session.gateway import common as common_mod
from redis_session.gateway import create_app, openapi, serve
from redis_session.projection import project, to_anthropic, to_openai

from support import cleanup_prefix, running_gateway, wait_blocked_in_xread, wait_until

pytestmark = pytest.mark.anyio


# --------------------------------------------------------------------------- helpers


def path(session_id: str, sub: str = "") -> str:
    return "/sessions/" + quote(session_id, safe="") + (f"/{sub}" if sub else "")


async def sse(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Parse an event stream: one dict per event ({id, event, data} or {comment})."""
    ev: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if line == "":
            if ev:
                yield ev
            ev = {}
        elif line.startswith(":"):
            ev["comment"] = line[1:].strip()
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data":
                ev["data"] = json.loads(value)
            else:
                ev[field] = value


def event_n(event_id: str) -> int:
    """The n of an SSE event id ``<incarnation>:<n>`` (``…/<live id>`` on a deltas stream)."""
    return int(event_id.split("/")[0].rsplit(":", 1)[1])


async def incarnation_of(store: Any, sid: str) -> str:
    head = await store.head(sid)
    assert head is not None
    return str(head.header.incarnation)


async def collect_entries(
    client: httpx.AsyncClient, url: str, until_n: int, headers: dict[str, str] | None = None
) -> list[int]:
    """The n of every entry event, until `until_n` has arrived."""
    got: list[int] = []
    async with client.stream("GET", url, headers=headers) as r:
        assert r.status_code == 200, r.text
        async for ev in sse(r):
            if "id" in ev:
                assert event_n(ev["id"]) == ev["data"]["n"]
                got.append(ev["data"]["n"])
                if got[-1] >= until_n:
                    return got
    return got


async def mk(store: Any, sid: str, k: int = 0, **hdr: Any) -> None:
    await store.create(SessionHeader(id=sid, **hdr), [("user/message", {"content": f"m{i}"}) for i in range(k)])


async def write_marks(store: Any, sid: str, count: int, batch: int = 1, pause: float = 0.0) -> None:
    for i in range(0, count, batch):
        await store.put(sid, None, [("test/mark", {"i": i + j}) for j in range(min(batch, count - i))])
        if pause:
            await anyio.sleep(pause)


# --------------------------------------------------------------------------- SSE


async def test_sse_delivers_every_entry_in_order_while_a_writer_appends(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    await mk(redis_store, "live", 5)
    total = 5 + 300
    with anyio.fail_after(90):
        async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base) as client:
            got: list[int] = []

            async def read() -> None:
                got.extend(await collect_entries(client, path("live", "events"), total - 1))

            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await wait_blocked_in_xread(redis_url, prefix)  # the stream is past its backlog, live
                await write_marks(redis_store, "live", 300, batch=3, pause=0.001)
    assert got == list(range(total))


async def test_sse_resumes_with_last_event_id_without_gap_or_repeat(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    await mk(redis_store, "r", 10)
    with anyio.fail_after(90):
        async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base) as client:
            first = await collect_entries(client, path("r", "events"), 6)  # hang up after n=6
            assert first == list(range(7))
            await write_marks(redis_store, "r", 20, batch=4)  # written while disconnected
            # a browser reconnects to the same URL (here with ?start=0) and sends Last-Event-ID
            inc = await incarnation_of(redis_store, "r")  # event ids name the life: <incarnation>:<n>
            rest = await collect_entries(client, path("r", "events") + "?start=0", 29, {"Last-Event-ID": f"{inc}:6"})
            assert first + rest == list(range(30))
            # without Last-Event-ID, ?start= decides
            assert await collect_entries(client, path("r", "events") + "?start=25", 29) == [25, 26, 27, 28, 29]
            # resuming at the very end waits for the next entry
            got: list[int] = []

            async def late() -> None:
                got.extend(await collect_entries(client, path("r", "events"), 30, {"Last-Event-ID": f"{inc}:29"}))

            async with anyio.create_task_group() as tg:
                tg.start_soon(late)
                await wait_blocked_in_xread(redis_url, prefix)  # resumed at the end: waiting
                await write_marks(redis_store, "r", 1)
            assert got == [30]


async def test_fifty_concurrent_clients_all_get_everything(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    """One XREAD BLOCK connection per SSE client: 50 of them fit the pool with room to spare."""
    await mk(redis_store, "fan", 3)
    clients, total = 50, 3 + 120
    results: list[list[int]] = []
    limits = httpx.Limits(max_connections=clients + 10)
    with anyio.fail_after(120):
        async with (
            running_gateway(redis_store, heartbeat=1.0) as base,
            httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client,
        ):

            async def one() -> None:
                results.append(await collect_entries(client, path("fan", "events"), total - 1))

            async with anyio.create_task_group() as tg:
                for _ in range(clients):
                    tg.start_soon(one)
                await wait_blocked_in_xread(redis_url, prefix)  # their tail is live, blocked in XREAD
                await write_marks(redis_store, "fan", 120, batch=2, pause=0.002)
    assert len(results) == clients
    assert all(r == list(range(total)) for r in results)


async def test_sse_sends_the_draft_heartbeats_and_the_end(redis_store: RedisSessionStore) -> None:
    redis_store.block_ms = 200  # how soon an idle tail notices the deletion
    await mk(redis_store, "d", 1)
    with anyio.fail_after(60):
        async with (
            running_gateway(redis_store, heartbeat=0.3) as base,
            httpx.AsyncClient(base_url=base) as client,
            client.stream("GET", path("d", "events")) as r,
        ):
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["cache-control"] == "no-cache"
            seen: list[dict[str, Any]] = []
            events = sse(r)
            async for ev in events:  # the backlog, then silence: a heartbeat
                seen.append(ev)
                if ev.get("comment") == "ping":
                    break
            assert [e["data"]["n"] for e in seen if "id" in e] == [0]
            await redis_store.set_draft("d", {"content": "Hel"})
            ev = await anext(x async for x in events if x.get("event") == "draft")
            assert ev["data"] == {"draft": {"content": "Hel"}}
            await redis_store.set_draft("d", None)
            ev = await anext(x async for x in events if x.get("event") == "draft")
            assert ev["data"] == {"draft": None}
            assert "id" not in ev  # a draft never moves Last-Event-ID
            await redis_store.delete("d")
            ev = await anext(x async for x in events if "comment" not in x)
            assert ev["event"] == "end"
            assert [x async for x in events if "comment" not in x] == []  # and the response ends


async def test_server_shutdown_ends_open_streams_at_once(redis_store: RedisSessionStore) -> None:
    redis_store.block_ms = 30_000  # the tail's XREAD blocks ~9 s (below the socket timeout)
    await mk(redis_store, "s", 1)
    with anyio.fail_after(60):
        async with httpx.AsyncClient() as client, anyio.create_task_group() as tg:
            port = await tg.start(lambda task_status: serve(redis_store, "127.0.0.1", 0, task_status=task_status))
            async with client.stream("GET", f"http://127.0.0.1:{port}{path('s', 'events')}") as r:
                events = sse(r)
                await anext(x async for x in events if "id" in x)
                t0 = anyio.current_time()
                tg.cancel_scope.cancel()
                assert [x async for x in events if "id" in x] == []
            assert anyio.current_time() - t0 < 5  # not after the block or a heartbeat (room for load)
        async with httpx.AsyncClient() as late:
            with pytest.raises(httpx.ConnectError):  # and the port is closed
                await late.get(f"http://127.0.0.1:{port}/sessions")


async def test_a_busy_port_is_an_oserror(redis_store: RedisSessionStore) -> None:
    async with running_gateway(redis_store) as base:
        port = int(base.rsplit(":", 1)[1])
        with pytest.raises(OSError, match="could not listen"):
            await serve(redis_store, "127.0.0.1", port, log_level="critical")


async def test_stream_limit_answers_503(redis_store: RedisSessionStore) -> None:
    await mk(redis_store, "cap", 1)
    with anyio.fail_after(60):
        async with (
            running_gateway(redis_store, max_streams=1) as base,
            httpx.AsyncClient(base_url=base) as client,
            client.stream("GET", path("cap", "events")) as r1,
        ):
            events = sse(r1)  # held: a dropped parser would close the response when collected
            await anext(x async for x in events if "id" in x)
            r2 = await client.get(path("cap", "events"))
            assert r2.status_code == 503 and r2.json()["error"] == "busy"
            assert r2.headers["retry-after"]


async def test_default_stream_limit_follows_the_pool(redis_url: str) -> None:
    store = RedisSessionStore.from_url(redis_url, prefix="unused", client_options={"max_connections": 100})
    app = create_app(store)
    # a live tail per followed session holds a pooled connection: the pool less a margin
    assert app.state.tails.connection_limit == 90 and app.state.streams.limit is None
    assert create_app(store, max_streams=5).state.streams.limit == 5
    await store.aclose()
    assert create_app(MemorySessionStore()).state.tails.connection_limit is None


# --------------------------------------------------------------------------- read routes


async def test_read_routes(redis_store: RedisSessionStore) -> None:
    sid = "user/42:ü-日本"  # `/`, `:` and unicode travel percent-encoded
    await mk(redis_store, sid, 0, title="hello")
    await redis_store.put(
        sid,
        0,
        [
            ("user/message", {"content": "what is 1+1?"}),
            ("assistant/chunk", {"chunk": "2"}),
            ("assistant/message", {"content": [{"type": "text", "text": "2"}]}),
            ("test/mark", {"x": 1}),
        ],
    )
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base) as client:
        head = (await client.get(path(sid))).json()
        assert head["id"] == sid and head["n"] == 4 and head["header"]["title"] == "hello"
        assert head["header"]["parent"] is None and head["last_cut"] is None

        r = (await client.get(path(sid, "entries"))).json()
        assert [e["n"] for e in r["entries"]] == [0, 1, 2, 3] and r["n"] == 4 and r["next"] is None
        r = (await client.get(path(sid, "entries"), params={"start": 1, "stop": 3})).json()
        assert [e["type"] for e in r["entries"]] == ["assistant/chunk", "assistant/message"]
        r = (await client.get(path(sid, "entries"), params={"start": 1, "limit": 2})).json()
        assert [e["n"] for e in r["entries"]] == [1, 2] and r["next"] == 3
        r = (await client.get(path(sid, "entries"), params={"start": 9})).json()
        assert r["entries"] == [] and r["next"] is None

        entries = await redis_store.read(sid)
        msgs = project(entries)
        r = (await client.get(path(sid, "messages"))).json()
        assert r == {"session": sid, "format": "openai", "messages": to_openai(msgs)}
        r = (await client.get(path(sid, "messages"), params={"format": "anthropic"})).json()
        assert r["messages"] == to_anthropic(msgs)
        r = (await client.get(path(sid, "messages"), params={"format": "neutral"})).json()
        assert [(m["role"], m["source"]) for m in r["messages"]] == [("user", [0]), ("assistant", [2])]


async def test_list_pages_and_branches(redis_store: RedisSessionStore) -> None:
    for i in range(5):
        await mk(redis_store, f"p{i}", 2, created_at=1_700_000_000_000 + i)
    await mk(redis_store, "p0:branch:a", parent="p0", at=1)
    await mk(redis_store, "p0:branch:b", parent="p0", at=2)
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base) as client:
        seen: list[str] = []
        cursor = None
        while True:
            page = (await client.get("/sessions", params={"limit": 2, **({"cursor": cursor} if cursor else {})})).json()
            seen += [h["id"] for h in page["items"]]
            cursor = page["cursor"]
            if cursor is None:
                break
        assert sorted(seen) == sorted(["p0", "p1", "p2", "p3", "p4", "p0:branch:a", "p0:branch:b"])
        kids = (await client.get("/sessions", params={"parent": "p0"})).json()
        assert {(h["id"], h["at"]) for h in kids["items"]} == {("p0:branch:a", 1), ("p0:branch:b", 2)}
        # a branch reads through its parent
        r = (await client.get(path("p0:branch:b", "entries"))).json()
        assert [e["data"]["content"] for e in r["entries"]] == ["m0", "m1"]


async def test_list_goes_on_past_an_unreadable_header(redis_store: RedisSessionStore, redis_url: str) -> None:
    """One header edited outside redis-session (no hash any more) made `GET /sessions` answer 500
    for everyone. The others are listed and that one is named in `unreadable`; a tenant token
    sees only its own there."""
    import redis.asyncio as aioredis

    from redis_session.gateway.auth import parse_tokens

    for sid in ("t/a", "t/b", "u/c", "u/d"):
        await mk(redis_store, sid, 1)
    raw = aioredis.Redis.from_url(redis_url)
    try:
        for sid in ("t/b", "u/d"):
            await raw.delete(redis_store.keys.hdr(sid))
            await raw.set(redis_store.keys.hdr(sid), "oops")
    finally:
        await raw.aclose()
    tokens = parse_tokens("admin-token admin\nt-token read t/", "test")
    async with running_gateway(redis_store, tokens=tokens) as base, httpx.AsyncClient(base_url=base) as client:
        every = await client.get("/sessions", headers={"Authorization": "Bearer admin-token"})
        assert every.status_code == 200, every.text
        assert sorted(h["id"] for h in every.json()["items"]) == ["t/a", "u/c"]
        assert sorted(every.json()["unreadable"]) == ["t/b", "u/d"]
        own = (await client.get("/sessions", headers={"Authorization": "Bearer t-token"})).json()
        assert [h["id"] for h in own["items"]] == ["t/a"] and own["unreadable"] == ["t/b"]
        broken = await client.get(path("t/b"), headers={"Authorization": "Bearer admin-token"})
        assert broken.status_code == 500 and broken.json()["error"] == "corrupt"  # named, not "internal"


async def test_memory_store_works_too() -> None:
    store = MemorySessionStore()
    await mk(store, "m", 2)
    with anyio.fail_after(60):
        async with running_gateway(store) as base, httpx.AsyncClient(base_url=base) as client:
            assert (await client.get(path("m"))).json()["n"] == 2

            async def write() -> None:
                await anyio.sleep(0.1)
                await write_marks(store, "m", 5)

            async with anyio.create_task_group() as tg:
                tg.start_soon(write)
                assert await collect_entries(client, path("m", "events"), 6) == list(range(7))


# --------------------------------------------------------------------------- auth


def every_route(sid: str) -> list[str]:
    return [
        "/",
        "/openapi.json",
        "/sessions",
        path(sid),
        path(sid, "entries"),
        path(sid, "messages"),
        path(sid, "events"),
    ]


async def status_of(client: httpx.AsyncClient, url: str, **kw: Any) -> int:
    # an event stream answers 200 and stays open: read the status line and hang up
    async with client.stream("GET", url, **kw) as r:
        return r.status_code


async def test_token_guards_every_route(redis_store: RedisSessionStore) -> None:
    await mk(redis_store, "sec", 1)
    token = "t0ken/with+chars"
    with anyio.fail_after(60):
        async with running_gateway(redis_store, token=token) as base, httpx.AsyncClient(base_url=base) as client:
            for url in every_route("sec"):
                r = await client.get(url)
                assert r.status_code == 401, url
                assert r.headers["www-authenticate"] == "Bearer"
                assert await status_of(client, url, headers={"Authorization": "Bearer nope"}) == 401, url
                assert await status_of(client, url, params={"token": "nope"}) == 401, url
                assert await status_of(client, url, headers={"Authorization": f"Bearer {token}"}) == 200, url
                assert await status_of(client, url, headers={"Authorization": f"bearer {token}"}) == 200, url
                assert await status_of(client, url, params={"token": token}) == 200, url
            assert (await client.get("/sessions?token=%C3%BC%00")).status_code == 401  # odd bytes: still a 401
            # a person opening the viewer gets a form asking for the token, still a 401
            r = await client.get("/", headers={"Accept": "text/html"})
            assert r.status_code == 401 and 'name="token"' in r.text and 'action="signin"' in r.text
            doc = (await client.get("/openapi.json", params={"token": token})).json()
            assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


async def test_without_a_token_every_route_is_open(redis_store: RedisSessionStore) -> None:
    await mk(redis_store, "open", 1)
    with anyio.fail_after(60):
        async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base) as client:
            for url in every_route("open"):
                assert await status_of(client, url) == 200, url


# --------------------------------------------------------------------------- bad input

HOSTILE_IDS = [
    "%7Bslot%7D",  # {slot}: would move the hash slot
    "a%7Bb",
    "a%20b",  # whitespace
    "a%0Ab",  # newline
    "%00",  # NUL
    "%FF%FE",  # not UTF-8
    "x" * 257,  # too long
    "",  # empty
]


async def test_bad_input_is_a_json_4xx_never_a_500(redis_store: RedisSessionStore) -> None:
    await mk(redis_store, "ok", 3)
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base) as client:

        async def expect(status: int, url: str, **kw: Any) -> None:
            r = await client.get(url, **kw)
            assert r.status_code == status, (url, kw, r.status_code, r.text)
            assert r.headers["content-type"] == "application/json", url
            body = r.json()
            assert set(body) == {"error", "message"} and "Traceback" not in body["message"]

        for sub in ["", "/entries", "/messages", "/events"]:
            await expect(404, f"/sessions/nope{sub}")
            await expect(404, f"/sessions/a%2Fb{sub}")
            for bad in HOSTILE_IDS:
                await expect(400, f"/sessions/{bad}{sub}")
        await expect(404, "/sessions/ok/nothing-here")
        await expect(404, "/sessions/ok/entries/more")
        await expect(404, "/nowhere")
        for q in [
            "start=-1",
            "start=x",
            "start=1.5",
            "start=1e3",
            "stop=-2",
            "start=3&stop=1",
            "limit=0",
            "limit=10001",
        ]:
            await expect(400, f"/sessions/ok/entries?{q}")
        await expect(400, "/sessions/ok/events?start=-1")
        await expect(400, "/sessions/ok/events?start=abc")
        await expect(400, "/sessions/ok/events", headers={"Last-Event-ID": "abc"})
        await expect(400, "/sessions/ok/events", headers={"Last-Event-ID": "-5"})
        await expect(400, "/sessions/ok/messages?format=xml")
        for q in ["limit=0", "limit=1001", "limit=ten", "parent=%7Bx%7D", "parent=a%20b", "cursor=" + "c" * 500]:
            await expect(400, f"/sessions?{q}")
        r = await client.post("/sessions/ok/messages")
        assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"
        r = await client.put("/sessions/ok")
        assert r.status_code == 405
        assert (await redis_store.head("ok")).n == 3  # type: ignore[union-attr]


# --------------------------------------------------------------------------- OpenAPI


async def test_openapi_describes_every_route(redis_store: RedisSessionStore) -> None:
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base) as client:
        doc = (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) >= {
        "/healthz",
        "/",
        "/openapi.json",
        "/sessions",
        "/sessions/{session_id}",
        "/sessions/{session_id}/entries",
        "/sessions/{session_id}/messages",
        "/sessions/{session_id}/events",
        "/events",
    }
    assert set(doc["paths"]) >= {
        "/sessions/{session_id}/branch",
        "/sessions/{session_id}/fork",
        "/sessions/{session_id}/draft",
        "/sessions/{session_id}/repair",
    }
    writes = {(p, m) for p, item in doc["paths"].items() for m in item if m != "get"}
    assert writes == {
        ("/sessions", "post"),
        ("/sessions/{session_id}", "delete"),
        ("/sessions/{session_id}/entries", "post"),
        ("/sessions/{session_id}/branch", "post"),
        ("/sessions/{session_id}/fork", "post"),
        ("/sessions/{session_id}/draft", "put"),
        ("/sessions/{session_id}/repair", "post"),
        ("/sessions/{session_id}/answers", "post"),
        ("/sessions/{session_id}/answers/{answer}/deltas", "post"),
        ("/sessions/{session_id}/answers/{answer}/end", "post"),
    }
    for p, item in doc["paths"].items():
        for m, op in item.items():
            assert {"200", "201", "204"} & set(op["responses"]), (p, m)
    assert "security" not in doc and "security" in openapi(auth=True)
    assert doc["paths"]["/healthz"]["get"]["security"] == []  # probes need no token
    for p, item in doc["paths"].items():  # every session route takes the pin to a life (409 once gone)
        for m, op in item.items():
            if p.startswith("/sessions/{session_id}"):
                assert {"X-Session-Incarnation", "incarnation"} <= {x["name"] for x in op["parameters"]}, (p, m)
                assert "409" in op["responses"], (p, m)
    refs = {m for m in json.dumps(doc).split('"') if m.startswith("#/components/schemas/")}
    assert {r.rsplit("/", 1)[1] for r in refs} <= set(doc["components"]["schemas"])


async def test_healthz_needs_no_token_and_reports_the_store(redis_store: RedisSessionStore) -> None:
    async with running_gateway(redis_store, token="s3cret") as base, httpx.AsyncClient(base_url=base) as client:
        r = await client.get("/healthz")
        assert r.status_code == 200 and r.json() == {"ok": True}
        r = await client.get("/readyz")
        assert r.status_code == 200 and r.json() == {"ok": True}
        assert (await client.get("/sessions")).status_code == 401


async def test_liveness_never_asks_redis_readiness_does() -> None:
    """/healthz answered 503 while Redis was down, and the liveness probe used it, so
    a Redis failover restarted every gateway pod. /healthz is the process; /readyz is Redis."""
    dead = RedisSessionStore.from_url(
        f"redis://127.0.0.1:{_free_port()}/0", client_options={"socket_connect_timeout": 1}
    )
    try:
        with anyio.fail_after(30):
            async with running_gateway(dead) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
                assert (await client.get("/healthz")).status_code == 200
                r = await client.get("/readyz")
                assert r.status_code == 503 and r.json()["error"] == "unavailable"
                assert r.headers["retry-after"]
    finally:
        await dead.aclose()


# --------------------------------------------------------------------------- incarnations


async def test_replaced_session_is_never_served_from_the_old_log(redis_store: RedisSessionStore) -> None:
    """An id deleted and created again (a redacting replace-import): /messages answers the new log
    (the gateway's SnapshotCache holds the old one), and a live SSE stream says `replaced` and ends
    instead of going on with the new session's entries."""
    from redis_session.projector import Projector

    await mk(redis_store, "x", 3)
    await Projector(redis_store, consumer="w").fold("x")  # a snapshot, decoded into the cache below
    with anyio.fail_after(30):
        async with (
            running_gateway(redis_store, heartbeat=0.3) as base,
            httpx.AsyncClient(base_url=base) as client,
        ):
            r = await client.get(path("x", "messages"))
            assert [m["content"] for m in r.json()["messages"]] == ["m0", "m1", "m2"]
            async with client.stream("GET", path("x", "events")) as stream:
                events = sse(stream)
                got = [ev async for ev in _until(events, lambda ev: "id" in ev and event_n(ev["id"]) == 2)]
                assert [event_n(e["id"]) for e in got if "id" in e] == [0, 1, 2]
                await redis_store.delete("x")
                await redis_store.create(
                    SessionHeader(id="x"), [("user/message", {"content": f"new{i}"}) for i in range(5)]
                )
                rest = [ev async for ev in events if "comment" not in ev]
            # `replaced` when the stream next looks after the re-creation; a plain `end` when it
            # looked between the delete and the create (it saw the id deleted): never an entry
            # of the new life either way
            assert [e.get("event") for e in rest] in (["replaced", "end"], ["end"]), rest
            r = await client.get(path("x", "messages"))
            assert [m["content"] for m in r.json()["messages"]] == [f"new{i}" for i in range(5)]
            r = await client.get(path("x", "messages"))  # and again, from the cache
            assert [m["content"] for m in r.json()["messages"]] == [f"new{i}" for i in range(5)]


async def _until(events: AsyncIterator[dict[str, Any]], last: Any) -> AsyncIterator[dict[str, Any]]:
    async for ev in events:
        yield ev
        if last(ev):
            return


# --------------------------------------------------------------------------- closed by default


def _gateway_cmd(*args: str, env: dict[str, str]) -> list[str]:
    return [sys.executable, "-m", "redis_session.cli", "gateway", *args]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_SESSION_TOKEN")}
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--host", "127.0.0.1"], {"REDIS_SESSION_TOKEN": ""}, "REDIS_SESSION_TOKEN is set but empty"),
        (["--host", "127.0.0.1"], {"REDIS_SESSION_TOKEN": "  "}, "REDIS_SESSION_TOKEN is set but empty"),
        (["--host", "127.0.0.1", "--token", ""], {}, "--token is empty"),
        (["--host", "0.0.0.0"], {}, "refusing to serve on 0.0.0.0 without a token"),
        (["--host", "0.0.0.0"], {"REDIS_SESSION_TOKEN": ""}, "set but empty"),
        (["--allowed-origin", "not a url"], {}, "is not scheme://host"),
    ],
)
def test_an_open_gateway_refuses_to_start(redis_url: str, args: list[str], env: dict[str, str], message: str) -> None:
    """`REDIS_SESSION_TOKEN=""` (as compose shipped it) used to give an open gateway;
    a non-loopback bind without any token refuses to start unless `--insecure-no-auth`."""
    cmd = _gateway_cmd("--url", redis_url, "--port", str(_free_port()), *args, env=env)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_env(**env))
    assert done.returncode == 1, done.stderr
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_insecure_no_auth_opens_it_loudly_and_hosts_are_still_checked(redis_url: str) -> None:
    port = _free_port()
    cmd = _gateway_cmd("--url", redis_url, "--host", "0.0.0.0", "--port", str(port), "--insecure-no-auth", env={})
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env())
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.05)
        assert r.status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/sessions", timeout=5).status_code == 200  # open, on purpose
        evil = httpx.get(f"http://127.0.0.1:{port}/sessions", headers={"Host": f"evil.example:{port}"}, timeout=5)
        assert evil.status_code == 421
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "INSECURE" in stderr and "NO TOKEN" in stderr, stderr


async def test_serve_refuses_a_public_address_without_a_token(redis_store: RedisSessionStore) -> None:
    with pytest.raises(ValueError, match="without a token"):
        await serve(redis_store, "0.0.0.0", 0)


async def test_dns_rebinding_reaches_no_route(redis_store: RedisSessionStore) -> None:
    """`Host: evil.example:PORT` with a matching Origin was served (read 200, write 201,
    delete 204). Now any Host outside the allowed list answers 421 on every route, SSE and the viewer
    included, and nothing is written; the probes answer whatever the Host."""
    await mk(redis_store, "victim", 2)
    with anyio.fail_after(30):
        async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
            port = base.rsplit(":", 1)[1]
            evil = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
            for method, url in [
                ("GET", "/"),
                ("GET", "/openapi.json"),
                ("GET", "/sessions"),
                ("GET", "/sessions/victim"),
                ("GET", "/sessions/victim/entries"),
                ("GET", "/sessions/victim/events"),
                ("GET", "/events"),
                ("POST", "/sessions"),
                ("POST", "/sessions/victim/entries"),
                ("DELETE", "/sessions/victim"),
                ("OPTIONS", "/sessions"),
            ]:
                body = {"type": "user/message", "data": {"content": "pwned"}} if method == "POST" else None
                r = await client.request(method, url, headers=evil, json=body)
                assert r.status_code == 421, (method, url, r.status_code)
                assert r.json()["error"] == "misdirected"
            for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST."):
                assert (await client.get("/sessions/victim", headers={"Host": host})).status_code == 200, host
            assert (await client.get("/healthz", headers=evil)).status_code == 200
            assert (await client.get("/readyz", headers=evil)).status_code == 200
    head = await redis_store.head("victim")
    assert head is not None and head.n == 2


async def test_new_ids_with_format_characters_are_refused_old_ones_stay_usable(
    redis_store: RedisSessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`chat\u200b1` and `chat1` look the same in the viewer and in logs but name two sessions:
    an id with a zero-width or bidirectional control character (Unicode Cf) is no longer created
    (400 bad_request, nothing written, by create, branch and fork), while a session created under
    such an id before the rule is still read, appended to, branched (to a clean id) and deleted."""
    from redis_session.store import rules

    old = ["chat\u200b1", "\u202egnp.exe", "a\u2066b\u2069", "\ufeffbom"]
    with monkeypatch.context() as m:  # sessions an older version created
        m.setattr(rules, "validate_new_session_id", rules.validate_session_id)
        for sid in old:
            await mk(redis_store, sid, 2)
    await mk(redis_store, "clean", 1)
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
        for new in ["chat\u200b2", "x\u202ey", "x\u2067", "\ufeff", "soft\u00adhyphen"]:
            for url, body in [
                ("/sessions", {"id": new, "entries": [um_entry("x")]}),
                (path("clean", "branch"), {"at": 1, "id": new}),
                (path("clean", "fork"), {"id": new}),
            ]:
                r = await client.post(url, json=body)
                assert r.status_code == 400 and r.json()["error"] == "bad_request", (url, new, r.text)
                assert "Cf" in r.json()["message"], r.text
            assert await redis_store.head(new) is None
        # branching an old one by default copies its id into the child's: refused, with the way out
        r = await client.post(path(old[0], "branch"), json={"at": 1})
        assert r.status_code == 400 and "explicit branch_id" in r.json()["message"], r.text
        listed = {h["id"] for h in (await client.get("/sessions")).json()["items"]}
        assert listed == {*old, "clean"}
        for sid in old:
            head = await client.get(path(sid))
            assert head.status_code == 200 and head.json()["n"] == 2, (sid, head.text)
            assert [e["n"] for e in (await client.get(path(sid, "entries"))).json()["entries"]] == [0, 1]
            assert (await client.post(path(sid, "entries"), json=um_entry("more"))).status_code == 201
            child = await client.post(path(sid, "branch"), json={"at": 1, "id": f"copy-{len(sid)}-{ord(sid[1])}"})
            assert child.status_code == 201, child.text
            assert (await client.delete(path(sid))).status_code == 204
            assert (await client.get(path(sid))).status_code == 404
    for sid in old:
        assert await redis_store.head(sid) is None
    assert len((await redis_store.list()).items) == 1 + len(old)  # clean and the branches


async def raw_http(base: str, request: bytes) -> tuple[int, bytes]:
    """Send `request` as it is over a TCP socket to the server at `base` (it asks the server to close
    the connection); the status and the body of the answer."""
    host, port = base.removeprefix("http://").split(":")
    stream = await anyio.connect_tcp(host, int(port))
    chunks: list[bytes] = []
    try:
        await stream.send(request)
        with anyio.fail_after(60):
            while True:
                try:
                    chunks.append(await stream.receive())
                except anyio.EndOfStream:
                    break
    finally:
        await stream.aclose()
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


_NO_HTTPTOOLS = importlib.util.find_spec("httptools") is None
PARSERS = [
    "h11",
    pytest.param("httptools", marks=pytest.mark.skipif(_NO_HTTPTOOLS, reason="httptools (the fast extra) is missing")),
]


@pytest.mark.parametrize("http", PARSERS)
async def test_an_ambiguous_host_reaches_no_route(redis_store: RedisSessionStore, http: str) -> None:
    """The host check read one Host value while other layers read another: with two Host headers
    (httptools passes both; the check took the last, Starlette the first) or an absolute-form
    target (``POST http://evil.example/...`` with an allowed Host: httptools drops the authority,
    which RFC 9112 says is the host the request is for), a write reached its route. Now the host
    must be unambiguous on every route (400, the gateway's JSON, before any handler) — the same on
    both parsers (h11 refuses two Host headers itself, httptools a target that is no URL)."""
    await mk(redis_store, "victim", 1)
    entry = json.dumps(um_entry("pwned")).encode()
    async with running_gateway(redis_store, http=http) as base:
        port = base.rsplit(":", 1)[1]
        me = f"127.0.0.1:{port}"

        def post(target: str, *hosts: str) -> bytes:
            lines = [f"POST {target} HTTP/1.1", *(f"Host: {h}" for h in hosts)]
            lines += ["Content-Type: application/json", f"Content-Length: {len(entry)}", "Connection: close"]
            return ("\r\n".join(lines) + "\r\n\r\n").encode() + entry

        # (name, request, the parser that lets it through to the guard: its 400 is the gateway's JSON)
        attacks = [
            ("evil Host first", post("/sessions/victim/entries", f"evil.example:{port}", me), "httptools"),
            ("evil Host last", post("/sessions/victim/entries", me, f"evil.example:{port}"), "httptools"),
            ("absolute-form", post(f"http://evil.example:{port}/sessions/victim/entries", me), "both"),
            ("userinfo", post(f"http://{me}@evil.example:{port}/sessions/victim/entries", me), "both"),
            ("another allowed name", post(f"http://localhost:{port}/sessions/victim/entries", me), "both"),
            ("no port in the target", post("http://127.0.0.1/sessions/victim/entries", me), "both"),
            ("a list in Host", post("/sessions/victim/entries", f"{me}, evil.example:{port}"), "both"),
            ("not a URL", post("http://[evil.example/sessions/victim/entries", me), "h11"),
            ("a probe", post(f"http://evil.example:{port}/healthz", me).replace(b"POST", b"GET", 1), "both"),
            ("two Origin headers", post("/sessions/victim/entries", me).replace(
                b"Connection:", f"Origin: http://{me}\r\nOrigin: http://evil.example\r\nConnection:".encode()
            ), "both"),
        ]  # fmt: skip
        for name, request, reaches in attacks:
            status, body = await raw_http(base, request)
            assert status == 400, (name, status, body[:200])
            if reaches in ("both", http):  # else the parser refused it itself (its own plain 400)
                assert json.loads(body)["error"] == "bad_request", (name, body[:200])
        # an absolute-form target naming the Host itself is the same request (RFC 9112 §3.2.2)
        status, body = await raw_http(base, post(f"http://{me}/sessions/victim/entries", me))
        assert status == 201, body[:200]
        status, body = await raw_http(base, f"GET http://{me}/sessions/victim HTTP/1.1\r\nHost: {me}\r\n"
                                            "Connection: close\r\n\r\n".encode())  # fmt: skip
        assert status == 200 and json.loads(body)["n"] == 2, body[:200]
    assert [e.data["content"] for e in await redis_store.read("victim")] == ["m0", "pwned"]


@pytest.mark.parametrize("http", PARSERS)
async def test_a_malformed_host_port_is_a_400(redis_store: RedisSessionStore, http: str) -> None:
    """``Host: 127.0.0.1:99999`` passed the host check (1-5 digits) and reached the routes, where
    anything that takes the port (urllib's ``.port``) fails: a port above 65535, an IPv6 literal
    that is none, an empty port or one of non-digits is refused before any route, on every route
    (the probes too), with the gateway's JSON 400 — and nothing is written."""
    await mk(redis_store, "hp", 1)
    entry = json.dumps(um_entry("through")).encode()
    bad = [
        "127.0.0.1:99999", "127.0.0.1:65536", "localhost:100000", "[::1]:99999", "[::1]:65536",
        "127.0.0.1:", "[::1]:", "127.0.0.1:8o", "127.0.0.1:-1", "127.0.0.1:+80", "[::1]x", "[::1",
        "[:::::]", "[1.2.3.4]", "[::1]:80:80", "127.0.0.1:80:80",
    ]  # fmt: skip
    async with running_gateway(redis_store, http=http) as base:
        for host in bad:
            for method, target in [("POST", "/sessions/hp/entries"), ("GET", "/sessions/hp"), ("GET", "/healthz")]:
                body = entry if method == "POST" else b""
                request = (
                    f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                ).encode() + body
                status, answer = await raw_http(base, request)
                assert status == 400, (host, target, status, answer[:200])
                if answer:  # h11 refuses some itself (its own plain 400); ours is JSON
                    got = json.loads(answer)
                    assert got["error"] == "bad_request" and "Host" in got["message"], (host, got)
        for host in ["127.0.0.1:65535", "127.0.0.1:1", "[::1]:8765", "localhost"]:  # still served
            request = f"GET /sessions/hp HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            status, answer = await raw_http(base, request)
            assert status == 200, (host, status, answer[:200])
    assert [e.data["content"] for e in await redis_store.read("hp")] == ["m0"]


async def test_allowed_hosts_are_configurable(redis_store: RedisSessionStore) -> None:
    await mk(redis_store, "h", 1)
    async with (
        running_gateway(redis_store, allowed_hosts=["gw.example.com", ".corp.example"]) as base,
        httpx.AsyncClient(base_url=base, timeout=10) as client,
    ):
        for host, status in [
            ("gw.example.com", 200),
            ("gw.example.com:8765", 200),
            ("corp.example", 200),
            ("a.b.corp.example", 200),
            ("evil-corp.example", 421),
            ("sub.gw.example.com", 421),
            ("127.0.0.1", 421),  # the list replaces the default
            ("", 421),
        ]:
            assert (await client.get("/sessions/h", headers={"Host": host})).status_code == status, host


async def test_a_host_with_an_empty_label_is_a_400(redis_store: RedisSessionStore) -> None:
    """With ``.example.com`` allowed, ``Host: .example.com``, ``..example.com`` and
    ``a..example.com`` (empty DNS labels: no host name) were served; they are a 400, on the probes
    too. A name with one trailing dot (the root) is still a name."""
    await mk(redis_store, "e", 1)
    async with running_gateway(redis_store, allowed_hosts=[".example.com"]) as base:
        for host in [".example.com", "..example.com", "a..example.com", ".example.com:80", "a.example.com..", "."]:
            for target in ("/sessions/e", "/healthz"):
                request = f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
                status, answer = await raw_http(base, request)
                assert status == 400, (host, target, status, answer[:200])
                assert json.loads(answer)["error"] == "bad_request", (host, answer[:200])
        for host, status in [("a.example.com", 200), ("example.com:8765", 200), ("a.example.com.", 200)]:
            request = f"GET /sessions/e HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            got, answer = await raw_http(base, request)
            assert got == status, (host, got, answer[:200])


async def test_cors_only_for_allowed_origins(redis_store: RedisSessionStore) -> None:
    """No origin by default; an allowed one gets its preflight and CORS headers on every
    answer (SSE included); any other origin's page can write nothing."""
    await mk(redis_store, "c", 1)
    app_origin = "http://app.example:3000"
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, if-match"}
    with anyio.fail_after(30):
        async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
            r = await client.options("/sessions/c/entries", headers={"Origin": app_origin, **pre})
            assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
            r = await client.post("/sessions/c/entries", headers={"Origin": app_origin}, json=um_entry("x"))
            assert r.status_code == 403
            r = await client.get("/sessions/c", headers={"Origin": app_origin})
            assert "access-control-allow-origin" not in r.headers  # served, but the page cannot read it
        async with (
            running_gateway(redis_store, allowed_origins=[app_origin], token="tok") as base,
            httpx.AsyncClient(base_url=base, timeout=10) as client,
        ):
            r = await client.options("/sessions/c/entries", headers={"Origin": app_origin, **pre})
            assert r.status_code == 204, r.text
            assert r.headers["access-control-allow-origin"] == app_origin
            assert "if-match" in r.headers["access-control-allow-headers"]
            assert "POST" in r.headers["access-control-allow-methods"]
            auth = {"Origin": app_origin, "Authorization": "Bearer tok"}
            r = await client.post("/sessions/c/entries", headers=auth, json=um_entry("from the app"))
            assert r.status_code == 201 and r.headers["access-control-allow-origin"] == app_origin
            assert "etag" in r.headers["access-control-expose-headers"]
            async with client.stream("GET", "/sessions/c/events", headers=auth) as s:
                assert s.status_code == 200 and s.headers["access-control-allow-origin"] == app_origin
            other = {"Origin": "http://other.example:3000", "Authorization": "Bearer tok"}
            assert (await client.post("/sessions/c/entries", headers=other, json=um_entry("no"))).status_code == 403
            # a 401 still carries the CORS header, so the page can tell "sign in" from "blocked"
            r = await client.get("/sessions/c", headers={"Origin": app_origin})
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == app_origin
    assert (await redis_store.head("c")).n == 2  # type: ignore[union-attr]


def um_entry(text: str) -> dict[str, Any]:
    return {"type": "user/message", "data": {"content": text}}


HOSTILE_BODIES: list[tuple[str, str, bytes, int, str | None]] = [
    # (name, route, body, status, path)
    ("4 KB of nested arrays", "entries", b"[" * 2048 + b"]" * 2048, 422, "$"),
    ("nested in data", "entries", b'{"type":"x/y","data":{"a":' + b"[" * 2000 + b"]" * 2000 + b"}}", 422, "$"),
    ("65 levels", "entries", b'{"type":"x/y","data":{"a":' + b"[" * 64 + b"]" * 64 + b"}}", 422, "$.data.a[0]"),
    ("ttl 1e308", "create", b'{"id":"t","ttl":1e308}', 422, "$.ttl"),
    ("ttl -0.0", "create", b'{"id":"t","ttl":-0.0}', 422, "$.ttl"),
    ("ttl NaN", "create", b'{"id":"t","ttl":NaN}', 400, None),
    ("NaN in data", "entries", b'{"type":"x/y","data":{"a":NaN}}', 400, None),
    ("Infinity", "entries", b'{"type":"x/y","data":{"a":1e999}}', 400, None),
    ("2^53+1 in data", "entries", b'{"type":"x/y","data":{"a":[1,9007199254740993]}}', 422, "$.data.a[1]"),
    ("-(2^53+1)", "entries", b'{"type":"x/y","data":{"a":-9007199254740993}}', 422, "$.data.a"),
    ("2^53+1 time", "entries", b'{"type":"x/y","data":{},"time":9007199254740993}', 422, "$.time"),
    ("2^53+1 depth", "create", b'{"id":"t","delegation_depth":9007199254740993}', 422, "$.delegation_depth"),
    ("2^53+1 at", "branch", b'{"at":9007199254740993}', 422, "$.at"),
    ("invalid UTF-8", "entries", b'{"type":"x/y","data":{"a":"\xff\xfe"}}', 400, None),
    ("lone surrogate", "entries", b'{"type":"x/y","data":{"a":"\\ud800"}}', 400, None),
    ("lone low surrogate key", "entries", b'{"type":"x/y","data":{"\\udc00":1}}', 400, None),
    ("duplicate keys", "entries", b'{"type":"x/y","type":"a/b","data":{}}', 422, "$"),
    ("duplicate in data", "entries", b'{"type":"x/y","data":{"k":1,"k":2}}', 422, "$.data"),
    ("duplicate in create", "create", b'{"id":"t","id":"u"}', 422, "$"),
]


@pytest.mark.parametrize(
    ("name", "route", "body", "status", "where"), HOSTILE_BODIES, ids=[b[0] for b in HOSTILE_BODIES]
)
async def test_hostile_small_bodies_are_4xx_with_the_path_and_write_nothing(
    redis_store: RedisSessionStore,
    caplog: pytest.LogCaptureFixture,
    name: str,
    route: str,
    body: bytes,
    status: int,
    where: str | None,
) -> None:
    """These answered 500 with a traceback (RecursionError, OverflowError) or were
    stored as something else than was sent (duplicates, integers JavaScript rounds)."""
    await mk(redis_store, "b", 1)
    url = {"entries": path("b", "entries"), "create": "/sessions", "branch": path("b", "branch")}[route]
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
        r = await client.post(url, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    got = r.json()
    if where is not None:
        assert got["path"] == where or got["path"].startswith(where + "["), got["path"]
    assert "Traceback" not in r.text
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert (await redis_store.head("b")).n == 1  # type: ignore[union-attr]
    assert await redis_store.head("t") is None and await redis_store.head("u") is None
    assert [h.id for h in (await redis_store.list()).items] == ["b"]


DUPLICATES: list[tuple[str, bytes, str, str]] = [
    # (route, body, path of the object holding the duplicate, the duplicate name)
    ("entries", b'{"type":"x/y","type":"a/b","data":{}}', "$", "type"),
    ("entries", b'{"type":"x/y","data":{"k":1,"k":2}}', "$.data", "k"),
    (
        "entries",
        b'{"entries":[{"type":"x/y","data":{"a":1}},{"type":"x/y","data":{"a":{"deep":[{"z":1,"z":2}]}}}]}',
        "$.entries[1].data.a.deep[0]",
        "z",
    ),
    ("entries", b'[{"type":"x/y","data":{}},{"type":"x/y","data":{},"meta":{"m":1,"m":1}}]', "$[1].meta", "m"),
    ("create", b'{"id":"t","entries":[{"type":"x/y","data":{"a":1,"b":2,"a":3}}]}', "$.entries[0].data", "a"),
    ("branch", b'{"at":0,"origin":{"o":{"p":1,"p":2}}}', "$.origin.o", "p"),
]


@pytest.mark.parametrize(("route", "body", "where", "key"), DUPLICATES, ids=[d[2] for d in DUPLICATES])
async def test_a_duplicate_member_name_is_a_422_naming_its_object_and_the_name(
    redis_store: RedisSessionStore, route: str, body: bytes, where: str, key: str
) -> None:
    """A duplicate member name answered 422 with `path` "$" wherever it was; the path now names
    the object holding it (as the other I-JSON errors name their field) and the message the name."""
    await mk(redis_store, "b", 1)
    url = {"entries": path("b", "entries"), "create": "/sessions", "branch": path("b", "branch")}[route]
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
        r = await client.post(url, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    got = r.json()
    assert got["error"] == "invalid" and got["path"] == where, got
    assert repr(key) in got["message"] and where in got["message"], got["message"]
    assert (await redis_store.head("b")).n == 1  # type: ignore[union-attr]
    assert [h.id for h in (await redis_store.list()).items] == ["b"]


_json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text()
)
_json_values = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


def _mangle(doc: Any, cut: int, junk: bytes) -> bytes:
    raw = json.dumps(doc, allow_nan=True).encode()
    return raw[:cut] + junk + raw[cut:] if junk else raw


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    doc=st.one_of(
        _json_values,
        st.fixed_dictionaries({"type": st.text(max_size=12), "data": _json_values}),
        st.fixed_dictionaries({"entries": st.lists(st.fixed_dictionaries({"type": st.text(), "data": _json_values}))}),
    ),
    cut=st.integers(0, 200),
    junk=st.one_of(
        st.just(b""), st.binary(max_size=6), st.sampled_from([b"[", b"]", b'"', b"\\ud800", b",", b'"a":1,'])
    ),
    depth=st.integers(0, 3000),
)
def test_fuzz_the_body_decoder_raises_only_client_errors(doc: Any, cut: int, junk: bytes, depth: int) -> None:
    """Whatever the bytes, the body decoder and the entry parser answer or raise a 4xx error, never
    anything else (a RecursionError, an OverflowError, a UnicodeError …)."""
    raw = _mangle(doc, cut, junk)
    if depth > 2500:
        raw = b"[" * depth + raw + b"]" * depth
    for fn in (body_mod.decode_json, lambda r: body_mod.parse_entries(r, 1000)):
        try:
            value = fn(raw)
        except (common_mod._BadRequest, body_mod.Unprocessable, body_mod.TooLarge):
            continue
        if fn is body_mod.decode_json:  # what passes is I-JSON: it survives an encode and decode unchanged
            again = json.loads(json.dumps(value, allow_nan=False))
            assert again == value


def test_workers_share_the_port_and_stop_on_sigterm(redis_url: str, prefix: str) -> None:
    """`--workers 2`: two processes accept on one socket; SIGTERM stops them all, exit 0."""
    port = _free_port()
    # a prefix of its own: a shared server (CI's Redis keeps db 15 between runs) holds other runs' keys
    cmd = _gateway_cmd("--url", redis_url, "--prefix", prefix, "--port", str(port), "--workers", "2", env={})
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env())
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            r = client.post("/sessions", json={"id": "w-1"})
            assert r.status_code == 201
            for _ in range(20):  # new connections, whichever worker takes them
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as fresh:
                    assert fresh.get("/sessions/w-1").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        anyio.run(cleanup_prefix, redis_url, prefix)
    assert proc.returncode == 0, stderr
    assert "2 worker processes" in stderr


def test_sigterm_with_a_reader_that_stopped_reading_stops_at_once_and_cleanly(redis_url: str, prefix: str) -> None:
    """SIGTERM while a client that stopped reading holds a stream whose writes are backed up: its
    connection is dropped, so the gateway stops at once, exits 0 and logs no error (it waited out
    uvicorn's 3 s graceful timeout, then logged a cancelled task and an incomplete response)."""
    port = _free_port()
    cmd = _gateway_cmd("--url", redis_url, "--prefix", prefix, "--port", str(port), env={})
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env())
    stalled = socket.socket()
    try:
        _big_backlog(proc, port)
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", port))
        stalled.sendall(b"GET /sessions/big/events?start=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        stalled.recv(1024)  # the answer began; then nothing more is read
        time.sleep(1.0)  # the gateway's writes back up behind it
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - started
    finally:
        stalled.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        anyio.run(cleanup_prefix, redis_url, prefix)
    assert proc.returncode == 0, stderr
    assert "ERROR" not in stderr, stderr
    assert took < 2.9, took  # under uvicorn's graceful timeout: nothing waited it out


def test_sigterm_lets_a_slow_reader_that_reads_get_its_stream_end(redis_url: str, prefix: str) -> None:
    """SIGTERM while a client reads a large backlog more slowly than the gateway writes it (its
    writes are held back all the time): it still reads, so its connection is not dropped, and its
    stream ends properly (the chunked body's last chunk), exit 0, no error logged."""
    port = _free_port()
    cmd = _gateway_cmd("--url", redis_url, "--prefix", prefix, "--port", str(port), env={})
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env())
    reader = socket.socket()
    got = bytearray()
    done = threading.Event()

    def read_slowly() -> None:
        with contextlib.suppress(OSError):
            while chunk := reader.recv(128 * 1024):
                got.extend(chunk)
                if got.endswith(b"0\r\n\r\n"):
                    break
                time.sleep(0.05)  # ~2.6 MB/s
        done.set()

    try:
        _big_backlog(proc, port)
        reader.connect(("127.0.0.1", port))
        reader.sendall(b"GET /sessions/big/events?start=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        threading.Thread(target=read_slowly, daemon=True).start()
        wait_until(lambda: len(got) > 1 << 20, within=60)  # reading, behind the gateway's writes
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        assert done.wait(30)
    finally:
        reader.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        anyio.run(cleanup_prefix, redis_url, prefix)
    assert got.endswith(b"0\r\n\r\n"), bytes(got[-80:])
    assert proc.returncode == 0, stderr
    assert "ERROR" not in stderr, stderr


def _big_backlog(proc: subprocess.Popen[str], port: int) -> None:
    """Wait for the gateway process to serve, then give it session ``big``: 12 MB of backlog,
    more than the sockets between it and a client hold."""
    wait_until(lambda: _ready(port) or proc.poll() is not None, within=60)
    assert proc.poll() is None, "the gateway did not start"
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        assert client.post("/sessions", json={"id": "big"}).status_code == 201
        pad = "x" * 200_000
        for k in range(0, 60, 10):
            batch = [{"type": "test/mark", "data": {"pad": pad}} for _ in range(10)]
            r = client.post("/sessions/big/entries", json={"entries": batch}, headers={"If-Match": f'"{k}"'})
            assert r.status_code == 201, r.text


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _children(pid: int) -> list[int]:
    """The live (not zombie) child processes of `pid`, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid and stat[0] != "Z":
                found.append(int(entry))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers in /proc")
@pytest.mark.parametrize("to", ["parent", "group"])
def test_workers_stop_cleanly_on_ctrl_c(redis_url: str, prefix: str, to: str) -> None:
    """Ctrl-C on `--workers 2` (SIGINT to the parent, or to the whole foreground process group as
    a terminal sends it) printed a KeyboardInterrupt traceback from each worker, or hung: the
    workers took SIGINT themselves as well as the parent's copy. Workers ignore SIGINT; the parent
    asks them to stop with SIGTERM (a graceful stop) and waits: exit 0, no traceback."""
    port = _free_port()
    cmd = _gateway_cmd("--url", redis_url, "--prefix", prefix, "--port", str(port), "--workers", "2", env={})
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env(), start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.05)
        for _ in range(10):  # both workers are up and serving (each new connection: either one)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as fresh:
                assert fresh.get("/readyz").status_code == 200
        assert httpx.post(f"http://127.0.0.1:{port}/sessions", json={"id": "cc"}, timeout=10).status_code == 201
        opened: list[int] = []

        def follow() -> None:  # an open live tail, as a viewer holds one
            with contextlib.suppress(httpx.HTTPError):
                with httpx.stream("GET", f"http://127.0.0.1:{port}/sessions/cc/events", timeout=60) as r:
                    opened.append(r.status_code)
                    for _ in r.iter_lines():
                        pass

        followers = [threading.Thread(target=follow, daemon=True) for _ in range(6)]
        for t in followers:
            t.start()
        wait_until(lambda: len(opened) == len(followers), within=60)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        for pid in workers:  # a worker is not stopped by a SIGINT of its own: the parent decides
            os.kill(pid, signal.SIGINT)
        for _ in range(10):
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as fresh:
                assert fresh.get("/healthz").status_code == 200
        assert sorted(_children(proc.pid)) == sorted(workers) and proc.poll() is None
        if to == "parent":
            proc.send_signal(signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)  # a hang guard: the stop itself takes < 4 s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        anyio.run(cleanup_prefix, redis_url, prefix)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    for t in followers:  # every stream was ended by the stop
        t.join(timeout=30)
        assert not t.is_alive()
    with pytest.raises(httpx.TransportError):  # no worker is left serving
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)


async def test_sign_in_sets_an_httponly_cookie_that_authenticates(redis_store: RedisSessionStore) -> None:
    await mk(redis_store, "sc", 1)
    async with running_gateway(redis_store, token="tok+/=") as base, httpx.AsyncClient(base_url=base) as client:
        assert (await client.post("/signin", json={"token": "nope"})).status_code == 401
        evil = await client.post("/signin", json={"token": "tok+/="}, headers={"Origin": "http://evil.example"})
        assert evil.status_code == 403 and "set-cookie" not in evil.headers
        r = await client.post("/signin", json={"token": "tok+/="})
        assert r.status_code == 204
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
        assert (await client.get("/sessions/sc")).status_code == 200  # the client keeps the cookie
        form = await client.post(
            "/signin", data={"token": "tok+/=", "next": "#sc"}, headers={"Origin": base}, follow_redirects=False
        )
        assert form.status_code == 303 and form.headers["location"] == "./#sc"
        out = await client.post("/signout", follow_redirects=False)
        assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]
        client.cookies.clear()
        assert (await client.get("/sessions/sc")).status_code == 401


async def test_sign_in_behind_a_tls_ingress_sets_a_secure_cookie_and_refuses_odd_bodies(
    redis_store: RedisSessionStore,
) -> None:
    """Behind an ingress that ends TLS the gateway sees plain http with the public Host: its cookie
    (the token itself) must still be Secure, so a browser never sends it over http. A local gateway
    (127.0.0.1) keeps it usable over plain http. A declared oversize body is refused at once, and
    a duplicate member name (`{"token": a, "token": b}`), NaN, a lone surrogate, an integer
    beyond 2^53 or a deep nesting is not taken: the body rule of every route."""
    async with (
        running_gateway(
            redis_store, token="tok", allowed_hosts=["127.0.0.1", "localhost", "sessions.example.com"]
        ) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        local = await client.post("/signin", json={"token": "tok"})
        assert local.status_code == 204 and "secure" not in local.headers["set-cookie"].lower()
        public = await client.post(
            "/signin", json={"token": "tok"}, headers={"Host": "sessions.example.com", "X-Forwarded-Proto": "https"}
        )
        assert public.status_code == 204, public.text
        assert "; Secure" in public.headers["set-cookie"], public.headers["set-cookie"]
        dup = await client.post("/signin", content=b'{"token":"nope","token":"tok"}',
                                headers={"Content-Type": "application/json"})  # fmt: skip
        assert dup.status_code == 422 and "set-cookie" not in dup.headers
        # the body rule of every route (I-JSON): nothing else signs in either
        odd = {
            b'{"token":"tok","x":NaN}': 400,
            b'{"token":"tok","x":Infinity}': 400,
            b'{"token":"tok","x":"\\ud800"}': 400,
            b'{"token":"tok","x":18446744073709551616}': 422,
            b'{"token":"tok","x":' + b"[" * 100 + b"]" * 100 + b"}": 422,
            b"  ": 400,
        }
        for raw, status in odd.items():
            r = await client.post("/signin", content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == status and "set-cookie" not in r.headers, (raw[:40], r.status_code, r.text)
            assert r.json()["error"] in ("bad_request", "invalid")
        host, port = base.removeprefix("http://").split(":")
        stream = await anyio.connect_tcp(host, int(port))
        try:
            await stream.send(
                f"POST /signin HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                "Content-Length: 999999999999\r\n\r\n{".encode()
            )
            with anyio.fail_after(60):  # answered without the body, which never comes: not after it
                reply = await stream.receive()
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        finally:
            await stream.aclose()


def test_workers_end_when_their_parent_is_killed(redis_url: str, prefix: str) -> None:
    """`--workers 2` whose parent was SIGKILLed (no stop passed on) left both workers serving,
    orphaned, holding the port: they get SIGTERM when the parent dies (a parent-death signal)."""
    port = _free_port()
    cmd = _gateway_cmd("--url", redis_url, "--prefix", prefix, "--port", str(port), "--workers", "2", env={})
    proc = subprocess.Popen(
        cmd, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=_env(), start_new_session=True
    )
    workers: list[int] = []
    try:
        wait_until(lambda: len(_children(proc.pid)) == 2, within=60)
        workers = _children(proc.pid)
        proc.kill()
        proc.wait(timeout=30)

        def gone(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/status") as f:
                    return "State:\tZ" in f.read()
            except FileNotFoundError:
                return True

        wait_until(lambda: all(gone(pid) for pid in workers), within=60)
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        anyio.run(cleanup_prefix, redis_url, prefix)
