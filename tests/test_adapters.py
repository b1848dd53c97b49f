"""The drop-in adapters, driven the way their frameworks drive them, on real stores.

- `RedisEventSession`: the OpenAI Agents SDK ``Session`` protocol (the sequence of the SDK's own
  session tests, then `Runner.run` with a scripted model), plus what the SDK's sessions lack: an
  append-only log that survives pop/clear, and concurrent writers that lose nothing.
- `RedisChatMessageHistory`: LangChain's ``BaseChatMessageHistory`` (sync and async), and
  ``RunnableWithMessageHistory`` over it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from redis_session import MemorySessionStore, NewEntry, RedisSessionStore, SessionHeader
from redis_session.errors import SessionReplacedError
from redis_session.projection import project, to_openai

from support import require_extra

pytestmark = pytest.mark.anyio


# =========================================================================== OpenAI Agents SDK

ITEM, POP, CLEAR_REASON = "openai/item", "openai/pop", "openai-agents:clear_session"


def _warm_up() -> None:
    """Why the concurrency tests make one call before going concurrent: a *cold*
    ``redis.asyncio.RedisCluster`` client hit by ~10 concurrent scripts races while it connects
    (redis-py raises ``AttributeError: 'NoneType' object has no attribute 'writelines'``, or retries
    a create that landed, which then reports "already exists"). That is the cluster store's
    start-up, not the adapters' concern; these tests are about conflicts between writers."""


@pytest.fixture
def Ev() -> Any:
    """`RedisEventSession`, when the SDK is installed (the `openai-agents` extra)."""
    require_extra("agents", "openai-agents")
    from redis_session.adapters.openai_agents import RedisEventSession

    return RedisEventSession


async def test_satisfies_the_sdk_session_protocol(store: Any, Ev: Any) -> None:
    from agents.memory import Session as AgentsSession

    s = Ev("p-1", store)
    assert isinstance(s, AgentsSession)
    from agents.memory import SessionSettings

    assert s.session_id == "p-1" and s.session_settings == SessionSettings()
    for name in ("get_items", "add_items", "pop_item", "clear_session"):
        assert callable(getattr(s, name))


async def test_direct_ops_and_the_log_keeps_everything(store: Any, Ev: Any) -> None:
    """The SDK's own session test sequence, then a look at the log underneath."""
    s = Ev("direct", store)
    items: list[Any] = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there!"}]
    await s.add_items(items)
    got = await s.get_items()
    assert got == items
    popped = await s.pop_item()
    assert popped == {"role": "assistant", "content": "Hi there!"}
    assert await s.get_items() == [{"role": "user", "content": "Hello"}]
    await s.clear_session()
    assert await s.get_items() == []

    log = await store.read("direct")
    assert [e.type for e in log] == [ITEM, ITEM, POP, "cut"]
    assert [e.data for e in log[:2]] == items  # the audit trail survives pop and clear
    assert log[2].data == {"n": 1}
    assert log[3].data == {"before": 3, "summary": [], "reason": CLEAR_REASON}
    head = await store.head("direct")
    assert head is not None and head.header.origin == {"adapter": "openai-agents"}

    # a fresh instance sees the same state; new items show after the clear
    s2 = Ev("direct", store)
    assert await s2.get_items() == []
    await s2.add_items([{"role": "user", "content": "after"}])
    assert await s.get_items() == [{"role": "user", "content": "after"}]
    assert await s.pop_item() == {"role": "user", "content": "after"}
    assert await s.pop_item() is None  # nothing visible: the cleared items stay cleared
    assert len(await store.read("direct")) == 6


async def test_get_items_limit(store: Any, Ev: Any) -> None:
    s = Ev("limit", store)
    items: list[Any] = [{"role": r, "content": str(i)} for i, r in enumerate(["user", "assistant"] * 2, 1)]
    await s.add_items(items)
    assert [i["content"] for i in await s.get_items(limit=2)] == ["3", "4"]
    assert len(await s.get_items()) == 4
    assert len(await s.get_items(limit=10)) == 4
    assert await s.get_items(limit=0) == []
    from agents.memory import SessionSettings

    s3 = Ev("limit", store, session_settings=SessionSettings(limit=3))
    assert [i["content"] for i in await s3.get_items()] == ["2", "3", "4"]
    assert len(await s3.get_items(limit=1)) == 1


async def test_empty_session_pop_clear_and_add_nothing_write_nothing(store: Any, Ev: Any) -> None:
    s = Ev("empty", store)
    assert await s.get_items() == []
    assert await s.pop_item() is None
    await s.clear_session()
    await s.add_items([])
    assert await store.head("empty") is None  # created on the first write, not before
    await s.add_items([{"role": "user", "content": "x"}])
    assert (await store.head("empty")) is not None


async def test_items_round_trip_exactly(store: Any, Ev: Any) -> None:
    s = Ev("exact", store)
    items: list[Any] = [
        {"role": "user", "content": 'こんにちは 😊 O\'Reilly "q" \\n'},
        {"role": "assistant", "content": "Robert'); DROP TABLE students;--"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "look"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAA", "detail": "auto"},
            ],
        },
    ]
    await s.add_items(items)
    assert await Ev("exact", store).get_items() == items
    got = await s.get_items()
    got[0]["content"] = "mutated"  # callers get copies
    assert (await s.get_items())[0] == items[0]


async def test_two_instances_appending_concurrently_lose_nothing(store: Any, Ev: Any) -> None:
    a = Ev("busy", store)
    b = Ev("busy", store)
    await store.head("warm-up")  # see _warm_up

    async def add(s: Any, tag: str, k: int) -> None:
        await s.add_items([{"role": "user", "content": f"{tag}{k}.{i}"} for i in range(5)])

    async with anyio.create_task_group() as tg:
        for k in range(6):
            tg.start_soon(add, a, "a", k)
            tg.start_soon(add, b, "b", k)
    contents = [i["content"] for i in await a.get_items()]
    assert sorted(contents) == sorted(f"{t}{k}.{i}" for t in "ab" for k in range(6) for i in range(5))
    # each add_items call landed as one contiguous batch, in its own order
    for t in "ab":
        for k in range(6):
            at = contents.index(f"{t}{k}.0")
            assert contents[at : at + 5] == [f"{t}{k}.{i}" for i in range(5)]
    assert await b.get_items() == await a.get_items()
    log = await store.read("busy")
    assert len(log) == 60 and {e.type for e in log} == {ITEM}


async def test_concurrent_pops_pop_each_item_once(store: Any, Ev: Any) -> None:
    writer = Ev("pops", store)
    await store.head("warm-up")  # see _warm_up
    await writer.add_items([{"role": "user", "content": str(i)} for i in range(10)])
    popped: list[Any] = []

    async def pop(s: Any) -> None:
        popped.append(await s.pop_item())

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(pop, Ev("pops", store))
            tg.start_soon(pop, Ev("pops", store))
    got = [p["content"] for p in popped if p is not None]
    assert sorted(got, key=int) == [str(i) for i in range(10)]
    assert popped.count(None) == 2
    assert await writer.get_items() == []
    pops = [e.data["n"] for e in await store.read("pops") if e.type == POP]
    assert sorted(pops) == list(range(10))


async def test_session_deleted_and_recreated_under_the_same_id(store: Any, Ev: Any) -> None:
    s = Ev("again", store)
    await s.add_items([{"role": "user", "content": str(i)} for i in range(3)])
    assert len(await s.get_items()) == 3
    await store.delete("again")
    await store.create(SessionHeader(id="again"), [NewEntry(ITEM, {"role": "user", "content": "new"})])
    # the object belongs to the life it saw: the new one is refused (tests/test_adapters_lives.py)
    with pytest.raises(SessionReplacedError):
        await s.add_items([{"role": "user", "content": "newer"}])
    assert [i["content"] for i in await Ev("again", store).get_items()] == ["new"]


async def test_takes_a_sessions_service_and_honours_a_compaction(store: Any, Ev: Any) -> None:
    from redis_session.sessions import Sessions

    s = Ev("svc", Sessions(store))
    await s.add_items([{"role": "user", "content": "old"}, {"role": "assistant", "content": "older"}])
    # another tool compacts the session: the summary comes first, the hidden items are gone
    await store.put(
        "svc", 2, [NewEntry("cut", {"before": 2, "summary": [{"role": "system", "content": "S"}], "reason": "compact"})]
    )
    await s.add_items([{"role": "user", "content": "new"}])
    assert await s.get_items() == [{"role": "system", "content": "S"}, {"role": "user", "content": "new"}]


async def test_from_url_owns_its_store(redis_url: str, prefix: str, redis_store: Any, Ev: Any) -> None:
    # (`redis_store` shares the prefix: its teardown removes every key this test made)
    s = Ev.from_url("owned", url=redis_url, prefix=prefix)
    try:
        assert await s.ping()
        await s.add_items([{"role": "user", "content": "hi"}])
        assert await s.get_items() == [{"role": "user", "content": "hi"}]
        await s.clear_session()
    finally:
        await s.store.delete("owned")
        await s.close()


def _scripted_model(replies: list[str]) -> Any:
    """A model that answers from a script and records what it was sent."""
    from agents import Model
    from agents.items import ModelResponse
    from agents.usage import Usage
    from openai.types.responses import ResponseOutputMessage, ResponseOutputText

    class Scripted(Model):  # type: ignore[misc]
        def __init__(self) -> None:
            self.replies = list(replies)
            self.inputs: list[Any] = []

        async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
            self.inputs.append(input)
            msg = ResponseOutputMessage(
                id=f"msg_{len(self.inputs)}",
                type="message",
                role="assistant",
                status="completed",
                content=[ResponseOutputText(type="output_text", text=self.replies.pop(0), annotations=[])],
            )
            return ModelResponse(output=[msg], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    return Scripted()


async def test_runner_uses_the_session(store: Any, Ev: Any) -> None:
    from agents import Agent, RunConfig, Runner

    model = _scripted_model(["San Francisco", "California"])
    agent = Agent(name="test", model=model)
    session = Ev("runner", store)
    config = RunConfig(tracing_disabled=True)
    r1 = await Runner.run(agent, "What city is the Golden Gate Bridge in?", session=session, run_config=config)
    assert r1.final_output == "San Francisco"
    r2 = await Runner.run(agent, "What state is it in?", session=session, run_config=config)
    assert r2.final_output == "California"
    second = model.inputs[1]
    assert any("Golden Gate Bridge" in str(i.get("content", "")) for i in second)
    assert any("San Francisco" in json.dumps(i) for i in second)
    items = await session.get_items()
    assert len(items) == 4
    assert [e.type for e in await store.read("runner")] == [ITEM] * 4


# =========================================================================== LangChain


@pytest.fixture
def lc() -> Any:
    """langchain_core.messages, when LangChain is installed (the `langchain` extra)."""
    return require_extra("langchain_core.messages", "langchain")


@pytest.fixture
def History(lc: Any) -> Any:
    from redis_session.adapters.langchain import RedisChatMessageHistory

    return RedisChatMessageHistory


def _conversation() -> list[Any]:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    return [
        SystemMessage("You are terse."),
        HumanMessage("Weather in 北京?", id="h1"),
        AIMessage(
            "",
            tool_calls=[{"name": "weather", "args": {"city": "北京"}, "id": "call_1"}],
            usage_metadata={"input_tokens": 5, "output_tokens": 2, "total_tokens": 7},
            response_metadata={"model_name": "m"},
            additional_kwargs={"reasoning_content": "look it up"},
        ),
        ToolMessage("晴", tool_call_id="call_1", status="success"),
        AIMessage("Sunny.", id="a2"),
    ]


async def test_langchain_async_round_trip(store: Any, History: Any, lc: Any) -> None:
    h = History("lc-1", store)
    assert await h.aget_messages() == []
    msgs = _conversation()
    await h.aadd_messages(msgs)
    assert await h.aget_messages() == msgs
    assert await History("lc-1", store).aget_messages() == msgs
    # stored as plain `message` entries: every reader (and the OpenAI rendering) understands them
    log = await store.read("lc-1")
    assert {e.type for e in log} == {"message"}
    assert to_openai(project(log)) == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in 北京?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "look it up",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "北京"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "晴"},
        {"role": "assistant", "content": "Sunny."},
    ]
    await h.aclear()
    assert await h.aget_messages() == []
    log = await store.read("lc-1")
    assert len(log) == 6 and log[-1].type == "cut" and log[-1].data["before"] == 5  # nothing deleted
    await h.aadd_messages([lc.HumanMessage("again")])
    assert await h.aget_messages() == [lc.HumanMessage("again")]


async def test_langchain_concurrent_histories_lose_nothing(store: Any, History: Any, lc: Any) -> None:
    await store.head("warm-up")  # see _warm_up

    async def add(k: int) -> None:
        h = History("lc-busy", store)
        await h.aadd_messages([lc.HumanMessage(f"q{k}"), lc.AIMessage(f"a{k}")])

    async with anyio.create_task_group() as tg:
        for k in range(10):
            tg.start_soon(add, k)
    got = [m.content for m in await History("lc-busy", store).aget_messages()]
    assert sorted(got) == sorted([f"q{k}" for k in range(10)] + [f"a{k}" for k in range(10)])
    for k in range(10):
        assert got[got.index(f"q{k}") + 1] == f"a{k}"


async def test_langchain_reads_sessions_written_by_others(store: Any, tmp_path: Path, History: Any, lc: Any) -> None:
    from redis_session.importers import import_path

    rows = [
        {"type": "session", "version": 0, "id": "dsh-x", "createdAt": 1},
        {
            "type": "user/message",
            "seq": 0,
            "time": 2,
            "data": {"content": [{"type": "text", "text": "hi"}]},
            "surfaceOp": "append",
        },
        {
            "type": "assistant/message",
            "seq": 1,
            "time": 3,
            "surfaceOp": "append",
            "data": {
                "content": [
                    {"type": "text", "text": "calling"},
                    {"type": "tool-call", "id": "c1", "name": "ls", "arguments": "{}"},
                ]
            },
        },
        {
            "type": "tool/result",
            "seq": 2,
            "time": 4,
            "surfaceOp": "append",
            "data": {"callId": "c1", "content": [{"type": "text", "text": "a.txt"}], "isError": False},
        },
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    await import_path(store, path)
    got = await History("dsh-x", store).aget_messages()
    assert got == [
        lc.HumanMessage("hi"),
        lc.AIMessage("calling", tool_calls=[{"name": "ls", "args": {}, "id": "c1"}]),
        lc.ToolMessage("a.txt", tool_call_id="c1"),
    ]


@pytest.mark.filterwarnings("ignore:RunnableWithMessageHistory is deprecated")
async def test_runnable_with_message_history(store: Any, History: Any) -> None:
    from langchain_core.language_models.fake_chat_models import FakeListChatModel
    from langchain_core.runnables.history import RunnableWithMessageHistory

    model = FakeListChatModel(responses=["Hello Ann!", "Your name is Ann."])
    chain = RunnableWithMessageHistory(model, lambda sid: History(sid, store))
    cfg: Any = {"configurable": {"session_id": "lc-chain"}}
    assert (await chain.ainvoke("I am Ann", config=cfg)).content == "Hello Ann!"
    assert (await chain.ainvoke("Who am I?", config=cfg)).content == "Your name is Ann."
    history = await History("lc-chain", store).aget_messages()
    assert [(type(m).__name__, m.content) for m in history] == [
        ("HumanMessage", "I am Ann"),
        ("AIMessage", "Hello Ann!"),
        ("HumanMessage", "Who am I?"),
        ("AIMessage", "Your name is Ann."),
    ]


# -- the sync API runs on a background loop: these tests are plain functions (no running loop)


@pytest.fixture
def sync_redis_store(redis_url: str, prefix: str) -> Any:
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    yield store
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{prefix}:*"))
    if keys:
        r.delete(*keys)
    r.close()


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_langchain_sync_api(backend: str, request: pytest.FixtureRequest, History: Any, lc: Any) -> None:
    store = MemorySessionStore() if backend == "memory" else request.getfixturevalue("sync_redis_store")
    h = History("lc-sync", store)
    assert h.messages == []
    msgs = _conversation()
    h.add_messages(msgs[:2])
    h.add_message(msgs[2])
    h.add_messages(msgs[3:])
    assert h.messages == msgs
    assert "Sunny." in str(h)
    h.clear()
    assert h.messages == []
    h.add_user_message("u")
    h.add_ai_message("a")
    assert History("lc-sync", store).messages == [lc.HumanMessage("u"), lc.AIMessage("a")]


@pytest.mark.filterwarnings("ignore:RunnableWithMessageHistory is deprecated")
def test_langchain_sync_chain(sync_redis_store: Any, History: Any) -> None:
    from langchain_core.language_models.fake_chat_models import FakeListChatModel
    from langchain_core.runnables.history import RunnableWithMessageHistory

    model = FakeListChatModel(responses=["one", "two"])
    chain = RunnableWithMessageHistory(model, lambda sid: History(sid, sync_redis_store))
    cfg: Any = {"configurable": {"session_id": "lc-sync-chain"}}
    assert chain.invoke("first", config=cfg).content == "one"
    assert chain.invoke("second", config=cfg).content == "two"
    assert len(History("lc-sync-chain", sync_redis_store).messages) == 4


async def test_adapters_package_is_lazy(Ev: Any, History: Any) -> None:
    import redis_session.adapters as adapters

    assert adapters.RedisEventSession is Ev
    assert adapters.RedisChatMessageHistory is History
    with pytest.raises(AttributeError):
        _ = adapters.Nope
