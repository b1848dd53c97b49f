"""The gateway's short way in (``/sessions/{id}...`` and ``/healthz`` skip Starlette's own
layers) answers exactly what the whole way answers: the same status, body and headers for
successes, every kind of refusal, an unexpected error, with and without tokens."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from redis_session import RedisSessionStore, SessionHeader
from redis_session.gateway import create_app

pytestmark = pytest.mark.anyio

SECURITY = {"x-content-type-options": "nosniff", "referrer-policy": "same-origin", "x-frame-options": "DENY"}


async def _boom(session_id: str) -> Sequence[Any]:
    raise RuntimeError(f"projection of {session_id} failed")


def _apps(store: RedisSessionStore, **options: Any) -> tuple[Any, Any]:
    fast = create_app(store, messages=_boom, **options)
    whole = create_app(store, messages=_boom, **options)
    whole.hot = whole.probe = None  # every request the whole way through Starlette
    return fast, whole


REQUESTS: list[tuple[str, str, dict[str, str], bytes]] = [
    ("GET", "/healthz", {}, b""),
    ("HEAD", "/healthz", {}, b""),
    ("GET", "/healthz", {"host": "evil.example"}, b""),  # probes answer any Host
    ("GET", "/sessions/s", {}, b""),
    ("HEAD", "/sessions/s", {}, b""),
    ("GET", "/sessions/s", {"host": "evil.example"}, b""),  # 421
    ("GET", "/sessions/nobody", {}, b""),  # 404
    ("GET", "/sessions/s/nope", {}, b""),  # 404, no such route
    ("GET", "/sessions/s/a/b/c/d", {}, b""),  # 404
    ("PUT", "/sessions/s", {}, b"{}"),  # 405 with Allow
    ("PATCH", "/sessions/s", {}, b"{}"),  # 405 (a method no session route has)
    ("POST", "/sessions/s/messages", {}, b""),  # 405
    ("GET", "/sessions/s/entries?start=x", {}, b""),  # 400
    ("GET", "/sessions/s/entries?start=1&start=2", {}, b""),  # 400, the query rule
    ("GET", "/sessions/%7Bbad%7D", {}, b""),  # 400, a hostile id
    ("GET", "/sessions/s/entries", {}, b""),
    ("POST", "/sessions/s/entries", {"if-match": '"7"'}, b'{"type":"user/message","data":{"content":"x"}}'),  # 412
    ("POST", "/sessions/s/entries", {"if-match": '"3'}, b"{}"),  # 400, half-quoted
    ("POST", "/sessions/s/entries", {"if-match": '"1"', "if-match ": '"2"'}, b"{}"),
    ("POST", "/sessions/s/entries", {}, b'{"type": "user/message"'),  # 400, not JSON
    ("POST", "/sessions/s/entries", {}, b'{"type": "", "data": {}}'),  # 422
    ("GET", "/sessions/s/messages", {}, b""),  # 500: the projection raised
    ("OPTIONS", "/sessions/s", {"origin": "http://other:1", "access-control-request-method": "POST"}, b""),
    ("POST", "/sessions/s/entries", {"origin": "http://other:1"}, b"{}"),  # 403, a cross-origin write
    ("GET", "/sessions", {}, b""),  # the whole way on both
]


async def _answers(app: Any, requests: list[tuple[str, str, dict[str, str], bytes]], **headers: str) -> list[Any]:
    out = []
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        for method, url, extra, body in requests:
            r = await client.request(method, url, headers={**headers, **extra}, content=body)
            got = dict(r.headers)
            got.pop("date", None)
            text = r.content.decode()
            out.append((method, url, r.status_code, got, json.loads(text) if text else None))
    return out


@pytest.mark.parametrize("with_token", [False, True])
async def test_the_short_way_answers_as_the_whole_way(redis_store: RedisSessionStore, with_token: bool) -> None:
    await redis_store.create(SessionHeader(id="s"))
    options: dict[str, Any] = {"token": "t0ken"} if with_token else {}
    fast, whole = _apps(redis_store, **options)
    auth = {"authorization": "Bearer t0ken"} if with_token else {}
    for headers in ({}, auth):  # without a token first: 401 where one is needed
        a = await _answers(fast, REQUESTS, **headers)
        b = await _answers(whole, REQUESTS, **headers)
        for got, expected in zip(a, b, strict=True):
            assert got == expected
    # what the answers are, not only that they agree
    answers: dict[tuple[str, str], Any] = {}
    for m, u, status, headers, body in a:
        answers.setdefault((m, u), (status, headers, body))  # the first request of each
    for m, u, status, headers, body in a:
        if m != "OPTIONS" or status != 204:
            assert {k: headers.get(k) for k in SECURITY} == SECURITY, (m, u, headers)
        if status >= 400 and m != "HEAD":
            assert body is not None and set(body) >= {"error", "message"}, (m, u, body)
    assert answers[("GET", "/healthz")][0] == 200
    assert answers[("GET", "/sessions/s")][0] == 200
    assert answers[("GET", "/sessions/s/messages")][0:3:2] == (500, {"error": "internal", "message": "internal error"})
    assert answers[("PUT", "/sessions/s")][0] == 405
    assert (await redis_store.head("s")).n == 0  # type: ignore[union-attr]


async def test_an_unexpected_error_on_the_short_way_reaches_the_server(redis_store: RedisSessionStore) -> None:
    """As on the whole way: the client gets the 500, and the exception goes on to the server
    (which logs it)."""
    await redis_store.create(SessionHeader(id="s"))
    fast, _ = _apps(redis_store)
    transport = httpx.ASGITransport(app=fast)  # raise_app_exceptions
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        with pytest.raises(RuntimeError, match="projection of s failed"):
            await client.get("/sessions/s/messages")


async def _call(app: Any, messages: list[dict[str, Any]], headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    """One ASGI request on `app` whose body arrives as `messages` (then the client is gone)."""
    sent: list[dict[str, Any]] = []
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/sessions/s/entries", "raw_path": b"/sessions/s/entries", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), *headers], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    await app(scope, receive, send)
    return sent


async def test_a_body_in_pieces_and_a_client_gone_mid_body(redis_store: RedisSessionStore) -> None:
    """The body is read as the server hands it over: in pieces (an empty one among them) it is one
    body; a client that hangs up before its last piece gets nothing written (its answer, a 400,
    is for the log); a declared length over the limit is refused before any piece is read."""
    await redis_store.create(SessionHeader(id="s"))
    body = b'{"type":"user/message","data":{"content":"in pieces"}}'
    pieces = [body[:10], b"", body[10:30], body[30:]]
    for app in _apps(redis_store):
        messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]
        sent = await _call(app, messages, [(b"if-match", b"*")])
        assert sent[0]["status"] == 201
        gone = await _call(app, [{"type": "http.request", "body": body[:10], "more_body": True}], [])
        assert gone[0]["status"] == 400 and json.loads(gone[1]["body"])["error"] == "client_disconnected"
        big = await _call(app, [], [(b"content-length", b"%d" % (64 << 20))])
        assert big[0]["status"] == 413 and json.loads(big[1]["body"])["error"] == "body_too_large"
    assert [e.data["content"] for e in await redis_store.read("s")] == ["in pieces", "in pieces"]
