"""ChatLuna's ctx.sessions rules on the Python side (docs/design.md §5): a branch inherits the parent's
title and origin unless given, a create keeps a given createdAt (store, Sessions and the HTTP
gateway), and a strict vocabulary checks ChatLuna's marks with every field its doc lists."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from redis_session import InvalidEntryError, MemorySessionStore, NewEntry, SessionHeader, Sessions, Vocabulary

from support import running_gateway

pytestmark = pytest.mark.anyio


async def test_branch_inherits_title_and_origin_unless_given(store: Any) -> None:
    sessions = Sessions(store)
    parent = await sessions.create("cl-parent", title="weather", origin={"platform": "discord", "guild": 42})
    await parent.append("message", {"role": "user", "content": "q"})
    child = await sessions.branch("cl-parent", 1)
    assert (child.header.title, child.header.origin) == ("weather", {"platform": "discord", "guild": 42})
    head = await store.head(child.id)
    assert (head.header.title, head.header.origin) == ("weather", {"platform": "discord", "guild": 42})
    own = await sessions.branch("cl-parent", 0, branch_id="cl-own", title="mine", origin={"sub": True})
    assert (own.header.title, own.header.origin) == ("mine", {"sub": True})
    await sessions.create("cl-bare")
    assert (await sessions.branch("cl-bare", 0)).header.title is None


async def test_create_keeps_a_given_created_at(store: Any) -> None:
    s = await Sessions(store).create("cl-created", created_at=1_700_000_000_123)
    assert s.header.created_at == 1_700_000_000_123
    assert (await store.head("cl-created")).header.created_at == 1_700_000_000_123
    with pytest.raises(ValueError, match="created_at"):
        await Sessions(store).create("cl-bad", created_at=-1)


async def test_the_gateway_keeps_a_given_created_at_and_names_a_bad_one(redis_store: Any) -> None:
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base) as http:
        r = await http.post("/sessions", json={"id": "cl-http", "created_at": 1_600_000_000_000})
        assert r.status_code == 201, r.text
        assert r.json()["header"]["created_at"] == 1_600_000_000_000
        bad = await http.post("/sessions", json={"id": "cl-http-2", "created_at": "yesterday"})
        assert bad.status_code in (400, 422) and "created_at" in bad.text
        assert (await http.get("/sessions/cl-http-2")).status_code == 404


@pytest.mark.parametrize(
    ("type_", "lenient_ok", "strict_bad", "strict_ok"),
    [
        ("preset/selected", {"presetId": "p"}, {"presetId": "p"}, {"presetId": "p", "revision": "r1"}),
        (
            "agent/input-enqueued",
            {"messageId": "m1"},
            {"messageId": "m1", "message": None, "target": "next-turn", "wakeup": True},
            {"messageId": "m1", "message": {"role": "user"}, "target": "next-step", "wakeup": False, "enqueuedAt": 5},
        ),
    ],
)
async def test_strict_vocabulary_checks_chatluna_marks_whole(
    type_: str, lenient_ok: dict[str, Any], strict_bad: dict[str, Any], strict_ok: dict[str, Any]
) -> None:
    lenient = MemorySessionStore()
    await lenient.create(SessionHeader(id="a"))
    await lenient.put("a", 0, [NewEntry(type_, lenient_ok)])
    strict = MemorySessionStore(vocabulary=Vocabulary(strict=True))
    await strict.create(SessionHeader(id="s"))
    with pytest.raises(InvalidEntryError, match=type_):
        await strict.put("s", 0, [NewEntry(type_, strict_bad)])
    assert (await strict.head("s")).n == 0
    await strict.put("s", 0, [NewEntry(type_, strict_ok)])
