"""The projection fold: derivation rules, surface replace, cuts, snapshots, renderers (pure, no Redis)."""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from redis_session.errors import InvalidEntryError
from redis_session.model import Entry, Surface, SurfaceReplace, Vocabulary, encode_batch
from redis_session.projection import (
    Message,
    ProjectionState,
    check_surface,
    cut_messages,
    derive_message,
    needs_rebuild,
    openai_messages,
    project,
    to_anthropic,
    to_openai,
)

# --------------------------------------------------------------------------- helpers


def E(n: int, type: str, data: dict[str, Any] | None = None, surface: Surface | None = None) -> Entry:
    return Entry(n=n, time=1000 + n, type=type, data=data if data is not None else {}, surface=surface)


def rep(start: int, end: int, seqs: list[int] | None) -> Surface:
    return Surface(op=SurfaceReplace(op="replace", start=start, end=end), source_event_seqs=seqs)


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def um(n: int, t: str, surface: Surface | None = None) -> Entry:
    return E(n, "user/message", {"content": t}, surface)


def am(n: int, t: str, surface: Surface | None = None) -> Entry:
    return E(n, "assistant/message", {"content": [text(t)]}, surface)


def texts(messages: list[Message]) -> list[str]:
    return [m.text for m in messages]


def sources(messages: list[Message]) -> list[int]:
    return [m.source[0] for m in messages]


def shape(messages: list[Message]) -> list[tuple[str, tuple[Any, ...]]]:
    return [(m.role, m.content) for m in messages]


# --------------------------------------------------------------------------- derivation rules


def test_user_message_string_becomes_one_text_block() -> None:
    [m] = project([um(0, "hello")])
    assert m == Message("user", (text("hello"),), (0,))
    assert m.role == "user" and m.source == (0,)


def test_user_message_blocks_are_kept() -> None:
    blocks = [text("look"), {"type": "image", "url": "https://x/a.png", "mimeType": "image/png"}]
    [m] = project([E(0, "user/message", {"content": blocks, "source": {"kind": "cli"}})])
    assert list(m.content) == blocks


@pytest.mark.parametrize("content", ["", []])
def test_empty_assistant_message_is_skipped(content: Any) -> None:
    log = [um(0, "q"), E(1, "assistant/message", {"content": content, "usage": {"output": 0}}), am(2, "a")]
    assert sources(project(log)) == [0, 2]


def test_assistant_message_keeps_reasoning_and_tool_calls() -> None:
    blocks = [
        {"type": "reasoning", "text": "hmm", "signature": "sig"},
        text("let me check"),
        {"type": "tool-call", "id": "c1", "name": "ls", "arguments": '{"path": "."}'},
    ]
    [m] = project([E(0, "assistant/message", {"content": blocks, "turn": 1, "step": 1})])
    assert m.role == "assistant" and list(m.content) == blocks


_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_openai_tool_calls_on_an_assistant_message_project_as_tool_calls() -> None:
    """The OpenAI shape on an assistant/message used to vanish with its result."""
    log = [
        um(0, "Weather in Paris?"),
        E(1, "assistant/message", {"content": None, "tool_calls": [_CALL]}),
        E(2, "tool/result", {"callId": "call_1", "content": "18 °C"}),
        am(3, "18 °C in Paris."),
    ]
    messages = project(log)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1].content == (
        {"type": "tool-call", "id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    )
    openai = to_openai(messages)
    assert openai[1] == {"role": "assistant", "content": None, "tool_calls": [_CALL]}
    assert openai[2] == {"role": "tool", "tool_call_id": "call_1", "content": "18 °C"}
    anthropic = to_anthropic(messages)["messages"]
    assert anthropic[1] == {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}],
    }
    assert anthropic[2]["content"][0]["type"] == "tool_result"
    assert anthropic[2]["content"][0]["tool_use_id"] == "call_1"


def test_openai_tool_calls_follow_the_text_content_and_fold_incrementally_alike() -> None:
    log = [um(0, "q"), E(1, "assistant/message", {"content": "Let me look.", "tool_calls": [_CALL]})]
    state = ProjectionState()
    state.extend(log)
    assert ProjectionState.from_bytes(state.to_bytes()).messages() == project(log) == state.messages()
    assert [b["type"] for b in project(log)[1].content] == ["text", "tool-call"]


@pytest.mark.parametrize(
    ("data", "where"),
    [
        (
            {"content": None, "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": {"city": "Paris"}}}]},
            "arguments",
        ),
        ({"content": "", "tool_calls": {"id": "call_1"}}, "$.tool_calls"),
        ({"content": "", "tool_calls": [{"id": "call_1", "name": "f", "arguments": "{}"}]}, "function"),
        ({"tool_calls": []}, "needs `content` or `tool_calls`"),
        ({"content": "", "tool_calls": [_CALL, _CALL]}, "unique"),
    ],
)
def test_a_malformed_tool_calls_is_refused_showing_the_accepted_shape(data: dict[str, Any], where: str) -> None:
    with pytest.raises(InvalidEntryError) as info:
        encode_batch([("assistant/message", data)], Vocabulary())
    assert where in str(info.value)
    if where != "unique":
        assert '"tool_calls": [{"id": "call_1", "type": "function", "function": {"name":' in str(info.value)


_MALFORMED_CALLS = {
    "repeated-id": (
        {"content": None, "tool_calls": [_CALL, {**_CALL, "function": {"name": "g", "arguments": "{}"}}]},
        "unique",
    ),
    "repeated-across-block-and-tool_calls": (
        {"content": [{"type": "tool-call", "id": _CALL["id"], "name": "f", "arguments": "{}"}], "tool_calls": [_CALL]},
        "unique",
    ),
    "block-arguments-an-object": (
        {"content": [{"type": "tool-call", "id": "c1", "name": "f", "arguments": {"a": 1}}]},
        "Expected `str`, got `object`",
    ),
    "block-without-name": ({"content": [{"type": "tool-call", "id": "c1", "arguments": "{}"}]}, "`name`"),
}


@pytest.mark.parametrize("etype", ["assistant/message", "message"])
@pytest.mark.parametrize("case", list(_MALFORMED_CALLS))
def test_malformed_tool_calls_are_refused_alike_on_assistant_message_and_message(etype: str, case: str) -> None:
    """A repeated id, an object for arguments, a block without a name were written on the plain
    `message` type (role assistant) and then dropped or garbled by `to_openai`: the same rule
    (`model.check_tool_calls`) now refuses them on both types, nothing written."""
    data, where = _MALFORMED_CALLS[case]
    if etype == "message":
        data = {"role": "assistant", **data}
    with pytest.raises(InvalidEntryError) as info:
        encode_batch([(etype, data)], Vocabulary())
    assert where in str(info.value)


def test_well_formed_tool_calls_on_a_message_still_project() -> None:
    block = {"type": "tool-call", "id": "b1", "name": "f", "arguments": "{}"}
    data = {"role": "assistant", "content": [{"type": "text", "text": "x"}, block], "tool_calls": [_CALL]}
    encode_batch([("message", data)], Vocabulary())  # accepted
    [_, m] = project([um(0, "q"), E(1, "message", data)])
    assert [b["id"] for b in m.content if b["type"] == "tool-call"] == ["b1", _CALL["id"]]


def test_tool_result_becomes_a_tool_message_with_one_tool_result_block() -> None:
    [m] = project([E(0, "tool/result", {"callId": "c1", "content": [text("ok")], "isError": False})])
    assert m.role == "tool"
    assert m.content == ({"type": "tool-result", "toolCallId": "c1", "content": (text("ok"),), "isError": False},)
    [m] = project([E(0, "tool/result", {"callId": "c2", "content": "boom", "isError": True})])
    assert m.content[0]["content"] == (text("boom"),) and m.content[0]["isError"] is True


@pytest.mark.parametrize(
    ("source", "kind"),
    [("file-change", "file-change"), ({"kind": "agents-md", "path": "/x"}, "agents-md"), (None, "context")],
)
def test_context_message_is_wrapped_in_a_context_tag(source: Any, kind: str) -> None:
    [m] = project([E(0, "context/message", {"content": [text("body")], "source": source})])
    assert m.role == "user"
    assert m.content == (text(f'<context source="{kind}">'), text("body"), text("</context>"))


def test_steering_message_uses_the_steering_tag() -> None:
    [m] = project([E(0, "steering/message", {"turn": 1, "content": "go left", "source": {"kind": "user"}})])
    assert m.content == (text('<steering source="user">'), text("go left"), text("</steering>"))


def test_context_kind_is_json_quoted() -> None:
    [m] = project([E(0, "context/message", {"content": "x", "source": 'a"b'})])
    assert m.content[0]["text"] == '<context source="a\\"b">'


def test_openai_message_user_system_tool() -> None:
    log = [
        E(0, "message", {"role": "system", "content": "be brief"}),
        E(1, "message", {"role": "user", "content": "hi", "name": "alice"}),
        E(2, "message", {"role": "tool", "tool_call_id": "c1", "content": "42", "name": "calc"}),
    ]
    sys, user, tool = project(log)
    assert sys == Message("system", (text("be brief"),), (0,))
    assert user == Message("user", (text("hi"),), (1,), name="alice")
    assert tool.role == "tool" and tool.name == "calc"
    assert tool.content == ({"type": "tool-result", "toolCallId": "c1", "content": (text("42"),), "isError": False},)


def test_openai_assistant_message_becomes_reasoning_text_then_tool_calls() -> None:
    data = {
        "role": "assistant",
        "content": "checking",
        "reasoning_content": "think",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "cat", "arguments": '{"f": 1}'}},
        ],
    }
    [m] = project([E(0, "message", data)])
    assert m.content == (
        {"type": "reasoning", "text": "think"},
        text("checking"),
        {"type": "tool-call", "id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "tool-call", "id": "c2", "name": "cat", "arguments": '{"f": 1}'},
    )


@pytest.mark.parametrize("content", ["", None, []])
def test_openai_assistant_without_content_calls_or_reasoning_is_skipped(content: Any) -> None:
    log = [
        E(0, "message", {"role": "user", "content": "q"}),
        E(1, "message", {"role": "assistant", "content": content}),
    ]
    assert sources(project(log)) == [0]


def test_openai_assistant_with_only_tool_calls_is_kept() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    [m] = project([E(0, "message", {"role": "assistant", "content": None, "tool_calls": [call]})])
    assert [b["type"] for b in m.content] == ["tool-call"]


def test_openai_image_part_becomes_an_image_block() -> None:
    parts = [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": "https://x/c.png"}}]
    [m] = project([E(0, "message", {"role": "user", "content": parts})])
    assert m.content == (text("what is it"), {"type": "image", "url": "https://x/c.png"})


def test_chunks_marks_and_boundaries_never_appear() -> None:
    log = [
        E(0, "turn/start", {"turn": 1}),
        um(1, "q"),
        E(2, "step/start", {"turn": 1, "step": 1}),
        E(3, "assistant/chunk", {"turn": 1, "step": 1, "chunk": {"delta": "a"}}),
        E(4, "tool/call", {"turn": 1, "step": 1, "callId": "c", "name": "x", "arguments": "{}"}),
        E(5, "prompt", {"header": {"model": "m"}}),
        E(6, "preset/selected", {"presetId": "p"}),
        E(7, "my-plugin/thing", {"x": 1}),
        am(8, "a"),
        E(9, "step/end", {"turn": 1, "step": 1}),
        E(10, "turn/end", {"turn": 1, "reason": "completed"}),
    ]
    assert sources(project(log)) == [1, 8]
    assert derive_message(log[3]) is None and derive_message(log[1]) == project(log)[0]


# --------------------------------------------------------------------------- surface replace


def test_replace_range_by_dsh_example() -> None:
    base = [um(0, "m0"), am(1, "m1"), um(2, "m2")]
    assert sources(project([*base, am(3, "s", rep(0, 1, [0, 1]))])) == [3, 2]
    assert sources(project([*base, am(3, "s", rep(1, 1, [1]))])) == [0, 3, 2]


def test_replace_order_is_by_position_not_by_n() -> None:
    log = [E(0, "turn/start", {"turn": 1}), E(1, "prompt", {}), um(2, "m2"), am(3, "m3"), am(4, "s", rep(2, 2, [2]))]
    state = ProjectionState()
    state.extend(log)
    assert state.surface == [4, 3]
    check_surface(state, [am(5, "t", rep(4, 3, [4, 3]))], 5)  # 4 precedes 3 on the surface
    with pytest.raises(InvalidEntryError, match=r"start seq 3 \(position 1\) is after end seq 4 \(position 0\)"):
        check_surface(state, [am(5, "t", rep(3, 4, [3, 4]))], 5)
    state.apply(am(5, "t", rep(4, 3, [4, 3])))
    assert sources(state.messages()) == [5]


def test_replace_with_an_empty_assistant_message_removes_the_range() -> None:
    log = [um(0, "a"), am(1, "b"), um(2, "c"), E(3, "assistant/message", {"content": []}, rep(0, 1, [0, 1]))]
    assert sources(project(log)) == [2]


def test_a_replace_written_around_the_check_lands_as_an_append() -> None:
    log = [um(0, "a"), am(1, "b"), am(2, "bad", rep(1, 0, [0, 1])), am(3, "ghost", rep(9, 9, [1]))]
    assert sources(project(log)) == [0, 1, 2, 3]


# --------------------------------------------------------------------------- check_surface


@pytest.fixture
def three() -> ProjectionState:
    state = ProjectionState()
    state.extend([um(0, "m0"), am(1, "m1"), um(2, "m2"), E(3, "assistant/chunk", {})])
    return state


@pytest.mark.parametrize(
    ("surface", "error"),
    [
        (rep(5, 1, [1]), "start seq 5 not found in surface"),
        (rep(0, 99, [0]), "end seq 99 not found in surface"),
        (rep(3, 3, [3]), "start seq 3 not found in surface"),  # a chunk is not a surface node
        (rep(1, 0, [0, 1]), r"start seq 1 \(position 1\) is after end seq 0 \(position 0\)"),
        (rep(0, 1, None), "sourceEventSeqs must list every replaced surface node"),
        (rep(0, 1, []), "sourceEventSeqs must not be empty"),
        (rep(0, 1, [0, 1, 1]), "sourceEventSeqs must not contain duplicates"),
        (rep(0, 1, [0, 1, 4]), "sourceEventSeqs must reference earlier entries: 4 >= own n 4"),
        (rep(0, 1, [0, 1, 7]), "must reference earlier entries: 7 >= own n 4"),
        (rep(0, 1, [0, 1, -1]), "sourceEventSeqs references unknown seq -1"),
        (rep(0, 2, [0, 1]), "must include every replaced surface node; missing 2"),
        (rep(0, 2, [3, 1]), "missing 0, 2"),
    ],
)
def test_check_surface_rejects(three: ProjectionState, surface: Surface, error: str) -> None:
    with pytest.raises(InvalidEntryError, match=error) as info:
        check_surface(three, [am(4, "x", surface)], 4)
    assert info.value.index == 0


def test_check_surface_accepts_extra_earlier_sources(three: ProjectionState) -> None:
    check_surface(three, [am(4, "x", rep(0, 1, [0, 1, 3]))], 4)  # 3 is a chunk it was built from


def test_check_surface_applies_the_batch_in_order_and_leaves_the_state_alone(three: ProjectionState) -> None:
    batch = [
        E(4, "prompt", {}),
        um(5, "m5"),
        am(6, "s", rep(2, 5, [2, 5])),  # names a node appended earlier in the batch
        am(7, "t", rep(6, 6, [6])),  # and the replacement itself
        am(8, "bad", rep(2, 2, [2])),  # 2 is gone by now
    ]
    with pytest.raises(InvalidEntryError, match="start seq 2 not found") as info:
        check_surface(three, batch, 4)
    assert info.value.index == 4
    check_surface(three, batch[:4], 4)
    assert three.n == 4 and three.surface == [0, 1, 2]


def test_check_surface_on_encoded_entries(three: ProjectionState) -> None:
    vocab = Vocabulary()
    good = encode_batch(
        [("user/message", {"content": "x"}), ("assistant/message", {"content": "s"}, None, rep(0, 4, [0, 1, 2, 4]))],
        vocab,
        first_n=4,
    )
    check_surface(three, good, 4)
    bad = encode_batch([("assistant/message", {"content": "s"}, None, rep(0, 1, [0]))], vocab, first_n=4)
    with pytest.raises(InvalidEntryError, match="missing 1"):
        check_surface(three, bad, 4)


def test_check_surface_checks_append_sources(three: ProjectionState) -> None:
    check_surface(three, [am(4, "x", Surface("append", [3]))], 4)
    with pytest.raises(InvalidEntryError, match="earlier entries: 4 >= own n 4"):
        check_surface(three, [am(4, "x", Surface("append", [4]))], 4)


def test_check_surface_needs_the_state_at_first_n(three: ProjectionState) -> None:
    with pytest.raises(ValueError, match="state at n=5"):
        check_surface(three, [], 5)
    with pytest.raises(InvalidEntryError, match="n=9"):
        check_surface(three, [am(9, "x")], 4)


def test_a_replace_cannot_name_nodes_hidden_by_the_last_cut() -> None:
    state = ProjectionState()
    state.extend([um(0, "a"), am(1, "b"), um(2, "c"), E(3, "cut", {"before": 2, "summary": [], "reason": "r"})])
    with pytest.raises(InvalidEntryError, match="start seq 1 not found"):
        check_surface(state, [am(4, "x", rep(1, 2, [1, 2]))], 4)
    check_surface(state, [am(4, "x", rep(2, 2, [2]))], 4)


# --------------------------------------------------------------------------- cuts


def cut(n: int, before: int, summary: list[dict[str, Any]] | None = None, native: Any = None) -> Entry:
    data: dict[str, Any] = {"before": before, "summary": summary or [], "reason": "token_limit"}
    if native is not None:
        data["native"] = native
    return E(n, "cut", data)


def test_cut_projects_summary_then_messages_from_before() -> None:
    summary = [{"role": "system", "content": "so far: greetings"}]
    log = [um(0, "a"), am(1, "b"), um(2, "c"), am(3, "d"), cut(4, 2, summary), um(5, "e")]
    got = project(log)
    assert texts(got) == ["so far: greetings", "c", "d", "e"]
    assert got[0] == Message("system", (text("so far: greetings"),), (4,))


def test_cut_before_equal_to_its_n_keeps_only_the_summary_and_later_entries() -> None:
    log = [um(0, "a"), am(1, "b"), cut(2, 2, [{"role": "user", "content": "sum"}]), um(3, "c")]
    assert texts(project(log)) == ["sum", "c"]


def test_only_the_last_cut_counts() -> None:
    log = [um(0, "a"), am(1, "b"), um(2, "c"), cut(3, 3, [{"role": "user", "content": "S1"}])]
    log += [cut(4, 1, [{"role": "user", "content": "S2"}])]
    assert texts(project(log)) == ["S2", "b", "c"]


@pytest.mark.parametrize(
    ("native", "expected"),
    [
        ([{"role": "user", "content": "N"}], ["N"]),
        ({"messages": [{"role": "assistant", "content": "N"}], "provider": "x"}, ["N"]),
        ({"messages": [{"role": "user", "content": "N"}], "unusable": True}, ["S"]),
        ({"unusable": True, "blob": "..."}, ["S"]),
        ({"blob": "opaque provider state"}, ["S"]),
        ([{"no": "role"}], ["S"]),
        ([], ["S"]),
    ],
)
def test_cut_native_is_used_when_usable(native: Any, expected: list[str]) -> None:
    c = cut(0, 0, [{"role": "user", "content": "S"}], native)
    assert texts(list(cut_messages(c))) == expected


def test_a_malformed_native_never_breaks_the_fold() -> None:
    native = [{"role": "assistant", "content": "N", "tool_calls": ["junk", {"id": "c", "function": 3}]}]
    [m] = project([cut(0, 0, [], native)])
    assert m.content == (text("N"), {"type": "tool-call", "id": "c", "name": None, "arguments": ""})


def test_summary_messages_follow_the_message_rules() -> None:
    summary: list[dict[str, Any]] = [
        {"role": "assistant", "content": ""},  # skipped, like any empty assistant message
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "r"},
    ]
    got = project([cut(0, 0, summary)])
    assert [m.role for m in got] == ["assistant", "tool"] and all(m.source == (0,) for m in got)


def test_replace_after_a_cut_works_on_visible_nodes() -> None:
    log = [um(0, "a"), am(1, "b"), um(2, "c"), am(3, "d"), cut(4, 2, [{"role": "user", "content": "S"}])]
    log += [am(5, "cd", rep(2, 3, [2, 3]))]
    assert texts(project(log)) == ["S", "cd"]


# --------------------------------------------------------------------------- the state object


def test_apply_demands_contiguous_n() -> None:
    state = ProjectionState()
    state.apply(um(0, "a"))
    with pytest.raises(ValueError, match="expects entry n=1, got n=2"):
        state.apply(um(2, "b"))
    assert state.n == 1
    with pytest.raises(ValueError, match="expects entry n=2, got n=5"):
        state.extend([am(1, "b"), um(5, "c")])
    assert state.n == 2 and texts(state.messages()) == ["a", "b"]
    with pytest.raises(ValueError):
        project([um(1, "starts late")])


def test_messages_is_a_new_list_of_shared_immutable_messages() -> None:
    state = ProjectionState()
    state.extend([E(0, "user/message", {"content": [text("a"), {"type": "x", "nested": {"k": [1, 2]}}]})])
    first, second = state.messages(), state.messages()
    assert first == second and first is not second and first[0] is second[0]
    first.append(first[0])
    assert len(state.messages()) == 1
    m = first[0]
    with pytest.raises(TypeError):
        m.content[0]["text"] = "changed"  # type: ignore[index]
    with pytest.raises(TypeError):
        m.content[1]["nested"]["k"] = 3
    with pytest.raises(AttributeError):
        m.content[1]["nested"]["k"].append(3)
    with pytest.raises(AttributeError):
        m.role = "system"  # type: ignore[misc]
    assert isinstance(m.content, tuple) and hash(m) == hash(copy.deepcopy(m))


def test_messages_do_not_alias_the_log() -> None:
    data = {"content": [text("a")]}
    entry = E(0, "user/message", data)
    [m] = project([entry])
    data["content"][0]["text"] = "mutated after the fold"
    assert m.text == "a"


def test_message_constructor_freezes_and_normalises() -> None:
    m = Message("user", [{"type": "text", "text": "x", "meta": {"a": [1]}}], [3])  # type: ignore[arg-type]
    assert m.source == (3,) and isinstance(m.content, tuple) and m.content[0]["meta"]["a"] == (1,)
    assert Message("user", "plain", (0,)) == Message("user", (text("plain"),), (0,))  # type: ignore[arg-type]


def test_copy_is_independent() -> None:
    state = ProjectionState()
    state.extend([um(0, "a"), am(1, "b")])
    other = state.copy()
    other.apply(am(2, "c", rep(0, 1, [0, 1])))
    state.apply(um(2, "z"))
    assert texts(state.messages()) == ["a", "b", "z"] and texts(other.messages()) == ["c"]


def test_generation_and_needs_rebuild() -> None:
    state = ProjectionState()
    appends = [um(0, "a"), am(1, "b"), E(2, "assistant/chunk", {})]
    state.extend(appends)
    assert state.generation == 0 and not any(needs_rebuild(e) for e in appends)
    r = am(3, "s", rep(0, 1, [0, 1]))
    state.apply(r)
    assert needs_rebuild(r) and state.generation == 1
    c = cut(4, 4)
    state.apply(c)
    assert needs_rebuild(c) and state.generation == 2 and state.last_cut == 4
    enc = encode_batch([("cut", {"before": 0, "summary": [], "reason": "r"})], Vocabulary(), first_n=5)
    assert needs_rebuild(enc[0])


def test_snapshot_round_trip_continues_like_a_fresh_fold() -> None:
    log = [um(0, "a"), am(1, "b"), cut(2, 1, [{"role": "system", "content": "S"}]), um(3, "c")]
    state = ProjectionState()
    state.extend(log)
    blob = state.to_bytes()
    json.loads(blob)  # plain JSON, readable in redis-cli
    loaded = ProjectionState.from_bytes(blob)
    assert loaded.n == 4 and loaded.messages() == state.messages() and loaded.generation == state.generation
    more = [am(4, "d", rep(3, 3, [3])), um(5, "e")]
    loaded.extend(more)
    assert loaded.messages() == project(log + more)
    with pytest.raises(TypeError):
        loaded.messages()[0].content[0]["text"] = "x"  # type: ignore[index]


def _recrc(body: bytes) -> bytes:
    import zlib

    return b'{"crc":"%08x",' % zlib.crc32(body) + body[1:]


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"garbage",
        b"{}",
        b'{"crc":"zzzzzzzz","v":1}',
        b'{"crc":"00000000","v":1}',
        "not bytes",
        12,
    ],
)
def test_from_bytes_rejects_garbage(blob: Any) -> None:
    with pytest.raises(ValueError):
        ProjectionState.from_bytes(blob)


def test_from_bytes_rejects_every_damaged_byte() -> None:
    state = ProjectionState()
    state.extend([um(0, "hello"), am(1, "world"), cut(2, 1)])
    blob = state.to_bytes()
    for i in range(len(blob)):
        damaged = blob[:i] + bytes([blob[i] ^ 0x01]) + blob[i + 1 :]
        with pytest.raises(ValueError):
            ProjectionState.from_bytes(damaged)
    with pytest.raises(ValueError):
        ProjectionState.from_bytes(blob[:-1])


@pytest.mark.parametrize(
    "change",
    [
        {"v": 1},
        {"v": 3},
        {"n": 1},
        {"nodes": [0, 0]},
        {"msgs": [None]},
        {"cut": 5},
        {"before": 3},
        {"floor": 2},
        {"generation": -1},
        {"extra": 1},
    ],
)
def test_from_bytes_rejects_inconsistent_snapshots_with_a_valid_crc(change: dict[str, Any]) -> None:
    state = ProjectionState()
    state.extend([um(0, "a"), am(1, "b"), cut(2, 1)])
    body = json.loads(state.to_bytes())
    del body["crc"]
    body.update(change)
    with pytest.raises(ValueError):
        ProjectionState.from_bytes(_recrc(json.dumps(body).encode()))
    body = json.loads(state.to_bytes())
    del body["crc"]
    assert ProjectionState.from_bytes(_recrc(json.dumps(body).encode())).messages() == state.messages()


@pytest.mark.parametrize("content", [["str"], [1], [[1]], {"type": "text"}, [{"type": "text", "text": "x"}]])
def test_from_bytes_checks_message_content(content: Any) -> None:
    state = ProjectionState()
    state.extend([um(0, "a")])
    body = json.loads(state.to_bytes())
    del body["crc"]
    body["msgs"][0]["content"] = content
    blob = _recrc(json.dumps(body).encode())
    if content == [{"type": "text", "text": "x"}]:
        [m] = ProjectionState.from_bytes(blob).messages()
        assert m.text == "x"
        with pytest.raises(TypeError):
            m.content[0]["text"] = "y"  # type: ignore[index]
    else:
        with pytest.raises(ValueError):
            ProjectionState.from_bytes(blob)


def test_from_bytes_rejects_a_message_from_another_node() -> None:
    # A snapshot stores no source: a node's message comes from its node. A row naming one is foreign.
    state = ProjectionState()
    state.extend([um(0, "a"), am(1, "b")])
    body = json.loads(state.to_bytes())
    del body["crc"]
    body["msgs"][0]["source"] = [1]
    with pytest.raises(ValueError, match="source"):
        ProjectionState.from_bytes(_recrc(json.dumps(body).encode()))


def _nested_log() -> list[Entry]:
    """Messages with flat blocks, nested blocks (tool results, a provider part) and a cut summary."""
    part = {"type": "x-part", "meta": {"k": [1, {"deep": True}]}}
    return [
        um(0, "q"),
        E(1, "assistant/message", {"content": [text("a"), {"type": "reasoning", "text": "r", "signature": "s"}]}),
        E(2, "tool/result", {"callId": "c1", "content": [text("out"), text("more")], "isError": False}),
        E(3, "user/message", {"content": [text("look"), part]}),
        E(4, "message", {"role": "tool", "tool_call_id": "c2", "content": "plain", "name": "fn"}),
        cut(5, 1, [{"role": "system", "content": "S"}]),
        E(6, "tool/result", {"callId": "c3", "content": "x", "isError": True}),
        am(7, "done"),
    ]


def test_snapshot_layout_is_readable_and_keeps_flat_blocks_apart() -> None:
    state = ProjectionState()
    state.extend(_nested_log())
    body = json.loads(state.to_bytes())
    assert body["v"] == 2 and list(body)[:2] == ["crc", "v"]
    rows = dict(zip(body["nodes"], body["msgs"], strict=True))
    assert rows[0] == {"role": "user", "content": [text("q")]}
    assert rows[2] == {
        "role": "tool",
        "result": {"toolCallId": "c1", "content": [text("out"), text("more")], "isError": False},
    }
    assert list(rows[3]) == ["role", "nested"] and rows[3]["nested"][1]["meta"] == {"k": [1, {"deep": True}]}
    assert list(rows[4]) == ["role", "result", "name"] and rows[4]["result"]["content"] == [text("plain")]
    assert body["summary"] == [{"role": "system", "content": [text("S")]}]


def test_nested_blocks_round_trip_frozen() -> None:
    log = _nested_log()
    state = ProjectionState()
    state.extend(log)
    loaded = ProjectionState.from_bytes(state.to_bytes())
    assert loaded.messages() == state.messages() == project(log)
    assert [m.source for m in loaded.messages()] == [m.source for m in project(log)]
    by_source = {m.source: m for m in loaded.messages()}
    result = by_source[(2,)].content[0]
    assert result["content"] == (text("out"), text("more"))
    with pytest.raises(TypeError):
        result["content"][0]["text"] = "y"
    m3 = by_source[(3,)]
    assert m3.content[1]["meta"]["k"] == (1, {"deep": True})
    with pytest.raises(TypeError):
        m3.content[1]["meta"]["k"][1]["deep"] = False
    assert hash(m3) == hash(next(m for m in project(log) if m.source == (3,)))


@pytest.mark.parametrize(
    "row",
    [
        {"role": "user", "content": [{"type": "x", "k": [1]}]},  # a nested value among flat blocks
        {"role": "user", "content": [{"type": "x", "k": {"a": 1}}]},
        {"role": "user", "content": [text("a")], "nested": [text("b")]},
        {
            "role": "tool",
            "result": {"toolCallId": "c", "content": [text("a")], "isError": False},
            "nested": [text("b")],
        },
        {
            "role": "tool",
            "result": {"toolCallId": "c", "content": [text("a")], "isError": False},
            "content": [text("b")],
        },
        {"role": "tool", "result": {"toolCallId": "c", "content": [{"type": "x", "k": [1]}], "isError": False}},
        {"role": "tool", "result": {"toolCallId": 1, "content": [], "isError": False}},
        {"role": "tool", "result": {"toolCallId": "c", "content": []}},
        {"role": "user", "nested": {"type": "text"}},
        {"role": "robot", "content": [text("a")]},
        {"role": "user", "content": [text("a")], "name": 3},
    ],
)
def test_from_bytes_checks_stored_rows(row: dict[str, Any]) -> None:
    state = ProjectionState()
    state.extend([um(0, "a")])
    body = json.loads(state.to_bytes())
    del body["crc"]
    body["msgs"][0] = row
    with pytest.raises(ValueError):
        ProjectionState.from_bytes(_recrc(json.dumps(body).encode()))


def test_odd_blocks_from_a_native_cut_round_trip() -> None:
    # `native` is not schema-checked: its content parts may be anything; the snapshot keeps them.
    native = [{"role": "user", "content": [1, [2, {"a": 3}], "s", {"type": "x", "y": [4]}]}]
    log = [um(0, "a"), cut(1, 1, native=native), am(2, "b")]
    state = _fold(log)
    assert state.messages()[0].content[:2] == (1, (2, {"a": 3}))
    loaded = ProjectionState.from_bytes(state.to_bytes())
    assert loaded.messages() == project(log) and loaded.to_bytes() == state.to_bytes()


def test_from_bytes_refuses_the_old_format() -> None:
    v1 = {
        "v": 1,
        "n": 1,
        "floor": 0,
        "nodes": [0],
        "msgs": [{"role": "user", "content": [text("a")], "source": [0]}],
        "cut": None,
        "before": 0,
        "summary": [],
        "generation": 0,
    }
    with pytest.raises(ValueError, match="version 1"):
        ProjectionState.from_bytes(_recrc(json.dumps(v1).encode()))


def test_snapshot_after_load_extend_and_replace_matches_a_fresh_one() -> None:
    # The state remembers which loaded rows were `result` or `nested`, so to_bytes classifies only
    # new messages: whatever it remembers, the bytes are those of a fresh fold.
    log = _nested_log()
    more = [
        E(8, "tool/result", {"callId": "c4", "content": [text("t")], "isError": False}),
        am(9, "s", rep(6, 8, [6, 7, 8])),  # replaces tool results and a flat node with a flat one
        E(10, "user/message", {"content": [{"type": "x", "v": [1]}]}, rep(9, 9, [9])),
        E(11, "tool/result", {"callId": "c5", "content": [{"type": "x", "v": {"w": 1}}], "isError": False}),
    ]
    state = ProjectionState.from_bytes(_fold(log).to_bytes())
    for e in more:
        copy_ = state.copy()
        state.apply(e)
        assert state.to_bytes() == _fold(log + more[: e.n - 7]).to_bytes()
        assert copy_.to_bytes() == _fold(log + more[: e.n - 8]).to_bytes()
    assert ProjectionState.from_bytes(state.to_bytes()).messages() == project(log + more)


def _fold(entries: list[Entry]) -> ProjectionState:
    state = ProjectionState()
    state.extend(entries)
    return state


# --------------------------------------------------------------------------- rebuilding from a cut


def test_from_cut_equals_the_full_fold() -> None:
    log = [um(0, "a"), am(1, "b"), um(2, "c"), am(3, "d", rep(2, 2, [2])), am(4, "e")]
    log += [cut(5, 2, [{"role": "system", "content": "S"}]), um(6, "f"), am(7, "g", rep(4, 6, [4, 6]))]
    assert texts(project(log)) == ["S", "d", "g"]
    state = ProjectionState.from_cut(log[5], log[2:5])
    assert state.n == 6
    state.extend(log[6:])
    assert state.messages() == project(log)
    assert ProjectionState.from_bytes(state.to_bytes()).messages() == project(log)


def test_from_cut_with_before_equal_to_n_needs_no_window() -> None:
    log = [um(0, "a"), am(1, "b"), cut(2, 2, [{"role": "user", "content": "S"}]), um(3, "c")]
    state = ProjectionState.from_cut(log[2])
    state.extend(log[3:])
    assert state.messages() == project(log)


def test_from_cut_checks_its_window() -> None:
    log = [um(0, "a"), am(1, "b"), um(2, "c"), cut(3, 1)]
    with pytest.raises(ValueError, match="stop at n=2"):
        ProjectionState.from_cut(log[3], log[1:2])
    with pytest.raises(ValueError, match="expects entry n=1"):
        ProjectionState.from_cut(log[3], log[0:3])
    with pytest.raises(ValueError, match="needs a cut"):
        ProjectionState.from_cut(log[0])


def test_from_cut_refuses_a_window_replace_that_names_older_history() -> None:
    # [0,1,2,3]; 4 puts a node where 0 was: [4,1,2,3]; a cut at 5 keeps n >= 2, so the projection
    # is [4,2,3] — but from entries 2..4 alone, nothing says 4 sits before 2.
    log = [um(0, "a"), am(1, "b"), um(2, "c"), am(3, "d"), am(4, "s", rep(0, 0, [0])), cut(5, 2)]
    assert sources(project(log)) == [4, 2, 3]
    with pytest.raises(ValueError, match="fold the log from 0"):
        ProjectionState.from_cut(log[5], log[2:5])


def test_a_cut_below_the_rebuilt_floor_needs_a_full_fold() -> None:
    log = [um(0, "a"), am(1, "b"), um(2, "c"), cut(3, 2), cut(4, 0)]
    state = ProjectionState.from_cut(log[3], log[2:3])
    with pytest.raises(ValueError, match="fold the log from 0"):
        state.apply(log[4])
    assert state.n == 4
    assert texts(project(log)) == ["a", "b", "c"]


def test_from_cut_tolerates_an_older_cut_in_its_window() -> None:
    log = [um(0, "a"), am(1, "b"), um(2, "c"), cut(3, 0), am(4, "d"), cut(5, 2), um(6, "e")]
    state = ProjectionState.from_cut(log[5], log[2:5])
    state.extend(log[6:])
    assert state.messages() == project(log)


def test_replace_naming_hidden_node_after_cut_agrees_between_full_and_rebuilt() -> None:
    log = [um(0, "a"), am(1, "b"), um(2, "c"), cut(3, 2), am(4, "x", rep(0, 2, [0, 1, 2]))]
    state = ProjectionState.from_cut(log[3], log[2:3])
    state.extend(log[4:])
    assert state.messages() == project(log)
    assert sources(project(log)) == [2, 4]


# --------------------------------------------------------------------------- renderers


def tutorial_log() -> list[Entry]:
    call = {"type": "tool-call", "id": "call_1", "name": "run_bash", "arguments": '{"cmd": "echo 1+1 | bc"}'}
    return [
        E(0, "turn/start", {"turn": 1}),
        um(1, "1+1 等于多少?"),
        E(2, "step/start", {"turn": 1, "step": 1}),
        E(3, "assistant/chunk", {"chunk": {"delta": "x"}}),
        E(4, "assistant/message", {"turn": 1, "step": 1, "content": [call]}),
        E(5, "tool/result", {"turn": 1, "step": 1, "callId": "call_1", "content": [text("2")], "isError": False}),
        E(6, "step/end", {"turn": 1, "step": 1}),
        E(7, "assistant/message", {"turn": 1, "step": 2, "content": [text("答案是 2")]}),
        E(8, "turn/end", {"turn": 1, "reason": "completed"}),
    ]


def test_to_openai_tutorial_order() -> None:
    assert to_openai(project(tutorial_log())) == [
        {"role": "user", "content": "1+1 等于多少?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "run_bash", "arguments": '{"cmd": "echo 1+1 | bc"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        {"role": "assistant", "content": "答案是 2"},
    ]


def test_to_openai_round_trips_openai_messages() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q", "name": "bob"},
        {
            "role": "assistant",
            "content": "thinking aloud",
            "reasoning_content": "r",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "assistant", "content": "done"},
    ]
    log = [E(i, "message", m) for i, m in enumerate(msgs)]
    assert to_openai(project(log)) == msgs


def test_to_openai_images_and_structured_results() -> None:
    img = {"type": "image", "data": "QUJD", "mimeType": "image/png"}
    log = [
        E(0, "user/message", {"content": [text("see"), img, {"type": "image", "url": "https://x/y.jpg"}]}),
        E(1, "tool/result", {"callId": "c", "content": [text("a"), text("b")], "isError": False}),
        E(2, "tool/result", {"callId": "d", "content": [img], "isError": True}),
    ]
    user, r1, r2 = openai_messages(project(log))  # the conversion; orphan results are to_openai's to drop
    assert user == {
        "role": "user",
        "content": [
            {"type": "text", "text": "see"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
            {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}},
        ],
    }
    assert r1 == {"role": "tool", "tool_call_id": "c", "content": "a\nb"}
    assert r2["tool_call_id"] == "d" and json.loads(r2["content"]) == [img]


def test_to_openai_output_is_plain_and_mutable() -> None:
    out = to_openai(project([E(0, "user/message", {"content": [text("a"), {"type": "file", "file": {"id": "f"}}]})]))
    out[0]["content"][1]["file"]["id"] = "changed"
    assert type(out[0]["content"][1]["file"]) is dict
    msgspec.json.encode(out)


def test_to_anthropic_tools_system_and_merging() -> None:
    log = [
        E(0, "message", {"role": "system", "content": "sys"}),
        *tutorial_log()[1:6],
        E(6, "context/message", {"content": "file changed", "source": "fs"}),
        E(7, "assistant/message", {"content": [{"type": "reasoning", "text": "r", "signature": "s"}, text("ok")]}),
        E(8, "assistant/message", {"content": [{"type": "reasoning", "text": "unsigned"}, text("more")]}),
    ]
    out = to_anthropic(project(log))
    assert out["system"] == "sys"
    assert out["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "1+1 等于多少?"}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "call_1", "name": "run_bash", "input": {"cmd": "echo 1+1 | bc"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "2"}]},
                {"type": "text", "text": '<context source="fs">'},
                {"type": "text", "text": "file changed"},
                {"type": "text", "text": "</context>"},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "r", "signature": "s"},
                {"type": "text", "text": "ok"},
                {"type": "text", "text": "more"},
            ],
        },
    ]


def test_to_anthropic_puts_tool_results_first_and_flags_errors() -> None:
    call = {"type": "tool-call", "id": "c", "name": "f", "arguments": "not json"}
    log = [
        um(0, "q"),
        E(1, "assistant/message", {"content": [call]}),
        E(2, "steering/message", {"content": "hurry", "source": "user"}),
        E(3, "tool/result", {"callId": "c", "content": "failed", "isError": True}),
        E(4, "user/message", {"content": [{"type": "image", "url": "data:image/gif;base64,R0lG"}]}),
    ]
    out = to_anthropic(project(log))
    assert out["system"] is None
    assistant, user = out["messages"][1:]
    assert assistant["content"][0]["input"] == {"_raw_arguments": "not json"}
    assert [b["type"] for b in user["content"]] == ["tool_result", "text", "text", "text", "image"]
    assert user["content"][0] == {
        "type": "tool_result",
        "tool_use_id": "c",
        "content": [{"type": "text", "text": "failed"}],
        "is_error": True,
    }
    assert user["content"][-1]["source"] == {"type": "base64", "media_type": "image/gif", "data": "R0lG"}


# --------------------------------------------------------------------------- properties

CHAT_ROLES = ["system", "user", "assistant", "tool"]


def _reference(entries: list[Entry]) -> list[Message]:
    """An independent, naive fold: the rules of docs/design.md §6 written as directly as possible."""
    nodes: list[tuple[int, Message | None]] = []
    last_cut: Entry | None = None
    for e in entries:
        if e.type == "cut":
            last_cut = e
            continue
        if e.type not in {
            "user/message",
            "assistant/message",
            "tool/result",
            "context/message",
            "steering/message",
            "message",
        }:
            continue
        msg = derive_message(e)
        before = last_cut.data["before"] if last_cut else 0
        op = e.surface.op if e.surface else "append"
        ns = [k for k, _ in nodes]
        if isinstance(op, SurfaceReplace) and op.start in ns and op.end in ns:
            i, j = ns.index(op.start), ns.index(op.end)
            if i <= j and op.start >= before and op.end >= before:
                nodes[i : j + 1] = [(e.n, msg)]
                continue
        nodes.append((e.n, msg))
    before = last_cut.data["before"] if last_cut else 0
    front = list(cut_messages(last_cut)) if last_cut else []
    return front + [m for k, m in nodes if k >= before and m is not None]


_texts = st.text(alphabet="abcxyz ", max_size=6)
_summary = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": _texts}), max_size=2
)


@st.composite
def logs(draw: st.DrawFn, max_size: int = 30, cuts: bool = True, marks: bool = True) -> list[Entry]:
    """Random logs of every entry kind, with only valid replaces (as check_surface would allow)."""
    entries: list[Entry] = []
    nodes: list[int] = []  # the surface, in position order
    before = 0
    kinds = ["user", "assistant", "tool", "context", "steering", "chat", "replace", "replace"]
    if marks:
        kinds += ["chunk", "chunk", "mark", "turn"]
    if cuts:
        kinds += ["cut"]
    for n in range(draw(st.integers(0, max_size))):
        kind = draw(st.sampled_from(kinds))
        visible = [k for k in nodes if k >= before]
        if kind == "replace" and not visible:
            kind = "user"
        surface = None
        if kind == "replace":
            i = draw(st.integers(0, len(visible) - 1))
            j = draw(st.integers(i, len(visible) - 1))
            a, b = nodes.index(visible[i]), nodes.index(visible[j])
            shadowed = nodes[a : b + 1]
            extra = draw(st.lists(st.integers(0, n - 1), max_size=2)) if n else []
            seqs = list(dict.fromkeys(shadowed + extra))
            surface = rep(visible[i], visible[j], seqs)
            nodes[a : b + 1] = [n]
            kind = draw(st.sampled_from(["assistant", "user", "context", "empty"]))
        elif kind in ("user", "assistant", "tool", "context", "steering", "chat"):
            nodes.append(n)
        if kind == "user":
            e = E(n, "user/message", {"content": draw(_texts)}, surface)
        elif kind == "assistant":
            adata: dict[str, Any] = {
                "content": draw(st.sampled_from([[], ""]))
                if draw(st.booleans()) and n % 3 == 0
                else [text(draw(_texts))]
            }
            if draw(st.booleans()) and n % 2 == 0:  # OpenAI-shaped calls, answered by the `tool` kind's c<n>
                adata["tool_calls"] = [
                    {"id": f"c{n + 1}", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                ]
            e = E(n, "assistant/message", adata, surface)
        elif kind == "empty":
            e = E(n, "assistant/message", {"content": []}, surface)
        elif kind == "tool":
            e = E(n, "tool/result", {"callId": f"c{n}", "content": draw(_texts), "isError": draw(st.booleans())})
        elif kind == "context":
            e = E(
                n,
                "context/message",
                {"content": draw(_texts), "source": draw(st.sampled_from(["fs", {"kind": "k"}, None]))},
                surface,
            )
        elif kind == "steering":
            e = E(n, "steering/message", {"content": draw(_texts), "source": "user", "turn": 1})
        elif kind == "chat":
            role = draw(st.sampled_from(CHAT_ROLES))
            data: dict[str, Any] = {"role": role, "content": draw(_texts)}
            if role == "assistant" and draw(st.booleans()):
                data["tool_calls"] = [{"id": f"t{n}", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
            if role == "tool":
                data["tool_call_id"] = f"t{n}"
            e = E(n, "message", data)
        elif kind == "chunk":
            e = E(n, "assistant/chunk", {"chunk": {"delta": draw(_texts)}})
        elif kind == "mark":
            e = E(
                n, draw(st.sampled_from(["prompt", "preset/selected", "todo/write", "x/custom"])), {"k": draw(_texts)}
            )
        elif kind == "turn":
            e = E(
                n, draw(st.sampled_from(["turn/start", "turn/end", "step/start", "step/end"])), {"turn": 1, "step": 1}
            )
        else:
            before = draw(st.integers(0, n))
            native = draw(st.sampled_from([None, [{"role": "user", "content": "native"}], {"unusable": True}]))
            e = cut(n, before, draw(_summary), native)
        entries.append(e)
    return entries


def _fold_in_batches(entries: list[Entry], cuts: list[int], roundtrip: bool) -> ProjectionState:
    state = ProjectionState()
    prev = 0
    for k in [*sorted(cuts), len(entries)]:
        state.extend(entries[prev:k])
        prev = k
        state = ProjectionState.from_bytes(state.to_bytes()) if roundtrip else state.copy()
    return state


@settings(max_examples=300, deadline=None)
@given(logs(), st.lists(st.integers(0, 30), max_size=5), st.booleans())
def test_incremental_fold_equals_fold_from_scratch(entries: list[Entry], splits: list[int], roundtrip: bool) -> None:
    expected = project(entries)
    assert expected == _reference(entries)
    splits = [min(s, len(entries)) for s in splits]
    state = _fold_in_batches(entries, splits, roundtrip)
    assert state.n == len(entries) and state.messages() == expected
    one_by_one = ProjectionState()
    for e in entries:
        one_by_one.apply(e)
        assert one_by_one.messages() == project(entries[: e.n + 1])


@settings(max_examples=200, deadline=None)
@given(logs(), st.lists(st.integers(0, 30), max_size=5))
def test_snapshot_bytes_do_not_depend_on_how_the_state_was_built(entries: list[Entry], splits: list[int]) -> None:
    splits = [min(s, len(entries)) for s in splits]
    fresh = ProjectionState()
    fresh.extend(entries)
    assert _fold_in_batches(entries, splits, roundtrip=True).to_bytes() == fresh.to_bytes()


@settings(max_examples=200, deadline=None)
@given(logs(), st.integers(0, 30))
def test_snapshot_mid_way_then_continue(entries: list[Entry], k: int) -> None:
    k = min(k, len(entries))
    state = ProjectionState()
    state.extend(entries[:k])
    loaded = ProjectionState.from_bytes(state.to_bytes())
    assert loaded.messages() == state.messages()
    loaded.extend(entries[k:])
    assert loaded.messages() == project(entries)


@settings(max_examples=200, deadline=None)
@given(logs())
def test_every_generated_entry_passes_check_surface(entries: list[Entry]) -> None:
    state = ProjectionState()
    for e in entries:
        check_surface(state, [e], e.n)
        state.apply(e)


def _renumber(entries: list[Entry], inserted_before: list[int]) -> list[Entry]:
    """Insert one mark before each old position in `inserted_before`, remapping every n reference."""
    out: list[Entry] = []
    new_n: dict[int, int] = {}
    for e in entries:
        for _ in range(inserted_before.count(e.n)):
            out.append(E(len(out), "x/mark", {"m": True}))
        new_n[e.n] = len(out)
        out.append(e)
    for _ in range(inserted_before.count(len(entries))):
        out.append(E(len(out), "x/mark", {}))
    fixed: list[Entry] = []
    for i, e in enumerate(out):
        data, surface = e.data, e.surface
        if e.type == "cut":
            data = {**data, "before": new_n[data["before"]] if data["before"] in new_n else i}
        if surface is not None:
            seqs = [new_n[s] for s in surface.source_event_seqs or []]
            op = surface.op
            if isinstance(op, SurfaceReplace):
                op = SurfaceReplace(op="replace", start=new_n[op.start], end=new_n[op.end])
            surface = Surface(op, seqs)
        fixed.append(msgspec.structs.replace(e, n=i, data=data, surface=surface))
    return fixed


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logs(), st.lists(st.integers(0, 30), max_size=6))
def test_inserting_marks_never_changes_the_messages(entries: list[Entry], where: list[int]) -> None:
    where = [min(w, len(entries)) for w in where]
    marked = _renumber(entries, where)
    assert shape(project(marked)) == shape(project(entries))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(logs(cuts=False), st.integers(0, 30), st.integers(0, 30), _summary)
def test_a_cut_gives_its_summary_then_the_messages_from_before(
    entries: list[Entry], k: int, b: int, summary: list[dict[str, Any]]
) -> None:
    k = min(k, len(entries))
    b = min(b, k)
    # a replace after the cut may only name visible nodes (the rule check_surface enforces)
    for e in entries[k:]:
        if e.surface is not None and isinstance(e.surface.op, SurfaceReplace):
            assume(e.surface.op.start >= b and e.surface.op.end >= b)
    shifted = [
        msgspec.structs.replace(
            e,
            n=e.n + 1,
            surface=None
            if e.surface is None
            else Surface(
                SurfaceReplace(
                    op="replace",
                    start=e.surface.op.start + (e.surface.op.start >= k),
                    end=e.surface.op.end + (e.surface.op.end >= k),
                )
                if isinstance(e.surface.op, SurfaceReplace)
                else "append",
                [s + (s >= k) for s in e.surface.source_event_seqs or []],
            ),
        )
        for e in entries[k:]
    ]
    with_cut = [*entries[:k], cut(k, b, summary), *shifted]
    expected = [m for m in project(entries) if m.source[0] >= b]
    got = project(with_cut)
    front = list(cut_messages(with_cut[k]))
    assert shape(got) == shape(front) + shape(expected)
    assert [m.source for m in got[: len(front)]] == [(k,)] * len(front)


@settings(max_examples=300, deadline=None)
@given(logs(max_size=40))
def test_rebuilding_from_the_last_cut_is_exact_or_refuses(entries: list[Entry]) -> None:
    cut_ns = [e.n for e in entries if e.type == "cut"]
    assume(cut_ns)
    c = entries[cut_ns[-1]]
    before = c.data["before"]
    window = entries[before : c.n]
    reaches_back = any(
        e.surface is not None
        and isinstance(e.surface.op, SurfaceReplace)
        and min(e.surface.op.start, e.surface.op.end) < before
        for e in window
    )
    try:
        state = ProjectionState.from_cut(c, window)
        state.extend(entries[c.n + 1 :])
    except ValueError:
        assert reaches_back
        event("refused: a window replace names older history")
        return
    event("rebuilt from the cut")
    assert state.messages() == project(entries)
    assert ProjectionState.from_bytes(state.to_bytes()).messages() == project(entries)
