"""HTTP writes through the gateway on a real uvicorn server and a real Redis: every route and status
code, expected n (If-Match / ETag / 412), idempotency keys, incarnation pins, bad input that writes
nothing, scoped and tenant-confined tokens, and many concurrent HTTP writers."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import pytest

from redis_session import NewEntry, RedisSessionStore, SessionHeader
from redis_session.gateway.auth import Token, TokenSet, load_tokens, parse_tokens
from redis_session.gateway.sse import parse_resume

from support import running_gateway

pytestmark = pytest.mark.anyio


def path(session_id: str, sub: str = "") -> str:
    return "/sessions/" + quote(session_id, safe="") + (f"/{sub}" if sub else "")


def um(text: str) -> dict[str, Any]:
    return {"type": "user/message", "data": {"content": text}}


def am(text: str) -> dict[str, Any]:
    return {"type": "assistant/message", "data": {"content": text}}


def etag(r: httpx.Response) -> int:
    return int(r.headers["etag"].strip('"'))


@pytest.fixture
async def client(redis_store: RedisSessionStore) -> AsyncIterator[httpx.AsyncClient]:
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=20) as c:
        yield c


async def snapshot(store: RedisSessionStore, sid: str) -> tuple[int, list[Any]] | None:
    head = await store.head(sid)
    return None if head is None else (head.n, await store.read(sid))


# --------------------------------------------------------------------------- create, append, If-Match


async def test_create_append_if_match_and_412(client: httpx.AsyncClient, redis_store: RedisSessionStore) -> None:
    r = await client.post("/sessions", json={"id": "c1", "title": "hi", "entries": [um("hello")]})
    assert r.status_code == 201, r.text
    assert r.json()["n"] == 1 and r.json()["header"]["title"] == "hi" and etag(r) == 1
    inc = r.json()["header"]["incarnation"]
    assert r.headers["x-session-incarnation"] == inc
    assert (await client.post("/sessions", json={"id": "c1"})).status_code == 409

    r = await client.post(path("c1", "entries"), json=am("hi!"), headers={"If-Match": '"1"'})
    assert r.status_code == 201 and etag(r) == 2
    assert [e["n"] for e in r.json()["entries"]] == [1] and r.json()["n"] == 2

    before = await snapshot(redis_store, "c1")
    r = await client.post(path("c1", "entries"), json=am("stale"), headers={"If-Match": '"1"'})
    assert r.status_code == 412 and etag(r) == 2
    assert r.json() | {"message": ""} == {"error": "conflict", "message": "", "expected_n": 1, "actual_n": 2}
    assert await snapshot(redis_store, "c1") == before

    # `*` and no If-Match append at the end; a batch lands in one piece; a bare list is a batch too
    assert etag(await client.post(path("c1", "entries"), json=um("a"), headers={"If-Match": "*"})) == 3
    r = await client.post(path("c1", "entries"), json={"entries": [um("b"), am("c")]})
    assert r.status_code == 201 and [e["n"] for e in r.json()["entries"]] == [3, 4]
    r = await client.post(path("c1", "entries"), json=[um("d"), am("e")], headers={"If-Match": f'"5;{inc}"'})
    assert r.status_code == 201 and etag(r) == 7
    r = await client.get(path("c1"))
    assert etag(r) == 7 and r.headers["x-session-incarnation"] == inc

    # a tenantless create without an id gets a fresh one
    r = await client.post("/sessions", json={})
    assert r.status_code == 201 and r.json()["id"].startswith("session-")
    assert (await client.post("/sessions")).status_code == 201  # no body at all


async def test_idempotency_key_retries_return_the_same_answer(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await redis_store.create(SessionHeader(id="i"))
    h = {"Idempotency-Key": "turn-1", "If-Match": '"0"'}
    first = await client.post(path("i", "entries"), json=[um("q"), am("a")], headers=h)
    assert first.status_code == 201
    await redis_store.put("i", None, [("test/mark", {})])  # someone else writes in between
    again = await client.post(path("i", "entries"), json=[um("q"), am("a")], headers=h)  # If-Match now stale
    assert (again.status_code, again.json(), again.headers["etag"]) == (201, first.json(), first.headers["etag"])
    assert (await redis_store.head("i")).n == 3  # written once  # type: ignore[union-attr]
    r = await client.post(path("i", "entries"), json=[um("other")], headers={"Idempotency-Key": "turn-1"})
    assert r.status_code == 422 and r.json()["error"] == "idempotency_key_reused"
    assert (await redis_store.head("i")).n == 3  # type: ignore[union-attr]

    # create: a retry of a landed create answers it again; another body with the key is a 409
    body = {"id": "ic", "title": "t", "entries": [um("x")]}
    r1 = await client.post("/sessions", json=body, headers={"Idempotency-Key": "mk"})
    r2 = await client.post("/sessions", json=body, headers={"Idempotency-Key": "mk"})
    assert r1.status_code == r2.status_code == 201 and r1.json()["header"] == r2.json()["header"]
    assert (await client.post("/sessions", json=body)).status_code == 409  # no key: it exists
    r = await client.post("/sessions", json=body | {"title": "other"}, headers={"Idempotency-Key": "mk"})
    assert r.status_code == 422 and r.json()["error"] == "idempotency_key_reused"  # as an append's key

    # branch / fork without an id: the key decides the id, so a retry finds the same child
    b1 = await client.post(path("i", "branch"), json={"at": 1}, headers={"Idempotency-Key": "br"})
    b2 = await client.post(path("i", "branch"), json={"at": 1}, headers={"Idempotency-Key": "br"})
    assert b1.status_code == b2.status_code == 201 and b1.json()["id"] == b2.json()["id"]
    r = await client.post(path("i", "branch"), json={"at": 2}, headers={"Idempotency-Key": "br"})
    assert r.status_code == 422 and r.json()["error"] == "idempotency_key_reused"
    kids = (await client.get("/sessions", params={"parent": "i"})).json()["items"]
    assert [k["id"] for k in kids] == [b1.json()["id"]]


async def test_a_keyed_create_retried_after_a_delete_makes_nothing(client: httpx.AsyncClient) -> None:
    """A keyed create (and branch, and fork) whose reply was lost, retried after another client
    deleted what it made: 409 session_replaced and nothing made — it used to make the deleted
    session again (its title, its entries), the retry silently undoing the delete. Without the
    key, or with another, the id is made anew."""
    turn = [
        {"type": "turn/start", "data": {"turn": 1}},
        um("x"),
        {"type": "turn/end", "data": {"turn": 1, "reason": "completed"}},
    ]
    body = {"id": "once", "title": "t", "entries": turn}
    assert (await client.post("/sessions", json=body, headers={"Idempotency-Key": "k1"})).status_code == 201
    b = await client.post(path("once", "branch"), json={"at": 1}, headers={"Idempotency-Key": "kb"})
    f = await client.post(path("once", "fork"), json={"id": "once-f"}, headers={"Idempotency-Key": "kf"})
    assert b.status_code == f.status_code == 201, (b.text, f.text)
    for sid in (b.json()["id"], "once-f"):
        assert (await client.delete(path(sid))).status_code == 204
    assert (await client.delete(path("once"))).status_code == 204
    for method_path, payload, key in (
        ("/sessions", body, "k1"),
        (path("once", "branch"), {"at": 1}, "kb"),
        (path("once", "fork"), {"id": "once-f"}, "kf"),
    ):
        r = await client.post(method_path, json=payload, headers={"Idempotency-Key": key})
        if method_path == "/sessions":
            assert (r.status_code, r.json()["error"]) == (409, "session_replaced"), r.text
            assert "deleted since" in r.json()["message"]
        else:  # the parent is gone too: its branch and fork are refused before their create
            assert r.status_code == 404, r.text
    assert (await client.get(path("once"))).status_code == 404
    again = await client.post("/sessions", json=body, headers={"Idempotency-Key": "k2"})
    late = await client.post("/sessions", json=body, headers={"Idempotency-Key": "k1"})  # another life holds it
    assert (late.status_code, late.json()["error"]) == (409, "session_replaced"), late.text
    assert again.status_code == 201 and len((await client.get(path("once", "entries"))).json()["entries"]) == 3
    # a branch made and deleted under a live parent: its keyed retry is refused, the parent unlinked
    b = await client.post(path("once", "branch"), json={"at": 1}, headers={"Idempotency-Key": "kb2"})
    assert (await client.delete(path(b.json()["id"]))).status_code == 204
    r = await client.post(path("once", "branch"), json={"at": 1}, headers={"Idempotency-Key": "kb2"})
    assert (r.status_code, r.json()["error"]) == (409, "session_replaced"), r.text
    assert (await client.get("/sessions", params={"parent": "once"})).json()["items"] == []


async def test_a_keyed_create_or_branch_is_never_another_clients(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    """The key is recorded with the creation; another key (or none) for the same new id
    is a 409 already_exists, whatever the body, and only the creating key replays its 201."""
    turn = [
        {"type": "turn/start", "data": {"turn": 1}},
        um("x"),
        {"type": "turn/end", "data": {"turn": 1, "reason": "completed"}},
    ]
    body = {"id": "race", "title": "t", "entries": turn}
    mine = await client.post("/sessions", json=body, headers={"Idempotency-Key": "client-a"})
    assert mine.status_code == 201
    for headers in ({"Idempotency-Key": "client-b"}, {}):
        r = await client.post("/sessions", json=body, headers=headers)
        assert (r.status_code, r.json()["error"]) == (409, "already_exists"), headers
    again = await client.post("/sessions", json=body, headers={"Idempotency-Key": "client-a"})
    assert again.status_code == 201 and again.json()["header"] == mine.json()["header"]
    assert mine.json()["header"]["create_key"] not in (None, "client-a")  # a digest, not the key
    # a session created without a key is nobody's retry
    await redis_store.create(SessionHeader(id="plain"))
    r = await client.post("/sessions", json={"id": "plain"}, headers={"Idempotency-Key": "client-a"})
    assert r.status_code == 409

    # a branch (and a fork) to an explicit id: the same
    b = await client.post(path("race", "branch"), json={"at": 1, "id": "race-b"}, headers={"Idempotency-Key": "ka"})
    assert b.status_code == 201
    for headers in ({"Idempotency-Key": "kb"}, {}):
        r = await client.post(path("race", "branch"), json={"at": 1, "id": "race-b"}, headers=headers)
        assert (r.status_code, r.json()["error"]) == (409, "already_exists"), headers
    r = await client.post(path("race", "branch"), json={"at": 1, "id": "race-b"}, headers={"Idempotency-Key": "ka"})
    assert r.status_code == 201 and r.json()["header"] == b.json()["header"]
    f = await client.post(path("race", "fork"), json={"id": "race-f"}, headers={"Idempotency-Key": "fa"})
    assert f.status_code == 201, f.text
    r = await client.post(path("race", "fork"), json={"id": "race-f"}, headers={"Idempotency-Key": "fb"})
    assert r.status_code == 409, r.text
    r = await client.post(path("race", "fork"), json={"id": "race-f"}, headers={"Idempotency-Key": "fa"})
    assert r.status_code == 201 and r.json()["header"] == f.json()["header"]
    assert (await redis_store.head("race")).n == 3  # type: ignore[union-attr]


async def test_incarnation_pin_refuses_a_replaced_session(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    old = (await client.post("/sessions", json={"id": "re", "entries": [um("a")]})).json()["header"]["incarnation"]
    await redis_store.delete("re")
    await redis_store.create(SessionHeader(id="re"), [("user/message", {"content": "new"})])
    before = await snapshot(redis_store, "re")
    for headers in ({"X-Session-Incarnation": old}, {"If-Match": f'"1;{old}"'}):
        r = await client.post(path("re", "entries"), json=am("to the old one"), headers=headers)
        assert r.status_code == 409 and r.json()["error"] == "session_replaced", r.text
    r = await client.post(
        path("re", "entries"),
        json={"type": "assistant/message", "data": {"content": "x"}, "surface": {"surfaceOp": "append"}},
        headers={"If-Match": f'"1;{old}"'},
    )
    assert r.status_code == 409
    r = await client.delete(path("re"), headers={"X-Session-Incarnation": old})
    assert r.status_code == 409
    assert await snapshot(redis_store, "re") == before
    assert (await client.post(path("re", "entries"), json=um("x"), headers={"If-Match": '"1"'})).status_code == 201


# --------------------------------------------------------------------------- bad input writes nothing


async def test_bad_input_answers_4xx_and_writes_nothing(redis_url: str, prefix: str) -> None:
    store = RedisSessionStore.from_url(redis_url, prefix=prefix, max_batch=5, max_entry_bytes=2000)
    try:
        await store.create(SessionHeader(id="ok"), [("user/message", {"content": "hi"})])
        async with running_gateway(store, max_body=20_000) as base, httpx.AsyncClient(base_url=base) as client:
            await _bad_input_cases(client, store)
    finally:
        await store.aclose()


async def _bad_input_cases(client: httpx.AsyncClient, store: RedisSessionStore) -> None:
    before = await snapshot(store, "ok")
    listing = (await client.get("/sessions")).json()

    async def expect(status: int, method: str, url: str, **kw: Any) -> dict[str, Any]:
        r = await client.request(method, url, **kw)
        assert r.status_code == status, (method, url, kw, r.status_code, r.text)
        assert r.headers["content-type"] == "application/json"
        body: dict[str, Any] = r.json()
        assert {"error", "message"} <= set(body) and "Traceback" not in body["message"]
        return body

    entries = path("ok", "entries")
    # 422 with the field's path
    got = await expect(422, "POST", entries, json={"entries": [um("fine"), {"type": "user/message", "data": {}}]})
    assert got["path"] == "$.entries[1].data" and got["index"] == 1
    got = await expect(422, "POST", entries, json=[um("fine"), {"type": "user/message", "data": {"content": 5}}])
    assert got["path"] == "$[1].data.content"
    assert (await expect(422, "POST", entries, json={"type": 5, "data": {}}))["path"] == "$.type"
    assert (await expect(422, "POST", entries, json={"type": "m", "data": [1]}))["path"] == "$.data"
    assert (await expect(422, "POST", entries, json={"type": "m", "data": {}, "extra": 1}))["path"] == "$.extra"
    got = await expect(422, "POST", entries, json={"type": "m", "data": {}, "surface": {"surfaceOp": "append"}})
    assert got["path"] == "$.surface"
    got = await expect(422, "POST", entries, json=[um("x"), {"type": "cut", "data": {"before": 9, "summary": []}}])
    assert got["path"].startswith("$[1]")
    await expect(422, "POST", entries, json=[])
    await expect(422, "POST", entries, json="a string")
    await expect(422, "POST", "/sessions", json={"id": "new", "entries": [{"type": "m", "data": 1}]})
    await expect(422, "POST", "/sessions", json={"id": "new", "parent": "ok", "at": 0})
    await expect(422, "POST", path("ok", "branch"), json={"at": 5})  # beyond n
    await expect(422, "POST", path("ok", "branch"), json={"at": -1})
    await expect(422, "PUT", path("ok", "draft"), json=[1, 2])
    # 413: an entry, a batch, a body over its limit (a streamed body without a length too)
    assert (await expect(413, "POST", entries, json=um("x" * 3000)))["error"] == "entry_too_large"
    assert (await expect(413, "POST", entries, json=[um("x")] * 6))["error"] == "batch_too_large"
    big = json.dumps(um("y" * 30_000)).encode()
    assert (await expect(413, "POST", entries, content=big))["error"] == "body_too_large"

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b" " * 1000

    assert (await expect(413, "POST", entries, content=chunks()))["error"] == "body_too_large"
    await expect(413, "PUT", path("ok", "draft"), json={"content": "z" * 3000})
    # 400: malformed JSON, id, header
    await expect(400, "POST", entries, content=b"{not json")
    await expect(400, "POST", entries, json=um("x"), headers={"If-Match": "soon"})
    await expect(400, "POST", entries, json=um("x"), headers={"If-Match": '"1", "2"'})
    await expect(400, "POST", entries, json=um("x"), headers={"Idempotency-Key": "k" * 300})
    await expect(400, "POST", "/sessions", json={"id": "a b"})
    await expect(400, "POST", path("ok", "branch"), json={"at": 0, "id": "{x}"})
    for bad in ["%7Bslot%7D", "a%20b", "%FF%FE", "x" * 257]:
        for method, sub in [("POST", "/entries"), ("POST", "/branch"), ("POST", "/fork"), ("DELETE", "")]:
            await expect(400, method, f"/sessions/{bad}{sub}", json={"at": 0} if sub == "/branch" else um("x"))
        await expect(400, "PUT", f"/sessions/{bad}/draft", json={})
        await expect(400, "POST", f"/sessions/{bad}/repair")
    # 404: unknown session, on every write route
    for method, sub, body in [
        ("POST", "entries", um("x")),
        ("POST", "branch", {"at": 0}),
        ("POST", "fork", {}),
        ("PUT", "draft", {"content": "x"}),
        ("POST", "repair", None),
    ]:
        await expect(404, method, path("nope", sub), json=body)
    await expect(404, "DELETE", path("nope"))
    # 405: a known resource, another method
    r = await client.post(path("ok", "messages"))
    assert r.status_code == 405 and "GET" in r.headers["allow"]
    assert (await client.put(path("ok"))).status_code == 405
    # nothing changed, nothing was created
    assert await snapshot(store, "ok") == before
    assert (await client.get("/sessions")).json() == listing
    assert await store.head("new") is None


# --------------------------------------------------------------------------- branch, fork, delete, draft, repair


async def test_branch_fork_delete_draft_repair(client: httpx.AsyncClient, redis_store: RedisSessionStore) -> None:
    turn = [
        {"type": "turn/start", "data": {"turn": 1, "trigger": {"kind": "message"}}},
        um("q"),
        {"type": "turn/end", "data": {"turn": 1, "reason": {"kind": "completed"}}},
    ]
    assert (await client.post("/sessions", json={"id": "p", "entries": turn})).status_code == 201
    r = await client.post(path("p", "branch"), json={"at": 2, "id": "p-b", "title": "b"})
    assert r.status_code == 201 and r.json()["header"]["parent"] == "p" and r.json()["header"]["at"] == 2
    assert etag(r) == 2
    assert (await client.post(path("p", "branch"), json={"at": 1, "id": "p-b"})).status_code == 409
    assert (await client.post(path("p", "branch"), json={"at": 3})).json()["id"].startswith("p:branch:")

    r = await client.post(path("p", "fork"))  # at the last turn/end
    assert r.status_code == 201 and r.json()["n"] == 3
    r = await client.post(path("p", "fork"), json={"boundary": 1, "id": "p-f"})
    assert r.status_code == 422 and r.json()["code"] == "OPEN_TURN"
    r = await client.post(path("p", "fork"), json={"boundary": 9})
    assert r.status_code == 422 and r.json()["code"] == "INVALID_BOUNDARY"
    assert (await client.post(path("p", "fork"), json={"id": "p-b"})).status_code == 409
    assert await redis_store.head("p-f") is None

    assert (await client.put(path("p", "draft"), json={"content": "Hel"})).status_code == 204
    assert (await client.get(path("p", "draft"))).json() == {"draft": {"content": "Hel"}}
    assert (await client.put(path("p", "draft"), content=b"null")).status_code == 204
    assert (await client.get(path("p", "draft"))).json() == {"draft": None}

    # a crashed writer's open turn with an unanswered tool call: repair closes it, then nothing to do
    crashed = [
        {"type": "turn/start", "data": {"turn": 2, "trigger": {"kind": "message"}}},
        um("run it"),
        {"type": "step/start", "data": {"turn": 2, "step": 1}},
        {
            "type": "assistant/message",
            "data": {
                "turn": 2,
                "step": 1,
                "content": [{"type": "tool-call", "id": "c1", "name": "sh", "arguments": "{}"}],
            },
        },
    ]
    assert (await client.post(path("p", "entries"), json=crashed, headers={"If-Match": '"3"'})).status_code == 201
    r = await client.post(path("p", "repair"))
    assert r.status_code == 200
    assert [e["type"] for e in r.json()["entries"]] == ["tool/result", "step/end", "turn/end"] and etag(r) == 10
    r = await client.post(path("p", "repair"))
    assert (r.status_code, r.json()["entries"], etag(r)) == (200, [], 10)
    # a live writer's lease: repair refuses
    await client.post(path("p", "entries"), json=crashed[:2])
    assert await redis_store.acquire_lease("p", "live-writer", 10_000)
    r = await client.post(path("p", "repair"))
    assert r.status_code == 409 and r.json()["error"] == "lease_held"

    r = await client.delete(path("p-b"), headers={"If-Match": '"0"'})
    assert r.status_code == 412 and etag(r) == 2
    assert (await client.delete(path("p-b"))).status_code == 204
    assert (await client.delete(path("p-b"))).status_code == 404
    assert await redis_store.head("p-b") is None


# --------------------------------------------------------------------------- tokens


TOKENS = """
# token        scopes  prefix
adm-0123456789 admin
wri-0123456789 write
rea-0123456789 read
acme-w-0123456 write   acme/
acme-r-0123456 read    acme/
"""


async def test_scoped_and_tenant_tokens(redis_store: RedisSessionStore) -> None:
    for sid in ("acme/1", "acme/2", "globex/1"):
        await redis_store.create(SessionHeader(id=sid), [("user/message", {"content": sid})])
    tokens = parse_tokens(TOKENS, "test")
    with anyio.fail_after(60):
        async with running_gateway(redis_store, token="legacy-token", tokens=tokens, heartbeat=0.3) as base:
            await _token_cases(base, redis_store)


async def _token_cases(base: str, store: RedisSessionStore) -> None:
    def as_(token: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=20)

    async with (
        as_("adm-0123456789") as admin,
        as_("wri-0123456789") as writer,
        as_("rea-0123456789") as reader,
        as_("acme-w-0123456") as acme_w,
        as_("acme-r-0123456") as acme_r,
        as_("legacy-token") as legacy,
        as_("nope") as stranger,
    ):
        # unknown token: 401, on reads and writes alike
        assert (await stranger.get("/sessions")).status_code == 401
        assert (await stranger.post(path("acme/1", "entries"), json=um("x"))).status_code == 401
        # a read token never writes
        for method, url, body in [
            ("POST", "/sessions", {"id": "r1"}),
            ("POST", path("globex/1", "entries"), um("x")),
            ("POST", path("globex/1", "branch"), {"at": 0}),
            ("POST", path("globex/1", "fork"), {}),
            ("PUT", path("globex/1", "draft"), {"a": 1}),
            ("POST", path("globex/1", "repair"), None),
            ("DELETE", path("globex/1"), None),
        ]:
            r = await reader.request(method, url, json=body)
            assert r.status_code == 403 and r.json()["error"] == "forbidden", (method, url, r.text)
        assert (await reader.get(path("globex/1", "entries"))).status_code == 200
        # write: no delete (admin only); admin and the legacy --token do everything
        assert (await writer.post(path("globex/1", "entries"), json=um("w"))).status_code == 201
        assert (await writer.delete(path("globex/1"))).status_code == 403
        assert (await legacy.post("/sessions", json={"id": "legacy/1"})).status_code == 201
        assert (await admin.delete(path("legacy/1"))).status_code == 204

        # a tenant sees only its own sessions: list filtered, 404 on the rest (SSE and messages too)
        ids = {h["id"] for h in (await acme_r.get("/sessions", params={"limit": 1000})).json()["items"]}
        assert ids == {"acme/1", "acme/2"}
        page = (await acme_r.get("/sessions", params={"limit": 1})).json()
        assert len(page["items"]) == 1 and page["items"][0]["id"].startswith("acme/")
        for sub in ["", "entries", "messages", "events", "draft"]:
            assert (await acme_r.get(path("globex/1", sub))).status_code == 404, sub
            assert (await acme_r.get(path("nothing-here", sub))).status_code == 404, sub
        assert (await acme_r.get("/sessions", params={"parent": "globex/1"})).status_code == 404
        before = await snapshot(store, "globex/1")
        for method, url, body in [
            ("POST", path("globex/1", "entries"), um("x")),
            ("POST", path("globex/1", "branch"), {"at": 0, "id": "acme/stolen"}),
            ("POST", path("globex/1", "fork"), {"id": "acme/stolen"}),
            ("PUT", path("globex/1", "draft"), {"a": 1}),
            ("POST", path("globex/1", "repair"), None),
            ("DELETE", path("globex/1"), None),
        ]:
            assert (await acme_w.request(method, url, json=body)).status_code == 404, (method, url)
        assert await snapshot(store, "globex/1") == before and await store.head("acme/stolen") is None
        # it creates inside its prefix only (an id of its own by default), and branches stay inside
        assert (await acme_w.post("/sessions", json={"id": "globex/2"})).status_code == 403
        assert (await acme_w.post(path("acme/1", "branch"), json={"at": 1, "id": "globex/b"})).status_code == 403
        assert (await acme_w.post("/sessions", json={})).json()["id"].startswith("acme/session-")
        r = await acme_w.post(path("acme/1", "branch"), json={"at": 1})
        assert r.status_code == 201 and r.json()["id"].startswith("acme/1:branch:")
        assert (await acme_w.post(path("acme/1", "entries"), json=um("mine"))).status_code == 201
        assert (await acme_r.post(path("acme/1", "entries"), json=um("mine"))).status_code == 403
        # ?token= (EventSource) works the same way
        async with httpx.AsyncClient(base_url=base) as plain:
            r = await plain.get(path("acme/1"), params={"token": "acme-r-0123456"})
            assert r.status_code == 200
        await _tenant_store_events(base, acme_r, admin)


async def _tenant_store_events(base: str, acme_r: httpx.AsyncClient, admin: httpx.AsyncClient) -> None:
    """The store-wide notification stream shows a tenant only its own branches."""
    seen: list[dict[str, Any]] = []
    async with acme_r.stream("GET", "/events") as r:
        assert r.status_code == 200
        lines = r.aiter_lines()
        await anext(x async for x in lines if x.startswith(": open"))
        assert (await admin.post(path("globex/1", "branch"), json={"at": 0, "id": "globex/b2"})).status_code == 201
        assert (await admin.post(path("acme/2", "branch"), json={"at": 0, "id": "acme/b2"})).status_code == 201
        async for line in lines:
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
                break
    assert seen == [{"parent": "acme/2", "session": "acme/b2", "at": 0}]


def test_token_file_formats(tmp_path: Any) -> None:
    lines = parse_tokens("a-token write acme/ # a comment\n\nb-token;c-token admin", "t")
    assert [(t.secret, sorted(t.scopes), t.prefix) for t in lines] == [
        ("a-token", ["read", "write"], "acme/"),
        ("b-token", ["read"], None),
        ("c-token", ["admin", "read", "write"], None),
    ]
    as_json = parse_tokens('{"tokens": [{"token": "j", "scopes": ["write"], "prefix": "t/", "name": "pods"}]}')
    assert as_json == [Token.make("j", ["write"], "t/", "pods")]
    assert parse_tokens('[{"token": "k"}]')[0].scopes == {"read"}
    for bad in ["tok reed", "tok read p extra", '{"tokens": [{"token": "x", "scopes": "read"}]}', "[1]", "{x"]:
        with pytest.raises(ValueError):
            parse_tokens(bad, "t")
    f = tmp_path / "tokens"
    f.write_text("file-token admin\n")
    got = load_tokens(f, env={"REDIS_SESSION_TOKENS": "env-token read tenant/"})
    assert [(t.secret, t.prefix) for t in got] == [("file-token", None), ("env-token", "tenant/")]
    with pytest.raises(ValueError, match="twice"):
        TokenSet(parse_tokens("same read\nsame write"))


def test_tokens_are_compared_with_every_one_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        calls.append(len(a))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    tokens = TokenSet(parse_tokens("first admin\nsecond read\nthird write"))
    for given, want in [(b"first", "first"), (b"third", "third"), (b"fir", None), (b"x" * 500, None)]:
        calls.clear()
        found = tokens.authenticate(given)
        assert (found.secret if found else None) == want
        assert calls == [32, 32, 32]  # all three, digests of one length, whichever matched


# --------------------------------------------------------------------------- load


async def test_many_concurrent_http_writers(redis_store: RedisSessionStore) -> None:
    """Writers on their own sessions and on one contended session, over real HTTP: nothing lost,
    no turn interleaved with another, every 412 retried from the actual n."""
    distinct, contended, turns = 12, 8, 8
    await redis_store.create(SessionHeader(id="hot"))
    retries = 0
    limits = httpx.Limits(max_connections=distinct + contended + 4)
    with anyio.fail_after(120):
        async with (
            running_gateway(redis_store) as base,
            httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client,
        ):

            async def own(w: int) -> None:
                sid = f"own-{w}"
                assert (await client.post("/sessions", json={"id": sid})).status_code == 201
                n = 0
                for t in range(turns):
                    r = await client.post(
                        path(sid, "entries"), json=[um(f"{w}.{t}"), am(f"{w}.{t}")], headers={"If-Match": f'"{n}"'}
                    )
                    assert r.status_code == 201, r.text
                    n = etag(r)

            async def hot(w: int) -> None:
                nonlocal retries
                n = 0
                for t in range(turns):
                    while True:
                        r = await client.post(
                            path("hot", "entries"),
                            json=[um(f"{w}.{t}"), am(f"{w}.{t}")],
                            headers={"If-Match": f'"{n}"', "Idempotency-Key": f"{w}.{t}"},
                        )
                        if r.status_code == 201:
                            n = etag(r)
                            break
                        assert r.status_code == 412, r.text
                        retries += 1
                        n = r.json()["actual_n"]
                        await anyio.sleep(random.random() * 0.005)

            async with anyio.create_task_group() as tg:
                for w in range(distinct):
                    tg.start_soon(own, w)
                for w in range(contended):
                    tg.start_soon(hot, w)

    for w in range(distinct):
        got = [e.data["content"] for e in await redis_store.read(f"own-{w}")]
        assert got == [f"{w}.{t}" for t in range(turns) for _ in range(2)]
    log = await redis_store.read("hot")
    assert len(log) == contended * turns * 2  # nothing lost, nothing twice
    pairs = [(log[i], log[i + 1]) for i in range(0, len(log), 2)]
    assert all(u.type == "user/message" and a.type == "assistant/message" for u, a in pairs)
    assert all(u.data["content"] == a.data["content"] for u, a in pairs)  # no turn interleaved
    for w in range(contended):  # each writer's turns in its order
        mine = [u.data["content"] for u, _ in pairs if u.data["content"].startswith(f"{w}.")]
        assert mine == [f"{w}.{t}" for t in range(turns)]
    assert retries > 0


async def test_a_tenant_pages_through_its_sessions_and_never_sees_another_tenants_id(
    redis_store: RedisSessionStore,
) -> None:
    """A tenant's sessions sparse among many others: pages (some short, with a cursor) give every
    one of its sessions exactly once, and no cursor names another tenant's session."""
    from redis_session.gateway import reads

    own = []
    for i in range(60):
        sid = f"acme/{i}" if i % 13 == 0 else f"globex/{i}"
        await redis_store.create(SessionHeader(id=sid, created_at=1_700_000_000_000 + (i // 2)))  # ms ties too
        if sid.startswith("acme/"):
            own.append(sid)
    tokens = parse_tokens(TOKENS, "test")
    saved = reads.TENANT_SCAN_PAGES
    reads.TENANT_SCAN_PAGES = 1  # short pages: the cursor often stops on another tenant's member
    try:
        async with running_gateway(redis_store, tokens=tokens) as base:
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": "Bearer acme-r-0123456"}) as http:
                seen: list[str] = []
                cursor = None
                for _ in range(100):
                    r = await http.get("/sessions", params={"limit": 3, **({"cursor": cursor} if cursor else {})})
                    assert r.status_code == 200, r.text
                    body = r.json()
                    seen += [h["id"] for h in body["items"]]
                    cursor = body["cursor"]
                    assert cursor is None or "globex" not in cursor, cursor
                    if cursor is None:
                        break
    finally:
        reads.TENANT_SCAN_PAGES = saved
    assert sorted(seen) == sorted(own) and len(seen) == len(set(seen))


async def test_a_client_that_hangs_up_mid_body_writes_nothing_and_is_no_server_error(
    redis_store: RedisSessionStore,
) -> None:
    """A write whose client goes away before its body is read (a cancelled request, a killed
    process) writes nothing and is no server error (no 'Exception in ASGI application'): driven
    through the app's ASGI interface, which delivers half a body and then the disconnect."""
    from redis_session.gateway import create_app

    app = create_app(redis_store)
    await redis_store.create(SessionHeader(id="hang"))
    body = json.dumps({"type": "user/message", "data": {"content": "x" * 500}}).encode()
    events = [
        {"type": "http.request", "body": body[:100], "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return events.pop(0) if events else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path("hang", "entries"), "raw_path": path("hang", "entries").encode(),
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8765), "client": ("127.0.0.1", 5000),
        "headers": [(b"host", b"127.0.0.1:8765"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip
    await app(scope, receive, send)  # raises (a 500 and a traceback) when the hang-up is not expected
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 400, sent
    head = await redis_store.head("hang")
    assert head is not None and head.n == 0


# --------------------------------------------------------------------------- huge and negative integers

BAD_INTS = [10**30, 2**63, 2**64, 2**53, -1, -(2**63)]


async def test_huge_and_negative_integers_are_refused_with_their_path(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    """An expected n, a start, a branch point, a boundary … of 10**30, 2**63, -1: every integer a
    body or a query carries is refused as the gateway refuses any invalid value (422 naming the
    JSON path in a body, 400 in a query or header), never a 500, and nothing is written. A live
    stream id beyond 64 bits (Last-Event-ID of a deltas stream, an end's begin_id) was sent on to
    Redis: an SSE stream that failed server-side (``event: error``), a begin_id accepted."""
    end = {"type": "turn/end", "data": {"turn": 1, "reason": {"kind": "completed"}}}
    r = await client.post("/sessions", json={"id": "big", "entries": [um("a"), end]})
    inc = r.json()["header"]["incarnation"]
    answer = (await client.post(path("big", "answers"), json={})).json()["answer"]
    before = await snapshot(redis_store, "big")
    a = f"answers/{answer}"
    for v in BAD_INTS:
        bodies: list[tuple[str, str, Any, str]] = [
            ("POST", "entries", {"type": "m", "data": {}, "time": v}, "$.time"),
            ("POST", "entries", {"entries": [um("x"), {"type": "m", "data": {}, "time": v}]}, "$.entries[1].time"),
            ("POST", "branch", {"at": v}, "$.at"),
            ("POST", "branch", {"at": 0, "delegation_depth": v}, "$.delegation_depth"),
            ("POST", "fork", {"boundary": v}, "$.boundary"),
            ("POST", f"{a}/deltas", {"first_index": v, "deltas": [{"text": "x"}]}, "$.first_index"),
            ("POST", f"{a}/end", {"reason": "committed", "expected_n": v}, "$.expected_n"),
            ("POST", f"{a}/end", {"reason": "committed", "deltas": v}, "$.deltas"),
        ]
        if abs(v) > 2**53:  # within ±(2^53-1) a turn, a draft or a data field is any integer
            bodies += [
                ("PUT", "draft", {"n": v}, "$.n"),
                ("POST", "answers", {"turn": v}, "$.turn"),
                ("POST", "entries", {"type": "m", "data": {"deep": [{"x": v}]}}, "$.data.deep[0].x"),
            ]
        for method, sub, body, where in bodies:
            r = await client.request(method, path("big", sub), json=body)
            assert r.status_code == 422 and r.json().get("path") == where, (v, sub, body, r.status_code, r.text)
        for sub in ("", "?delegation_depth", "?created_at"):
            field = sub.lstrip("?") or "created_at"
            r = await client.post("/sessions", json={"id": "big-new", field: v})
            assert r.status_code == 422 and r.json()["path"] == f"$.{field}", (v, field, r.text)
        for q in ("start", "stop", "limit"):
            r = await client.get(path("big", "entries"), params={q: str(v)})
            assert r.status_code == 400 and r.json()["error"] == "bad_request", (v, q, r.text)
        for q, sub in (("start", "events"), ("last", "messages"), ("limit", "")):
            r = await client.get(path("big", sub) if sub else "/sessions", params={q: str(v)})
            assert r.status_code == 400 and r.json()["error"] == "bad_request", (v, q, r.text)
        r = await client.post(path("big", "entries"), json=um("x"), headers={"If-Match": f'"{v}"'})
        assert r.status_code == 400, (v, r.text)
    for live in ("18446744073709551616-0", "0-18446744073709551616", "99999999999999999999-99999999999999999999"):
        async with client.stream(
            "GET", path("big", "events"), params={"deltas": "1"}, headers={"Last-Event-ID": f"{inc}:1/{live}"}
        ) as r:
            assert r.status_code == 400, (live, r.status_code, (await r.aread())[:300])
            assert json.loads(await r.aread())["error"] == "bad_request"
        r = await client.post(path("big", f"{a}/end"), json={"reason": "committed", "begin_id": live})
        assert r.status_code == 422 and r.json()["path"] == "$.begin_id", (live, r.text)
    assert await snapshot(redis_store, "big") == before
    assert await redis_store.head("big-new") is None
    assert (await redis_store.list(parent="big")).items == []


async def test_a_last_event_id_with_a_negative_n_is_a_400_as_start_minus_1(client: httpx.AsyncClient) -> None:
    """``Last-Event-ID: <inc>:-1`` (with or without ``?deltas=1``) answered 200 and replayed the
    log from n=0, while ``?start=-1`` is a 400. -1 is only in the ids the gateway sends for a delta
    before the first entry, which carry a live id: that form still resumes."""
    r = await client.post("/sessions", json={"id": "neg", "entries": [um("a")]})
    inc = r.json()["header"]["incarnation"]
    for params in ({}, {"deltas": "1"}):
        for last in (f"{inc}:-1", "-1", f"{inc}:-2", f"{inc}:-1/", f"{inc}:-1/1", f"{inc}:-1/-1-0"):
            async with client.stream("GET", path("neg", "events"), params=params, headers={"Last-Event-ID": last}) as r:
                assert r.status_code == 400, (params, last, r.status_code, (await r.aread())[:300])
                assert json.loads(await r.aread())["error"] == "bad_request"
    assert parse_resume(f"{inc}:-1/0-1") is not None and parse_resume(f"{inc}:-1/0-1").start == 0  # type: ignore[union-attr]


async def test_a_list_cursor_the_gateway_did_not_issue_is_a_400(client: httpx.AsyncClient) -> None:
    """``GET /sessions?cursor=`` answered 200 for any cursor: an empty page ("abc", "inf:x") or
    the first page again ("-1", "0:x", "%00"). Only ``<13 digits>:<id>`` as issued is taken."""
    for i in range(4):
        assert (
            await client.post("/sessions", json={"id": f"l{i}", "created_at": 1_700_000_000_000 + i})
        ).status_code == 201
    first = (await client.get("/sessions", params={"limit": 3})).json()
    assert [h["id"] for h in first["items"]] == ["l3", "l2", "l1"]
    rest = await client.get("/sessions", params={"limit": 3, "cursor": first["cursor"]})
    assert rest.status_code == 200 and [h["id"] for h in rest.json()["items"]] == ["l0"]
    for bad in ["abc", "x", "inf:x", "nan:x", "1e26:x", "-1", "0:x", "1e400:x", "18446744073709551616:x", "1_0:x",
                "\x00", "0000000000000:a b", "\u0661" * 13 + ":x"]:  # fmt: skip
        r = await client.get("/sessions", params={"limit": 3, "cursor": bad})
        assert r.status_code == 400 and r.json()["error"] == "bad_request", (bad, r.status_code, r.text[:200])


# --------------------------------------------------------------------------- bodies of field-less routes

NOT_EMPTY_BODIES: list[tuple[bytes, int]] = [
    (b"not json", 400),
    (b'{"x": NaN}', 400),
    (b'{"lease_ttl": 18446744073709551616}', 422),
    (b'{"a":1,"a":2}', 422),
    (b"[" * 100 + b"]" * 100, 422),
    (b'{"a":"\xff\xfe"}', 400),
    (b'{"a":"\\ud800"}', 400),
    (b'{"lease_ttl": 5}', 422),  # well-formed, but these routes take no fields
    (b"[]", 422),
]


@pytest.mark.parametrize(("body", "status"), NOT_EMPTY_BODIES, ids=[repr(b[:24]) for b, _ in NOT_EMPTY_BODIES])
async def test_repair_and_delete_parse_their_body_and_write_nothing_on_a_bad_one(
    redis_store: RedisSessionStore, body: bytes, status: int
) -> None:
    """`POST /repair` never read its body: invalid JSON, NaN, 2^64, duplicate names, 100 levels
    of nesting, invalid UTF-8 or a lone surrogate answered 200 and the repair closed the open turn
    (and DELETE deleted). Both now take the gateway's one I-JSON parser: empty or ``{}`` only."""
    open_turn = [{"type": "turn/start", "data": {"turn": 1}}, um("hi")]
    for sid in ("r1", "r2"):
        await redis_store.create(SessionHeader(id=sid), [NewEntry(e["type"], e["data"]) for e in open_turn])
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=20) as client:
        headers = {"Content-Type": "application/json"}
        r = await client.post(path("r1", "repair"), content=body, headers=headers)
        assert r.status_code == status, r.text
        assert "Traceback" not in r.text
        assert (await redis_store.head("r1")).n == 2  # type: ignore[union-attr]
        r = await client.request("DELETE", path("r1"), content=body, headers=headers)
        assert r.status_code == status, r.text
        assert await redis_store.head("r1") is not None
        # the control: an empty body and {} are served, and the repair writes
        assert (await client.post(path("r1", "repair"))).status_code == 200
        assert (await redis_store.head("r1")).n > 2  # type: ignore[union-attr]
        assert (await client.post(path("r2", "repair"), content=b"{}", headers=headers)).status_code == 200
        assert (await redis_store.head("r2")).n > 2  # type: ignore[union-attr]
        assert (await client.request("DELETE", path("r2"), content=b"{}", headers=headers)).status_code == 204
