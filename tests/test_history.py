"""history(): the legal suffix (nanobot get_history cases 1-5, 12, 13, adapted)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from redis_session.model import Entry
from redis_session.projection import Message, estimate_tokens, history, project

# --------------------------------------------------------------------------- a nanobot-style session


class Log:
    """Builds a log of OpenAI-style `message` entries, as nanobot stores them."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def add(self, data: dict[str, Any]) -> Log:
        self.entries.append(Entry(n=len(self.entries), time=0, type="message", data=data))
        return self

    def u(self, text: str) -> Log:
        return self.add({"role": "user", "content": text})

    def a(self, text: str) -> Log:
        return self.add({"role": "assistant", "content": text})

    def calls(self, *ids: str) -> Log:
        tool_calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]
        return self.add({"role": "assistant", "content": "", "tool_calls": tool_calls})

    def result(self, call_id: str) -> Log:
        return self.add({"role": "tool", "tool_call_id": call_id, "content": f"out {call_id}"})

    def T(self, p: str, i: int) -> Log:
        """nanobot's T(p, i): one assistant message calling p_i_a and p_i_b, then both results."""
        return self.calls(f"{p}_{i}_a", f"{p}_{i}_b").result(f"{p}_{i}_a").result(f"{p}_{i}_b")

    def messages(self) -> list[Message]:
        return project(self.entries)


def calls_in(msgs: list[Message]) -> set[str]:
    return {b["id"] for m in msgs for b in m.content if b["type"] == "tool-call"}


def results_in(msgs: list[Message]) -> list[str]:
    return [b["toolCallId"] for m in msgs for b in m.content if b["type"] == "tool-result"]


def orphans(msgs: list[Message]) -> list[str]:
    calls = calls_in(msgs)
    return [r for r in results_in(msgs) if r not in calls]


# --------------------------------------------------------------------------- nanobot cases


def test_1_orphan_guard() -> None:
    log = Log().u("first")
    for i in range(20):
        log.T("old", i)
    log.u("second")
    for i in range(25):
        log.T("mid", i)
    log.u("new q")
    got = history(log.messages(), max_messages=100)
    assert orphans(got) == []
    assert got[0].role == "user" and got[-1].text == "new q"
    assert got[0].text == "second" and len(got) == 77  # the longest legal suffix under 100


def test_2_complete_groups_survive() -> None:
    log = Log().u("go")
    for i in range(5):
        log.T("g", i)
    log.a("done")
    got = history(log.messages(), max_messages=500)
    assert len(results_in(got)) == 10 and orphans(got) == []
    assert got[0].text == "go" and len(got) == 17


def test_3_orphan_only_prefix_is_dropped() -> None:
    log = Log().result("gone_1").result("gone_2").u("hello").a("hi")
    got = history(log.messages())
    assert [m.text for m in got] == ["hello", "hi"]


def test_4_cut_in_the_middle_of_a_group() -> None:
    log = Log().u("u1").calls("x", "y").result("x").result("y").u("u2").T("t", 0).a("end")
    got = history(log.messages(), max_messages=6)
    assert orphans(got) == [] and got[0].role == "user"
    assert got[0].text == "u2" and len(got) == 5


def test_4b_a_window_that_would_start_on_a_result_moves_to_a_legal_start() -> None:
    log = Log().u("u1").calls("x", "y").result("x").result("y").a("mid")
    # the last 4 messages start at tool x; the only legal start is u1
    got = history(log.messages(), max_messages=4)
    assert got[0].text == "u1" and orphans(got) == []


def test_5_edge_cases() -> None:
    assert history([]) == []
    assert history([], max_messages=3, max_tokens=10) == []
    log = Log()
    for i in range(5):
        log.u(f"u{i}").a(f"a{i}")
    got = history(log.messages(), max_messages=6)
    assert [m.text for m in got] == ["u2", "a2", "u3", "a3", "u4", "a4"]


def per_message(tokens: int) -> Any:
    return lambda m: tokens


def test_12_token_budget_from_the_tail() -> None:
    log = Log().u("u1").a("a1").u("u2").a("a2").u("u3").a("a3")
    got = history(log.messages(), max_tokens=120, estimator=per_message(50))
    assert [m.text for m in got] == ["u3", "a3"]
    got = history(log.messages(), max_tokens=200, estimator=per_message(50))
    assert [m.text for m in got] == ["u2", "a2", "u3", "a3"]


def test_12b_goes_back_to_the_user_message_even_over_budget() -> None:
    log = Log().u("u1").a("a1").u("u2").a("a2")
    got = history(log.messages(), max_tokens=100, estimator=per_message(100))
    assert [m.text for m in got] == ["u2", "a2"]


def test_13_the_last_turn_is_kept_whole_when_nothing_fits() -> None:
    # nanobot's extend_to_user=True answer is ours by default: never an empty or user-less window
    log = Log().u("old").a("old answer").u("record this")
    for i in range(4):
        log.T("r", i)
    log.a("done")
    got = history(log.messages(), max_messages=8)
    assert len(got) > 8 and got[0].text == "record this" and got[-1].text == "done"
    assert orphans(got) == []


def test_13b_a_newer_user_message_inside_the_window_wins() -> None:
    log = Log().u("long")
    for i in range(8):
        log.T("l", i)
    log.a("long answer").u("new question").a("new answer")
    got = history(log.messages(), max_messages=6)
    assert [m.text for m in got] == ["new question", "new answer"]


# --------------------------------------------------------------------------- our own edges


def test_both_caps_apply() -> None:
    log = Log().u("u1").a("a1").u("u2").a("a2").u("u3").a("a3")
    assert len(history(log.messages(), max_messages=4, max_tokens=1000, estimator=per_message(1))) == 4
    assert len(history(log.messages(), max_messages=100, max_tokens=3, estimator=per_message(1))) == 2


def test_no_user_message_gives_nothing() -> None:
    log = Log().a("hi").calls("x").result("x")
    assert history(log.messages()) == []


def test_no_legal_start_drops_only_the_orphans() -> None:
    # the results answer a call made before the first user message: no suffix is legal
    log = Log().calls("x").u("q").result("x").a("answer")
    got = history(log.messages(), max_messages=2)
    assert [m.role for m in got] == ["user", "assistant"] and orphans(got) == []


def test_dsh_logs_work_too() -> None:
    call = {"type": "tool-call", "id": "c", "name": "f", "arguments": "{}"}
    entries = [
        Entry(n=0, time=0, type="user/message", data={"content": "q"}),
        Entry(n=1, time=0, type="assistant/message", data={"content": [call]}),
        Entry(n=2, time=0, type="tool/result", data={"callId": "c", "content": "r", "isError": False}),
        Entry(n=3, time=0, type="context/message", data={"content": "note", "source": "fs"}),
        Entry(n=4, time=0, type="assistant/message", data={"content": "ok"}),
    ]
    msgs = project(entries)
    # the context message is a user message, but starting there would orphan nothing: it is legal
    assert history(msgs, max_messages=2) == msgs[3:]
    assert history(msgs, max_messages=4) == msgs[3:]
    assert history(msgs, max_messages=5) == msgs


def test_default_estimator_counts_a_quarter_of_the_characters() -> None:
    m = Message("user", ({"type": "text", "text": "x" * 400},))
    assert estimate_tokens(m) == 100
    call = Message("assistant", ({"type": "tool-call", "id": "c", "name": "abcd", "arguments": "x" * 36},))
    assert estimate_tokens(call) == 10
    assert estimate_tokens(Message("user", ())) == 1
    log = Log().u("x" * 400).a("y" * 400).u("z" * 40).a("w" * 40)
    assert [m.text[0] for m in history(log.messages(), max_tokens=150)] == ["z", "w"]
    assert len(history(log.messages(), max_tokens=250)) == 4


# --------------------------------------------------------------------------- property


@st.composite
def sessions(draw: st.DrawFn) -> list[Message]:
    log = Log()
    for i in range(draw(st.integers(0, 25))):
        kind = draw(st.sampled_from(["u", "a", "T", "orphan"]))
        if kind == "u":
            log.u(f"u{i}")
        elif kind == "a":
            log.a(f"a{i}")
        elif kind == "T":
            log.T("p", i)
        else:
            log.result(f"gone{i}")
    return log.messages()


@settings(max_examples=300, deadline=None)
@given(sessions(), st.one_of(st.none(), st.integers(0, 40)), st.one_of(st.none(), st.integers(0, 20)))
def test_history_is_the_longest_legal_suffix(msgs: list[Message], cap: int | None, budget: int | None) -> None:
    got = history(msgs, max_messages=cap, max_tokens=budget, estimator=per_message(1))

    def legal(i: int) -> bool:
        return msgs[i].role == "user" and orphans(msgs[i:]) == []

    def fits(i: int) -> bool:
        n = len(msgs) - i
        return (cap is None or n <= cap) and (budget is None or n <= budget)

    legal_starts = [i for i in range(len(msgs)) if legal(i)]
    if not any(m.role == "user" for m in msgs):
        assert got == []
        return
    assert got and got[0].role == "user" and orphans(got) == []
    if legal_starts:
        fitting = [i for i in legal_starts if fits(i)]
        start = fitting[0] if fitting else legal_starts[-1]
        assert got == msgs[start:]
