"""Request headers: canonical form, diff/apply/fold (dsh), prompt digest and reconstruct_request (ChatLuna)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redis_session.errors import InvalidEntryError
from redis_session.model import Entry
from redis_session.projection import project
from redis_session.projection.request import (
    apply_header_delta,
    canonical_header,
    diff_header,
    fold_request_header,
    header_entry,
    prompt_digest,
    reconstruct_request,
)

CONFIG = {"model": "deepseek-chat", "temperature": 0.2}


def H(system: str | None = None, tools: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    h: dict[str, Any] = {"config": CONFIG, **extra}
    if system is not None:
        h["system"] = system
    if tools is not None:
        h["tools"] = tools
    return h


def tool(name: str, desc: str = "d") -> dict[str, Any]:
    return {"name": name, "description": desc, "parameters": {"type": "object"}}


def E(n: int, type: str, data: dict[str, Any]) -> Entry:
    return Entry(n=n, time=0, type=type, data=data)


# --------------------------------------------------------------------------- canonical form


def test_canonical_header_drops_empty_fields_without_touching_the_input() -> None:
    h: dict[str, Any] = {"config": CONFIG, "system": "", "tools": [], "messagePrefix": [], "prelude": []}
    h |= {"x": None, "y": 0}
    assert canonical_header(h) == {"config": CONFIG, "y": 0}
    assert h["system"] == "" and h["tools"] == []
    assert canonical_header(H("sys", [tool("a")])) == H("sys", [tool("a")])


# --------------------------------------------------------------------------- diff


def test_diff_system_keeps_common_lines() -> None:
    delta = diff_header(H("k1\nold\nk2\nk3"), H("k1\nA\nB\nk2\nk3"))
    assert delta == {"system": {"keepStart": 1, "keepEnd": 2, "insert": ["A", "B"]}}


def test_diff_system_from_and_to_none() -> None:
    assert diff_header(H(), H("x\ny")) == {"system": {"keepStart": 0, "keepEnd": 0, "insert": ["x", "y"]}}
    assert diff_header(H("x\ny"), H()) == {"system": {"keepStart": 0, "keepEnd": 0, "insert": []}}
    assert apply_header_delta(H("x\ny"), {"system": {"keepStart": 0, "keepEnd": 0, "insert": []}}) == H()


def test_diff_system_prefix_and_suffix_do_not_overlap() -> None:
    delta = diff_header(H("a\na"), H("a\na\na"))
    assert delta == {"system": {"keepStart": 2, "keepEnd": 0, "insert": ["a"]}}
    assert apply_header_delta(H("a\na"), delta) == H("a\na\na")


def test_diff_tools_by_name() -> None:
    old = H(tools=[tool("read"), tool("write"), tool("ls")])
    new = H(tools=[tool("read", "changed"), tool("ls"), tool("grep")])
    delta = diff_header(old, new)
    assert delta == {"tools": {"added": [tool("grep")], "removed": ["write"], "changed": [tool("read", "changed")]}}
    assert apply_header_delta(old, delta) == new


def test_diff_tools_by_openai_function_name() -> None:
    def fn(name: str, desc: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "description": desc}}

    old, new = H(tools=[fn("a", "1"), fn("b", "1")]), H(tools=[fn("a", "2")])
    delta = diff_header(old, new)
    assert delta == {"tools": {"added": [], "removed": ["b"], "changed": [fn("a", "2")]}}
    assert apply_header_delta(old, delta) == new


def test_config_and_prefix_are_replaced_whole() -> None:
    other = {"model": "deepseek-reasoner"}
    assert diff_header(H(), {"config": other}) == {"config": other}
    prefix = [{"role": "user", "content": [{"type": "text", "text": "AGENTS.md"}]}]
    delta = diff_header(H(), H(messagePrefix=prefix))
    assert delta == {"messagePrefix": prefix}
    assert diff_header(H(messagePrefix=prefix), H()) == {"messagePrefix": []}
    assert apply_header_delta(H(messagePrefix=prefix), {"messagePrefix": []}) == H()


def test_equal_headers_give_none() -> None:
    assert diff_header(H("s", [tool("a")]), H("s", [tool("a")])) is None
    assert diff_header(H(""), H(None, [])) is None


def test_tool_reordering_does_not_round_trip() -> None:
    old, new = H(tools=[tool("a"), tool("b")]), H(tools=[tool("b"), tool("a")])
    delta = diff_header(old, new)
    assert delta == {"tools": {"added": [], "removed": [], "changed": []}}
    assert apply_header_delta(old, delta) != canonical_header(new)


def test_an_inexpressible_change_is_not_reported_equal() -> None:
    assert diff_header({"config": CONFIG, "extra": 1}, {"config": CONFIG, "extra": 2}) == {}


# --------------------------------------------------------------------------- apply errors


@pytest.mark.parametrize(
    "delta",
    [
        {"system": {"keepStart": 2, "keepEnd": 1, "insert": []}},
        {"system": {"keepStart": -1, "keepEnd": 0, "insert": []}},
        {"system": {"keepStart": 0, "keepEnd": 0}},
        {"system": "replace me"},
        {"tools": ["not", "an", "object"]},
        {"messagePrefix": "x"},
    ],
)
def test_a_delta_that_cannot_apply_raises(delta: dict[str, Any]) -> None:
    with pytest.raises(InvalidEntryError):
        apply_header_delta(H("one\ntwo"), delta)


# --------------------------------------------------------------------------- fold


def test_fold_without_header_events_is_none() -> None:
    assert fold_request_header([E(0, "user/message", {"content": "hi"})]) is None
    assert fold_request_header([]) is None


def test_fold_latest_snapshot_then_deltas() -> None:
    log = [
        E(0, "request/header", {"header": H("s1", [tool("a")]), "reason": "initial"}),
        E(1, "request/header-delta", {"system": {"keepStart": 0, "keepEnd": 0, "insert": ["s2"]}}),
        E(2, "user/message", {"content": "hi"}),
        E(3, "request/header", {"header": H("fresh"), "reason": "resume"}),
        E(4, "request/header-delta", {"tools": {"added": [tool("b")], "removed": [], "changed": []}}),
        E(5, "request/header-delta", {"config": {"model": "m2"}}),
    ]
    assert fold_request_header(log[:2]) == H("s2", [tool("a")])
    assert fold_request_header(log[:4]) == H("fresh")
    assert fold_request_header(log) == {"config": {"model": "m2"}, "system": "fresh", "tools": [tool("b")]}


def test_a_delta_before_any_snapshot_raises() -> None:
    log = [E(0, "prompt", {"header": H("s")}), E(1, "request/header-delta", {"config": {}})]
    with pytest.raises(InvalidEntryError, match="n=1 before any request/header snapshot"):
        fold_request_header(log)


def test_header_entry_picks_snapshot_delta_or_nothing() -> None:
    first = header_entry(None, H("s"))
    assert (
        first is not None and first.type == "request/header" and first.data == {"header": H("s"), "reason": "initial"}
    )
    assert header_entry(H("s"), H("s")) is None
    step = header_entry(H("s"), H("s\nmore"))
    assert step is not None and step.type == "request/header-delta"
    reorder = header_entry(H(tools=[tool("a"), tool("b")]), H(tools=[tool("b"), tool("a")]))
    assert reorder is not None and reorder.type == "request/header" and reorder.data["reason"] == "fallback"


# --------------------------------------------------------------------------- digest


def test_prompt_digest_is_sha256_of_canonical_json_of_the_epoch_fields() -> None:
    header = {
        "provider": "deepseek",
        "model": "deepseek-chat",
        "temperature": 0.5,
        "system": "be brief",
        "tools": [tool("a")],
        "turn": 3,
    }
    fields = {
        "maxTokens": None,
        "model": "deepseek-chat",
        "prelude": None,
        "provider": "deepseek",
        "reasoningEffort": None,
        "stop": None,
        "system": "be brief",
        "temperature": 0.5,
        "tools": [tool("a")],
    }
    raw = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert prompt_digest(header) == hashlib.sha256(raw.encode()).hexdigest()


def test_prompt_digest_ignores_what_does_not_define_the_epoch() -> None:
    base = {"provider": "p", "model": "m", "temperature": 1, "system": "s"}
    d = prompt_digest(base)
    assert prompt_digest({**base, "turn": 9, "reason": "x", "sources": [1]}) == d
    assert prompt_digest({**base, "temperature": 1.0}) == d
    assert prompt_digest({**base, "tools": [], "stop": None}) == d
    assert prompt_digest(dict(reversed(list(base.items())))) == d
    assert prompt_digest({**base, "model": "m2"}) != d
    assert prompt_digest({**base, "system": "t"}) != d
    assert prompt_digest({**base, "maxTokens": 10}) != d


def test_prompt_digest_reads_dsh_config_and_message_prefix() -> None:
    dsh = {"config": {"provider": "p", "model": "m", "temperature": 1}, "system": "s", "messagePrefix": [{"r": 1}]}
    flat = {"provider": "p", "model": "m", "temperature": 1, "system": "s", "prelude": [{"r": 1}]}
    assert prompt_digest(dsh) == prompt_digest(flat)


# --------------------------------------------------------------------------- reconstruct_request


def chat_log() -> list[Entry]:
    return [
        E(0, "prompt", {"header": {"provider": "p", "model": "m1", "system": "s"}, "turn": 1, "reason": "new"}),
        E(1, "message", {"role": "user", "content": "q1"}),
        E(2, "message", {"role": "assistant", "content": "a1"}),
        E(3, "prompt", {"header": {"provider": "p", "model": "m2", "system": "s"}, "turn": 2}),
        E(4, "message", {"role": "user", "content": "q2"}),
        E(5, "message", {"role": "assistant", "content": "a2"}),
    ]


def test_reconstruct_request_from_prompt_marks() -> None:
    log = chat_log()
    first = reconstruct_request(log, 2)
    assert first.header == {"provider": "p", "model": "m1", "system": "s"}
    assert [m.text for m in first.messages] == ["q1"]
    assert first.digest == prompt_digest({"provider": "p", "model": "m1", "system": "s"})
    second = reconstruct_request(log, 5)
    assert second.header is not None and second.header["model"] == "m2"
    assert second.messages == project(log[:5])
    assert second.digest != first.digest


def test_reconstruct_request_from_header_snapshot_and_deltas() -> None:
    log = [
        E(0, "turn/start", {"turn": 1}),
        E(1, "user/message", {"content": "hi"}),
        E(2, "request/header", {"header": H("k1\nold"), "reason": "initial"}),
        E(3, "assistant/message", {"content": "hello"}),
        E(4, "request/header-delta", {"system": {"keepStart": 1, "keepEnd": 0, "insert": ["new"]}}),
        E(5, "user/message", {"content": "again"}),
    ]
    assert reconstruct_request(log, 4).header == H("k1\nold")
    req = reconstruct_request(log, 6)
    assert req.header == H("k1\nnew") and [m.text for m in req.messages] == ["hi", "hello", "again"]
    assert req.digest == prompt_digest(H("k1\nnew"))


def test_reconstruct_request_edges() -> None:
    log = chat_log()
    empty = reconstruct_request(log, 0)
    assert empty.header is None and empty.messages == [] and empty.digest is None
    with pytest.raises(ValueError):
        reconstruct_request(log, 7)
    with pytest.raises(ValueError):
        reconstruct_request(log, -1)


# --------------------------------------------------------------------------- round trips

_line = st.sampled_from(["a", "b", "c", "", "x y"])
_systems = st.one_of(st.none(), st.lists(_line, min_size=1, max_size=6).map("\n".join))
_names = st.sampled_from(["read", "write", "ls", "grep", "bash", "edit"])
_tool_list = st.lists(st.builds(tool, _names, st.sampled_from(["v1", "v2"])), max_size=5, unique_by=lambda t: t["name"])
_configs = st.fixed_dictionaries({"model": st.sampled_from(["m1", "m2"]), "temperature": st.sampled_from([0, 0.5, 1])})
_prefixes = st.one_of(
    st.none(), st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": _line}), max_size=2)
)


@st.composite
def headers(draw: st.DrawFn, tools: Any = _tool_list) -> dict[str, Any]:
    h: dict[str, Any] = {"config": draw(_configs)}
    for key, value in (("system", draw(_systems)), ("tools", draw(tools)), ("messagePrefix", draw(_prefixes))):
        if value is not None:
            h[key] = value
    return h


@st.composite
def header_pairs(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two headers whose tools the delta can express: the old ones in order (some removed, some
    changed), then new names at the end."""
    old = draw(headers())
    new = draw(headers(tools=st.just([])))
    kept = []
    for t in old.get("tools", []):
        if draw(st.booleans()):
            kept.append(tool(t["name"], draw(st.sampled_from(["v1", "v2", "v3"]))))
    taken = {t["name"] for t in old.get("tools", [])}
    added = [tool(n) for n in draw(st.lists(_names, unique=True, max_size=3)) if n not in taken]
    if kept + added:
        new["tools"] = kept + added
    return old, new


@settings(max_examples=300, deadline=None)
@given(header_pairs())
def test_diff_then_apply_round_trips(pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    old, new = pair
    delta = diff_header(old, new)
    if delta is None:
        assert canonical_header(old) == canonical_header(new)
    else:
        assert apply_header_delta(old, delta) == canonical_header(new)
        assert json.loads(json.dumps(delta)) == delta  # loggable as is


@settings(max_examples=300, deadline=None)
@given(st.lists(headers(), min_size=1, max_size=6))
def test_logged_header_changes_always_fold_back(sequence: list[dict[str, Any]]) -> None:
    log: list[Entry] = []
    folded: dict[str, Any] | None = None
    for h in sequence:
        entry = header_entry(folded, h)
        if entry is not None:
            log.append(E(len(log), entry.type, entry.data))
        folded = fold_request_header(log)
        assert folded == canonical_header(h)
