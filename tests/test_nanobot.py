"""The legacy drop-in (redis_session.adapters.nanobot): nanobot 8656549's SessionManager on the store.

The fixtures in tests/fixtures/seed/nanobot were written by nanobot's own SessionManager, and
`expected_get_history.json` is what nanobot's own `get_history` returned for them: every file ×
every recorded setting must come back the same through the adapter, on a real server and on the
memory store.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from redis_session import MemorySessionStore, RedisSessionStore, SessionConflictError
from redis_session.adapters.nanobot import Session, SessionManager, fold
from redis_session.importers import import_path
from redis_session.model import CUT
from redis_session.projection import project, to_anthropic, to_openai

# Copies of the files nanobot's own code wrote (tests/fixtures/seed/README.md says where from).
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "seed" / "nanobot"
EXPECTED = json.loads((FIXTURES / "expected_get_history.json").read_text())
CASES = [
    pytest.param(key, i, id=f"{key}-{json.dumps(r['settings'], sort_keys=True)}")
    for key, s in EXPECTED["sessions"].items()
    for i, r in enumerate(s["results"])
]


class Backend:
    """A store on one backend, usable both from the test (imports, reads) and by a manager."""

    def __init__(self, kind: str, url: str | None, prefix: str) -> None:
        self.kind, self.url, self.prefix = kind, url, prefix
        self.memory = MemorySessionStore() if kind == "memory" else None

    def manager(self) -> SessionManager:
        if self.memory is not None:
            return SessionManager(self.memory)
        assert self.url is not None
        return SessionManager(self.url, prefix=self.prefix)

    def run(self, fn: Callable[[Any], Any]) -> Any:
        """`await fn(store)` on a fresh loop (a Redis store per call: stores are bound to a loop)."""

        async def go() -> Any:
            if self.memory is not None:
                return await fn(self.memory)
            assert self.url is not None
            store = RedisSessionStore.from_url(self.url, prefix=self.prefix)
            try:
                return await fn(store)
            finally:
                await store.aclose()

        return anyio.run(go)

    def cleanup(self) -> None:
        if self.url is None:
            return
        r = redis.Redis.from_url(self.url)
        keys = list(r.scan_iter(match=f"{self.prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest, prefix: str) -> Iterator[Backend]:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    b = Backend(request.param, url, prefix)
    yield b
    b.cleanup()


@pytest.fixture
def manager(backend: Backend) -> Iterator[SessionManager]:
    m = backend.manager()
    yield m
    m.close()


def _import(backend: Backend, name: str) -> None:
    backend.run(lambda store: import_path(store, FIXTURES / name))


def _entries(backend: Backend, sid: str) -> list[Any]:
    return list(backend.run(lambda store: store.read(sid)))


# --------------------------------------------------------------------------- the fixtures


@pytest.mark.parametrize(("key", "index"), CASES)
def test_get_history_matches_nanobot_for_every_fixture_and_setting(
    backend: Backend, manager: SessionManager, key: str, index: int
) -> None:
    recorded = EXPECTED["sessions"][key]
    _import(backend, recorded["file"])
    session = manager.get_or_create(key)
    assert len(session.messages) == recorded["n_messages"]
    assert session.last_consolidated == recorded["last_consolidated"]
    result = recorded["results"][index]
    assert session.get_history(**result["settings"]) == result["history"]


def test_get_history_signature_is_nanobots() -> None:
    import inspect

    sig = str(inspect.signature(Session.get_history))
    assert sig.replace("'", "") == EXPECTED["get_history_signature"].replace("typing.", "")


@pytest.mark.parametrize("key", list(EXPECTED["sessions"]))
def test_saved_through_the_adapter_gives_the_same_history(backend: Backend, manager: SessionManager, key: str) -> None:
    """A session built by the adapter's own saves (no importer) answers like nanobot too."""
    recorded = EXPECTED["sessions"][key]
    lines = [json.loads(x) for x in (FIXTURES / recorded["file"]).read_text().splitlines() if x.strip()]
    meta, messages = lines[0], lines[1:]
    s = manager.get_or_create(key)
    for i, m in enumerate(messages):
        s.messages.append(m)
        if i % 3 == 2:
            manager.save(s)
    s.metadata = meta["metadata"]
    s.last_consolidated = meta["last_consolidated"]
    manager.save(s)
    fresh = backend.manager()
    try:
        loaded = fresh.get_or_create(key)
        assert loaded.messages == messages
        assert loaded.last_consolidated == recorded["last_consolidated"]
        assert loaded.metadata == meta["metadata"]
        for r in recorded["results"]:
            assert loaded.get_history(**r["settings"]) == r["history"]
    finally:
        fresh.close()


# --------------------------------------------------------------------------- saves are appends


def test_save_appends_only_what_is_new(backend: Backend, manager: SessionManager) -> None:
    s = manager.get_or_create("cli:append")
    s.add_message("user", "hi")
    s.add_message("assistant", "hello", latency_ms=12)
    manager.save(s)
    manager.save(s)  # nothing new: nothing written
    s.add_message("user", "/status", _command=True)
    s.add_message("user", "more", media=["/m/x.png"])
    manager.save(s)
    entries = _entries(backend, "cli:append")
    assert [e.type for e in entries] == ["message", "message", "nanobot/command", "message"]
    assert entries[1].data["latency_ms"] == 12 and entries[3].data["media"] == ["/m/x.png"]
    # the generic projection sees the messages, never the command
    assert [m.text for m in project(entries)] == ["hi", "hello", "more"]


def test_metadata_changes_are_marks(backend: Backend, manager: SessionManager) -> None:
    s = manager.get_or_create("cli:meta")
    s.add_message("user", "hi")
    s.metadata["title"] = "<think>x</think>Greeting"
    manager.save(s)
    s.metadata["webui"] = {"pinned": True}
    manager.save(s)
    types = [e.type for e in _entries(backend, "cli:meta")]
    assert types == ["message", "nanobot/metadata", "nanobot/metadata"]
    manager.invalidate("cli:meta")
    metadata = manager.get_or_create("cli:meta").metadata
    assert metadata == {"title": "<think>x</think>Greeting", "webui": {"pinned": True}}
    [info] = [i for i in manager.list_sessions() if i["key"] == "cli:meta"]
    assert info["title"] == "Greeting" and info["preview"] == "hi"


def test_get_or_create_caches_and_invalidate_reloads(manager: SessionManager) -> None:
    s = manager.get_or_create("cli:cache")
    assert manager.get_or_create("cli:cache") is s
    s.add_message("user", "x")
    manager.save(s)
    manager.invalidate("cli:cache")
    again = manager.get_or_create("cli:cache")
    assert again is not s and again.messages == s.messages


def test_clear_is_a_cut_never_a_deletion(backend: Backend, manager: SessionManager) -> None:
    s = manager.get_or_create("cli:clear")
    for i in range(3):
        s.add_message("user", f"u{i}")
        s.add_message("assistant", f"a{i}")
    s.metadata["_last_summary"] = {"text": "old", "last_active": "2026-01-01T00:00:00"}
    manager.save(s)
    s.clear()
    manager.save(s)
    entries = _entries(backend, "cli:clear")
    assert sum(e.type == "message" for e in entries) == 6  # nothing deleted
    assert entries[-1].type == CUT and entries[-1].data["reason"] == "nanobot:clear"
    assert project(entries) == []
    s.add_message("user", "fresh")
    manager.save(s)
    manager.invalidate("cli:clear")
    loaded = manager.get_or_create("cli:clear")
    assert [m["content"] for m in loaded.messages] == ["fresh"]
    assert loaded.get_history() == [{"role": "user", "content": "fresh"}]


def test_retain_recent_legal_suffix_and_file_cap_become_cuts(backend: Backend, manager: SessionManager) -> None:
    s = manager.get_or_create("cli:cap")
    for i in range(15):
        s.add_message("user", f"u{i}")
    for i in range(10):
        s.add_message("assistant", f"a{i}")
    s.last_consolidated = 8
    manager.save(s)
    archived: list[list[dict[str, Any]]] = []
    s.enforce_file_cap(archived.append, limit=6)
    kept = list(s.messages)
    manager.save(s)
    entries = _entries(backend, "cli:cap")
    assert sum(e.type == "message" for e in entries) >= 25  # the log keeps every message
    assert not any(m in kept for m in archived[0])
    manager.invalidate("cli:cap")
    loaded = manager.get_or_create("cli:cap")
    assert loaded.messages == kept
    assert loaded.last_consolidated == s.last_consolidated
    assert loaded.get_history() == s.get_history()


def test_non_contiguous_retain_reappends_what_is_kept(backend: Backend, manager: SessionManager) -> None:
    """nanobot's quirk: a tail with no user message keeps a window forward from the last user
    message, dropping newer messages; the log can only say that by re-appending the window."""
    s = manager.get_or_create("cli:quirk")
    for i in range(10):
        s.add_message("user", f"u{i}")
    for i in range(10):
        s.add_message("assistant", f"a{i}")
    s.last_consolidated = 12
    manager.save(s)
    s.retain_recent_legal_suffix(4)
    assert [m["content"] for m in s.messages] == ["u9", "a0", "a1", "a2"] and s.last_consolidated == 3
    manager.save(s)
    manager.invalidate("cli:quirk")
    loaded = manager.get_or_create("cli:quirk")
    assert loaded.messages == s.messages and loaded.last_consolidated == 3
    assert [m.text for m in project(_entries(backend, "cli:quirk"))] == ["a2"]


def test_edit_in_place_is_saved(manager: SessionManager) -> None:
    s = manager.get_or_create("cli:edit")
    s.add_message("user", "hi")
    s.add_message("assistant", "draft")
    manager.save(s)
    s.messages[-1]["content"] = "final"
    s.add_message("user", "next")
    manager.save(s)
    manager.invalidate("cli:edit")
    assert [m["content"] for m in manager.get_or_create("cli:edit").messages] == ["hi", "final", "next"]


# --------------------------------------------------------------------------- consolidation


def test_consolidation_writes_a_cut_with_the_summary(backend: Backend, manager: SessionManager) -> None:
    """The Consolidator's moves (last_consolidated forward, `_last_summary` in metadata) land as a
    cut whose summary the model sees through the generic API."""
    s = manager.get_or_create("slack:auto")
    for i in range(4):
        s.add_message("user", f"u{i}")
        s.add_message("assistant", "", tool_calls=[_call(f"c{i}")])
        s.add_message("tool", f"r{i}", tool_call_id=f"c{i}", name="lookup")
        s.add_message("assistant", f"a{i}")
    manager.save(s)
    # Consolidator.maybe_consolidate_by_tokens: archive a chunk, move the offset, save; then
    # _persist_last_summary: summary into metadata, save.
    s.last_consolidated = 6  # inside the second tool-call group: the tool result r1 is next
    manager.save(s)
    s.metadata["_last_summary"] = {"text": "User asked u0, u1.", "last_active": "2026-12-01T04:00:00"}
    manager.save(s)
    entries = _entries(backend, "slack:auto")
    cuts = [e for e in entries if e.type == CUT]
    assert cuts[-1].data["before"] == 6
    summary = cuts[-1].data["summary"]
    assert "User asked u0, u1." in summary[0]["content"] and summary[0]["role"] == "user"

    async def generic(store: Any) -> Any:
        from redis_session.sessions import Sessions

        sessions = Sessions(store)
        handle = await sessions.open("slack:auto")
        return await handle.messages(), await handle.history()

    msgs, hist = backend.run(generic)
    assert hist[0].role == "user"
    assert "User asked u0, u1." in msgs[0].text
    assert msgs[1].role == "tool"  # the cut fell inside a tool-call group …
    rendered = to_openai(msgs)
    assert rendered[0]["role"] == "user" and rendered[1]["role"] == "assistant"  # … the renderer drops the orphan
    assert all(m["role"] != "tool" or m["tool_call_id"] != "c1" for m in rendered)
    assert to_anthropic(msgs)["messages"][0]["role"] == "user"
    manager.invalidate("slack:auto")
    again = manager.get_or_create("slack:auto")
    assert again.last_consolidated == 6 and again.metadata["_last_summary"]["text"] == "User asked u0, u1."
    assert again.get_history() == s.get_history()


def test_idle_compaction_keeps_a_suffix_and_the_summary(backend: Backend, manager: SessionManager) -> None:
    """AutoCompact's compact_idle_session: keep a legal recent suffix, lc 0, summary in metadata."""
    s = manager.get_or_create("tg:idle")
    for i in range(6):
        s.add_message("user", f"u{i}")
        s.add_message("assistant", f"a{i}")
    manager.save(s)
    manager.invalidate("tg:idle")
    session = manager.get_or_create("tg:idle")
    probe = Session(key=session.key, messages=list(session.messages))
    probe.retain_recent_legal_suffix(4, extend_to_user=True)
    session.metadata["_last_summary"] = {"text": "six turns of greetings", "last_active": "2026-12-01T00:00:00"}
    session.messages = probe.messages
    session.last_consolidated = 0
    manager.save(session)
    msgs = project(_entries(backend, "tg:idle"))
    assert "six turns of greetings" in msgs[0].text
    assert [m.text for m in msgs[1:]] == ["u4", "a4", "u5", "a5"]
    manager.invalidate("tg:idle")
    assert [m["content"] for m in manager.get_or_create("tg:idle").messages] == ["u4", "a4", "u5", "a5"]


def test_import_then_save_puts_the_imported_summary_in_a_cut(backend: Backend, manager: SessionManager) -> None:
    _import(backend, "slack_consolidated.jsonl")
    s = manager.get_or_create("slack:consolidated")
    manager.save(s)
    msgs = project(_entries(backend, "slack:consolidated"))
    assert "User asked u0..u3" in msgs[0].text


# --------------------------------------------------------------------------- two pods


def test_two_managers_saving_one_session_one_wins_nothing_interleaves(backend: Backend) -> None:
    a, b = backend.manager(), backend.manager()
    try:
        base = a.get_or_create("pod:shared")
        base.add_message("user", "q")
        a.save(base)
        sa, sb = a.get_or_create("pod:shared"), b.get_or_create("pod:shared")
        sa.add_message("assistant", "from A")
        sb.add_message("assistant", "from B")
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        def save(m: SessionManager, s: Session) -> None:
            barrier.wait()
            try:
                m.save(s)
            except SessionConflictError as e:
                errors.append(e)

        threads = [threading.Thread(target=save, args=(a, sa)), threading.Thread(target=save, args=(b, sb))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(errors) == 1
        contents = [e.data["content"] for e in _entries(backend, "pod:shared")]
        assert contents in (["q", "from A"], ["q", "from B"])
        # the loser reloads and retries
        loser, session = (b, sb) if contents[-1] == "from A" else (a, sa)
        loser.invalidate("pod:shared")
        fresh = loser.get_or_create("pod:shared")
        fresh.add_message("assistant", session.messages[-1]["content"])
        loser.save(fresh)
        retried = session.messages[-1]["content"]
        assert [e.data["content"] for e in _entries(backend, "pod:shared")] == [*contents, retried]
    finally:
        a.close()
        b.close()


def test_two_new_sessions_created_concurrently_conflict(backend: Backend) -> None:
    a, b = backend.manager(), backend.manager()
    try:
        sa, sb = a.get_or_create("pod:new"), b.get_or_create("pod:new")
        sa.add_message("user", "A")
        sb.add_message("user", "B")
        a.save(sa)
        with pytest.raises(SessionConflictError):
            b.save(sb)
        assert [e.data["content"] for e in _entries(backend, "pod:new")] == ["A"]
    finally:
        a.close()
        b.close()


# --------------------------------------------------------------------------- the rest of the API


def test_fork_before_user_index(manager: SessionManager) -> None:
    s = manager.get_or_create("web:src")
    for text in ["r1", "a1", "r2", "a2", "r3"]:
        s.add_message("user" if text.startswith("r") else "assistant", text)
    s.metadata.update({"title": "T", "goal_state": {"x": 1}, "webui": {"k": 1}})
    manager.save(s)
    fork = manager.fork_session_before_user_index("web:src", "web:dst", 1)
    assert fork is not None and [m["content"] for m in fork.messages] == ["r1", "a1"]
    assert fork.metadata == {"webui": {"k": 1}}
    assert manager.fork_session_before_user_index("web:src", "web:x", 4) is None
    assert manager.fork_session_before_user_index("web:src", "web:x", -1) is None
    assert manager.fork_session_before_user_index("web:missing", "web:x", 0) is None
    full = manager.fork_session_before_user_index("web:src", "web:dst", 3)  # over the old target
    assert full is not None and len(full.messages) == 5
    manager.invalidate("web:dst")
    assert [m["content"] for m in manager.get_or_create("web:dst").messages] == ["r1", "a1", "r2", "a2", "r3"]
    assert [m["content"] for m in manager.get_or_create("web:src").messages] == ["r1", "a1", "r2", "a2", "r3"]
    assert {"web:src", "web:dst"} <= {i["key"] for i in manager.list_sessions()}


def test_delete_flush_all_and_read_session_file(backend: Backend, manager: SessionManager) -> None:
    assert manager.flush_all() == 0
    for k in ("x:1", "x:2"):
        s = manager.get_or_create(k)
        s.add_message("user", k)
    assert manager.flush_all() == 2
    payload = manager.read_session_file("x:1")
    assert payload is not None and payload["messages"][0]["content"] == "x:1"
    assert manager.delete("x:1") is True
    assert manager.delete_session("x:1") is False
    assert manager.read_session_file("x:1") is None
    assert manager.get_or_create("x:1").messages == []


def test_fold_of_a_foreign_cut_counts_consolidated_messages() -> None:
    """A cut written by another tool (no nanobot floor) consolidates, drops nothing."""
    from redis_session.model import Entry, SessionHead, SessionHeader

    entries = [Entry(n=i, time=0, type="message", data={"role": "user", "content": f"u{i}"}) for i in range(3)]
    entries.append(Entry(n=3, time=0, type=CUT, data={"before": 2, "summary": [], "reason": "x"}))
    s = fold("k", SessionHead(header=SessionHeader(id="k"), n=4, updated_at=0), entries)
    assert len(s.messages) == 3 and s.last_consolidated == 2


def test_a_summary_cut_written_by_another_compactor_survives_saves(backend: Backend, manager: SessionManager) -> None:
    s = manager.get_or_create("other:compactor")
    for i in range(3):
        s.add_message("user", f"u{i}")
        s.add_message("assistant", f"a{i}")
    manager.save(s)

    async def compact(store: Any) -> None:
        from redis_session.sessions import Sessions

        handle = await Sessions(store).open("other:compactor")
        await handle.compact(4, [{"role": "user", "content": "earlier: u0, u1"}], "token_limit")

    backend.run(compact)
    manager.invalidate("other:compactor")
    s = manager.get_or_create("other:compactor")
    assert s.last_consolidated == 4 and len(s.messages) == 6
    s.add_message("user", "u3")
    s.last_consolidated = 6  # nanobot consolidates further, without a summary of its own
    manager.save(s)
    msgs = project(_entries(backend, "other:compactor"))
    assert [m.text for m in msgs] == ["earlier: u0, u1", "u3"]
    s.clear()
    manager.save(s)
    assert project(_entries(backend, "other:compactor")) == []


def _call(cid: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


def test_an_unclosed_manager_does_not_hold_up_exit() -> None:
    """nanobot never closes its SessionManager: the loop thread must not keep the process alive."""
    import subprocess
    import sys

    code = (
        "from redis_session import MemorySessionStore\n"
        "from redis_session.adapters.nanobot import SessionManager\n"
        "m = SessionManager(MemorySessionStore())\n"
        "s = m.get_or_create('k:1'); s.add_message('user', 'a'); m.save(s)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.anyio
async def test_sync_calls_work_inside_a_coroutine() -> None:
    """nanobot calls its manager synchronously from its agent loop's coroutines."""
    with SessionManager(MemorySessionStore()) as m:
        s = m.get_or_create("loop:1")
        s.add_message("user", "hi")
        m.save(s)
        m.invalidate("loop:1")
        assert m.get_or_create("loop:1").get_history() == [{"role": "user", "content": "hi"}]


def test_any_key_works_by_default(backend: Backend, manager: SessionManager) -> None:
    """Keys nanobot takes that are no session id (whitespace, tabs, braces) map reversibly."""
    keys = ["discord:guild 42", "tab\tkey", "{x}:y", "50%"]
    for key in keys:
        s = manager.get_or_create(key)
        s.add_message("user", key)
        manager.save(s)
    other = backend.manager()
    try:
        assert sorted(x["key"] for x in other.list_sessions()) == sorted(keys)
        for key in keys:
            assert [m["content"] for m in other.get_or_create(key).messages] == [key]
    finally:
        other.close()


def test_a_session_of_one_life_never_writes_another(backend: Backend, manager: SessionManager) -> None:
    """Deleted and created again with the same number of entries: the old object's save is
    refused (SessionReplacedError), the new life keeps only its own messages."""
    from redis_session import SessionReplacedError

    key = "cli:direct"
    old = manager.get_or_create(key)
    old.add_message("user", "old life")
    manager.save(old)
    other = backend.manager()
    try:
        assert other.delete_session(key)
        new = other.get_or_create(key)
        new.add_message("user", "new life")
        other.save(new)
        old.add_message("assistant", "meant for the old life")
        with pytest.raises(SessionReplacedError):
            manager.save(old)
        other.invalidate(key)
        assert [m["content"] for m in other.get_or_create(key).messages] == ["new life"]
    finally:
        other.close()


def test_an_integer_past_64_bits_loads_back_and_lists(backend: Backend, manager: SessionManager) -> None:
    """A message field and metadata past 64 bits (a 20-digit channel id): saved, then a fresh
    manager loads them exactly and lists the session (every load used to raise OverflowError)."""
    big = 2**64
    s = manager.get_or_create("telegram:big")
    s.add_message("user", "hi", ref=big)
    s.metadata["chat"] = -(2**70)
    manager.save(s)
    other = backend.manager()
    try:
        loaded = other.get_or_create("telegram:big")
        assert loaded.messages[0]["ref"] == big and loaded.metadata["chat"] == -(2**70)
        assert [x["key"] for x in other.list_sessions()] == ["telegram:big"]
    finally:
        other.close()


def test_a_value_nested_too_deep_is_a_typed_error_and_nothing_is_written(
    backend: Backend, manager: SessionManager
) -> None:
    from redis_session import InvalidEntryError

    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    s = manager.get_or_create("cli:deep")
    s.add_message("user", "fine")
    manager.save(s)
    s.add_message("assistant", "bad", extra=deep)
    with pytest.raises(InvalidEntryError):
        manager.save(s)
    other = backend.manager()
    try:
        assert [m["content"] for m in other.get_or_create("cli:deep").messages] == ["fine"]
    finally:
        other.close()


def test_one_session_that_cannot_be_folded_never_hides_the_others_from_the_listing(
    backend: Backend, manager: SessionManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fold raising OverflowError for one session once broke the listing for all: with that
    fold put back (the old msgpack-only copy), every session is still listed."""
    import msgspec

    from redis_session.projection import nanobot as nanobot_log

    for key, extra in (("cli:fine", {}), ("cli:poisoned", {"ref": 2**64})):
        s = manager.get_or_create(key)
        s.add_message("user", key, **extra)
        manager.save(s)
    monkeypatch.setattr(nanobot_log, "clone", lambda v: msgspec.msgpack.decode(msgspec.msgpack.encode(v)))
    listed = {x["key"]: x["preview"] for x in manager.list_sessions()}
    assert listed == {"cli:fine": "cli:fine", "cli:poisoned": ""}


def test_an_import_with_an_id_is_listed_under_the_key_that_loads_it(backend: Backend, manager: SessionManager) -> None:
    """A file imported with ``--id copy-1`` is listed under ``copy-1`` (the key that reaches it),
    never under the file's key (which loads another session)."""
    backend.run(lambda store: import_path(store, FIXTURES / "cli_tools.jsonl", session_id="copy-1"))
    listed = [x["key"] for x in manager.list_sessions()]
    assert listed == ["copy-1"]
    assert manager.get_or_create("copy-1").messages
