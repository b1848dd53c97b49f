"""What the renderers send a provider is always legal: every tool result follows its call.

A cut can fall inside a tool-call group, a crash can leave a call unanswered, a surface replace
can shadow a call and keep its result: the projection then holds a tool result without its call
or a call without its result, and OpenAI and Anthropic reject such a request. `to_openai` and
`to_anthropic` repair it (orphan results dropped, unanswered calls dropped from their message);
a rendering that is legal already comes out unchanged.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from redis_session.model import Entry, Surface, SurfaceReplace
from redis_session.projection import Message, openai_messages, project, to_anthropic, to_openai
from redis_session.projection import render as projection

# --------------------------------------------------------------------------- what providers accept


def openai_legal(out: list[dict[str, Any]], allow_pending: bool = False) -> bool:
    """An assistant message with tool_calls (ids distinct) is followed directly by one tool message
    per call; no other tool message exists; (with allow_pending) the last group may be short."""
    i = 0
    while i < len(out):
        m = out[i]
        if m["role"] == "tool":
            return False
        if m["role"] == "assistant" and m.get("tool_calls"):
            ids = [c["id"] for c in m["tool_calls"]]
            if len(set(ids)) != len(ids):
                return False
            pending = set(ids)
            j = i + 1
            while j < len(out) and out[j]["role"] == "tool":
                if out[j]["tool_call_id"] not in pending:
                    return False
                pending.discard(out[j]["tool_call_id"])
                j += 1
            if pending and not (allow_pending and j == len(out)):
                return False
            i = j
            continue
        if m["role"] == "assistant" and m.get("content") is None:
            return False
        i += 1
    return True


def anthropic_legal(request: dict[str, Any], allow_pending: bool = False) -> bool:
    """Roles alternate; every tool_use is answered in the next message, every tool_result answers
    a tool_use of the message before, once, and results come first in their message."""
    msgs = request["messages"]
    for i, m in enumerate(msgs):
        if not m["content"] or (i and msgs[i - 1]["role"] == m["role"]):
            return False
        types = [b["type"] for b in m["content"]]
        if m["role"] == "assistant":
            if "tool_result" in types:
                return False
            uses = [b["id"] for b in m["content"] if b["type"] == "tool_use"]
            if len(set(uses)) != len(uses):
                return False
            nxt = msgs[i + 1] if i + 1 < len(msgs) else None
            answered = {b.get("tool_use_id") for b in nxt["content"]} if nxt is not None else set()
            missing = set(uses) - answered
            last_group = nxt is None or (i + 2 == len(msgs) and all(b["type"] == "tool_result" for b in nxt["content"]))
            if missing and not (allow_pending and last_group):
                return False
        else:
            results = [b["tool_use_id"] for b in m["content"] if b["type"] == "tool_result"]
            prev = msgs[i - 1] if i else None
            uses = {b["id"] for b in prev["content"] if b["type"] == "tool_use"} if prev else set()
            if len(set(results)) != len(results) or any(r not in uses for r in results):
                return False
            if types != sorted(types, key=lambda t: t != "tool_result"):
                return False
    return True


def raw_anthropic(messages: list[Message]) -> dict[str, Any]:
    """to_anthropic without its repair (`_legal_anthropic` patched out): what it rendered before."""
    with mock.patch.object(projection, "_legal_anthropic", lambda out, allow: out):
        return to_anthropic(messages)


# --------------------------------------------------------------------------- random logs


def E(n: int, type: str, data: dict[str, Any], surface: Surface | None = None) -> Entry:
    return Entry(n=n, time=1000 + n, type=type, data=data, surface=surface)


def call(cid: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


_text = st.text(alphabet="ab ", max_size=3)


@st.composite
def logs(draw: st.DrawFn) -> list[Entry]:
    """Conversations in turns (user, assistant calls, their results, a reply), in both dsh and chat
    shapes, with noise: results missing, doubled, late or unknown, calls never answered,
    messages between a call and its result, system messages, cuts anywhere (summaries holding
    tools too) and surface replaces over any visible nodes."""
    entries: list[Entry] = []
    nodes: list[int] = []
    before = 0
    calls_made: list[str] = []
    noisy = draw(st.booleans())

    def add(type: str, data: dict[str, Any], node: bool = True, surface: Surface | None = None) -> None:
        n = len(entries)
        entries.append(E(n, type, data, surface))
        if node and surface is None:
            nodes.append(n)

    for _turn in range(draw(st.integers(0, 5))):
        add("user/message", {"content": draw(_text) or "q"})
        for _step in range(draw(st.integers(0, 2))):
            ids = [f"c{len(entries)}_{k}" for k in range(draw(st.integers(1, 3)))]
            calls_made.extend(ids)
            chat = draw(st.booleans())
            text = draw(st.sampled_from(["", "calling"]))
            if chat:
                data: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": [call(i) for i in ids]}
                if draw(st.booleans()):
                    data["reasoning_content"] = "why"
                add("message", data)
            else:
                blocks: list[dict[str, Any]] = []
                if draw(st.booleans()):
                    blocks.append({"type": "reasoning", "text": "hm", "signature": draw(st.sampled_from([None, "s"]))})
                if text:
                    blocks.append({"type": "text", "text": text})
                blocks += [{"type": "tool-call", "id": i, "name": "f", "arguments": "{}"} for i in ids]
                add("assistant/message", {"content": blocks})
            answers = list(ids)
            if noisy:
                answers = draw(st.permutations(answers))
                answers = answers[: draw(st.integers(0, len(answers)))]
                answers += draw(st.lists(st.sampled_from([*calls_made, "zz"]), max_size=2))
            for rid in answers:
                if noisy and draw(st.integers(0, 9)) == 0:
                    add("message", {"role": draw(st.sampled_from(["user", "system"])), "content": "between"})
                if draw(st.booleans()):
                    add("tool/result", {"callId": rid, "content": "r", "isError": False})
                else:
                    add("message", {"role": "tool", "content": "r", "tool_call_id": rid})
        if draw(st.booleans()):
            add("assistant/message", {"content": [{"type": "text", "text": "done"}]})
        if noisy and draw(st.integers(0, 3)) == 0:
            visible = [k for k in nodes if k >= before]
            if visible:
                i = draw(st.integers(0, len(visible) - 1))
                j = draw(st.integers(i, len(visible) - 1))
                a, b = nodes.index(visible[i]), nodes.index(visible[j])
                shadowed = nodes[a : b + 1]
                surface = Surface(
                    op=SurfaceReplace(op="replace", start=visible[i], end=visible[j]), source_event_seqs=shadowed
                )
                n = len(entries)
                add("assistant/message", {"content": [{"type": "text", "text": "replaced"}]}, surface=surface)
                nodes[a : b + 1] = [n]
        if draw(st.integers(0, 3)) == 0:
            n = len(entries)
            before = draw(st.integers(before, n))
            summary = draw(
                st.sampled_from(
                    [
                        [],
                        [{"role": "user", "content": "summary"}],
                        [{"role": "tool", "content": "r", "tool_call_id": "c_sum"}],
                        [
                            {"role": "user", "content": "s"},
                            {"role": "assistant", "content": "", "tool_calls": [call("c_sum")]},
                        ],
                    ]
                )
            )
            add("cut", {"before": before, "summary": summary, "reason": "test"}, node=False)
    return entries


# --------------------------------------------------------------------------- properties


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logs(), st.booleans())
def test_every_rendering_is_legal(log: list[Entry], pending: bool) -> None:
    messages = project(log)
    openai = to_openai(messages, allow_pending_tool_calls=pending)
    anthropic = to_anthropic(messages, allow_pending_tool_calls=pending)
    assert openai_legal(openai, allow_pending=pending), openai
    assert anthropic_legal(anthropic, allow_pending=pending), anthropic
    if not pending:
        assert openai_legal(openai) and anthropic_legal(anthropic)
    raw = openai_messages(messages)
    event("openai repaired" if openai != raw else "openai legal as projected")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logs(), st.booleans())
def test_a_legal_rendering_is_left_unchanged(log: list[Entry], pending: bool) -> None:
    messages = project(log)
    raw = openai_messages(messages)
    if openai_legal(raw, allow_pending=pending):
        event("openai legal")
        assert to_openai(messages, allow_pending_tool_calls=pending) == raw
    raw_a = raw_anthropic(messages)
    if anthropic_legal(raw_a, allow_pending=pending):
        event("anthropic legal")
        assert to_anthropic(messages, allow_pending_tool_calls=pending) == raw_a


@settings(max_examples=200, deadline=None)
@given(logs())
def test_the_repair_only_removes(log: list[Entry]) -> None:
    """Nothing is invented: every rendered tool message and call was in the projection."""
    messages = project(log)
    raw = openai_messages(messages)
    raw_calls = [c for m in raw for c in m.get("tool_calls") or ()]
    raw_tools = [m for m in raw if m["role"] == "tool"]
    out = to_openai(messages)
    assert all(c in raw_calls for m in out for c in m.get("tool_calls") or ())
    assert all(m in raw_tools for m in out if m["role"] == "tool")
    assert [m for m in out if m["role"] in ("user", "system")] == [m for m in raw if m["role"] in ("user", "system")]


# --------------------------------------------------------------------------- the repair, by example


def _chat(*msgs: dict[str, Any]) -> list[Message]:
    return project([E(i, "message", m) for i, m in enumerate(msgs)])


def test_a_cut_inside_a_tool_group_drops_the_orphan_result() -> None:
    log = [
        E(0, "message", {"role": "user", "content": "q"}),
        E(1, "message", {"role": "assistant", "content": "", "tool_calls": [call("a"), call("b")]}),
        E(2, "message", {"role": "tool", "content": "ra", "tool_call_id": "a"}),
        E(3, "message", {"role": "tool", "content": "rb", "tool_call_id": "b"}),
        E(4, "message", {"role": "assistant", "content": "done"}),
        E(5, "cut", {"before": 3, "summary": [{"role": "user", "content": "sum"}], "reason": "x"}),
    ]
    messages = project(log)
    assert [m.role for m in messages] == ["user", "tool", "assistant"]
    assert to_openai(messages) == [{"role": "user", "content": "sum"}, {"role": "assistant", "content": "done"}]
    assert to_anthropic(messages)["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "sum"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
    ]


def test_an_unanswered_call_in_the_middle_is_dropped_from_its_message() -> None:
    messages = _chat(
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me look", "tool_calls": [call("a"), call("b")]},
        {"role": "tool", "content": "ra", "tool_call_id": "a"},
        {"role": "user", "content": "stop"},
    )
    out = to_openai(messages)
    assert out[1] == {"role": "assistant", "content": "let me look", "tool_calls": [call("a")]}
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "user"]


def test_a_message_with_nothing_but_the_dropped_call_goes() -> None:
    messages = _chat(
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call("a")]},
        {"role": "user", "content": "again"},
    )
    assert to_openai(messages) == [{"role": "user", "content": "q"}, {"role": "user", "content": "again"}]
    assert to_anthropic(messages)["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "text", "text": "again"}]}
    ]


def test_pending_calls_of_the_last_message_only_when_asked() -> None:
    messages = _chat(
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call("a"), call("b")]},
        {"role": "tool", "content": "ra", "tool_call_id": "a"},
    )
    strict = to_openai(messages)
    assert strict[1]["tool_calls"] == [call("a")] and strict[2]["tool_call_id"] == "a"
    kept = to_openai(messages, allow_pending_tool_calls=True)
    assert kept[1]["tool_calls"] == [call("a"), call("b")] and kept[2]["tool_call_id"] == "a"
    assert anthropic_legal(to_anthropic(messages))
    pending = to_anthropic(messages, allow_pending_tool_calls=True)["messages"]
    assert [b["id"] for b in pending[1]["content"]] == ["a", "b"]


def test_a_system_message_between_call_and_result() -> None:
    """OpenAI wants the results right after the call; Anthropic moves system text out of the turn."""
    messages = _chat(
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "x", "tool_calls": [call("a")]},
        {"role": "system", "content": "note"},
        {"role": "tool", "content": "ra", "tool_call_id": "a"},
    )
    assert to_openai(messages) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "x"},
        {"role": "system", "content": "note"},
    ]
    request = to_anthropic(messages)
    assert request == raw_anthropic(messages) and anthropic_legal(request)


def test_nanobot_tool_messages_keep_their_name_and_list_content_through_a_legal_render() -> None:
    messages = _chat(
        {"role": "user", "content": "draw"},
        {"role": "assistant", "content": "", "tool_calls": [call("img")]},
        {"role": "tool", "content": [{"type": "text", "text": "saved"}], "tool_call_id": "img", "name": "gen"},
    )
    assert to_openai(messages) == openai_messages(messages)
