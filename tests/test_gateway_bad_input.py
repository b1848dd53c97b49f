"""Bad input at the gateway gets a clear, typed error (a JSON body ``{error, message}``) and
nothing is written: the cases an outside fuzzing found taken silently, each against a real
uvicorn server (both HTTP parsers where they differ) and a real Redis."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import pytest

from redis_session import RedisSessionStore, SessionHeader
from redis_session.gateway.auth import Token
from redis_session.model import MAX_ORIGIN_BYTES, MAX_TITLE_BYTES

from support import running_gateway

pytestmark = pytest.mark.anyio


def path(session_id: str, sub: str = "") -> str:
    return "/sessions/" + quote(session_id, safe="") + (f"/{sub}" if sub else "")


def um(text: str) -> dict[str, Any]:
    return {"type": "user/message", "data": {"content": text}}


@pytest.fixture
async def client(redis_store: RedisSessionStore) -> AsyncIterator[httpx.AsyncClient]:
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=60) as c:
        yield c


async def snapshot(store: RedisSessionStore, sid: str) -> tuple[int, str, list[Any]] | None:
    head = await store.head(sid)
    return None if head is None else (head.n, head.header.incarnation, await store.read(sid))


def refused(r: httpx.Response, status: int, error: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    assert r.json()["error"] == error and r.json()["message"], r.text


async def seeded(client: httpx.AsyncClient, sid: str, n: int = 3) -> str:
    r = await client.post("/sessions", json={"id": sid, "entries": [um(f"m{i}") for i in range(n)]})
    assert r.status_code == 201, r.text
    return str(r.json()["header"]["incarnation"])


async def sse_events(client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None) -> list[str]:
    """The `event:` names of a stream until its `end` (every stream here ends)."""
    kinds: list[str] = []
    async with client.stream("GET", url, headers=headers or {}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                kinds.append(line.partition(":")[2].strip())
                if kinds[-1] == "end":
                    break
            elif line.startswith("data:") and kinds and kinds[-1] == "rewound":
                kinds.append(line.partition(":")[2].strip())
    return kinds


# --------------------------------------------------------------------------- 4: SSE ?start= past the end


async def test_a_pinned_sse_start_past_the_log_is_rewound_an_unpinned_one_waits(client: httpx.AsyncClient) -> None:
    """``?start=`` with the life it read (``?incarnation=``, what an EventSource reconnecting by its
    own URL sends, or ``X-Session-Incarnation``) is a resume: past the log's end (a failover took
    entries back) it gets ``event: rewound`` and ``end``, as a Last-Event-ID does, not silence. An
    unpinned ``?start=`` is a fresh tail: ahead of the log it waits, then gets the entry."""
    inc = await seeded(client, "ahead", 3)
    rewound = json.dumps({"session": "ahead", "cursor": 10, "n": 3}, separators=(",", ":"))
    with anyio.fail_after(60):
        for query, headers in [
            (f"?start=10&incarnation={inc}", None),
            (f"?start=10&incarnation={inc}&deltas=1", None),
            ("?start=10", {"X-Session-Incarnation": inc}),
            ("", {"Last-Event-ID": f"{inc}:9"}),
        ]:
            got = await sse_events(client, path("ahead", "events") + query, headers)
            assert got == ["rewound", rewound, "end"], (query, headers, got)

        # fresh: it waits for entry 4, and gets it once it lands
        seen: list[int] = []
        async with client.stream("GET", path("ahead", "events") + "?start=4") as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            first = await lines.__anext__()  # open (its opening comment), and waiting
            assert not first.startswith("event:"), first
            for text in ("m3", "m4"):
                assert (await client.post(path("ahead", "entries"), json=um(text))).status_code == 201
            async for line in lines:
                assert not line.startswith("event: rewound"), line
                if line.startswith("data:"):
                    seen.append(json.loads(line[5:])["n"])
                    break
        assert seen == [4]


# --------------------------------------------------------------------------- 5: a keyed create's key is its request


async def test_a_keyed_create_without_an_id_is_made_once_however_often_it_is_retried(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    """A keyed ``POST /sessions`` with no ``id`` (the server picks one) made a new session on every
    retry — what the key is for: the id now comes from the key, so a retry replays the 201."""
    body: dict[str, Any] = {"title": "no id", "entries": [um("hi")]}
    key = {"Idempotency-Key": "no-id-create"}
    answers = [await client.post("/sessions", json=body, headers=key) for _ in range(3)]
    assert [a.status_code for a in answers] == [201, 201, 201], [a.text for a in answers]
    ids = {a.json()["id"] for a in answers}
    assert len(ids) == 1, ids
    assert await redis_store.head(next(iter(ids))) is not None
    assert len([k async for k in redis_store.client.scan_iter(match=f"{redis_store.prefix}*session-*:hdr")]) == 1
    refused(await client.post("/sessions", json=body | {"title": "other"}, headers=key), 422, "idempotency_key_reused")
    other = await client.post("/sessions", json=body, headers={"Idempotency-Key": "another"})
    assert other.status_code == 201 and other.json()["id"] not in ids


async def test_a_keyed_create_or_branch_retried_with_another_body_is_422(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    """The Idempotency-Key names the whole request: a retry with any other field — entries left
    out, a ttl, another created_at; a branch's title, origin or depth — answers 422
    ``idempotency_key_reused`` and changes nothing; the same body replays the 201."""
    body: dict[str, Any] = {"id": "keyed", "title": "t", "entries": [um("a")], "created_at": 1_700_000_000_000}
    key = {"Idempotency-Key": "create-1"}
    first = await client.post("/sessions", json=body, headers=key)
    assert first.status_code == 201, first.text
    before = await snapshot(redis_store, "keyed")
    for other in [
        {k: v for k, v in body.items() if k != "entries"},
        body | {"ttl": 60},
        body | {"created_at": 1_700_000_000_001},
        {k: v for k, v in body.items() if k != "created_at"},
        body | {"entries": [um("b")]},
    ]:
        refused(await client.post("/sessions", json=other, headers=key), 422, "idempotency_key_reused")
    assert await snapshot(redis_store, "keyed") == before
    assert await redis_store.client.pttl(redis_store.keys.hdr("keyed")) == -1  # no ttl was set by the "retry"
    again = await client.post("/sessions", json=body, headers=key)
    assert again.status_code == 201 and again.json()["header"] == first.json()["header"]

    branch: dict[str, Any] = {"at": 1, "id": "keyed-b", "title": "bt", "origin": {"o": 1}, "delegation_depth": 1}
    bkey = {"Idempotency-Key": "branch-1"}
    b = await client.post(path("keyed", "branch"), json=branch, headers=bkey)
    assert b.status_code == 201, b.text
    for other in [branch | {"title": "other"}, branch | {"origin": {"o": 2}}, branch | {"delegation_depth": 2}]:
        refused(await client.post(path("keyed", "branch"), json=other, headers=bkey), 422, "idempotency_key_reused")
    again = await client.post(path("keyed", "branch"), json=branch, headers=bkey)
    assert again.status_code == 201 and again.json()["header"] == b.json()["header"]
    # a fork's retry still replays (it gives no header field)
    await seeded(client, "fsrc", 0)
    f = await client.post(path("fsrc", "fork"), json={"id": "keyed-f"}, headers={"Idempotency-Key": "fork-1"})
    assert f.status_code == 201, f.text
    again = await client.post(path("fsrc", "fork"), json={"id": "keyed-f"}, headers={"Idempotency-Key": "fork-1"})
    assert again.status_code == 201 and again.json()["header"] == f.json()["header"]


# --------------------------------------------------------------------------- 9: header sizes


async def test_header_title_and_origin_are_bounded_on_every_create(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    """A title over 1 KiB of UTF-8 or an origin over 64 KiB of JSON is refused 422 naming the
    field, on create and branch (the store's check: imports and Python callers get it too), and
    nothing is written; so a list page stays bounded."""
    at_limit = "é" * (MAX_TITLE_BYTES // 2)
    assert (await client.post("/sessions", json={"id": "t-ok", "title": at_limit})).status_code == 201
    for field, value in [
        ("title", at_limit + "x"),
        ("title", "x" * (15 << 20)),
        ("origin", {"blob": "x" * MAX_ORIGIN_BYTES}),
    ]:
        r = await client.post("/sessions", json={"id": "t-big", field: value})
        refused(r, 422, "invalid")
        assert r.json()["path"] == f"$.{field}" and field in r.json()["message"], r.text
        r = await client.post(path("t-ok", "branch"), json={"at": 0, "id": "t-big-b", field: value})
        refused(r, 422, "invalid")
        assert r.json()["path"] == f"$.{field}", r.text
    assert await redis_store.head("t-big") is None and await redis_store.head("t-big-b") is None
    from redis_session import InvalidEntryError

    with pytest.raises(InvalidEntryError, match="title"):
        await redis_store.create(SessionHeader(id="t-py", title="x" * (MAX_TITLE_BYTES + 1)))
    assert await redis_store.head("t-py") is None


# --------------------------------------------------------------------------- 10: what the HTTP parser refuses


async def raw_exchange(base: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `request` as it is on a fresh connection; (status, headers, body) of the answer."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    async with await anyio.connect_tcp(host, int(port)) as sock:
        await sock.send(request)
        data = b""
        with anyio.fail_after(60):
            while b"\r\n\r\n" not in data:
                data += await sock.receive()
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            while len(body) < int(headers.get("content-length", "0")):
                body += await sock.receive()
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_requests_the_http_parser_refuses_get_the_json_error(redis_store: RedisSessionStore, http: str) -> None:
    """A request uvicorn's parser refuses before the app sees it (a NUL or control byte in a
    header, a lower-case method, a raw space in the query, a huge id) answers the documented JSON
    400 ``{error: "bad_request", message}``, not a plain-text one, on both HTTP stacks (h11 takes
    a lower-case method, a control byte in a header, HTTP/9.9, and Content-Length with
    Transfer-Encoding: refused as httptools refuses them); where h11 lets one through (the huge
    id), the app's own JSON answer; and nothing is written."""
    await redis_store.create(SessionHeader(id="p"))
    end = "Host: 127.0.0.1\r\nConnection: close\r\n"
    cases = [
        f"POST /sessions/p/entries HTTP/1.1\r\n{end}Idempotency-Key: a\x00b\r\nContent-Length: 2\r\n\r\n{{}}",
        f"POST /sessions/p/entries HTTP/1.1\r\n{end}X-Session-Incarnation: a\x00b\r\nContent-Length: 2\r\n\r\n{{}}",
        f"POST /sessions/p/entries HTTP/1.1\r\n{end}If-Match: \x01\r\nContent-Length: 2\r\n\r\n{{}}",
        f"get /sessions HTTP/1.1\r\n{end}\r\n",
        f"GET /sessions HTTP/1.1\r\n{end}X-Note: a\x01b\r\n\r\n",
        f"GET /sessions HTTP/1.1\r\n{end}X-Note: a\x1b[31mb\r\n\r\n",
        f"GET /sessions HTTP/1.1\r\n{end}X-Note: a\x7fb\r\n\r\n",
        f"GET /sessions HTTP/9.9\r\n{end}\r\n",
        f"POST /sessions HTTP/1.1\r\n{end}Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
        "2\r\n{}\r\n0\r\n\r\n",
        f"GET /sessions?parent=a b HTTP/1.1\r\n{end}\r\n",
        f"GET /sessions/{'x' * 100_000} HTTP/1.1\r\n{end}\r\n",
    ]
    async with running_gateway(redis_store, http=http) as base:
        for request in cases:
            status, headers, body = await raw_exchange(base, request.encode("latin-1"))
            shown = request[:60]
            assert headers.get("content-type") == "application/json", (shown, headers, body[:200])
            doc = json.loads(body)
            assert set(doc) >= {"error", "message"} and doc["message"], (shown, doc)
            if http == "httptools" or "x" * 1000 not in request:  # h11 is held to httptools' rules too
                assert (status, doc["error"]) == (400, "bad_request"), (shown, status, doc)
            else:  # h11 hands the long id to the app: its own typed answer
                assert status in (400, 405), (shown, status, doc)
            assert headers.get("x-content-type-options") == "nosniff", headers
    head = await redis_store.head("p")
    assert head is not None and head.n == 0


# --------------------------------------------------------------------------- 11: If-Match half quoted


async def test_if_match_with_an_unbalanced_quote_is_refused(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await seeded(client, "im", 0)
    for value in ['"0', '0"', '"0;x', '0;x"']:
        r = await client.post(path("im", "entries"), json=um("x"), headers={"If-Match": value})
        refused(r, 400, "bad_request")
        refused(await client.delete(path("im"), headers={"If-Match": value}), 400, "bad_request")
    assert (await redis_store.head("im")).n == 0  # type: ignore[union-attr]
    for value in ['"0"', "1"]:  # quoted or bare: both still taken
        assert (await client.post(path("im", "entries"), json=um("x"), headers={"If-Match": value})).status_code == 201


# --------------------------------------------------------------------------- 12: ambiguous query parameters


async def test_ambiguous_query_parameters_are_refused(client: httpx.AsyncClient) -> None:
    """A flag is 1/true/0/false, nothing else; any parameter sent twice, or empty, is a 400 — on
    every route, by the one rule they share."""
    await seeded(client, "q", 3)
    for url in [
        path("q", "events") + "?deltas=yes",
        path("q", "events") + "?deltas=2",
        path("q", "events") + "?deltas=",
        path("q", "events") + "?deltas=1&deltas=1",
        path("q", "events") + "?start=1&start=2",
        path("q", "entries") + "?start=1&start=2",
        path("q", "entries") + "?limit=1&limit=2",
        path("q", "entries") + "?limit=",
        path("q", "entries") + "?stop=",
        path("q", "messages") + "?format=openai&format=anthropic",
        path("q", "messages") + "?format=",
        path("q", "messages") + "?last=1&last=2",
        "/sessions?limit=1&limit=2",
        "/sessions?limit=",
        "/sessions?parent=q&parent=q",
        "/sessions?cursor=",
        # parameters the route does not read are held to the same rule (they were served)
        "/sessions?start=1&start=2",
        "/sessions?incarnation=&incarnation=",
        path("q") + "?limit=",
        path("q", "messages") + "?start=1&start=2",
        path("q", "entries") + "?format=openai&format=anthropic",
        path("q", "draft") + "?limit=",
        path("q", "events") + "?limit=1&limit=2",
        "/healthz?x=1&x=2",
        "/sessions?incarnation=",
        "/healthz?incarnation=",
    ]:
        async with client.stream("GET", url) as r:  # taken, an event stream would never end
            assert r.status_code == 400, url
            await r.aread()
        refused(r, 400, "bad_request")
        assert any(w in r.json()["message"] for w in ("once", "empty", "deltas")), (url, r.text)
    # the flag's documented values are all taken
    for value in ("1", "true", "0", "false"):
        async with client.stream("GET", path("q", "events") + f"?deltas={value}") as r:
            assert r.status_code == 200, value
    assert (await client.get(path("q", "entries") + "?limit=2")).json()["next"] == 2


# --------------------------------------------------------------------------- 13: ambiguous credentials


async def test_ambiguous_credentials_are_refused(redis_store: RedisSessionStore) -> None:
    """Two Authorization headers, Authorization and ?token=, or ?token= twice: 400 "send one",
    whichever tokens they are (a proxy appending its own must not let the client's decide), and
    nothing is deleted."""
    await redis_store.create(SessionHeader(id="cred"))
    tokens = [Token.make("admin-tok-0123", ["admin"]), Token.make("read-tok-01234", ["read"])]
    with anyio.fail_after(60):
        async with running_gateway(redis_store, tokens=tokens) as base, httpx.AsyncClient(base_url=base) as c:
            admin, read = "Bearer admin-tok-0123", "Bearer read-tok-01234"
            for headers, query in [
                ([("Authorization", admin), ("Authorization", read)], ""),
                ([("Authorization", admin), ("Authorization", admin)], ""),
                ([("Authorization", admin)], "?token=read-tok-01234"),
                ([], "?token=admin-tok-0123&token=admin-tok-0123"),
                ([], "?token=admin-tok-0123&token="),
            ]:
                r = await c.request("DELETE", path("cred") + query, headers=headers)
                refused(r, 400, "bad_request")
                assert "send one" in r.json()["message"], r.text
            assert await redis_store.head("cred") is not None
            # one credential: as before
            assert (await c.get(path("cred"), headers={"Authorization": read})).status_code == 200
            assert (await c.get(path("cred") + "?token=read-tok-01234")).status_code == 200
            assert (await c.delete(path("cred"), headers={"Authorization": admin})).status_code == 204


# --------------------------------------------------------------------------- 16: a blank body is no empty body


async def test_delete_and_repair_refuse_a_blank_body(client: httpx.AsyncClient, redis_store: RedisSessionStore) -> None:
    await seeded(client, "blank", 2)
    before = await snapshot(redis_store, "blank")
    for body in (b" ", b"\n\t ", b"\r\n"):
        refused(await client.request("DELETE", path("blank"), content=body), 400, "bad_request")
        refused(await client.post(path("blank", "repair"), content=body), 400, "bad_request")
    assert await snapshot(redis_store, "blank") == before
    assert (await client.post(path("blank", "repair"), content=b"{}")).status_code == 200
    assert (await client.request("DELETE", path("blank"), content=b"")).status_code == 204


# --------------------------------------------------------------------------- 17: fork's codes are everyone's


async def test_fork_answers_the_documented_error_codes(client: httpx.AsyncClient) -> None:
    """A fork into a taken id is 409 ``already_exists`` and of an unknown parent 404 ``not_found``,
    as a branch's; the dsh `code` stays for the TypeScript client's `SessionForkError`."""
    await seeded(client, "fk", 0)
    await seeded(client, "fk-taken", 0)
    r = await client.post(path("fk", "fork"), json={"id": "fk-taken"})
    refused(r, 409, "already_exists")
    assert r.json()["code"] == "SESSION_ALREADY_EXISTS"
    branch = await client.post(path("fk", "branch"), json={"at": 0, "id": "fk-taken"})
    assert branch.json()["error"] == r.json()["error"]
    r = await client.post(path("no-such", "fork"), json={})
    refused(r, 404, "not_found")
    assert r.json()["code"] == "SESSION_NOT_FOUND"
    assert (await client.post(path("no-such", "branch"), json={"at": 0})).json()["error"] == "not_found"
    keyed = await client.post(path("fk", "fork"), json={"id": "fk-taken"}, headers={"Idempotency-Key": "k"})
    refused(keyed, 409, "already_exists")


async def test_two_sign_in_cookies_or_two_tokens_in_the_sign_in_form_are_refused(
    redis_store: RedisSessionStore,
) -> None:
    """Two different ``rs_token`` cookies (one tossed for a parent domain or another path by
    another page) were decided by the browser's order, and a sign-in form with ``token`` twice
    kept the last: both are refused; one cookie, or the same one twice, still signs in."""
    await redis_store.create(SessionHeader(id="cookie"))
    tokens = [Token.make("admin-tok-0123", ["admin"]), Token.make("read-tok-01234", ["read"])]
    with anyio.fail_after(60):
        async with running_gateway(redis_store, tokens=tokens) as base, httpx.AsyncClient(base_url=base) as c:
            two = {"Cookie": "rs_token=admin-tok-0123; rs_token=read-tok-01234"}
            refused(await c.request("DELETE", path("cookie"), headers=two), 400, "bad_request")
            assert await redis_store.head("cookie") is not None
            same = {"Cookie": "rs_token=read-tok-01234; rs_token=read-tok-01234"}
            assert (await c.get(path("cookie"), headers=same)).status_code == 200
            form = {"Content-Type": "application/x-www-form-urlencoded"}
            r = await c.post("/signin", content=b"token=read-tok-01234&token=admin-tok-0123", headers=form)
            assert r.status_code == 400 and "set-cookie" not in r.headers, r.text[:200]
            r = await c.post("/signin", content=b"token=read-tok-01234", headers=form)
            assert r.status_code in (200, 303) and "rs_token=" in r.headers.get("set-cookie", ""), r.text[:200]


async def test_a_request_the_parser_refuses_after_a_pipelined_write_does_not_hide_its_answer(
    redis_store: RedisSessionStore,
) -> None:
    """A write and, in the same packet, a request the parser refuses: the write's own answer
    (201) comes first, then the 400 (it said "nothing was done" alone while the write was done:
    a client retrying it would write twice)."""
    async with running_gateway(redis_store) as base:
        host, port = base.removeprefix("http://").split(":")
        stream = await anyio.connect_tcp(host, int(port))
        body = b'{"id": "pipelined"}'
        try:
            await stream.send(
                b"POST /sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%b"
                % (len(body), body)
                + b"get /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            )
            got = b""
            with anyio.fail_after(30):
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    while True:
                        got += await stream.receive()
        finally:
            await stream.aclose()
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", got)  # the 400 follows the 201's body directly
    assert statuses == [b"201", b"400"], got[:400]
    assert (await redis_store.head("pipelined")) is not None
