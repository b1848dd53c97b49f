"""The Google ADK session service (`redis_session.adapters.adk`), driven as ADK drives it.

- ADK's `Runner` with a scripted model (a tool call, several turns) on a real server: the stored
  events and state after each turn, the same turns on ADK's `InMemorySessionService` for
  comparison, and a second service instance (another pod) reading and continuing the session.
- The behaviours ADK's own in-memory service shows (written from its source and docstrings):
  state scopes (``app:``/``user:`` shared, ``temp:`` never stored), `GetSessionConfig` filters,
  listing without events, delete, a missing session, a duplicate id; plus what a shared store
  adds: two pods appending to one session (the loser gets the stale-session error, nothing
  interleaves), ids with any characters, re-delivered events.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import redis.asyncio

from redis_session import MemorySessionStore, RedisSessionStore, SessionConflictError
from redis_session.errors import InvalidEntryError, InvalidSessionIdError, SessionReplacedError

if os.environ.get("CI"):
    import google.adk  # noqa: F401  (CI installs the adk extra: a missing one fails, never skips)
else:
    pytest.importorskip("google.adk", reason="needs the adk extra: pip install -e '.[adk]'")

from google.adk.agents import LlmAgent
from google.adk.errors import StaleSessionError
from google.adk.errors.already_exists_error import AlreadyExistsError
from google.adk.errors.session_not_found_error import SessionNotFoundError as AdkSessionNotFoundError
from google.adk.events.event import Event
from google.adk.events.event_actions import EventActions
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.adk.runners import Runner
from google.adk.sessions import BaseSessionService, InMemorySessionService, Session
from google.adk.sessions.base_session_service import GetSessionConfig
from google.adk.tools import ToolContext
from google.genai import types
from pydantic import Field

from redis_session.adapters.adk import (
    RedisAdkSessionService,
    ReplacedAdkSessionError,
    StaleAdkSessionError,
    adk_names,
    escape,
    unescape,
)

pytestmark = pytest.mark.anyio

APP = "weather-app"


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, redis_url: str, prefix: str) -> AsyncIterator[Any]:
    """The store under the service: in memory, and on a real server (its keys removed after)."""
    if request.param == "memory":
        yield MemorySessionStore()
        return
    s = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        yield s
    finally:
        await s.aclose()
        r = redis.asyncio.Redis.from_url(redis_url)
        try:
            keys = [k async for k in r.scan_iter(match=f"{prefix}:*", count=1000)]
            if keys:
                await r.delete(*keys)
        finally:
            await r.aclose()


@pytest.fixture
async def other_pod_store(store: Any, redis_url: str, prefix: str) -> AsyncIterator[Any]:
    """A second client on the same data: another store object on the same server (or the same
    memory store, which has no second client)."""
    if isinstance(store, MemorySessionStore):
        yield store
        return
    s = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        yield s
    finally:
        await s.aclose()


def _user(text: str) -> types.Content:
    return types.Content(role="user", parts=[types.Part(text=text)])


def _event(author: str = "user", text: str = "hi", *, ts: float | None = None, **delta: Any) -> Event:
    kw: dict[str, Any] = {"timestamp": ts} if ts is not None else {}
    return Event(
        invocation_id="inv-1",
        author=author,
        content=types.Content(role="user" if author == "user" else "model", parts=[types.Part(text=text)]),
        actions=EventActions(state_delta=dict(delta)),
        **kw,
    )


# =========================================================================== the Runner


class ScriptedModel(BaseLlm):
    """A model that answers from a script: each call pops the next response."""

    script: list[LlmResponse]
    requests: list[LlmRequest] = Field(default_factory=list)

    async def generate_content_async(self, llm_request: LlmRequest, stream: bool = False) -> AsyncIterator[LlmResponse]:
        self.requests.append(llm_request)
        yield self.script.pop(0)


def _say(text: str) -> LlmResponse:
    return LlmResponse(content=types.Content(role="model", parts=[types.Part(text=text)]))


def _call(name: str, **args: Any) -> LlmResponse:
    return LlmResponse(
        content=types.Content(role="model", parts=[types.Part(function_call=types.FunctionCall(name=name, args=args))])
    )


def get_weather(city: str, tool_context: ToolContext) -> dict[str, Any]:
    """The weather in a city."""
    tool_context.state["user:last_city"] = city
    tool_context.state["app:lookups"] = tool_context.state.get("app:lookups", 0) + 1
    tool_context.state["temp:scratch"] = f"looked up {city}"
    tool_context.state["cities"] = [*tool_context.state.get("cities", []), city]
    return {"city": city, "forecast": "sunny", "celsius": 21}


def _script() -> list[LlmResponse]:
    return [
        _call("get_weather", city="Paris"),  # turn 1: a tool call, then the answer
        _say("Sunny in Paris, 21 °C."),
        _say("You asked about Paris."),  # turn 2: a plain answer
        _call("get_weather", city="Oslo"),  # turn 3 (on the other pod): another tool call
        _say("Sunny in Oslo too."),
    ]


def _runner(service: BaseSessionService, model: ScriptedModel) -> Runner:
    agent = LlmAgent(name="forecaster", model=model, tools=[get_weather], output_key="last_answer")
    return Runner(app_name=APP, agent=agent, session_service=service)


async def _turn(runner: Runner, session_id: str, text: str, user_id: str = "alice") -> list[Event]:
    return [e async for e in runner.run_async(user_id=user_id, session_id=session_id, new_message=_user(text))]


def _shape(events: list[Event]) -> list[tuple[str, list[Any]]]:
    """What an event says, without its generated ids and timestamps."""
    out = []
    for e in events:
        parts = []
        for p in (e.content.parts if e.content else None) or []:
            if p.text is not None:
                parts.append(p.text)
            elif p.function_call is not None:
                parts.append(("call", p.function_call.name, p.function_call.args))
            elif p.function_response is not None:
                parts.append(("response", p.function_response.name, p.function_response.response))
        out.append((e.author, parts))
    return out


async def test_runner_turns_with_a_tool_call_then_another_pod_continues(store: Any, other_pod_store: Any) -> None:
    pod1 = RedisAdkSessionService(store)
    model = ScriptedModel(model="scripted", script=_script())
    runner = _runner(pod1, model)
    # The same conversation on ADK's own in-memory service, for comparison.
    reference = InMemorySessionService()  # type: ignore[no-untyped-call]
    ref_runner = _runner(reference, ScriptedModel(model="scripted", script=_script()))

    s = await pod1.create_session(app_name=APP, user_id="alice", state={"units": "metric"})
    r = await reference.create_session(app_name=APP, user_id="alice", state={"units": "metric"})
    store_id = pod1.session_store_id(APP, "alice", s.id)

    # Turn 1: user message, the model's call, the tool's response, the model's answer.
    yielded = await _turn(runner, s.id, "Weather in Paris?")
    await _turn(ref_runner, r.id, "Weather in Paris?")
    got = await pod1.get_session(app_name=APP, user_id="alice", session_id=s.id)
    ref = await reference.get_session(app_name=APP, user_id="alice", session_id=r.id)
    assert got is not None and ref is not None
    assert (
        _shape(got.events)
        == _shape(ref.events)
        == [
            ("user", ["Weather in Paris?"]),
            ("forecaster", [("call", "get_weather", {"city": "Paris"})]),
            ("forecaster", [("response", "get_weather", {"city": "Paris", "forecast": "sunny", "celsius": 21})]),
            ("forecaster", ["Sunny in Paris, 21 °C."]),
        ]
    )
    assert [e.id for e in got.events[1:]] == [e.id for e in yielded]  # what the Runner yielded is what is stored
    assert (
        got.state
        == ref.state
        == {
            "units": "metric",
            "cities": ["Paris"],
            "last_answer": "Sunny in Paris, 21 °C.",
            "app:lookups": 1,
            "user:last_city": "Paris",
        }
    )
    # On the log: entry 0 says whose session it is, then one entry per event, nothing else.
    entries = await store.read(store_id)
    assert [e.type for e in entries] == ["adk/session"] + ["adk/event"] * 4
    assert [e.data["event"]["id"] for e in entries[1:]] == [e.id for e in got.events]
    assert all("temp:scratch" not in str(e.data) for e in entries)  # temp: never stored
    # The model saw the tool's answer on its second call.
    assert any(p.function_response for c in model.requests[-1].contents for p in c.parts or [])

    # Turn 2, same pod.
    await _turn(runner, s.id, "What did I ask?")
    await _turn(ref_runner, r.id, "What did I ask?")
    got = await pod1.get_session(app_name=APP, user_id="alice", session_id=s.id)
    ref = await reference.get_session(app_name=APP, user_id="alice", session_id=r.id)
    assert got is not None and ref is not None
    assert _shape(got.events) == _shape(ref.events) and len(got.events) == 6
    assert got.state == ref.state and got.state["last_answer"] == "You asked about Paris."
    assert len(await store.read(store_id)) == 7

    # Another pod: a fresh service over another client reads the same session, event for event.
    pod2 = RedisAdkSessionService(other_pod_store)
    seen = await pod2.get_session(app_name=APP, user_id="alice", session_id=s.id)
    assert seen is not None
    assert [e.model_dump(mode="json") for e in seen.events] == [e.model_dump(mode="json") for e in got.events]
    assert seen.state == got.state and seen.last_update_time == got.last_update_time
    # ... and continues it (turn 3 with a tool call); the first pod sees that turn.
    await _turn(_runner(pod2, model), s.id, "And Oslo?")
    await _turn(ref_runner, r.id, "And Oslo?")
    back = await pod1.get_session(app_name=APP, user_id="alice", session_id=s.id)
    ref = await reference.get_session(app_name=APP, user_id="alice", session_id=r.id)
    assert back is not None and ref is not None
    assert _shape(back.events) == _shape(ref.events) and len(back.events) == 10
    assert back.state == ref.state
    assert back.state["cities"] == ["Paris", "Oslo"] and back.state["app:lookups"] == 2
    assert back.state["user:last_city"] == "Oslo"
    assert await pod1.get_user_state(app_name=APP, user_id="alice") == {"last_city": "Oslo"}
    # A new session of the same user in the same app starts with the shared scopes only.
    fresh = await pod2.create_session(app_name=APP, user_id="alice")
    assert fresh.state == {"app:lookups": 2, "user:last_city": "Oslo"}


async def test_runner_needs_an_existing_session_unless_auto_create(store: Any) -> None:
    svc = RedisAdkSessionService(store)
    model = ScriptedModel(model="scripted", script=[_say("hello")])
    with pytest.raises(ValueError):
        await _turn(_runner(svc, model), "nope", "hi")
    agent = LlmAgent(name="forecaster", model=model)
    runner = Runner(app_name=APP, agent=agent, session_service=svc, auto_create_session=True)
    await _turn(runner, "made-by-runner", "hi")
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="made-by-runner")
    assert got is not None and _shape(got.events) == [("user", ["hi"]), ("forecaster", ["hello"])]


# =========================================================================== ADK's session behaviours


async def test_state_scopes_on_create(store: Any) -> None:
    svc = RedisAdkSessionService(store)
    state = {"app:theme": "dark", "user:lang": "fr", "draft": 1, "temp:token": "x"}
    s = await svc.create_session(app_name=APP, user_id="alice", state=state, session_id="s1")
    assert s.id == "s1" and s.app_name == APP and s.user_id == "alice" and s.events == []
    assert s.state == {"app:theme": "dark", "user:lang": "fr", "draft": 1}  # temp: dropped at create
    # Same user, same app: app and user state, not the other session's own state.
    s2 = await svc.create_session(app_name=APP, user_id="alice")
    assert s2.state == {"app:theme": "dark", "user:lang": "fr"}
    # Another user: app state only. Another app: nothing.
    assert (await svc.create_session(app_name=APP, user_id="bob")).state == {"app:theme": "dark"}
    assert (await svc.create_session(app_name="other", user_id="alice")).state == {}
    # Stored once: the app's and the user's own logs, merged into every session read.
    assert await svc.get_user_state(app_name=APP, user_id="alice") == {"lang": "fr"}
    assert await svc.get_user_state(app_name=APP, user_id="nobody") == {}
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and got.state == s.state


async def test_append_event_state_deltas_by_scope(store: Any) -> None:
    svc = RedisAdkSessionService(store)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="s1")
    other = await svc.create_session(app_name=APP, user_id="alice", session_id="s2")
    ev = _event(**{"app:k": 1, "user:k": 2, "k": 3, "temp:k": 4})
    returned = await svc.append_event(s, ev)
    # ADK's base service: temp state reaches the in-memory session, then leaves the event's delta.
    assert s.state == {"app:k": 1, "user:k": 2, "k": 3, "temp:k": 4}
    assert returned.actions.state_delta == {"app:k": 1, "user:k": 2, "k": 3}
    assert s.events == [returned] and s.last_update_time == ev.timestamp
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and got.state == {"app:k": 1, "user:k": 2, "k": 3}
    assert got.events[0].actions.state_delta == {"app:k": 1, "user:k": 2, "k": 3}
    assert got.events == s.events
    # The other session of the user shares app: and user:, not k.
    again = await svc.get_session(app_name=APP, user_id="alice", session_id="s2")
    assert again is not None and again.state == {"app:k": 1, "user:k": 2}
    # Its session object, read before the delta, still appends (it is not stale: its log did not move).
    await svc.append_event(other, _event(**{"user:k": 5, "j": 6}))
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and got.state == {"app:k": 1, "user:k": 5, "k": 3}
    # A partial (streaming) event is returned untouched and stored nowhere.
    partial = _event(text="chunk", k=99)
    partial.partial = True
    assert await svc.append_event(s, partial) is partial
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and len(got.events) == 1 and got.state["k"] == 3


async def test_get_session_config_filters(store: Any) -> None:
    svc = RedisAdkSessionService(store)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="s1")
    for i in range(5):
        await svc.append_event(s, _event(text=f"m{i}", ts=100.0 + i, n=i))

    async def texts(**config: Any) -> list[str]:
        got = await svc.get_session(
            app_name=APP, user_id="alice", session_id="s1", config=GetSessionConfig(**config) if config else None
        )
        assert got is not None
        assert got.state == {"n": 4}  # filters trim events, never state
        return [e.content.parts[0].text for e in got.events]

    assert await texts() == ["m0", "m1", "m2", "m3", "m4"]
    assert await texts(num_recent_events=2) == ["m3", "m4"]
    assert await texts(num_recent_events=9) == ["m0", "m1", "m2", "m3", "m4"]
    assert await texts(num_recent_events=0) == []
    assert await texts(after_timestamp=102.0) == ["m2", "m3", "m4"]  # timestamp >= after
    assert await texts(after_timestamp=102.5) == ["m3", "m4"]
    assert await texts(after_timestamp=200.0) == []
    assert await texts(after_timestamp=101.0, num_recent_events=2) == ["m3", "m4"]
    assert await texts(after_timestamp=103.0, num_recent_events=9) == ["m3", "m4"]
    with pytest.raises(ValueError):
        GetSessionConfig(num_recent_events=-1)


async def test_list_sessions_with_and_without_user(store: Any) -> None:
    svc = RedisAdkSessionService(store)
    a1 = await svc.create_session(app_name=APP, user_id="alice", session_id="a1", state={"x": 1, "app:v": 1})
    b1 = await svc.create_session(app_name=APP, user_id="bob", session_id="b1", state={"user:name": "Bob"})
    a2 = await svc.create_session(app_name=APP, user_id="alice", session_id="a2")
    await svc.create_session(app_name="other-app", user_id="alice", session_id="elsewhere")
    await svc.append_event(a1, _event(text="later"))  # a1 is now the most recently active

    mine = (await svc.list_sessions(app_name=APP, user_id="alice")).sessions
    assert [s.id for s in mine] == ["a2", "a1"]  # oldest update first
    assert all(s.events == [] for s in mine)  # listed without events
    assert mine[1].state == {"x": 1, "app:v": 1} and mine[0].state == {"app:v": 1}
    assert mine[1].last_update_time == a1.last_update_time

    everyone = (await svc.list_sessions(app_name=APP)).sessions
    assert [(s.user_id, s.id) for s in everyone] == [("bob", "b1"), ("alice", "a2"), ("alice", "a1")]
    assert everyone[0].state == {"app:v": 1, "user:name": "Bob"}
    assert {s.id for s in everyone} == {a1.id, a2.id, b1.id}

    assert (await svc.list_sessions(app_name=APP, user_id="carol")).sessions == []
    assert (await svc.list_sessions(app_name="no-such-app")).sessions == []
    # A fresh service instance (another pod) lists the same.
    pod2 = RedisAdkSessionService(store)
    assert [s.id for s in (await pod2.list_sessions(app_name=APP)).sessions] == ["b1", "a2", "a1"]


async def test_delete_session(store: Any) -> None:
    svc = RedisAdkSessionService(store)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="s1", state={"user:u": 1, "k": 1})
    await svc.append_event(s, _event())
    await svc.create_session(app_name=APP, user_id="alice", session_id="s2")
    await svc.delete_session(app_name=APP, user_id="alice", session_id="s1")
    assert await svc.get_session(app_name=APP, user_id="alice", session_id="s1") is None
    assert [x.id for x in (await svc.list_sessions(app_name=APP)).sessions] == ["s2"]
    assert await store.head(svc.session_store_id(APP, "alice", "s1")) is None
    # User state outlives the session; deleting what is not there is a no-op.
    assert await svc.get_user_state(app_name=APP, user_id="alice") == {"u": 1}
    await svc.delete_session(app_name=APP, user_id="alice", session_id="s1")
    await svc.delete_session(app_name=APP, user_id="nobody", session_id="nothing")
    # The stale session object cannot write into the void.
    with pytest.raises(AdkSessionNotFoundError):
        await svc.append_event(s, _event())
    # The id is free again, and the new session starts empty.
    again = await svc.create_session(app_name=APP, user_id="alice", session_id="s1")
    assert again.events == [] and again.state == {"user:u": 1}
    # Its first event sits at the same n as the old one's did; its state deltas still land.
    await svc.append_event(again, _event(**{"user:u": 2, "app:a": 3}))
    assert await svc.get_user_state(app_name=APP, user_id="alice") == {"u": 2}
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and got.state == {"user:u": 2, "app:a": 3} and len(got.events) == 1
    assert sorted(x.id for x in (await svc.list_sessions(app_name=APP)).sessions) == ["s1", "s2"]


async def test_missing_session_and_duplicate_id(store: Any) -> None:
    svc = RedisAdkSessionService(store)
    assert await svc.get_session(app_name=APP, user_id="alice", session_id="nope") is None
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="  s1  ")
    assert s.id == "s1"  # ADK's in-memory service strips the id
    # The same id under another user or app is another session; get with the wrong owner finds nothing.
    assert await svc.get_session(app_name=APP, user_id="bob", session_id="s1") is None
    assert await svc.get_session(app_name="other", user_id="alice", session_id="s1") is None
    await svc.create_session(app_name=APP, user_id="bob", session_id="s1")
    with pytest.raises(AlreadyExistsError, match="Session with id s1 already exists"):
        await svc.create_session(app_name=APP, user_id="alice", session_id="s1", state={"app:x": 1, "user:y": 1})
    # The failed create changed no state (ADK's in-memory service raises before touching any).
    assert (await svc.get_session(app_name=APP, user_id="alice", session_id="s1")).state == {}  # type: ignore[union-attr]
    # Appending to a session that does not exist: ADK's SessionNotFoundError.
    ghost = Session(id="ghost", app_name=APP, user_id="alice")
    with pytest.raises(AdkSessionNotFoundError):
        await svc.append_event(ghost, _event())
    # Generated ids are unique.
    ids = {(await svc.create_session(app_name=APP, user_id="alice")).id for _ in range(5)}
    assert len(ids) == 5


# =========================================================================== pods, ids, retries


async def test_two_pods_appending_to_one_session_never_interleave(store: Any, other_pod_store: Any) -> None:
    pod1, pod2 = RedisAdkSessionService(store), RedisAdkSessionService(other_pod_store)
    await pod1.create_session(app_name=APP, user_id="alice", session_id="shared")
    s1 = await pod1.get_session(app_name=APP, user_id="alice", session_id="shared")
    s2 = await pod2.get_session(app_name=APP, user_id="alice", session_id="shared")
    assert s1 is not None and s2 is not None
    await pod1.append_event(s1, _event(text="from pod 1", k=1))
    with pytest.raises(StaleSessionError) as info:
        await pod2.append_event(s2, _event(text="from pod 2", k=2))
    assert isinstance(info.value, SessionConflictError) and isinstance(info.value, StaleAdkSessionError)
    assert info.value.expected_n == 1 and info.value.actual_n == 2
    assert "modified in storage since it was loaded" in str(info.value)
    assert s2.events == []  # the loser's session object took nothing
    # The loser reloads and retries.
    s2 = await pod2.get_session(app_name=APP, user_id="alice", session_id="shared")
    assert s2 is not None
    await pod2.append_event(s2, _event(text="from pod 2", k=2))
    got = await pod1.get_session(app_name=APP, user_id="alice", session_id="shared")
    assert got is not None and [e.content.parts[0].text for e in got.events] == ["from pod 1", "from pod 2"]
    assert got.state == {"k": 2}

    # Concurrent: ten writers holding the same session object version, one wins each round.
    base = await pod1.get_session(app_name=APP, user_id="alice", session_id="shared")
    assert base is not None
    results: list[str] = []

    async def write(i: int) -> None:
        pod = pod1 if i % 2 else pod2
        mine = await pod.get_session(app_name=APP, user_id="alice", session_id="shared")
        assert mine is not None
        mine._storage_update_marker = base._storage_update_marker  # all read at the same revision
        try:
            await pod.append_event(mine, _event(text=f"w{i}", ts=1000.0 + i))
            results.append("ok")
        except StaleSessionError:
            results.append("stale")

    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(write, i)
    assert sorted(results) == ["ok"] + ["stale"] * 9
    log = await store.read(pod1.session_store_id(APP, "alice", "shared"))
    assert [e.type for e in log] == ["adk/session"] + ["adk/event"] * 3


# =========================================================================== another life of the id


async def _recreate(svc: RedisAdkSessionService, session_id: str, texts: list[str]) -> Session:
    """Delete the session and create it again under the same id with these events."""
    await svc.delete_session(app_name=APP, user_id="alice", session_id=session_id)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id=session_id, state={"life": 2})
    for t in texts:
        await svc.append_event(s, _event(text=t))
    return s


@pytest.mark.parametrize("new_events", [2, 3], ids=["same-count", "more"])
async def test_a_session_object_of_another_life_is_refused(store: Any, other_pod_store: Any, new_events: int) -> None:
    """Pod A holds a session object of life 1; pod B deletes the id and creates it again with
    the same number of events (or more). A's next append must not land in the new conversation
    (it did: the expected n matched), and reading never mixes the two lives."""
    pod_a, pod_b = RedisAdkSessionService(store), RedisAdkSessionService(other_pod_store)
    s = await pod_a.create_session(app_name=APP, user_id="alice", session_id="x", state={"life": 1})
    for t in ["old-0", "old-1"]:
        await pod_a.append_event(s, _event(text=t))
    old = await pod_a.get_session(app_name=APP, user_id="alice", session_id="x")
    assert old is not None
    copies = [old.model_copy(), old.model_copy(deep=True)]  # ADK's own copies of a session
    await _recreate(pod_b, "x", [f"new-{i}" for i in range(new_events)])
    new_log = await store.read(pod_b.session_store_id(APP, "alice", "x"))

    for held in [s, old, *copies]:
        with pytest.raises(StaleSessionError) as info:  # ADK's type (a ValueError)...
            await pod_a.append_event(held, _event(text="from the old life"))
        assert isinstance(info.value, ReplacedAdkSessionError)
        assert isinstance(info.value, SessionReplacedError)  # ...and ours
        assert "modified in storage since it was loaded" in str(info.value)
        assert [e.content.parts[0].text for e in held.events] == ["old-0", "old-1"]  # took nothing
    assert await store.read(pod_b.session_store_id(APP, "alice", "x")) == new_log  # nothing landed

    got = await pod_a.get_session(app_name=APP, user_id="alice", session_id="x")
    assert got is not None and got.state == {"life": 2}
    assert [e.content.parts[0].text for e in got.events] == [f"new-{i}" for i in range(new_events)]
    await pod_a.append_event(got, _event(text="on the new life"))  # a fresh read pins the new life
    assert len(await store.read(pod_b.session_store_id(APP, "alice", "x"))) == new_events + 2


async def test_another_life_after_a_delete_only_is_not_found(store: Any) -> None:
    svc = RedisAdkSessionService(store)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="x")
    await svc.delete_session(app_name=APP, user_id="alice", session_id="x")
    with pytest.raises(AdkSessionNotFoundError):
        await svc.append_event(s, _event())
    assert await svc.get_session(app_name=APP, user_id="alice", session_id="x") is None


class _RecreateOnFirstRead:
    """The real store, with another pod's delete + re-create of one id landing between a
    reader's head and its log read (the window a two-step read has)."""

    def __init__(self, inner: Any, victim: str, recreate: Any) -> None:
        self._inner, self._victim, self._recreate, self.fired = inner, victim, recreate, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def read(self, session_id: str, *args: Any, **kwargs: Any) -> Any:
        if session_id == self._victim and not self.fired:
            self.fired = True
            await self._recreate()
        return await self._inner.read(session_id, *args, **kwargs)


async def test_get_session_never_mixes_two_lives(store: Any) -> None:
    """The id is re-created between get_session's head and its log read: the session read back
    is the new life whole (its events, its state, its marker), never life 1's head with life 2's
    log; an append through it lands on life 2."""
    plain = RedisAdkSessionService(store)
    s = await plain.create_session(app_name=APP, user_id="alice", session_id="x", state={"life": 1})
    for t in ["old-0", "old-1"]:
        await plain.append_event(s, _event(text=t))
    sid = plain.session_store_id(APP, "alice", "x")
    racing = _RecreateOnFirstRead(store, sid, lambda: _recreate(plain, "x", ["new-0", "new-1"]))
    svc = RedisAdkSessionService(racing)
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="x")
    assert racing.fired and got is not None
    assert got.state == {"life": 2} and [e.content.parts[0].text for e in got.events] == ["new-0", "new-1"]
    await svc.append_event(got, _event(text="new-2"))
    log = await store.read(sid)
    assert [e.data["event"]["content"]["parts"][0]["text"] for e in log[1:]] == ["new-0", "new-1", "new-2"]


async def test_session_objects_without_our_marker(store: Any) -> None:
    """A session object this service did not return (built by hand, or copied without private
    attributes): the log decides, as DatabaseSessionService does for marker-less sessions."""
    svc = RedisAdkSessionService(store)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="s1")
    handmade = Session(id="s1", app_name=APP, user_id="alice")
    await svc.append_event(handmade, _event(text="one"))  # matches the log (no events yet)
    copy = Session(id="s1", app_name=APP, user_id="alice", events=list(handmade.events))
    await svc.append_event(copy, _event(text="two"))  # its last event is the log's last
    behind = Session(id="s1", app_name=APP, user_id="alice", events=list(handmade.events))
    with pytest.raises(StaleSessionError):
        await svc.append_event(behind, _event(text="three"))
    with pytest.raises(StaleSessionError):
        await svc.append_event(s, _event(text="stale marker"))  # s was read at n=1
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and [e.content.parts[0].text for e in got.events] == ["one", "two"]


async def test_redelivered_event_lands_once(store: Any) -> None:
    svc = RedisAdkSessionService(store)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="s1")
    ev = _event(text="once", **{"app:count": 1, "k": 1})
    await svc.append_event(s, ev)
    await svc.append_event(s, ev)  # an equal event again (a retried call): a no-op
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and len(got.events) == 1 and len(s.events) == 1
    assert len(await store.read(svc.app_state_store_id(APP))) == 1
    # A retry from a session object that never saw the first success completes it, once.
    fresh = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert fresh is not None
    ev2 = _event(text="twice?", k=2)
    await svc.append_event(fresh, ev2)
    fresh._storage_update_marker = f"rs:{2}"  # as if the reply had been lost
    fresh.events.pop()
    await svc.append_event(fresh, ev2)
    assert [e.id for e in fresh.events] == [ev.id, ev2.id]
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and [e.content.parts[0].text for e in got.events] == ["once", "twice?"]
    # Two distinct events that share an id are both kept (ADK dedupes on equality, not on id).
    twin = _event(text="same id, other text")
    twin.id = ev2.id
    await svc.append_event(got, twin)
    assert len((await svc.get_session(app_name=APP, user_id="alice", session_id="s1")).events) == 3  # type: ignore[union-attr]


NAMES = [
    "plain",
    "with space",
    "colon:and/slash",
    "braces{x}",
    "percent%41",
    "tab\tnewline\n",
    "ünïcødé ✓",
    "",
]


@pytest.mark.parametrize("name", NAMES)
def test_escaping_is_reversible_and_store_safe(name: str) -> None:
    e = escape(name)
    assert unescape(e) == name
    assert ":" not in e and "{" not in e and "}" not in e and not any(c.isspace() for c in e)


async def test_any_adk_names_map_to_store_ids(store: Any) -> None:
    svc = RedisAdkSessionService(store, namespace="agents")
    app, user, sid = "my app {prod}", "user:42 %", "session/1 ✓"
    s = await svc.create_session(app_name=app, user_id=user, session_id=sid, state={"user:a": 1})
    store_id = svc.session_store_id(app, user, sid)
    assert store_id == "agents:s:my%20app%20%7Bprod%7D:user%3A42%20%25:session%2F1%20%E2%9C%93"
    assert adk_names(store_id) == ("s", app, user, sid)
    head = await store.head(store_id)
    assert head is not None and head.header.origin == {"adk": {"app_name": app, "user_id": user, "session_id": sid}}
    await svc.append_event(s, _event())
    got = await svc.get_session(app_name=app, user_id=user, session_id=sid)
    assert got is not None and (got.app_name, got.user_id, got.id) == (app, user, sid) and got.state == {"user:a": 1}
    listed = (await svc.list_sessions(app_name=app, user_id=user)).sessions
    assert [(x.app_name, x.user_id, x.id) for x in listed] == [(app, user, sid)]
    with pytest.raises(ValueError, match="store id"):
        await svc.create_session(app_name=app, user_id=user, session_id="é" * 100)
    with pytest.raises(ValueError):
        RedisAdkSessionService(store, namespace="bad:ns")


async def test_events_round_trip_field_for_field(store: Any) -> None:
    """What ADK's database service stores of an event (`model_dump(mode="json", exclude_none=True)`)
    comes back equal: bytes, function calls and responses, actions, custom metadata."""
    svc = RedisAdkSessionService(store)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="s1")
    rich = Event(
        invocation_id="inv-9",
        author="forecaster",
        branch="root.forecaster",
        content=types.Content(
            role="model",
            parts=[
                types.Part(text="see"),
                types.Part(inline_data=types.Blob(mime_type="image/png", data=b"\x89PNG\x00\xff")),
                types.Part(function_call=types.FunctionCall(id="c1", name="f", args={"a": [1, {"b": None}]})),
            ],
        ),
        actions=EventActions(state_delta={"k": {"nested": [1, 2]}}, transfer_to_agent="other", escalate=True),
        custom_metadata={"trace": "t-1"},
        turn_complete=True,
    )
    await svc.append_event(s, rich)
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and got.events == [rich] and got.state == {"k": {"nested": [1, 2]}}
    assert got.events[0].content.parts[1].inline_data.data == b"\x89PNG\x00\xff"


def test_lazy_export() -> None:
    import redis_session.adapters as adapters

    assert adapters.RedisAdkSessionService is RedisAdkSessionService
    assert issubclass(RedisAdkSessionService, BaseSessionService)


# =========================================================================== surface ADK's own services have


async def test_events_with_tied_timestamps_in_database_order(store: Any) -> None:
    """ADK's database service returns events by (timestamp, id); ties are broken by id, and
    `num_recent_events` cuts that order."""
    svc = RedisAdkSessionService(store)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="ties")
    ids = ["e-c", "e-a", "e-b"]
    for i in ids:
        ev = _event(text=i, ts=1000.0)
        ev.id = i
        await svc.append_event(s, ev)
    late = _event(text="earlier", ts=999.0)
    late.id = "e-z"
    await svc.append_event(s, late)
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="ties")
    assert got is not None and [e.id for e in got.events] == ["e-z", "e-a", "e-b", "e-c"]
    recent = await svc.get_session(
        app_name=APP, user_id="alice", session_id="ties", config=GetSessionConfig(num_recent_events=2)
    )
    assert recent is not None and [e.id for e in recent.events] == ["e-b", "e-c"]
    await svc.append_event(got, _event(text="next", ts=1001.0))  # the marker still holds (n, not order)


async def test_close_and_async_with(store: Any, redis_url: str, prefix: str) -> None:
    svc = RedisAdkSessionService(store)
    async with svc as entered:
        assert entered is svc
        await svc.create_session(app_name=APP, user_id="alice", session_id="s1")
    # A given store belongs to the caller: still open after close.
    assert await RedisAdkSessionService(store).get_session(app_name=APP, user_id="alice", session_id="s1")
    if isinstance(store, MemorySessionStore):
        return
    # One made from a URI owns its store: close closes it (twice is fine).
    async with RedisAdkSessionService(uri=_uri(redis_url, prefix)) as owned:
        assert await owned.get_session(app_name=APP, user_id="alice", session_id="s1") is not None
    await owned.close()


def _uri(redis_url: str, prefix: str, scheme: str = "redis-session", **query: str) -> str:
    import urllib.parse

    parts = urllib.parse.urlsplit(redis_url)
    q = urllib.parse.urlencode({"prefix": prefix, **query})
    return urllib.parse.urlunsplit((scheme, parts.netloc, parts.path, q, ""))


def test_sync_twins_outside_and_inside_a_loop(redis_url: str, prefix: str) -> None:
    """The `*_sync` methods InMemorySessionService has (ADK's agent_test_runner calls them),
    from plain code and from inside a running loop."""
    svc = RedisAdkSessionService(uri=_uri(redis_url, prefix))
    s = svc.create_session_sync(app_name=APP, user_id="alice", session_id="sync", state={"k": 1})
    svc.append_event_sync(s, _event(text="hello", **{"user:seen": True}))
    got = svc.get_session_sync(app_name=APP, user_id="alice", session_id="sync")
    assert got is not None and got.state == {"k": 1, "user:seen": True} and len(got.events) == 1
    assert [x.id for x in svc.list_sessions_sync(app_name=APP, user_id="alice").sessions] == ["sync"]

    async def inside() -> None:
        assert svc.get_session_sync(app_name=APP, user_id="alice", session_id="sync") is not None
        assert await svc.get_session(app_name=APP, user_id="alice", session_id="sync") is not None

    anyio.run(inside)
    svc.delete_session_sync(app_name=APP, user_id="alice", session_id="sync")
    assert svc.get_session_sync(app_name=APP, user_id="alice", session_id="sync") is None
    anyio.run(svc.close)


async def test_selected_by_adks_own_registry(redis_url: str, prefix: str, tmp_path: Any) -> None:
    """`adk web/run --session_service_uri redis-session://…` resolves through ADK's registry
    (create_session_service_from_options, what the CLI calls) to our service; so does a
    ``services.yaml`` naming our class (no user code); ``redis://`` too while ADK holds no
    ``redis`` scheme; a scheme ADK holds is never taken."""
    from google.adk.cli.service_registry import ServiceRegistry, load_services_module
    from google.adk.cli.utils.service_factory import create_session_service_from_options

    from redis_session.adapters.adk import register

    for scheme in ["redis-session", "redis"]:
        svc = create_session_service_from_options(
            base_dir=tmp_path, session_service_uri=_uri(redis_url, prefix, scheme, ttl_seconds="60")
        )
        assert isinstance(svc, RedisAdkSessionService) and svc.ttl_seconds == 60
        s = await svc.create_session(app_name=APP, user_id="alice", session_id=f"via-{scheme}")
        assert await svc.get_session(app_name=APP, user_id="alice", session_id=s.id) is not None
        await svc.close()

    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "services.yaml").write_text(
        "services:\n"
        "  - scheme: mysessions\n"
        "    type: session\n"
        "    class: redis_session.adapters.adk.RedisAdkSessionService\n"
    )
    load_services_module(str(agents))
    svc = create_session_service_from_options(
        base_dir=agents, session_service_uri=_uri(redis_url, prefix, "mysessions")
    )
    assert isinstance(svc, RedisAdkSessionService)
    await svc.close()

    theirs = ServiceRegistry()
    sentinel = InMemorySessionService()
    theirs.register_session_service("redis", lambda uri, **kw: sentinel)
    assert register(theirs) == ["redis-session", "redis-session+tls", "rediss"]
    assert theirs.create_session_service("redis://localhost:6379") is sentinel


async def test_ttl_seconds_expire_sessions_and_state(redis_url: str, prefix: str) -> None:
    """`ttl_seconds` as ADK's RedisSessionService has it: a session and the app/user state
    expire that long after their last write (every write restarts the clock)."""
    svc = RedisAdkSessionService(uri=_uri(redis_url, prefix, ttl_seconds="30"))
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="t", state={"app:a": 1, "user:u": 1})
    await svc.append_event(s, _event(text="x"))
    r = redis.asyncio.Redis.from_url(redis_url)
    try:
        for store_id in [
            svc.session_store_id(APP, "alice", "t"),
            svc.app_state_store_id(APP),
            svc.user_state_store_id(APP, "alice"),
        ]:
            for part in ["hdr", "log"]:
                ttl = await r.pttl(f"{prefix}:{{{store_id}}}:{part}")
                assert 0 < ttl <= 30_000, (store_id, part, ttl)
        assert await r.pttl(f"{prefix}:{{{svc.index_store_id(APP)}}}:hdr") == -1  # the index stays
    finally:
        await r.aclose()
        await svc.close()
    with pytest.raises(ValueError, match="ttl_seconds"):
        RedisAdkSessionService(MemorySessionStore(), ttl_seconds=0)


async def test_where_we_differ_from_adks_redis_session_service(store: Any, redis_url: str, prefix: str) -> None:
    """What the README says about ADK 2.13's own RedisSessionService, on the same server: a stale
    session object's event is merged in (no stale error), and an object of a deleted and
    re-created session appends to the new one. Ours refuses both."""
    from google.adk.integrations.redis import RedisSessionService, RedisSessionServiceConfig

    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    theirs = RedisSessionService(config=RedisSessionServiceConfig(key_prefix=f"{prefix}:theirs:"), redis_client=client)
    ours = RedisAdkSessionService(store)
    try:
        outcome: dict[str, list[str]] = {}
        for name, svc in [("theirs", theirs), ("ours", ours)]:
            seen = outcome[name] = []
            s = await svc.create_session(app_name=APP, user_id="alice", session_id="d")
            a = await svc.get_session(app_name=APP, user_id="alice", session_id="d")
            b = await svc.get_session(app_name=APP, user_id="alice", session_id="d")
            await svc.append_event(a, _event(text="a"))
            try:
                await svc.append_event(b, _event(text="b (stale)"))
                seen.append("stale accepted")
            except StaleSessionError:
                seen.append("stale refused")
            old = await svc.get_session(app_name=APP, user_id="alice", session_id="d")
            await svc.delete_session(app_name=APP, user_id="alice", session_id="d")
            s = await svc.create_session(app_name=APP, user_id="alice", session_id="d")
            for t in ["n0", "n1"]:
                await svc.append_event(s, _event(text=t))
            try:
                await svc.append_event(old, _event(text="old life"))
                seen.append("old life accepted")
            except StaleSessionError:
                seen.append("old life refused")
        assert outcome == {
            "theirs": ["stale accepted", "old life accepted"],
            "ours": ["stale refused", "old life refused"],
        }
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:theirs:*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def test_append_event_whose_reply_is_lost_then_retried_lands_once(redis_url: str, prefix: str) -> None:
    """The append script ran but its reply never came back (a proxy cuts every reply); the
    Runner's retry of the same event with the same session object lands nothing twice: one
    event in the log, its app/user delta applied once, the object at the right n."""
    import urllib.parse

    from reliability._proxy import FaultProxy

    from redis_session.errors import StoreUnavailableError

    parts = urllib.parse.urlsplit(redis_url)
    with FaultProxy(parts.port or 6379) as proxy:
        url = proxy.url.rsplit("/", 1)[0] + (parts.path or "/0")
        store = RedisSessionStore.from_url(url, prefix=prefix, client_options={"socket_timeout": 0.5})
        try:
            svc = RedisAdkSessionService(store)
            s = await svc.create_session(app_name=APP, user_id="alice", session_id="lost")
            ev = _event(text="once", **{"app:count": 1, "user:seen": 1})
            proxy.cut_up, proxy.cut_rate = False, 1.0  # commands reach the server, replies do not
            with pytest.raises(StoreUnavailableError):
                await svc.append_event(s, ev)
            proxy.cut_rate = 0.0
            await svc.append_event(s, ev)  # the retry
            await svc.append_event(s, _event(text="next"))  # the object stands at the right n
            log = await store.read(svc.session_store_id(APP, "alice", "lost"))
            assert [e.type for e in log] == ["adk/session", "adk/event", "adk/event"]
            assert [e.id for e in s.events] == [ev.id, s.events[1].id]
            assert len(await store.read(svc.app_state_store_id(APP))) <= 1
            assert await svc.get_user_state(app_name=APP, user_id="alice") == {"seen": 1}
            got = await svc.get_session(app_name=APP, user_id="alice", session_id="lost")
            assert got is not None and got.state["app:count"] == 1
        finally:
            await store.aclose()
            await _drop(redis_url, prefix)


async def _drop(url: str, prefix: str) -> None:
    r = redis.asyncio.Redis.from_url(url)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await r.delete(*keys)
    finally:
        await r.aclose()


async def test_shared_events_read_only_what_is_new_and_never_another_life(store: Any, other_pod_store: Any) -> None:
    """`shared_events`: a warm service hands out the same validated events and folds only the
    entries after its cache; another pod's appends show up; a delete + re-create (same count)
    is a new fold, never the cached one; the caller's lists and state are its own."""
    warm = RedisAdkSessionService(store, shared_events=8)
    writer = RedisAdkSessionService(other_pod_store)
    s = await writer.create_session(app_name=APP, user_id="alice", session_id="c", state={"k": 0})
    for t in ["e0", "e1"]:
        await writer.append_event(s, _event(text=t))
    first = await warm.get_session(app_name=APP, user_id="alice", session_id="c")
    assert first is not None
    await writer.append_event(s, _event(text="e2", k=2))
    second = await warm.get_session(app_name=APP, user_id="alice", session_id="c")
    assert second is not None and [e.content.parts[0].text for e in second.events] == ["e0", "e1", "e2"]
    assert second.events[0] is first.events[0]  # shared, not validated again
    assert second.state == {"k": 2}
    first.events.append(_event(text="caller's own"))
    first.state["k"] = "mine"
    third = await warm.get_session(app_name=APP, user_id="alice", session_id="c")
    assert third is not None and len(third.events) == 3 and third.state == {"k": 2}
    await warm.append_event(third, _event(text="e3"))  # its marker is the log's
    await _recreate(writer, "c", ["n0", "n1", "n2", "n3"])
    fresh = await warm.get_session(app_name=APP, user_id="alice", session_id="c")
    assert fresh is not None and [e.content.parts[0].text for e in fresh.events] == ["n0", "n1", "n2", "n3"]
    assert fresh.state == {"life": 2}
    with pytest.raises(ReplacedAdkSessionError):
        await warm.append_event(third, _event(text="old life"))
    await writer.delete_session(app_name=APP, user_id="alice", session_id="c")
    assert await warm.get_session(app_name=APP, user_id="alice", session_id="c") is None


async def test_the_same_event_sent_twice_at_once_lands_once(store: Any, other_pod_store: Any) -> None:
    """A client timeout plus a retry: two copies of one session object append the same event at
    the same time (two pods). It lands once; both calls return it; the next append goes on."""
    pod1, pod2 = RedisAdkSessionService(store), RedisAdkSessionService(other_pod_store)
    s = await pod1.create_session(app_name=APP, user_id="alice", session_id="twice", state={"app:n": 0})
    copies = [s.model_copy(deep=True), s.model_copy(deep=True)]
    ev = _event(text="once", **{"app:n": 1})
    results: list[Event] = []

    async def send(pod: RedisAdkSessionService, copy: Session) -> None:
        results.append(await pod.append_event(copy, ev.model_copy(deep=True)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(send, pod1, copies[0])
        tg.start_soon(send, pod2, copies[1])
    assert [r.id for r in results] == [ev.id, ev.id]
    log = await store.read(pod1.session_store_id(APP, "alice", "twice"))
    assert [e.type for e in log] == ["adk/session", "adk/event"]
    assert len(await store.read(pod1.app_state_store_id(APP))) == 2  # the create's delta, then this one once
    await pod2.append_event(copies[1], _event(text="next"))


def test_service_uri_options_are_checked_before_connecting() -> None:
    """Bad options in a service URI (what `adk web --session_service_uri` passes) are a
    ValueError naming the option, raised before any connection is opened (port 1: none)."""
    for query, name in [("ttl_seconds=abc", "ttl_seconds"), ("ttl_seconds=-5", "ttl_seconds"),
                        ("shared_events=x", "shared_events"), ("namespace=a:b", "namespace")]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            RedisAdkSessionService(uri=f"redis-session://127.0.0.1:1/0?{query}")
    with pytest.raises(ValueError, match="service URI"):
        RedisAdkSessionService(uri="127.0.0.1:6379")
    with pytest.raises(TypeError):
        RedisAdkSessionService(MemorySessionStore(), uri="redis-session://127.0.0.1:1/0")
    svc = RedisAdkSessionService(uri="redis-session://127.0.0.1:1/0?shared_events=8&namespace=n1&ttl_seconds=5")
    assert (svc.shared_events, svc.namespace, svc.ttl_seconds) == (8, "n1", 5.0)


# =========================================================================== hostile input, big events


async def _no_trace(svc: RedisAdkSessionService, store: Any, session_id: str) -> None:
    """Nothing of a refused create is left: no session, no app/user state, not listed."""
    assert await svc.get_session(app_name=APP, user_id="alice", session_id=session_id) is None
    assert await store.head(svc.session_store_id(APP, "alice", session_id)) is None
    assert await store.head(svc.app_state_store_id(APP)) is None
    assert await store.head(svc.user_state_store_id(APP, "alice")) is None
    assert (await svc.list_sessions(app_name=APP)).sessions == []


@pytest.mark.parametrize(
    "state",
    [{"app:v": "\ud800"}, {"user:v": "\udfff"}, {"k": "x\ud800"}, {"app:v": "x" * 1_200_000}, {"\ud800": 1}],
    ids=["app-surrogate", "user-surrogate", "session-surrogate", "app-2MB", "surrogate-key"],
)
async def test_a_refused_create_writes_nothing_and_a_corrected_one_works(store: Any, state: dict[str, Any]) -> None:
    svc = RedisAdkSessionService(store)
    with pytest.raises(InvalidEntryError, match="state"):
        await svc.create_session(app_name=APP, user_id="alice", session_id="s1", state={"ok": 1, **state})
    await _no_trace(svc, store, "s1")
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="s1", state={"app:v": 1, "ok": 1})
    assert s.state == {"app:v": 1, "ok": 1}


async def test_create_state_is_coerced_as_adk_dumps_events(store: Any) -> None:
    """NaN, bytes and objects in a create's state are stored as ADK's ``Event`` dumps them (null,
    URL-safe base64, str), the same as the same values in an event's delta."""
    svc = RedisAdkSessionService(store)
    state = {"app:n": float("nan"), "user:b": b"\x00\xff\xfe", "b": b"\x00\xff\xfe"}
    await svc.create_session(app_name=APP, user_id="alice", session_id="s1", state=state)
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and got.state == {"app:n": None, "user:b": "AP_-", "b": "AP_-"}
    s2 = await svc.create_session(app_name=APP, user_id="alice", session_id="s2")
    await svc.append_event(s2, _event(**{"c": b"\x00\xff\xfe", "user:c": b"\x00\xff\xfe"}))
    got2 = await svc.get_session(app_name=APP, user_id="alice", session_id="s2")
    assert got2 is not None and got2.state["c"] == got2.state["user:c"] == "AP_-"


@pytest.mark.parametrize(
    "delta",
    [
        {"other": 1, "app:v": "\ud800"},
        {"other": 1, "user:v": "x" * 1_200_000},
        {"other": 1, "app:v": "x" * 1_200_000},
        {"other": 1, "\udfff": 1},
    ],
    ids=["app-surrogate", "user-2MB", "app-2MB", "surrogate-key"],
)
async def test_a_refused_append_writes_nothing(store: Any, delta: dict[str, Any]) -> None:
    svc = RedisAdkSessionService(store)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="s1")
    for _ in range(2):  # the retry is refused the same way
        with pytest.raises(InvalidEntryError, match="state"):
            await svc.append_event(s, _event(**delta))
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and got.events == [] and got.state == {}
    assert await store.head(svc.app_state_store_id(APP)) is None
    assert await store.head(svc.user_state_store_id(APP, "alice")) is None
    assert s.events == []
    await svc.append_event(s, _event(other=1))  # the session object is still good
    assert len(s.events) == 1


async def test_bytes_and_nan_deltas_land_once_as_adk_stores_them(store: Any) -> None:
    """What ``InMemorySessionService`` accepts in a delta (bytes, NaN) lands, with the app/user
    parts; the values read back as ADK's own JSON dump of the event has them."""
    svc = RedisAdkSessionService(store)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="s1")
    ev = _event(**{"other": 1, "v": b"\x00\xff", "app:n": float("nan"), "user:b": b"\xff"})
    await svc.append_event(s, ev)
    await svc.append_event(s, ev)  # a retry: a no-op
    got = await svc.get_session(app_name=APP, user_id="alice", session_id="s1")
    assert got is not None and len(got.events) == 1
    assert got.state == {"other": 1, "v": "AP8=", "app:n": None, "user:b": "_w=="}


@pytest.mark.parametrize(
    "names",
    [
        {"session_id": "\ud800"},
        {"user_id": "u\udfff"},
        {"app_name": "a\ud800"},
    ],
    ids=["session_id", "user_id", "app_name"],
)
async def test_ids_with_lone_surrogates_are_typed_errors_naming_the_field(store: Any, names: dict[str, str]) -> None:
    svc = RedisAdkSessionService(store)
    kw = {"app_name": APP, "user_id": "alice", "session_id": "s1", **names}
    field = next(iter(names))
    with pytest.raises(InvalidSessionIdError, match=field):
        await svc.create_session(**kw)
    for call in (svc.get_session, svc.delete_session):
        with pytest.raises(InvalidSessionIdError, match=field):
            await call(**kw)
    if field == "session_id":
        assert (await svc.list_sessions(app_name=APP)).sessions == []


async def test_an_event_over_the_entry_limit_is_stored_and_read_back_equal(store: Any) -> None:
    """A 1.5 MB inline image (ADK's InMemory and Redis services store it) goes in one batch of
    parts; reads give it back field for field, and a retry lands once."""
    svc = RedisAdkSessionService(store)
    s = await svc.create_session(app_name=APP, user_id="alice", session_id="s1")
    image = b"\x89PNG" + bytes(range(256)) * 6000
    big = Event(
        invocation_id="inv-1",
        author="user",
        content=types.Content(
            role="user",
            parts=[
                types.Part(text="what is in this picture? ü ✓"),
                types.Part.from_bytes(data=image, mime_type="image/png"),
            ],
        ),
        actions=EventActions(state_delta={"k": "v", "user:seen": 1}),
    )
    await svc.append_event(s, big)
    await svc.append_event(s, big)  # an equal event again: a no-op
    after = _event(text="after")
    await svc.append_event(s, after)
    ids = [big.id, after.id]
    for shared in (0, 4):
        reader = RedisAdkSessionService(store, shared_events=shared)
        got = await reader.get_session(app_name=APP, user_id="alice", session_id="s1")
        assert got is not None and [e.id for e in got.events] == ids
        assert got.events[0].model_dump(mode="json") == big.model_dump(mode="json")
        assert got.events[0].content.parts[1].inline_data.data == image  # type: ignore[union-attr,index]
        assert got.state == {"k": "v", "user:seen": 1}
        nxt = await reader.append_event(got, _event(text=f"next {shared}"))
        ids.append(nxt.id)
    log = await store.read(svc.session_store_id(APP, "alice", "s1"))
    assert [e.type for e in log].count("adk/part") >= 1
    # A session object this service never marked is checked against the log's last event (a part).
    unmarked = Session(id="s1", app_name=APP, user_id="alice", events=list(got.events))
    await svc.append_event(unmarked, _event(text="last"))
    listed = await svc.list_sessions(app_name=APP)
    assert [x.id for x in listed.sessions] == ["s1"]
