"""New session ids hold no invisible format character (Unicode category Cf: zero-width ones, the
bidirectional controls, the BOM), so two ids that look the same always name one session; a
session created under such an id before the rule stays readable, writable and deletable."""

from __future__ import annotations

import json
import unicodedata
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from redis_session import InvalidSessionIdError, MemorySessionStore, SessionHeader, Sessions
from redis_session.importers import ImportFormatError, import_path, session_id_to_key
from redis_session.keys import validate_new_session_id, validate_session_id
from redis_session.projection.nanobot import id_to_key as nanobot_id_to_key
from redis_session.projection.nanobot import key_to_id as nanobot_key_to_id
from redis_session.store import rules

pytestmark = pytest.mark.anyio

FORMAT_CHARS = ["\u200b", "\u200c", "\u200d", "\u200e", "\u202a", "\u202e", "\u2066", "\u2069", "\ufeff", "\u00ad"]


@pytest.fixture(params=["memory", "redis"])
async def any_store(request: pytest.FixtureRequest, redis_store: Any) -> AsyncIterator[Any]:
    yield MemorySessionStore() if request.param == "memory" else redis_store


async def legacy(store: Any, monkeypatch: pytest.MonkeyPatch, sid: str, k: int = 2) -> None:
    """A session an older version created under `sid` (before new ids were checked for Cf)."""
    with monkeypatch.context() as m:
        m.setattr(rules, "validate_new_session_id", validate_session_id)
        await store.create(SessionHeader(id=sid), [("user/message", {"content": f"m{i}"}) for i in range(k)])


@pytest.mark.parametrize("c", FORMAT_CHARS, ids=[f"U+{ord(c):04X}" for c in FORMAT_CHARS])
def test_the_rule_is_exactly_category_cf(c: str) -> None:
    assert unicodedata.category(c) == "Cf"
    assert validate_session_id(f"chat{c}1") == f"chat{c}1"  # an existing session stays addressable
    with pytest.raises(InvalidSessionIdError, match=f"U\\+{ord(c):04X}"):
        validate_new_session_id(f"chat{c}1")
    # what looks alike but is visible stays allowed: accents, CJK, emoji, RTL letters
    for ok in ("café", "会话-1", "chat🙂", "שיחה", "a:b/c"):
        assert validate_new_session_id(ok) == ok


async def test_no_store_creates_one_and_nothing_is_written(any_store: Any) -> None:
    sessions = Sessions(any_store)
    await any_store.create(SessionHeader(id="p"), [("user/message", {"content": "x"})])
    for c in FORMAT_CHARS:
        sid = f"chat{c}1"
        with pytest.raises(InvalidSessionIdError):
            await any_store.create(SessionHeader(id=sid), [("user/message", {"content": "x"})])
        with pytest.raises(InvalidSessionIdError):
            await any_store.create(SessionHeader(id=sid, parent="p", at=1))
        with pytest.raises(InvalidSessionIdError):
            await sessions.create(sid)
        with pytest.raises(InvalidSessionIdError):
            await sessions.open(sid)  # a missing id: open would create it
        with pytest.raises(InvalidSessionIdError):
            await sessions.branch("p", 1, branch_id=sid)
        with pytest.raises(InvalidSessionIdError):
            await sessions.fork("p", fork_id=sid)
        assert await any_store.head(sid) is None
    assert [h.id for h in (await any_store.list()).items] == ["p"]
    assert (await any_store.head("p")).n == 1  # type: ignore[union-attr]


async def test_an_existing_one_stays_readable_writable_and_deletable(
    any_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions = Sessions(any_store)
    sid = "\u202egnp.exe"
    await legacy(any_store, monkeypatch, sid)
    s = await sessions.open(sid)  # exists: opened, not created
    assert s.n == 2 and [e.n for e in await s.read()] == [0, 1]
    await s.append("user/message", {"content": "more"})
    assert len(await s.messages()) == 3
    assert [h.id for h in (await sessions.list()).items] == [sid]
    child = await sessions.branch(sid, 2, branch_id="clean-copy")  # a clean child of an old parent
    assert [e.data["content"] for e in await child.read()] == ["m0", "m1"]
    with pytest.raises(InvalidSessionIdError, match="explicit branch_id"):
        await sessions.branch(sid, 1)  # the default id would copy the format character
    assert await sessions.delete(sid)
    assert await any_store.head(sid) is None
    assert [e.data["content"] for e in await child.read()] == ["m0", "m1"]  # the branch keeps its entries


async def test_an_import_under_such_an_id_is_refused_and_writes_nothing(any_store: Any, tmp_path: Path) -> None:
    rows = [
        {"_type": "metadata", "key": "telegram:42", "created_at": "2026-01-01T00:00:00", "metadata": {}},
        {"role": "user", "content": "hi", "timestamp": "2026-01-01T00:00:01"},
    ]
    clean = tmp_path / "c.jsonl"
    clean.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(ImportFormatError, match="U\\+2066"):
        await import_path(any_store, clean, session_id="x\u2066y")  # an id given for it
    assert (await any_store.list()).items == []
    [done] = await import_path(any_store, clean)  # the file itself was fine
    assert done.session_id == "telegram:42"


@pytest.mark.parametrize("c", FORMAT_CHARS)
async def test_a_foreign_key_with_a_format_character_is_escaped_not_refused(
    any_store: Any, tmp_path: Path, c: str
) -> None:
    """A nanobot key (a chat title, a channel name) may hold a zero-width joiner or a bidi mark:
    the file imports under the key's escaped id (the character as %XX, visible), the mapping
    reverses to the key, and nanobot's own key mapping finds the same session."""
    key = f"telegram:{c}42"
    rows = [
        {"_type": "metadata", "key": key, "created_at": "2026-01-01T00:00:00", "metadata": {}},
        {"role": "user", "content": "hi", "timestamp": "2026-01-01T00:00:01"},
    ]
    path = tmp_path / "n.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    [done] = await import_path(any_store, path)
    escaped = "".join(f"%{b:02X}" for b in c.encode("utf-8"))
    assert done.session_id == f"telegram:{escaped}42"
    assert all(unicodedata.category(ch) != "Cf" for ch in done.session_id)
    assert session_id_to_key(done.session_id) == key
    assert nanobot_key_to_id(key) == done.session_id
    assert nanobot_id_to_key(done.session_id) == key
    [entry] = await any_store.read(done.session_id)
    assert entry.data["content"] == "hi"
    # two keys that differ only by the invisible character name two sessions
    assert nanobot_key_to_id("telegram:42") != done.session_id
