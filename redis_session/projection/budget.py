"""`history`: the longest legal suffix of a projection within a message or token budget
(nanobot ``get_history``), and `estimate_tokens`, the budget's default measure. Pure."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from ..checks import check_optional_int
from .messages import Message


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        t = value.get("type")
        if t == "text" or t == "reasoning":
            return len(value.get("text") or "")
        if t == "tool-call":
            return len(value.get("name") or "") + len(value.get("arguments") or "")
        if t == "tool-result":
            return _chars(value.get("content"))
        return 0
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    return 0


def estimate_tokens(message: Message) -> int:
    """A fast token estimate: a quarter of the characters of text, reasoning, tool calls and
    results (images and other blocks count 0), at least 1."""
    return max(1, _chars(message.content) // 4)


def _call_ids(m: Message) -> Iterable[Any]:
    return (b.get("id") for b in m.content if b.get("type") == "tool-call")


def _result_ids(m: Message) -> Iterable[Any]:
    return (b.get("toolCallId") for b in m.content if b.get("type") == "tool-result")


def history(
    messages: Sequence[Message],
    max_messages: int | None = None,
    max_tokens: int | None = None,
    *,
    estimator: Callable[[Message], int] | None = None,
) -> list[Message]:
    """The longest legal suffix of `messages` within the caps (nanobot ``get_history``).

    A legal suffix starts at a user message and holds no tool result whose call is not in it. When
    no legal suffix fits the caps, the answer is the last turn, from its user message, whatever its
    size: never empty while there is a user message. (Should no user message start a legal suffix
    at all — tool results before the first user message answer calls even earlier — the suffix from
    the last user message is returned without its orphaned results.)

    `estimator` gives a message's tokens for `max_tokens` (default `estimate_tokens`).
    """
    check_optional_int(max_messages, "max_messages")
    check_optional_int(max_tokens, "max_tokens")
    est = estimator or estimate_tokens
    unanswered: set[Any] = set()  # results met (walking back) whose call is not yet met
    count = tokens = 0
    best: int | None = None
    last_turn: int | None = None
    last_user: int | None = None
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        count += 1
        if max_tokens is not None:
            tokens += est(m)
        fits = (max_messages is None or count <= max_messages) and (max_tokens is None or tokens <= max_tokens)
        unanswered.update(_result_ids(m))
        unanswered.difference_update(_call_ids(m))
        if m.role == "user":
            if last_user is None:
                last_user = i
            if not unanswered:
                if last_turn is None:
                    last_turn = i
                if fits:
                    best = i
        if not fits and last_turn is not None:
            break  # caps only tighten further back
    if best is not None:
        return list(messages[best:])
    if last_turn is not None:
        return list(messages[last_turn:])
    if last_user is None:
        return []
    tail = messages[last_user:]
    calls = {c for m in tail for c in _call_ids(m)}
    out: list[Message] = []
    for m in tail:
        if m.role == "tool" and any(r not in calls for r in _result_ids(m)):
            kept = tuple(b for b in m.content if b.get("type") != "tool-result" or b.get("toolCallId") in calls)
            if not kept:
                continue
            m = msgspec.structs.replace(m, content=kept)
        out.append(m)
    return out


__all__ = ["estimate_tokens", "history"]
