"""check_invariants and interrupted_turn_closers (ChatLuna checkInvariants; dsh §(c) 24-31)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redis_session.model import Entry, NewEntry, Surface, SurfaceReplace, Vocabulary, encode_batch
from redis_session.projection import history, project
from redis_session.projection.invariants import INTERRUPTED_TEXT, Problem, check_invariants, interrupted_turn_closers


class Log:
    """A dsh-style log builder: `log.add(type, **data)` numbers entries from 0."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def add(self, type: str, surface: Surface | None = None, time: int | None = None, **data: Any) -> Log:
        n = len(self.entries)
        self.entries.append(Entry(n=n, time=1000 + n if time is None else time, type=type, data=data, surface=surface))
        return self

    def turn(self, turn: int) -> Log:
        return self.add("turn/start", turn=turn, trigger={"kind": "message", "source": {"kind": "cli"}})

    def end(self, turn: int, reason: Any = "completed") -> Log:
        return self.add("turn/end", turn=turn, reason=reason)

    def step(self, turn: int, step: int) -> Log:
        return self.add("step/start", turn=turn, step=step)

    def step_end(self, turn: int, step: int) -> Log:
        return self.add("step/end", turn=turn, step=step)

    def calls(self, turn: int, step: int, *ids: str) -> Log:
        blocks = [{"type": "tool-call", "id": i, "name": "f", "arguments": "{}"} for i in ids]
        return self.add("assistant/message", turn=turn, step=step, content=blocks)

    def call(self, turn: int, step: int, call_id: str) -> Log:
        return self.add("tool/call", turn=turn, step=step, callId=call_id, name="f", arguments="{}")

    def result(self, turn: int, step: int, call_id: str, **extra: Any) -> Log:
        data = {"turn": turn, "step": step, "callId": call_id, "content": "ok", "isError": False, **extra}
        return self.add("tool/result", **data)

    def then(self, news: list[NewEntry]) -> Log:
        for e in news:
            self.add(e.type, surface=e.surface if isinstance(e.surface, Surface) else None, time=e.time, **e.data)
        return self


def codes(entries: list[Entry]) -> list[tuple[int | None, str]]:
    return [(p.n, p.code) for p in check_invariants(entries)]


def one_turn() -> Log:
    log = Log().turn(1).add("user/message", content="q", source={"kind": "cli"}).step(1, 1)
    log.add("assistant/chunk", turn=1, step=1, chunk={"delta": "x"})
    log.calls(1, 1, "c1").call(1, 1, "c1").result(1, 1, "c1").step_end(1, 1)
    log.step(1, 2).add("assistant/message", turn=1, step=2, content=[{"type": "text", "text": "done"}]).step_end(1, 2)
    return log.end(1)


# --------------------------------------------------------------------------- ChatLuna invariants


def test_a_clean_log_has_no_problems() -> None:
    log = one_turn().turn(2).step(2, 1).step_end(2, 1).end(2, {"kind": "aborted", "reason": "user"})
    assert check_invariants(log.entries) == []
    assert check_invariants([]) == []


def test_n_must_run_from_0_without_gaps() -> None:
    entries = Log().add("message", role="user", content="a").add("message", role="user", content="b").entries
    gap = [entries[0], msgspec.structs.replace(entries[1], n=2)]
    assert check_invariants(gap) == [Problem(2, "n-gap", "expected n=1, got n=2")]
    assert codes([msgspec.structs.replace(entries[0], n=1)]) == [(1, "n-gap")]


@pytest.mark.parametrize("before", [-1, 3, "0", None])
def test_cut_before_must_lie_in_0_to_its_n(before: Any) -> None:
    log = Log().add("message", role="user", content="a").add("message", role="user", content="b")
    log.add("cut", before=before, summary=[], reason="r")
    assert codes(log.entries) == [(2, "cut-before")]
    ok = Log().add("message", role="user", content="a").add("cut", before=1, summary=[], reason="r")
    assert check_invariants(ok.entries) == []


@pytest.mark.parametrize("value", [math.nan, math.inf, b"bytes", {1, 2}, (1, 2), {1: "int key"}])
def test_data_must_be_lossless_json(value: Any) -> None:
    log = Log().add("x/mark", value=value)
    assert codes(log.entries) == [(0, "data-json")]


def test_meta_must_be_lossless_json_and_data_an_object() -> None:
    entry = Entry(n=0, time=0, type="x/mark", data={}, meta={"t": math.nan})
    assert codes([entry]) == [(0, "meta-json")]
    weird = Entry(n=0, time=0, type="x/mark", data=["not", "an", "object"])  # type: ignore[arg-type]
    assert codes([weird, msgspec.structs.replace(weird, n=1, data={})]) == [(0, "data-json")]


def test_chatluna_and_nanobot_logs_have_no_turn_problems() -> None:
    log = Log().add("preset/selected", presetId="p").add("message", role="user", content="hi")
    log.add("request/context", provider="p", model="m").add("message", role="assistant", content="yo")
    log.add("assistant/chunk", chunk="stray")  # a turn-scoped type, but this log never uses turns
    log.add("cut", before=1, summary=[{"role": "system", "content": "S"}], reason="manual")
    assert check_invariants(log.entries) == []


def test_surface_problems_are_reported_not_raised() -> None:
    log = Log().add("user/message", content="a").add("user/message", content="b")
    bad = Surface(SurfaceReplace(op="replace", start=1, end=0), [0, 1])
    log.add("assistant/message", surface=bad, content="s")
    log.add("x/mark", surface=Surface("append"))
    problems = check_invariants(log.entries)
    assert [(p.n, p.code) for p in problems] == [(2, "surface"), (3, "surface")]
    assert "start seq 1 (position 1) is after end seq 0" in problems[0].message
    assert "not surface-eligible" in problems[1].message


def test_header_delta_problems() -> None:
    log = Log().add("request/header-delta", config={"model": "m"})
    log.add("request/header", header={"config": {}, "system": "one"}, reason="initial")
    log.add("request/header-delta", system={"keepStart": 5, "keepEnd": 0, "insert": []})
    assert codes(log.entries) == [(0, "header-delta"), (2, "header-delta")]


# --------------------------------------------------------------------------- dsh turn enclosure (§24-26)


def test_turns_start_at_1_without_gaps() -> None:
    log = Log().turn(1).end(1).turn(3).end(3)
    problems = check_invariants(log.entries)
    assert problems == [Problem(2, "turn-number", "expected turn 2, got 3")]
    assert codes(Log().turn(2).end(2).entries) == [(0, "turn-number")]


def test_turns_do_not_nest() -> None:
    assert codes(Log().turn(1).turn(2).end(2).entries) == [(1, "turn-nested")]


def test_turn_end_matches_the_open_turn_with_no_step_open() -> None:
    assert codes(Log().turn(1).end(2).entries) == [(1, "turn-unmatched")]
    assert codes(Log().end(1).entries) == [(0, "turn-unmatched")]
    assert codes(Log().turn(1).step(1, 1).end(1).entries) == [(2, "step-open")]


def test_steps_start_at_1_per_turn_without_gaps_or_nesting() -> None:
    assert codes(Log().turn(1).step(1, 2).step_end(1, 2).end(1).entries) == [(1, "step-number")]
    assert codes(Log().turn(1).step(1, 1).step(1, 2).step_end(1, 2).end(1).entries) == [(2, "step-nested")]
    ok = Log().turn(1).step(1, 1).step_end(1, 1).end(1).turn(2).step(2, 1).step_end(2, 1).end(2)
    assert check_invariants(ok.entries) == []
    assert codes(Log().turn(1).step_end(1, 1).end(1).entries) == [(1, "step-unmatched")]
    assert codes(Log().turn(1).step(1, 1).step_end(1, 2).end(1).entries) == [(2, "step-mismatch")]


def test_events_name_the_open_turn_and_step() -> None:
    log = Log().turn(1).step(1, 1)
    log.add("assistant/chunk", turn=2, step=1, chunk="x")
    log.add("assistant/chunk", turn=1, step=2, chunk="x")
    log.add("assistant/message", turn=1, step=1, content="fine")
    log.step_end(1, 1).add("assistant/message", turn=1, step=1, content="after the step")
    log.end(1)
    assert codes(log.entries) == [(2, "turn-mismatch"), (3, "step-mismatch"), (6, "step-mismatch")]


def test_turn_scoped_events_outside_a_turn() -> None:
    log = Log().turn(1).end(1)
    for t in ["assistant/chunk", "assistant/message", "tool/call", "tool/result", "step/start", "step/end"]:
        log.add(t, callId="c", turn=1, step=1)
    problems = check_invariants(log.entries)
    assert [p.code for p in problems] == ["outside-turn"] * 6
    assert problems[0].message == "assistant/chunk appended outside any open turn"


def test_user_input_and_marks_may_sit_between_turns() -> None:
    log = Log().turn(1).end(1).add("user/message", content="queued", source={"kind": "cli"})
    log.add("agent/input-enqueued", messageId="m").add("todo/write", todos=[]).add("my-plugin/x", a=1)
    log.turn(2).end(2)
    assert check_invariants(log.entries) == []


def test_tool_results_pair_with_a_call_in_their_step() -> None:
    log = Log().turn(1).step(1, 1).calls(1, 1, "a", "b").call(1, 1, "a").call(1, 1, "b")
    log.result(1, 1, "a").step_end(1, 1)  # b never answered: legal
    log.step(1, 2).result(1, 2, "b")  # pending calls were cleared at step/end
    log.result(1, 2, "zzz")
    interrupted = {"isError": True, "error": {"name": "InterruptedError", "code": "interrupted"}}
    log.result(1, 2, "gone", **interrupted)  # the synthetic crash result is exempt
    log.step_end(1, 2).end(1)
    problems = check_invariants(log.entries)
    assert [(p.n, p.code) for p in problems] == [(8, "tool-unpaired"), (9, "tool-unpaired")]
    assert "'b'" in problems[0].message


def test_openai_tool_calls_pair_with_their_results_inside_a_step() -> None:
    """The README's round trip in a turn/step: an assistant/message with OpenAI `tool_calls`, then
    its tool/result. It was reported `tool-unpaired` (only tool/call marks counted as calls)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    log = Log().turn(1).add("user/message", content="Weather in Paris?").step(1, 1)
    log.add("assistant/message", content=None, tool_calls=[call], turn=1, step=1).result(1, 1, "call_1")
    log.step_end(1, 1).end(1)
    assert check_invariants(log.entries) == []
    # on a plain `message` (role assistant) too, with a tool-call block or OpenAI tool_calls
    log = Log().turn(1).step(1, 1).add("message", role="assistant", content=None, tool_calls=[call], turn=1, step=1)
    log.add("message", role="assistant", content=[{"type": "tool-call", "id": "b1", "name": "f", "arguments": "{}"}])
    log.result(1, 1, "call_1").result(1, 1, "b1").step_end(1, 1).end(1)
    assert check_invariants(log.entries) == []


def test_a_tool_result_whose_call_exists_nowhere_is_unpaired_in_a_log_without_turns() -> None:
    """A log without turns (ChatLuna, nanobot, a plain app): a result whose call exists nowhere
    was reported clean. Calls from tool/call marks, assistant blocks and tool_calls all count;
    only one made before the result pairs it."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    log = Log().add("user/message", content="hi").add("tool/result", callId="nowhere", content="r")
    log.add("assistant/message", content=None, tool_calls=[call]).add("tool/result", callId="c1", content="r")
    log.add("tool/call", callId="m1", name="f", arguments="{}").add("tool/result", callId="m1", content="r")
    log.add("message", role="tool", tool_call_id="c1", content="r")  # an OpenAI-shaped result of c1
    log.add("message", role="tool", tool_call_id="ghost", content="r")
    log.add("tool/result", callId="later", content="r").add("tool/call", callId="later", name="f", arguments="{}")
    problems = check_invariants(log.entries)
    assert [(p.n, p.code) for p in problems] == [(1, "tool-unpaired"), (7, "tool-unpaired"), (8, "tool-unpaired")]
    assert "'nowhere'" in problems[0].message and "before it" in problems[0].message


def test_check_invariants_never_raises() -> None:
    odd = [
        Entry(n=0, time=0, type="turn/start", data={"turn": "one"}),
        Entry(n=1, time=0, type="tool/call", data={"callId": ["unhashable"]}),
        Entry(n=2, time=0, type="tool/result", data={"callId": {"un": "hashable"}}),
        Entry(n=3, time=0, type="cut", data={}),
        Entry(n=4, time=0, type="user/message", data={"content": 12}),
        Entry(n=9, time=0, type="request/header", data={"header": "nope"}),
    ]
    problems = check_invariants(odd)
    # an unhashable call id is compared by its JSON: the result answers no call, reported as such
    assert {p.code for p in problems} >= {"tool-unpaired", "cut-before", "n-gap", "header-delta"}


# --------------------------------------------------------------------------- crash recovery (§28-31)


def test_balanced_or_empty_logs_need_no_closers() -> None:
    assert interrupted_turn_closers([]) == []
    assert interrupted_turn_closers(one_turn().entries) == []
    assert interrupted_turn_closers(Log().add("message", role="user", content="x").entries) == []


def test_an_open_turn_gets_an_interrupted_turn_end() -> None:
    log = Log().turn(1).add("user/message", content="q", source={"kind": "cli"}, time=77)
    assert interrupted_turn_closers(log.entries) == [
        NewEntry("turn/end", {"turn": 1, "reason": {"kind": "interrupted"}}, time=77)
    ]


def test_an_open_step_is_closed_first() -> None:
    log = one_turn().turn(2).step(2, 1).add("assistant/chunk", turn=2, step=1, chunk="x", time=5)
    closers = interrupted_turn_closers(log.entries)
    assert [(c.type, c.data) for c in closers] == [
        ("step/end", {"turn": 2, "step": 1}),
        ("turn/end", {"turn": 2, "reason": {"kind": "interrupted"}}),
    ]
    assert all(c.time == 5 for c in closers)


def test_unanswered_tool_calls_get_synthetic_results_in_log_order() -> None:
    log = Log().turn(1).step(1, 1).calls(1, 1, "old").result(1, 1, "old").step_end(1, 1)
    log.step(1, 2).calls(1, 2, "x", "y", "z").call(1, 2, "x").call(1, 2, "z").result(1, 2, "y")
    log.add("assistant/chunk", turn=1, step=2, chunk="...", time=4242)
    closers = interrupted_turn_closers(log.entries)
    assert [c.type for c in closers] == ["tool/result", "tool/result", "step/end", "turn/end"]
    x, z = closers[0], closers[1]
    assert x.data == {
        "turn": 1,
        "step": 2,
        "callId": "x",
        "content": [{"type": "text", "text": INTERRUPTED_TEXT}],
        "isError": True,
        "error": {"name": "InterruptedError", "code": "interrupted"},
    }
    assert INTERRUPTED_TEXT == "Tool call interrupted by a crash; no result was recorded."
    assert x.surface == Surface("append", [7]) and z.data["callId"] == "z" and z.surface == Surface("append", [8])
    assert all(c.time == 4242 for c in closers)


def test_calls_of_closed_turns_and_steps_are_ignored() -> None:
    log = Log().turn(1).step(1, 1).calls(1, 1, "a").step_end(1, 1).end(1)
    log.turn(2).step(2, 1).calls(2, 1, "b").step_end(2, 1).step(2, 2)
    assert [c.type for c in interrupted_turn_closers(log.entries)] == ["step/end", "turn/end"]


def test_a_call_without_an_assistant_block_gets_no_result() -> None:
    log = Log().turn(1).step(1, 1).call(1, 1, "lonely")
    assert [c.type for c in interrupted_turn_closers(log.entries)] == ["step/end", "turn/end"]


def test_a_call_logged_before_its_assistant_block_is_still_cited() -> None:
    log = Log().turn(1).step(1, 1).call(1, 1, "c").calls(1, 1, "c")
    [result, _, _] = interrupted_turn_closers(log.entries)
    assert result.surface == Surface("append", [2])


def test_closers_repair_the_log() -> None:
    log = Log().turn(1).add("user/message", content="q", source={"kind": "cli"}).step(1, 1)
    log.calls(1, 1, "a", "b").call(1, 1, "a")
    closers = interrupted_turn_closers(log.entries)
    # they pass the store's own validation …
    encode_batch(closers, Vocabulary(strict=True), first_n=len(log.entries))
    repaired = log.then(closers)
    # … leave a log with no problems, nothing more to close, and a transcript with no dangling call
    assert check_invariants(repaired.entries) == []
    assert interrupted_turn_closers(repaired.entries) == []
    msgs = project(repaired.entries)
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert history(msgs) == msgs


# --------------------------------------------------------------------------- property


@st.composite
def crashed_logs(draw: st.DrawFn) -> list[Entry]:
    """Well-formed dsh logs cut off at a random point."""
    log = Log()
    for turn in range(1, draw(st.integers(1, 3)) + 1):
        log.turn(turn).add("user/message", content="q", source={"kind": "cli"})
        for step in range(1, draw(st.integers(0, 3)) + 1):
            log.step(turn, step)
            ids = [f"t{turn}s{step}c{i}" for i in range(draw(st.integers(0, 3)))]
            if ids:
                log.calls(turn, step, *ids)
            for i in ids:
                log.call(turn, step, i)
            for i in draw(st.permutations(ids)):
                log.result(turn, step, i)
            log.step_end(turn, step)
        log.end(turn)
    return log.entries[: draw(st.integers(0, len(log.entries)))]


@settings(max_examples=300, deadline=None)
@given(crashed_logs())
def test_any_crash_tail_is_repaired(entries: list[Entry]) -> None:
    assert check_invariants(entries) == []
    log = Log()
    log.entries = list(entries)
    closers = interrupted_turn_closers(entries)
    repaired = log.then(closers).entries
    assert check_invariants(repaired) == []
    assert interrupted_turn_closers(repaired) == []
    msgs = project(repaired)
    calls = {b["id"] for m in msgs for b in m.content if b["type"] == "tool-call"}
    results = {b["toolCallId"] for m in msgs for b in m.content if b["type"] == "tool-result"}
    assert calls == results
