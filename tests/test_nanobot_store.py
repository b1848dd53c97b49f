"""nanobot 0.3.5's own code on our store (redis_session.adapters.nanobot_store).

Each scenario drives nanobot's own `AgentLoop` (a scripted provider, as nanobot's tests do) on a
`SessionManager` whose store is a tee: every save goes to nanobot's own `JsonlSessionStore` and to
`RedisNanobotStore`, every load is done by both and must agree, and the loop continues on the
session our store loaded. At the end nanobot's file and our export are byte-identical, and
`get_history` of both answers the same for every setting.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from redis_session import (
    RedisSessionStore,
    SessionConflictError,
    SessionNotFoundError,
    SessionReplacedError,
    StoreUnavailableError,
)
from redis_session.model import NewEntry, SessionHeader

from support import require_extra

require_extra("nanobot", "nanobot")

import nanobot.utils.helpers as nb_helpers  # noqa: E402
from nanobot.agent.loop import AgentLoop  # noqa: E402
from nanobot.agent.tools.base import Tool  # noqa: E402
from nanobot.bus.queue import MessageBus  # noqa: E402
from nanobot.providers.base import (  # noqa: E402
    GenerationSettings,
    LLMProvider,
    LLMResponse,
    ProviderConversationState,
    ToolCallRequest,
)
from nanobot.session.manager import JsonlSessionStore, Session, SessionManager  # noqa: E402

from redis_session.adapters.nanobot_store import (  # noqa: E402
    NanobotSessionConflict,
    NanobotSessionDeleted,
    RedisNanobotStore,
)
from redis_session.importers import import_path  # noqa: E402
from redis_session.importers.nanobot import export_lines  # noqa: E402
from redis_session.projection import project, to_openai  # noqa: E402
from redis_session.projection.nanobot import id_to_key, key_to_id  # noqa: E402

HISTORY_SETTINGS: list[dict[str, Any]] = [
    {},
    {"max_messages": 3},
    {"max_messages": 7, "extend_to_user": True},
    {"max_messages": 20},
    {"max_tokens": 60},
    {"max_tokens": 400},
    {"max_messages": 5, "max_tokens": 120},
    {"include_runtime_context": False},
]


@pytest.fixture(autouse=True)
def _offline_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """nanobot counts with tiktoken, whose encoding it downloads; offline, its byte fallback
    (the same for both stores) without a network attempt per count."""

    def no_encoding() -> Any:
        raise OSError("offline")

    monkeypatch.setattr(nb_helpers, "_get_token_encoding", no_encoding)


class Lookup(Tool):
    """A deterministic tool (nanobot's own tools would put temporary paths in the results)."""

    @property
    def name(self) -> str:
        return "lookup"

    @property
    def description(self) -> str:
        return "Look a word up."

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}

    async def execute(self, **kwargs: Any) -> Any:
        return f"result for {kwargs.get('q')}"


class ScriptedProvider(LLMProvider):
    """Answers by rule: a user text ``tools:K`` gets K lookup calls (then a text answer), the
    consolidator's archive prompt gets a summary, anything else an echo. Token estimates are a
    quarter of the characters, so a small context window consolidates long sessions."""

    def __init__(self) -> None:
        super().__init__(provider_name="scripted")
        self.generation = GenerationSettings(max_tokens=256, temperature=0.0)
        self.calls = 0

    def get_default_model(self) -> str:
        return "scripted"

    def estimate_prompt_tokens(self, messages: list[dict[str, Any]], tools: Any = None, model: Any = None) -> Any:
        visible = [m for m in messages if m.get("role") != "system"]  # nanobot's own prompt is fixed
        return len(json.dumps(visible, ensure_ascii=False)) // 4, "scripted"

    async def chat(self, messages: list[dict[str, Any]], tools: Any = None, **kwargs: Any) -> LLMResponse:
        self.calls += 1
        last = messages[-1]
        text = last.get("content") if isinstance(last.get("content"), str) else json.dumps(last.get("content"))
        if "Create a compact replacement checkpoint" in (text or ""):
            return LLMResponse(content=f"summary #{self.calls}: {len(messages)} messages")
        if last.get("role") == "tool":
            return LLMResponse(content=f"done: {str(last.get('content'))[:40]}", reasoning_content="thought")
        user = next((m for m in reversed(messages) if m.get("role") == "user"), {})
        content = user.get("content")
        body = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        if "tools:" in body and not body.split("tools:", 1)[1].startswith("0"):
            k = int(body.split("tools:", 1)[1].split()[0])
            calls = [
                ToolCallRequest(id=f"c{self.calls}_{i}", name="lookup", arguments={"q": f"w{i}"}) for i in range(k)
            ]
            return LLMResponse(content="", tool_calls=calls, finish_reason="tool_calls")
        return LLMResponse(content=f"echo ({len(body)} chars) ✓ {body[-30:]}")


class TeeStore:
    """nanobot's JSONL store and ours, side by side (see the module docstring)."""

    def __init__(self, jsonl: JsonlSessionStore, ours: RedisNanobotStore) -> None:
        self.jsonl, self.ours = jsonl, ours
        self.loads = 0

    def load(self, key: str) -> Session | None:
        theirs, mine = self.jsonl.load(key), self.ours.load(key)
        assert (theirs is None) == (mine is None), key
        if mine is not None and theirs is not None:
            assert_same_session(theirs, mine)
        self.loads += 1
        return mine

    def save(self, session: Session, *, fsync: bool = False) -> None:
        self.ours.save(session, fsync=fsync)
        self.jsonl.save(session, fsync=fsync)

    def delete(self, key: str) -> bool:
        a, b = self.jsonl.delete(key), self.ours.delete(key)
        assert a == b
        return b

    def read(self, key: str) -> Any:
        a, b = self.jsonl.read(key), self.ours.read(key)
        assert a == b
        return b

    def read_metadata(self, key: str) -> Any:
        a, b = self.jsonl.read_metadata(key), self.ours.read_metadata(key)
        assert a == b
        return b

    def update_metadata(self, key: str, updates: dict[str, Any], *, fsync: bool = False) -> bool:
        a, b = self.jsonl.update_metadata(key, updates), self.ours.update_metadata(key, updates)
        assert a == b
        return b

    def list_sessions(self) -> Any:
        a, b = self.jsonl.list_sessions(), self.ours.list_sessions()
        strip = lambda xs: sorted(({k: v for k, v in x.items() if k != "path"} for x in xs), key=lambda x: x["key"])  # noqa: E731
        assert strip(a) == strip(b)
        return b


def assert_same_session(theirs: Session, mine: Session) -> None:
    assert mine.key == theirs.key
    assert mine.messages == theirs.messages
    assert mine.metadata == theirs.metadata
    assert list(mine.metadata) == list(theirs.metadata)
    assert mine.last_archived == theirs.last_archived
    assert mine.created_at == theirs.created_at
    assert mine.updated_at == theirs.updated_at
    a = theirs.provider_state.to_private_record() if theirs.provider_state else None
    b = mine.provider_state.to_private_record() if mine.provider_state else None
    assert a == b
    for settings in HISTORY_SETTINGS:
        assert mine.get_history(**settings) == theirs.get_history(**settings), settings


class Rig:
    """One workspace, nanobot's JSONL store, our store on a real server, a tee, and loops."""

    def __init__(self, tmp: Path, url: str, prefix: str) -> None:
        self.tmp, self.url, self.prefix = tmp, url, prefix
        self.workspace = tmp / "workspace"
        self.jsonl = JsonlSessionStore(self.workspace, sessions_root=tmp / "sessions")
        self.ours = RedisNanobotStore(RedisSessionStore.from_url(url, prefix=prefix))
        self.tee = TeeStore(self.jsonl, self.ours)

    def manager(self) -> SessionManager:
        return SessionManager(self.workspace, store=self.tee, sessions_root=self.tmp / "sessions")

    def pod(self, store: Any = None) -> RedisNanobotStore:
        """Another pod: a `RedisNanobotStore` of its own on the same server and prefix."""
        return RedisNanobotStore(store or RedisSessionStore.from_url(self.url, prefix=self.prefix))

    def loop(self, *, window: int = 128_000, manager: SessionManager | None = None) -> AgentLoop:
        loop = AgentLoop(
            bus=MessageBus(),
            provider=ScriptedProvider(),
            workspace=self.workspace,
            model="scripted",
            context_window_tokens=window,
            session_manager=manager or self.manager(),
        )
        loop.tools.register(Lookup())
        return loop

    def check(self, key: str, *, reimport: bool = True) -> None:
        """nanobot's file and our export byte-identical; both loads the same (the tee checks);
        the file imported and exported again byte-identical (`reimport`)."""
        path = self.jsonl.get_session_path(key)
        sid = key_to_id(key)

        async def export() -> str:
            store = RedisSessionStore.from_url(self.url, prefix=self.prefix)
            try:
                head = await store.head(sid)
                assert head is not None
                return "".join(export_lines(head, await store.read(sid, 0, head.n)))
            finally:
                await store.aclose()

        written = path.read_text(encoding="utf-8")
        assert asyncio.run(export()) == written
        assert self.tee.load(key) is not None

        async def round_trip() -> str:
            # nanobot 0.3.5's own file, imported and exported again: byte-identical
            store = RedisSessionStore.from_url(self.url, prefix=self.prefix + "i")
            try:
                (result,) = await import_path(store, path)
                sid2 = result.session_id
                head = await store.head(sid2)
                assert head is not None
                text = "".join(export_lines(head, await store.read(sid2, 0, head.n)))
                await store.delete(sid2)
                return text
            finally:
                await store.aclose()

        if reimport:
            assert asyncio.run(round_trip()) == written


@pytest.fixture
def rig(tmp_path: Path, redis_url: str, prefix: str) -> Iterator[Rig]:
    yield Rig(tmp_path, redis_url, prefix)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_long_session_with_consolidation_tools_and_unicode_key(rig: Rig) -> None:
    """A small context window: nanobot consolidates in-turn (hidden summary checkpoints inserted
    at their boundary), tool groups straddle the window; every answer equals nanobot's."""
    key = "discord:guild 42\t{ünï}"
    loop = rig.loop(window=1_900)

    async def go() -> None:
        for i in range(14):
            text = f"turn {i} tools:{i % 3} " + "lorem ipsum " * (i % 4)
            await loop.process_direct(text, session_key=key)

    run(go())
    session = loop.sessions.get_or_create(key)
    assert any(m.get("_hidden_history") for m in session.messages), "the run never consolidated"
    assert session.last_archived > 0
    rig.check(key)
    assert [s["key"] for s in rig.tee.list_sessions()] == [key]


def test_new_command_idle_compaction_metadata_and_images(rig: Rig) -> None:
    key = "telegram:12345"
    loop = rig.loop()
    image = rig.workspace / "cat.png"
    rig.workspace.mkdir(parents=True, exist_ok=True)
    image.write_bytes(
        bytes.fromhex(
            "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
            "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
        )
    )

    async def go() -> None:
        await loop.process_direct("hello there", session_key=key)
        await loop.process_direct("look at this", session_key=key, media=[str(image)])
        await loop.process_direct("tools:2 please", session_key=key)
        loop.sessions.update_session_metadata(key, {"title": "Cats", "pinned": True})
        await loop.process_direct("and again", session_key=key)
        summary = await loop.consolidator.compact_idle_session(key, runtime=loop.llm_runtime())
        assert summary
        await loop.process_direct("after the idle compaction", session_key=key)
        await loop.process_direct("/new", session_key=key)
        await loop.process_direct("a fresh start", session_key=key)

    run(go())
    rig.check(key)
    listed = rig.tee.list_sessions()
    assert listed[0]["title"] == "Cats"


def test_provider_state_and_runtime_fields_survive(rig: Rig) -> None:
    manager = rig.manager()
    key = "websocket:ctx"
    s = manager.get_or_create(key)
    s.add_message("user", "hi", _runtime_context={"version": 1, "suffix": "\n[ctx]"})
    s.add_message("assistant", "yo", latency_ms=12)
    s.metadata["_last_usage"] = {"prompt_tokens": 10, "completion_tokens": 2}
    s.provider_state = ProviderConversationState(
        kind="openai_responses", provider="openai:test", model="m", version=1, payload={"items": [1, "ü"]}
    )
    manager.save(s)
    s.metadata.pop("_last_usage")
    s.metadata["_last_usage"] = {"prompt_tokens": 11}  # key order moved: the whole metadata again
    s.provider_state = None
    manager.save(s)
    manager.invalidate(key)
    manager.get_or_create(key)  # the tee compares both loads
    rig.check(key)


def test_two_pods_never_lose_an_update(rig: Rig, redis_url: str) -> None:
    """Two SessionManagers (two pods) on one session: the later save is a conflict nanobot sees,
    nothing of it written; a metadata merge in between is folded in by itself."""
    pod_a = SessionManager(rig.workspace, store=rig.ours, sessions_root=rig.tmp / "sessions")
    pod_b = SessionManager(
        rig.workspace,
        store=RedisNanobotStore(RedisSessionStore.from_url(redis_url, prefix=rig.prefix)),
        sessions_root=rig.tmp / "sessions",
    )
    key = "slack:C1 T2"
    a = pod_a.get_or_create(key)
    a.add_message("user", "one")
    pod_a.save(a)
    b = pod_b.get_or_create(key)
    pod_b.update_session_metadata(key, {"goal": "x"})
    a.add_message("assistant", "two")
    pod_a.save(a)  # only a metadata merge in between: retried by itself
    assert a.metadata["goal"] == "x"
    b.add_message("assistant", "lost?")
    with pytest.raises(NanobotSessionConflict) as err:
        pod_b.save(b)
    assert isinstance(err.value, SessionConflictError)
    # nothing of it written, and the object pod B's manager caches now holds the stored session
    assert pod_b.get_or_create(key) is b
    assert [m["content"] for m in b.messages] == ["one", "two"]
    b.add_message("user", "three")
    pod_b.save(b)
    fresh = rig.ours.load(key)
    assert fresh is not None
    assert [m["content"] for m in fresh.messages] == ["one", "two", "three"]
    assert fresh.metadata == {"goal": "x"}

    # two brand-new sessions under one key: the second create is a conflict too
    c1, c2 = Session(key="new:1"), Session(key="new:1")
    c1.add_message("user", "c1")
    c2.add_message("user", "c2")
    pod_a.save(c1)
    with pytest.raises(NanobotSessionConflict):
        pod_b.save(c2)
    assert [m["content"] for m in c2.messages] == ["c1"]
    c2.add_message("user", "c2 again")
    pod_b.save(c2)
    assert [m["content"] for m in rig.ours.load("new:1").messages] == ["c1", "c2 again"]  # type: ignore[union-attr]


def test_another_life_of_the_id_is_refused(rig: Rig) -> None:
    """A Session object of one life never writes into another (deleted and created again with
    the same number of entries)."""
    other = RedisNanobotStore(RedisSessionStore.from_url(rig.url, prefix=rig.prefix))
    key = "cli:direct"
    s = Session(key=key)
    s.add_message("user", "old life")
    rig.ours.save(s)
    loaded = rig.ours.load(key)
    assert loaded is not None
    assert other.delete(key)
    again = Session(key=key)
    again.add_message("user", "new life")
    other.save(again)
    loaded.add_message("assistant", "meant for the old life")
    with pytest.raises(SessionReplacedError):
        rig.ours.save(loaded)
    fresh = other.load(key)
    assert fresh is not None
    assert [m["content"] for m in fresh.messages] == ["new life"]
    # the refused object now holds the new life (nanobot's cached session is not stuck on a dead
    # one); what it saves from here on belongs to the new life
    assert [m["content"] for m in loaded.messages] == ["new life"]
    loaded.add_message("assistant", "for the new life")
    rig.ours.save(loaded)
    assert [m["content"] for m in other.load(key).messages] == ["new life", "for the new life"]  # type: ignore[union-attr]

    # deleted (not created again): the save is refused, nothing comes back, the object is empty
    assert other.delete(key)
    loaded.add_message("user", "after the delete")
    with pytest.raises(SessionReplacedError):
        rig.ours.save(loaded)
    assert other.load(key) is None
    assert loaded.messages == []


def test_a_save_after_a_plain_delete_raises_session_replaced_and_the_next_save_creates(rig: Rig) -> None:
    """The module doc's promise: a save into a life that is gone raises `SessionReplacedError`
    (deleted and created again, or just deleted: `NanobotSessionDeleted`), nothing written; the
    object is then empty and its next save creates the key anew. Two pods, nanobot's managers."""
    a = SessionManager(rig.workspace, store=rig.ours, sessions_root=rig.tmp / "a")
    b = SessionManager(rig.workspace, store=rig.pod(), sessions_root=rig.tmp / "b")
    key = "cli:deleted"
    s = a.get_or_create(key)
    s.add_message("user", "u0")
    a.save(s)
    assert b.delete_session(key)
    s.add_message("assistant", "a1")
    with pytest.raises(SessionReplacedError) as info:
        a.save(s)
    assert isinstance(info.value, NanobotSessionDeleted) and isinstance(info.value, SessionNotFoundError)
    assert info.value.key == key and "deleted" in str(info.value)
    assert b.read_session_file(key) is None  # nothing written
    assert s.messages == []
    s.add_message("user", "anew")
    a.save(s)
    stored = b.read_session_file(key)
    assert stored is not None and [m["content"] for m in stored["messages"]] == ["anew"]


@pytest.mark.parametrize(
    "key",
    [
        "discord:guild 42",
        "tab\there",
        "{braces}",
        "percent%41",
        "a" * 300,
        "nanobot~x",
        "ünï:ç ode",
        "%",
        " ",
        "\ud800",
    ],
)
def test_any_key_maps_to_a_session_id_and_back(key: str) -> None:
    sid = key_to_id(key)
    assert len(sid) <= 256
    back = id_to_key(sid)
    assert back is None or back == key
    assert len({key_to_id(k) for k in (key, key + " ", key + "%20")}) == 3


class LosesReplies:
    """A store whose next write runs on the real server and then loses its reply (as a cut
    connection does): the write landed, the caller sees an error."""

    def __init__(self, store: RedisSessionStore, error: type[Exception] = redis.exceptions.ConnectionError) -> None:
        self._store = store
        self.lose = 0
        self.fail = self.fail_create = 0  # puts / creates that fail before they are sent (nothing lands)
        self.error = error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def _lost(self, result: Any) -> Any:
        if self.lose:
            self.lose -= 1
            raise self.error("reply lost")
        return result

    async def put(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail:
            self.fail -= 1
            raise self.error("the server did not answer")
        return await self._lost(await self._store.put(*args, **kwargs))

    async def create(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail_create:
            self.fail_create -= 1
            raise self.error("the server did not answer")
        return await self._lost(await self._store.create(*args, **kwargs))


def test_a_save_retried_after_a_lost_reply_lands_once(rig: Rig) -> None:
    flaky = LosesReplies(RedisSessionStore.from_url(rig.url, prefix=rig.prefix))
    ours = RedisNanobotStore(flaky)
    key = "telegram:lost"
    s = Session(key=key)
    s.add_message("user", "first")
    flaky.lose = 1
    with pytest.raises(redis.exceptions.ConnectionError):
        ours.save(s)  # the create landed, its reply did not
    ours.save(s)  # nanobot saves again: it finds its own create
    s.add_message("assistant", "second")
    flaky.lose = 1
    with pytest.raises(redis.exceptions.ConnectionError):
        ours.save(s)
    ours.save(s)
    s.add_message("user", "third")
    ours.save(s)
    fresh = rig.ours.load(key)
    assert fresh is not None
    assert [m["content"] for m in fresh.messages] == ["first", "second", "third"]


def test_sessions_of_the_legacy_drop_in_load_as_they_were(rig: Rig) -> None:
    """One log layout: what the drop-in for the older nanobot wrote, this store reads."""
    from redis_session.adapters.nanobot import LegacySessionManager

    legacy = LegacySessionManager(rig.url, prefix=rig.prefix)
    try:
        s = legacy.get_or_create("slack:legacy 1")
        for i in range(6):
            s.add_message("user", f"u{i}")
            s.add_message("assistant", f"a{i}")
        s.last_consolidated = 4
        s.metadata["_last_summary"] = {"text": "four archived", "last_active": "2026-01-01T00:00:00"}
        legacy.save(s)
        s.retain_recent_legal_suffix(6)
        s.metadata["title"] = "kept"
        legacy.save(s)
        mine = rig.ours.load(s.key)
        assert mine is not None
        assert mine.messages == s.messages
        assert mine.metadata == s.metadata
        assert mine.last_archived == s.last_consolidated
        assert [x["key"] for x in rig.ours.list_sessions()] == [s.key]
        # and back: what nanobot 0.3 writes on it (a checkpoint inserted before the last message,
        # state marks), the legacy manager reads through the same fold
        mine.add_message("user", "from 0.3")
        mine.commit_summary_checkpoint("newer summary", insert_at=len(mine.messages) - 1)
        rig.ours.save(mine)
        legacy.invalidate(s.key)
        again = legacy.get_or_create(s.key)
        assert again.messages == mine.messages
        assert again.metadata == mine.metadata
        assert again.last_consolidated == mine.last_archived
    finally:
        legacy.close()


def test_the_generic_projection_shows_what_nanobot_replays(rig: Rig) -> None:
    """Consolidation and /new are cuts: `project` (what every other reader sees) starts with the
    summary and holds the messages nanobot still replays; after /new, only the new ones."""
    key = "cli:projection"
    loop = rig.loop(window=1_900)

    async def go() -> None:
        for i in range(12):
            await loop.process_direct(f"turn {i} " + "lorem ipsum " * 12, session_key=key)

    run(go())
    session = loop.sessions.get_or_create(key)
    assert session.last_archived > 0

    async def projected() -> list[Any]:
        store = RedisSessionStore.from_url(rig.url, prefix=rig.prefix)
        try:
            return project(await store.read(key_to_id(key)))
        finally:
            await store.aclose()

    messages = to_openai(run(projected()))
    assert messages[0]["content"].startswith("[Archived Context Summary]")
    replay = [m for m in session.messages[session.last_archived :] if not m.get("_command")]
    assert [m["content"] for m in messages[1:]] == [m["content"] for m in replay]

    run(loop.process_direct("/new", session_key=key))
    run(loop.process_direct("after new", session_key=key))
    after = to_openai(run(projected()))
    assert [m["role"] for m in after] == ["user", "assistant"]
    assert after[0]["content"] == "after new"
    rig.check(key)


def test_reads_forks_deletes_and_odd_messages_agree_with_nanobot(rig: Rig) -> None:
    """The rest of the seam, through the tee (each call answered by both stores, compared)."""
    manager = rig.manager()
    key = "webui:odd {1}"
    s = manager.get_or_create(key)
    s.add_message("user", "first")
    s.messages.append({"role": "assistant", "content": {"not": "a chat message"}, "timestamp": "t"})
    s.add_message("user", "second", media=["/m/a.png"])
    s.add_message("assistant", "ok")
    s.metadata.update({"a": 1, "b": [1, 2], "c": "x"})
    manager.save(s)
    del s.metadata["b"]  # a key that goes
    s.metadata["a"] = 2  # one that changes, in place
    manager.save(s)
    assert manager.read_session_file(key) is not None  # the tee compares both answers
    assert manager.read_session_metadata(key) is not None
    assert manager.update_session_metadata("missing:key", {"x": 1}) is False
    fork = manager.fork_session_before_user_index(key, "webui:fork", 1)
    assert fork is not None
    manager.invalidate("webui:fork")
    assert [m["content"] for m in manager.get_or_create("webui:fork").messages] == [
        "first",
        {"not": "a chat message"},
    ]
    rig.check(key, reimport=False)  # the importer refuses a message our schema does not take
    rig.check("webui:fork", reimport=False)
    assert {x["key"] for x in manager.list_sessions()} == {key, "webui:fork"}
    assert manager.delete_session(key) is True
    assert manager.read_session_file(key) is None
    assert manager.delete_session(key) is False


@pytest.mark.anyio
async def test_a_store_used_on_its_own_loop_too(redis_url: str, prefix: str) -> None:
    """The caller's store, bound to the caller's loop, handed to the adapter (whose sync calls run
    on its private loop, here from inside a coroutine as nanobot makes them): both keep working."""
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        assert await store.head("nothing") is None  # binds the store to this loop
        ours = RedisNanobotStore(store)
        s = Session(key="cli:loops")
        s.add_message("user", "hi")
        ours.save(s)
        head = await store.head(key_to_id("cli:loops"))
        assert head is not None and head.n == 2
        loaded = ours.load("cli:loops")
        assert loaded is not None and loaded.messages == s.messages
    finally:
        await store.aclose()


def test_two_agent_loops_on_one_session_lose_no_acknowledged_turn(rig: Rig, redis_url: str) -> None:
    """Two pods, each nanobot's own AgentLoop with its own manager and store, answer turns of one
    session in turn. A pod whose cached session is behind gets the conflict on its save (its turn
    fails, nothing written) and its next turn works on the stored session: every turn that
    succeeded is in the log, once, in order."""

    def pod() -> AgentLoop:
        store = RedisNanobotStore(RedisSessionStore.from_url(redis_url, prefix=rig.prefix))
        manager = SessionManager(rig.workspace, store=store, sessions_root=rig.tmp / "sessions")
        return rig.loop(manager=manager)

    a, b = pod(), pod()
    key = "telegram:shared"
    done: list[str] = []

    async def turn(loop: AgentLoop, text: str) -> None:
        try:
            await loop.process_direct(text, session_key=key)
        except SessionConflictError:
            return
        done.append(text)

    async def go() -> None:
        await turn(a, "a1")
        await turn(b, "b1")  # b loads the session: a1 is there
        await turn(a, "a2")  # a's cached session lacks b1: a conflict
        await turn(a, "a3")  # a now holds the stored session
        await turn(b, "b2")  # b is behind a3: a conflict
        await turn(b, "b3")

    run(go())
    stored = rig.ours.load(key)
    assert stored is not None
    users = [m["content"] for m in stored.messages if m["role"] == "user"]
    assert users == done
    assert done == ["a1", "b1", "a3", "b3"], done


def test_a_value_that_is_no_json_is_refused_and_nothing_written(rig: Rig) -> None:
    from redis_session import InvalidEntryError

    s = Session(key="cli:nan")
    s.add_message("user", "fine")
    rig.ours.save(s)
    s.add_message("assistant", "also fine")
    s.metadata["score"] = float("nan")
    with pytest.raises(InvalidEntryError):
        rig.ours.save(s)
    stored = rig.ours.load("cli:nan")
    assert stored is not None and [m["content"] for m in stored.messages] == ["fine"]
    s.metadata["score"] = 0.5
    rig.ours.save(s)  # the same object saves once the value is JSON
    stored = rig.ours.load("cli:nan")
    assert stored is not None and len(stored.messages) == 2 and stored.metadata == {"score": 0.5}


def test_old_exec_records_are_migrated_on_load_as_nanobot_does(rig: Rig) -> None:
    manager = rig.manager()
    key = "cli:exec"
    s = manager.get_or_create(key)
    s.add_message("user", "run it")
    call = {"id": "x1", "type": "function", "function": {"name": "write_stdin", "arguments": '{"chars": "ls"}'}}
    s.add_message("assistant", "", tool_calls=[call])
    s.add_message("tool", "ok", tool_call_id="x1", name="write_stdin")
    manager.save(s)
    manager.invalidate(key)
    loaded = manager.get_or_create(key)  # the tee: both loads migrate the same way
    assert loaded.messages[1]["tool_calls"][0]["function"]["name"] == "exec_session"
    manager.save(loaded)
    rig.check(key)


@pytest.mark.parametrize("lose_at", [0, 1, 2])
def test_a_save_of_many_batches_torn_by_a_lost_reply_lands_once(rig: Rig, lose_at: int) -> None:
    """A save bigger than one batch (the create, then puts): the reply of batch `lose_at` is lost;
    saving again finds what landed and writes the rest, every message once."""
    flaky = LosesReplies(RedisSessionStore.from_url(rig.url, prefix=rig.prefix, max_batch=3))
    ours = RedisNanobotStore(flaky)
    key = f"cli:batches:{lose_at}"
    s = Session(key=key)
    for i in range(8):
        s.add_message("user" if i % 2 == 0 else "assistant", f"m{i}")

    calls = {"n": 0}
    real_put, real_create = flaky.put, flaky.create

    async def counting(real: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] - 1 == lose_at:
            flaky.lose = 1
        return await real(*args, **kwargs)

    flaky.put = lambda *a, **k: counting(real_put, *a, **k)  # type: ignore[method-assign]
    flaky.create = lambda *a, **k: counting(real_create, *a, **k)  # type: ignore[method-assign]
    with pytest.raises(redis.exceptions.ConnectionError):
        ours.save(s)
    ours.save(s)
    fresh = rig.ours.load(key)
    assert fresh is not None
    assert [m["content"] for m in fresh.messages] == [f"m{i}" for i in range(8)]


SEED = Path(__file__).resolve().parent / "fixtures" / "seed" / "nanobot"


@pytest.mark.parametrize("name", sorted(p.name for p in SEED.glob("*.jsonl")))
def test_seed_files_saved_by_nanobot_035_import_and_export_byte_identical(rig: Rig, name: str) -> None:
    """The recorded files (an older nanobot wrote them), loaded and saved by nanobot 0.3.5's own
    JSONL store (its layout: ``last_archived`` on line 1): our import of that file gives the
    session nanobot loads (every `get_history` setting), and our export gives the file back."""
    key = json.loads((SEED / name).read_text(encoding="utf-8").splitlines()[0])["key"]
    path = rig.jsonl.get_session_path(key)
    path.write_text((SEED / name).read_text(encoding="utf-8"), encoding="utf-8")
    theirs = rig.jsonl.load(key)
    assert theirs is not None
    rig.jsonl.save(theirs)  # now as nanobot 0.3.5 writes it
    written = path.read_text(encoding="utf-8")
    assert '"last_archived"' in written.splitlines()[0]

    async def round_trip() -> str:
        store = RedisSessionStore.from_url(rig.url, prefix=rig.prefix)
        try:
            (result,) = await import_path(store, path)
            head = await store.head(result.session_id)
            assert head is not None
            return "".join(export_lines(head, await store.read(result.session_id, 0, head.n)))
        finally:
            await store.aclose()

    assert run(round_trip()) == written
    mine = rig.ours.load(key)
    assert mine is not None
    assert_same_session(rig.jsonl.load(key), mine)  # type: ignore[arg-type]


def test_listing_an_unchanged_session_reads_no_log(rig: Rig) -> None:
    """nanobot's idle check lists every session on a timer: a session unchanged since the last
    listing costs a head read, not a read of its log; a change is seen at once."""
    counting = LosesReplies(RedisSessionStore.from_url(rig.url, prefix=rig.prefix))
    reads = {"n": 0}
    real_read = counting.read

    async def read(*args: Any, **kwargs: Any) -> Any:
        reads["n"] += 1
        return await real_read(*args, **kwargs)

    counting.read = read  # type: ignore[method-assign]
    ours = RedisNanobotStore(counting)
    s = Session(key="cli:listed")
    s.add_message("user", "hello")
    rig.ours.save(s)
    assert [x["preview"] for x in ours.list_sessions()] == ["hello"]
    before = reads["n"]
    assert [x["preview"] for x in ours.list_sessions()] == ["hello"]
    assert reads["n"] == before
    rig.ours.update_metadata("cli:listed", {"title": "Greeting"})
    assert [x["title"] for x in ours.list_sessions()] == ["Greeting"]


def test_the_example_runs_as_a_user_runs_it_on_the_default_server(tmp_path: Path) -> None:
    """``python examples/nanobot_store.py`` with no URL (the embedded server, the
    default of every example; here the test run's private one), no hard-coded address."""
    import subprocess
    import sys

    example = Path(__file__).resolve().parent.parent / "examples" / "nanobot_store.py"
    assert "localhost:6379" not in example.read_text(encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["HOME"] = str(tmp_path)  # nanobot keeps its own state under ~/.nanobot
    env["HTTPS_PROXY"] = env["HTTP_PROXY"] = "http://127.0.0.1:9"  # tiktoken's download fails at once
    env["PYTHONPATH"] = str(example.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, str(example)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "user · hello" in lines and "assistant · you said: what did I say?" in lines, done.stdout


def test_a_compactors_cut_is_archived_with_its_summary_for_nanobot(rig: Rig) -> None:
    """Our compactor (or `Session.compact`) cuts a nanobot session: nanobot archives what the cut
    hides and its prompt carries the cut's summary (as `_last_summary`); nanobot's own next
    consolidation takes over from there."""
    from redis_session.sessions import Sessions

    key = "cli:compacted"
    s = Session(key=key)
    for i in range(4):
        s.add_message("user", f"u{i}")
        s.add_message("assistant", f"a{i}")
    rig.ours.save(s)

    async def compact() -> None:
        store = RedisSessionStore.from_url(rig.url, prefix=rig.prefix)
        try:
            handle = await Sessions(store).open(key_to_id(key))
            summary = [{"role": "user", "content": "[Archived Context Summary]\n\nu0..u1 discussed"}]
            await handle.compact(4, summary, "token_limit")
        finally:
            await store.aclose()

    run(compact())
    loaded = rig.ours.load(key)
    assert loaded is not None
    assert loaded.last_archived == 4 and len(loaded.messages) == 8
    assert loaded.metadata["_last_summary"]["text"] == "u0..u1 discussed"
    assert [m["content"] for m in loaded.get_history()] == ["u2", "a2", "u3", "a3"]
    loaded.add_message("user", "u4")
    rig.ours.save(loaded)  # writes the summary down as nanobot's metadata
    again = rig.ours.load(key)
    assert again is not None and again.metadata == loaded.metadata and again.last_archived == 4
    # nanobot's own summary replaces it, and stays
    again.metadata["_last_summary"] = {"text": "nanobot's own", "last_active": "2026-01-01T00:00:00"}
    rig.ours.save(again)
    last = rig.ours.load(key)
    assert last is not None and last.metadata["_last_summary"]["text"] == "nanobot's own"


@pytest.mark.parametrize("key", ["telegram:12345", "discord:guild 42", "tab\tkey", "{x}:y", "50%", "ü é"])
def test_the_importer_and_the_store_map_keys_alike(key: str) -> None:
    from redis_session.importers.common import key_to_session_id

    assert key_to_session_id(key) == key_to_id(key)


# ---------------------------------------------------- big integers, unfoldable sessions, timestamps, keys


BIG = 2**64  # a 20-digit id of some channel API: JSON and nanobot's own files hold it


def test_an_integer_past_64_bits_saves_loads_lists_and_exports_as_nanobot_keeps_it(rig: Rig) -> None:
    """A message field and an `update_session_metadata` value past 64 bits: a fresh pod loads
    them back exactly (they used to poison the session: every load raised OverflowError), the
    listing works, and the export is nanobot's file byte for byte (importing that file and
    exporting it again too: `check`)."""
    manager = rig.manager()
    key = "telegram:big"
    s = manager.get_or_create(key)
    s.add_message("user", "hi", ref=BIG, nested={"ids": [-(2**70), BIG * BIG]})
    manager.save(s)
    assert manager.update_session_metadata(key, {"chat": BIG + 1})
    manager.invalidate(key)
    loaded = manager.get_or_create(key)  # the tee: both stores load the same
    assert loaded.messages[0]["ref"] == BIG and loaded.messages[0]["nested"]["ids"][1] == BIG * BIG
    assert loaded.metadata["chat"] == BIG + 1
    fresh = rig.pod().load(key)
    assert fresh is not None and fresh.messages[0]["ref"] == BIG and fresh.metadata["chat"] == BIG + 1
    assert [x["key"] for x in manager.list_sessions()] == [key]
    rig.check(key)


def test_one_session_that_cannot_be_folded_never_hides_the_others_from_the_listing(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fold that raised OverflowError for one session once broke `list_sessions` for all: with
    that fold put back (its old msgpack-only copy), the listing still shows every session, the
    unreadable one from its header."""
    import msgspec

    from redis_session.projection import nanobot as nanobot_log

    for key, extra in (("cli:fine", {}), ("cli:poisoned", {"ref": BIG}), ("cli:also-fine", {})):
        s = Session(key=key)
        s.add_message("user", key, **extra)
        rig.ours.save(s)
    monkeypatch.setattr(nanobot_log, "clone", lambda v: msgspec.msgpack.decode(msgspec.msgpack.encode(v)))
    listed = {x["key"]: x for x in rig.pod().list_sessions()}
    assert sorted(listed) == ["cli:also-fine", "cli:fine", "cli:poisoned"]
    assert listed["cli:fine"]["preview"] == "cli:fine" and listed["cli:poisoned"]["preview"] == ""


def test_a_message_without_timestamp_is_exported_without_one(rig: Rig) -> None:
    """nanobot keeps (and writes) a message appended without ``timestamp`` as it is: the export
    invents none (byte-identical), and the file imported again gives the same session."""
    manager = rig.manager()
    key = "cli:no-timestamp"
    s = manager.get_or_create(key)
    s.add_message("user", "hello")
    s.messages.append({"role": "assistant", "content": "hi, no timestamp"})
    manager.save(s)
    manager.invalidate(key)
    loaded = manager.get_or_create(key)
    assert "timestamp" not in loaded.messages[1]
    rig.check(key)  # export == nanobot's file; its import exported again == nanobot's file


def test_a_key_too_long_once_escaped_imports_under_the_stores_own_id(rig: Rig) -> None:
    """136 characters, 64 spaces: escaped it is 264 characters, so the store keeps it under
    ``nanobot~<sha256>``; the importer maps it the same way (it used to refuse the file)."""
    key = "cli:" + " ".join(["x"] * 63) + " 123456"
    assert len(key) == 136 and key_to_id(key).startswith("nanobot~")
    jsonl = JsonlSessionStore(rig.workspace, sessions_root=rig.tmp / "files")
    s = Session(key=key)
    s.add_message("user", "hello")
    s.add_message("assistant", "hi")
    jsonl.save(s)

    async def go() -> str:
        store = RedisSessionStore.from_url(rig.url, prefix=rig.prefix)
        try:
            (result,) = await import_path(store, jsonl.get_session_path(key))
            return result.session_id
        finally:
            await store.aclose()

    assert run(go()) == key_to_id(key)
    loaded = rig.pod().load(key)
    assert loaded is not None and [m["content"] for m in loaded.messages] == ["hello", "hi"]
    assert [x["key"] for x in rig.pod().list_sessions()] == [key]


def test_an_import_with_an_id_is_listed_and_loaded_under_the_key_of_that_id(rig: Rig) -> None:
    """``import f.jsonl --id my-id`` (a file whose key is K): the store lists it under the key that
    maps to its id (``my-id``), once, and that key loads it and saves into it; K (whose own
    session that is not) lists and loads nothing; the export is still the file byte for byte.
    An id no key maps to is not listed (nanobot could not load it)."""
    jsonl = JsonlSessionStore(rig.workspace, sessions_root=rig.tmp / "files")
    s = Session(key="telegram:42")
    s.add_message("user", "Weather in Paris?")
    s.add_message("assistant", "Sunny.")
    jsonl.save(s)
    path = jsonl.get_session_path("telegram:42")

    async def imp(session_id: str) -> str:
        store = RedisSessionStore.from_url(rig.url, prefix=rig.prefix)
        try:
            await import_path(store, path, session_id=session_id)
            head = await store.head(session_id)
            assert head is not None
            return "".join(export_lines(head, await store.read(session_id, 0, head.n)))
        finally:
            await store.aclose()

    assert run(imp("my-id")) == path.read_text(encoding="utf-8")  # the file, byte for byte
    pod = SessionManager(rig.workspace, store=rig.pod(), sessions_root=rig.tmp / "pod")
    assert [(x["key"], x["preview"]) for x in pod.list_sessions()] == [("my-id", "Weather in Paris?")]
    loaded = pod.get_or_create("my-id")
    assert [m["content"] for m in loaded.messages] == ["Weather in Paris?", "Sunny."]
    assert pod.read_session_file("my-id")["key"] == "my-id"  # type: ignore[index]
    assert pod.read_session_file("telegram:42") is None
    loaded.add_message("user", "And Tokyo?")
    pod.save(loaded)
    pod.invalidate("my-id")
    assert len(pod.get_or_create("my-id").messages) == 3
    assert [x["key"] for x in pod.list_sessions()] == ["my-id"]  # one session, listed once
    for unreachable in ("nanobot~abc", "a%FF"):
        run(imp(unreachable))
    assert [x["key"] for x in pod.list_sessions()] == ["my-id"]


def test_a_session_whose_stored_key_leads_elsewhere_is_listed_under_the_key_that_loads_it(rig: Rig) -> None:
    """A nanobot session written by another tool under an id its stored key does not map to:
    listed under the key that reaches it (never under one whose load finds nothing)."""

    async def go() -> None:
        store = RedisSessionStore.from_url(rig.url, prefix=rig.prefix)
        try:
            origin = {"format": "nanobot", "key": "telegram:7"}
            hi = NewEntry("message", {"role": "user", "content": "hi"})
            await store.create(SessionHeader(id="copy-7", origin=origin), [hi])
            await store.create(SessionHeader(id="nanobot~0", origin=origin))  # no key reaches it
        finally:
            await store.aclose()

    run(go())
    pod = rig.pod()
    assert [x["key"] for x in pod.list_sessions()] == ["copy-7"]
    loaded = pod.load("copy-7")
    assert loaded is not None and [m["content"] for m in loaded.messages] == ["hi"]
    assert pod.read("copy-7")["key"] == "copy-7"  # type: ignore[index]


@pytest.mark.parametrize("first", [True, False], ids=["first-save", "later-save"])
@pytest.mark.parametrize("landed", [True, False])
def test_the_save_after_one_of_unknown_outcome_is_no_conflict(rig: Rig, first: bool, landed: bool) -> None:
    """A save (the session's first, its create, or a later one) fails with its outcome unknown
    (the store unreachable: it landed or not), and nanobot goes on: a metadata value changed in
    place, a message added, saved again. That save is its own, not another pod's: the earlier
    write lands once, as it was sent, then what changed since; no `NanobotSessionConflict` fails
    the turn (a CLIENT KILL or a restart under two writers gave one every few saves)."""
    flaky = LosesReplies(RedisSessionStore.from_url(rig.url, prefix=rig.prefix), StoreUnavailableError)
    ours = RedisNanobotStore(flaky)
    key = f"telegram:unsure-{first}-{landed}"
    s = Session(key=key)
    s.add_message("user", "first")
    if not first:
        ours.save(s)
    s.add_message("assistant", "second")
    s.metadata["usage"] = {"turns": 1}
    if landed:
        flaky.lose = 1
    elif first:
        flaky.fail_create = 1
    else:
        flaky.fail = 1
    with pytest.raises(StoreUnavailableError):
        ours.save(s)
    s.metadata["usage"]["turns"] = 2  # changed in place before the next save, as an app does
    s.add_message("user", "third")
    ours.save(s)
    s.add_message("assistant", "fourth")
    ours.save(s)
    fresh = rig.ours.load(key)
    assert fresh is not None
    assert [m["content"] for m in fresh.messages] == ["first", "second", "third", "fourth"]
    assert fresh.metadata["usage"] == {"turns": 2}


@pytest.mark.parametrize("landed", [True, False])
def test_a_first_save_of_unknown_outcome_then_a_delete_never_brings_the_session_back(rig: Rig, landed: bool) -> None:
    """A session's first save (its create) fails with its outcome unknown, and another pod
    deletes the key before this one saves again. When the create had landed, that save is the
    deletion (`NanobotSessionDeleted`, the object emptied, nothing written): it used to create
    the session again with the deleted messages. When it had not, there was nothing to delete,
    and the save makes the session as usual."""
    flaky = LosesReplies(RedisSessionStore.from_url(rig.url, prefix=rig.prefix), StoreUnavailableError)
    ours, other = RedisNanobotStore(flaky), rig.pod()
    key = f"telegram:unsure-deleted-{landed}"
    s = Session(key=key)
    s.add_message("user", "first")
    if landed:
        flaky.lose = 1
    else:
        flaky.fail_create = 1
    with pytest.raises(StoreUnavailableError):
        ours.save(s)
    assert other.delete(key) is landed
    s.add_message("assistant", "second")
    if landed:
        with pytest.raises(NanobotSessionDeleted):
            ours.save(s)
        assert rig.ours.load(key) is None  # not made again
        assert s.messages == []  # the object holds what is stored: nothing
        s.add_message("user", "anew")
        ours.save(s)  # a new session of the key, with only what came after
        assert [m["content"] for m in rig.ours.load(key).messages] == ["anew"]  # type: ignore[union-attr]
    else:
        ours.save(s)
        assert [m["content"] for m in rig.ours.load(key).messages] == ["first", "second"]  # type: ignore[union-attr]


class LosesAPut(LosesReplies):
    """`LosesReplies` that lets the create through and loses (`lose_put`) or fails (`fail`) a put."""

    lose_put = 0

    async def put(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail:
            self.fail -= 1
            raise self.error("the server did not answer")
        result = await self._store.put(*args, **kwargs)
        if self.lose_put:
            self.lose_put -= 1
            raise self.error("reply lost")
        return result


@pytest.mark.parametrize("what", ["create", "rest"])
@pytest.mark.parametrize("landed", [True, False])
def test_a_first_save_over_one_batch_of_unknown_outcome_settles(rig: Rig, what: str, landed: bool) -> None:
    """A first save with more messages than one batch (a create, then the rest in more puts)
    whose create or rest fails with its outcome unknown: the next save sends that very write
    again (replayed where it landed) and goes on, every message stored once, in order. A lost rest
    used to be planned again with what was added since — another write, another key — and
    every later save failed with a raw `SessionConflictError`."""
    flaky = LosesAPut(RedisSessionStore.from_url(rig.url, prefix=rig.prefix, max_batch=4), StoreUnavailableError)
    ours = RedisNanobotStore(flaky)
    key = f"telegram:big-{what}-{landed}"
    s = Session(key=key)
    for i in range(10):  # one create of 4 entries, then two puts (4 and 2)
        s.add_message("user" if i % 2 == 0 else "assistant", f"m{i}")
    if what == "create":
        flaky.lose, flaky.fail_create = (1, 0) if landed else (0, 1)
    else:  # the rest's first put: landed (its reply lost) or never sent
        flaky.lose_put, flaky.fail = (1, 0) if landed else (0, 1)
    with pytest.raises(StoreUnavailableError):
        ours.save(s)
    s.add_message("user", "m10")
    ours.save(s)
    s.add_message("assistant", "m11")
    ours.save(s)
    fresh = rig.ours.load(key)
    assert fresh is not None
    assert [m["content"] for m in fresh.messages] == [f"m{i}" for i in range(12)]


def test_a_save_of_unknown_outcome_overtaken_by_another_pod_is_the_conflict(rig: Rig) -> None:
    """The unsettled save did not land and another pod saved meanwhile: the next save is that
    conflict (nanobot's turn fails, the object holds what is stored), never a write over it."""
    flaky = LosesReplies(RedisSessionStore.from_url(rig.url, prefix=rig.prefix), StoreUnavailableError)
    a, b = RedisNanobotStore(flaky), rig.pod()
    key = "telegram:overtaken"
    s = Session(key=key)
    s.add_message("user", "first")
    a.save(s)
    s.add_message("assistant", "mine")
    flaky.fail = 1
    with pytest.raises(StoreUnavailableError):
        a.save(s)
    other = b.load(key)
    assert other is not None
    other.add_message("assistant", "theirs")
    b.save(other)
    with pytest.raises(NanobotSessionConflict):
        a.save(s)
    assert [m["content"] for m in s.messages] == ["first", "theirs"]  # what is stored
    assert [m["content"] for m in rig.ours.load(key).messages] == ["first", "theirs"]  # type: ignore[union-attr]


@pytest.mark.parametrize("error", [redis.exceptions.ConnectionError, StoreUnavailableError])
def test_a_retried_update_metadata_lands_once_and_never_puts_an_older_value_back(rig: Rig, error: type) -> None:
    """An update whose reply is lost, retried as a caller does: it lands once, and with another
    pod's update in between, the retry does not put the older value back over the newer one.
    A later call with the same updates is a new write (it lands)."""
    flaky = LosesReplies(RedisSessionStore.from_url(rig.url, prefix=rig.prefix), error)
    a, b = rig.pod(flaky), rig.pod()
    key = "cli:meta"
    s = Session(key=key)
    s.add_message("user", "hi")
    a.save(s)

    flaky.lose = 1
    with pytest.raises(error):
        a.update_metadata(key, {"u": 1})  # landed, its reply did not
    assert a.update_metadata(key, {"u": 1})  # the retry

    flaky.lose = 1
    with pytest.raises(error):
        a.update_metadata(key, {"title": "A"})
    assert b.update_metadata(key, {"title": "B"})  # another pod, in between
    assert a.update_metadata(key, {"title": "A"})  # the retry: already landed, B's value stays
    assert b.load(key).metadata == {"u": 1, "title": "B"}  # type: ignore[union-attr]

    async def marks() -> list[dict[str, Any]]:
        store = RedisSessionStore.from_url(rig.url, prefix=rig.prefix)
        try:
            entries = await store.read(key_to_id(key))
            return [e.data["metadata_set"] for e in entries if e.type == "nanobot/state" and "metadata_set" in e.data]
        finally:
            await store.aclose()

    assert run(marks()) == [{"u": 1}, {"title": "A"}, {"title": "B"}]
    assert a.update_metadata(key, {"title": "A"})  # a new call (the last one succeeded): it lands
    assert b.load(key).metadata == {"u": 1, "title": "A"}  # type: ignore[union-attr]


@pytest.mark.parametrize("value", [pytest.param("deep", id="nested-5000"), pytest.param("\ud800", id="lone-surrogate")])
def test_a_value_json_cannot_hold_is_a_typed_error_naming_it_and_nothing_is_written(rig: Rig, value: Any) -> None:
    from redis_session import InvalidEntryError

    if value == "deep":
        for _ in range(5000):
            value = [value]
    key = "cli:hostile"
    s = Session(key=key)
    s.add_message("user", "fine")
    rig.ours.save(s)
    s.add_message("assistant", "bad", extra=value)
    with pytest.raises(InvalidEntryError, match="message 1"):
        rig.ours.save(s)
    with pytest.raises(InvalidEntryError):
        rig.ours.update_metadata(key, {"extra": value})
    s.messages.pop()
    s.metadata["extra"] = value
    with pytest.raises(InvalidEntryError, match="metadata\\['extra'\\]"):
        rig.ours.save(s)
    stored = rig.pod().load(key)
    assert stored is not None and [m["content"] for m in stored.messages] == ["fine"] and stored.metadata == {}


def test_metadata_nested_deeper_than_pythons_stack_saves_and_loads_as_nanobot_keeps_it(rig: Rig) -> None:
    """600 levels: more than a `copy.deepcopy` survives (it raised a raw RecursionError), well
    within JSON's and nanobot's own file's reach: saved, merged and loaded back."""
    deep: Any = "leaf"
    for _ in range(600):
        deep = [deep]
    key = "cli:deep-metadata"
    s = Session(key=key)
    s.add_message("user", "hi")
    s.metadata["deep"] = deep
    rig.ours.save(s)
    assert rig.ours.update_metadata(key, {"deeper": [deep]})
    loaded = rig.pod().load(key)
    assert loaded is not None and loaded.metadata == {"deep": deep, "deeper": [deep]}


@pytest.mark.parametrize("value", [float("nan"), (1, 2), b"x"], ids=["nan", "tuple", "bytes"])
def test_an_update_metadata_value_that_is_no_json_is_refused_and_nothing_written(rig: Rig, value: Any) -> None:
    from redis_session import InvalidEntryError

    key = "cli:meta-no-json"
    s = Session(key=key)
    s.add_message("user", "hi")
    rig.ours.save(s)
    with pytest.raises(InvalidEntryError):
        rig.ours.update_metadata(key, {"v": value})
    assert rig.pod().load(key).metadata == {}  # type: ignore[union-attr]
    assert rig.ours.update_metadata(key, {"v": 1})  # and the next update is not mistaken for a retry
    assert rig.pod().load(key).metadata == {"v": 1}  # type: ignore[union-attr]
