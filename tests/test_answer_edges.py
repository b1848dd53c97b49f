"""Edges of the one answer protocol (``lua/answer.lua``, the memory store's twin, the gateway's
answer routes): an answer of an earlier life of the id is refused as *replaced* whatever else is
wrong with the request (the life is checked first), and an answer whose text would outgrow the
entry limit is refused at the batch that would do it, so it can always end with what it has."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from redis_session import (
    Delta,
    RedisSessionStore,
    SessionHeader,
    SessionReplacedError,
)

from support import running_gateway

pytestmark = pytest.mark.anyio


def path(session_id: str, sub: str = "") -> str:
    return "/sessions/" + quote(session_id, safe="") + (f"/{sub}" if sub else "")


def _batch(first: int, texts: str | list[str]) -> dict[str, Any]:
    return {"first_index": first, "deltas": [{"text": t} for t in texts]}


def _deltas(answer: str, first: int, texts: str) -> list[Delta]:
    return [Delta(answer=answer, index=first + i, kind="text", text=t) for i, t in enumerate(texts)]


@pytest.fixture
async def client(redis_store: RedisSessionStore) -> AsyncIterator[httpx.AsyncClient]:
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=20) as c:
        yield c


# --------------------------------------------------------------------------- the life comes first


async def test_http_end_of_an_earlier_lifes_answer_is_replaced_not_incomplete(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    # the old life had entries before the answer began, so its state names an n beyond the new
    # life's log: the end used to read nothing there and answer 409 incomplete (missing [0, 2))
    three = [("user/message", {"content": "u"})] * 3
    await redis_store.create(SessionHeader(id="old"), three)
    r = await client.post(path("old", "answers"), json={"turn": 1, "step": 1})
    assert r.status_code == 201, r.text
    a, inc = r.json()["answer"], r.json()["incarnation"]
    assert (await client.post(path("old", f"answers/{a}/deltas"), json=_batch(0, "ab"))).status_code == 201
    await redis_store.delete("old")
    await redis_store.create(SessionHeader(id="old"))  # the new life: an empty log
    end = path("old", f"answers/{a}/end")
    for body, headers in [
        ({"reason": "committed"}, {}),  # no life pinned: the answer's own life decides
        ({"reason": "committed", "deltas": 2}, {}),
        ({"reason": "committed", "deltas": 7}, {}),  # incomplete too: the life still comes first
        ({"reason": "interrupted"}, {}),
        ({"reason": "committed"}, {"X-Session-Incarnation": inc}),  # pinned to the old life
        ({"reason": "committed"}, {"If-Match": '"0"'}),
    ]:
        r = await client.post(end, json=body, headers=headers)
        assert r.status_code == 409 and r.json()["error"] == "session_replaced", (body, headers, r.text)
    for body in [_batch(2, "cd"), _batch(9, "zz"), _batch(0, "xy"), _batch(0, "ab"), _batch(0, [])]:
        r = await client.post(path("old", f"answers/{a}/deltas"), json=body)
        assert r.status_code == 409 and r.json()["error"] == "session_replaced", (body, r.text)
    assert await redis_store.read("old") == [] and await redis_store.read_live("old") == []


async def test_every_op_of_an_earlier_lifes_answer_is_replaced_first(store: Any) -> None:
    # the store ops themselves (answer.lua and the memory twin): whatever else the request gets
    # wrong (an index out of order, a row at a landed index with other deltas, a count the log
    # lacks, a stale expected n), an answer of another life is refused as replaced
    await store.create(SessionHeader(id="lv"), [("user/message", {"content": "u"})] * 4)
    begun = await store.answer_begin("lv", "a1", turn=1, step=1, ttl_ms=60_000)
    await store.answer_deltas("lv", "a1", 0, _deltas("a1", 0, "ab"), turn=1, step=1, ttl_ms=60_000)
    await store.delete("lv")
    await store.create(SessionHeader(id="lv"))
    calls = [
        lambda: store.answer_deltas("lv", "a1", 2, _deltas("a1", 2, "cd"), ttl_ms=60_000),
        lambda: store.answer_deltas("lv", "a1", 5, _deltas("a1", 5, "x"), ttl_ms=60_000),  # out of order
        lambda: store.answer_deltas("lv", "a1", 0, _deltas("a1", 0, "zz"), ttl_ms=60_000),  # other deltas
        lambda: store.answer_deltas("lv", "a1", 0, _deltas("a1", 0, "ab"), turn=1, step=1, ttl_ms=60_000),
        lambda: store.answer_deltas("lv", "a1", 2, _deltas("a1", 2, "c"), live=False, ttl_ms=60_000),
        lambda: store.answer_beat("lv", "a1", ttl_ms=60_000),
        lambda: store.answer_end("lv", "a1", deltas=9, reason="committed", grace_ms=1000),  # incomplete
        lambda: store.answer_end("lv", "a1", deltas=2, reason="committed", grace_ms=1000, expected=17),
        lambda: store.answer_end("lv", "a1", deltas=2, reason="interrupted", grace_ms=1000, stale_ms=10**9),
        lambda: store.answer_end(
            "lv", "a1", deltas=4, reason="committed", rest_first=7, rest=_deltas("a1", 7, "xy"), grace_ms=1000
        ),  # a rest row out of order
        lambda: store.answer_end(
            "lv", "a1", deltas=2, reason="committed", grace_ms=1000, incarnation=begun.incarnation
        ),  # the old life pinned
        lambda: store.answer_begin("lv", "a1", turn=1, step=1, incarnation=begun.incarnation, ttl_ms=60_000),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(SessionReplacedError):
            await call()
            pytest.fail(f"call {i} was not refused")
    assert await store.read("lv") == []
    assert [r for r in await store.read_live("lv") if r.answer == "a1"] == []
