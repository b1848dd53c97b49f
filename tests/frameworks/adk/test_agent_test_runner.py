"""ADK's own test harness, ``google.adk.cli.agent_test_runner`` (installed with google-adk
2.13.0), driving our service: its ``InMemoryRunner`` creates and reads the session through the
``*_sync`` methods and runs turns through the sync ``Runner.run`` (a thread with its own event
loop). The one change is its constructor line: the session service it builds is ours (on the
real server) instead of ``InMemorySessionService``; the same turns on ADK's own service are the
control, and ADK's ``normalize_events`` compares them."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from google.adk.agents import LlmAgent
from google.adk.cli import agent_test_runner
from google.adk.sessions import InMemorySessionService
from google.adk.tools import ToolContext
from google.genai import types

from redis_session.adapters.adk import RedisAdkSessionService


def lookup(city: str, tool_context: ToolContext) -> dict[str, Any]:
    """The weather in a city."""
    tool_context.state["user:last_city"] = city
    tool_context.state["cities"] = [*tool_context.state.get("cities", []), city]
    return {"city": city, "forecast": "sunny"}


def _script() -> list[types.Content]:
    call = types.Part(function_call=types.FunctionCall(name="lookup", args={"city": "Paris"}))
    return [
        types.Content(role="model", parts=[call]),
        types.Content(role="model", parts=[types.Part(text="Sunny in Paris.")]),
        types.Content(role="model", parts=[types.Part(text="You asked about Paris.")]),
    ]


def _turns(runner: Any) -> tuple[list[dict[str, Any]], Any]:
    events = runner.run("Weather in Paris?") + runner.run("What did I ask?")
    return _normalized(events), runner.session


def _normalized(events: list[Any]) -> list[dict[str, Any]]:
    """ADK's own normalization (generated function-call ids mapped to stable ones, then the
    volatile fields dropped), as its replay tests compare events."""
    return agent_test_runner.normalize_events(agent_test_runner._normalize_ids(list(events)))


@pytest.fixture
def ours_in_the_runner(redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    parts = urllib.parse.urlsplit(redis_url)
    uri = urllib.parse.urlunsplit(("redis-session", parts.netloc, parts.path, f"prefix={prefix}", ""))
    made: list[Any] = []

    def ours() -> RedisAdkSessionService:  # the harness's constructor line, made ours
        made.append(RedisAdkSessionService(uri=uri))
        return made[-1]

    monkeypatch.setattr(agent_test_runner, "InMemorySessionService", ours)
    yield made
    for svc in made:
        anyio.run(svc.close)


def test_adks_in_memory_runner_on_our_service(ours_in_the_runner: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    ours = agent_test_runner.InMemoryRunner(
        LlmAgent(name="forecaster", model=agent_test_runner.MockModel.create(_script()), tools=[lookup])
    )
    assert isinstance(ours._session_service, RedisAdkSessionService)
    got, ours_session = _turns(ours)

    monkeypatch.setattr(agent_test_runner, "InMemorySessionService", InMemorySessionService)  # the control
    control = agent_test_runner.InMemoryRunner(
        LlmAgent(name="forecaster", model=agent_test_runner.MockModel.create(_script()), tools=[lookup])
    )
    expected, control_session = _turns(control)

    assert got == expected
    assert ours_session.state == control_session.state == {"cities": ["Paris"], "user:last_city": "Paris"}
    assert _normalized(ours_session.events) == _normalized(control_session.events)
    assert len(ours_session.events) == 6
