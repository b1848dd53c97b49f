"""The renderers: a projection's `Message`s as a provider's request (docs/design.md §6).

`to_openai` (chat completions) and `to_anthropic` (the Messages API) always return a legal
request: where the projection pairs a tool call and its result badly (a cut inside a tool-call
group, a call never answered), the pairing is repaired. `openai_messages` converts messages one by
one without that repair. Plain, mutable dicts out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .messages import Block, Message, _thaw


def _legal_openai(out: list[dict[str, Any]], allow_pending: bool) -> list[dict[str, Any]]:
    """OpenAI's pairing rule on a rendered list (see `to_openai`); legal input is returned as is."""
    fixed: list[dict[str, Any] | None] = []
    group: int | None = None  # the assistant message whose tool messages may follow
    open_ids: list[Any] = []  # its calls not answered yet

    def close() -> None:
        nonlocal group
        if group is not None and open_ids:
            msg = dict(fixed[group] or {})
            calls = [c for c in msg["tool_calls"] if c.get("id") not in open_ids]
            if calls:
                msg["tool_calls"] = calls
            else:
                del msg["tool_calls"]
            fixed[group] = msg if calls or msg.get("content") else None
        group = None
        open_ids.clear()

    for msg in out:
        if msg["role"] == "tool":
            if group is not None and msg.get("tool_call_id") in open_ids:
                open_ids.remove(msg.get("tool_call_id"))
                fixed.append(msg)
            continue  # a result whose call is not just before it
        close()
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            calls = []
            for c in msg["tool_calls"]:
                if c.get("id") not in open_ids:  # a repeated id could be answered only once
                    open_ids.append(c.get("id"))
                    calls.append(c)
            if len(calls) < len(msg["tool_calls"]):
                msg = {**msg, "tool_calls": calls}
            group = len(fixed)
        fixed.append(msg)
    if not allow_pending:
        close()
    return [m for m in fixed if m is not None]


def _legal_anthropic(out: list[dict[str, Any]], allow_pending: bool) -> list[dict[str, Any]]:
    """Anthropic's pairing rule on merged, role-alternating messages (see `to_anthropic`)."""
    while True:
        changed = False
        fixed: list[dict[str, Any]] = []
        for i, msg in enumerate(out):
            blocks = msg["content"]
            if msg["role"] == "assistant":
                keep = _answered_calls(out, i, allow_pending)
            else:
                keep = _called_results(blocks, fixed)
            if len(keep) != len(blocks):
                changed = True
            if not keep or (
                len(keep) != len(blocks) and all(b.get("type") in ("thinking", "redacted_thinking") for b in keep)
            ):
                changed = True
                continue
            if fixed and fixed[-1]["role"] == msg["role"]:
                fixed[-1] = {**fixed[-1], "content": [*fixed[-1]["content"], *keep]}
                changed = True
            else:
                fixed.append(msg if len(keep) == len(blocks) else {**msg, "content": keep})
        for msg in fixed:
            if msg["role"] == "user" and changed:
                msg["content"] = sorted(msg["content"], key=lambda b: b.get("type") != "tool_result")
        if not changed:
            return fixed
        out = fixed


def _answered_calls(out: list[dict[str, Any]], i: int, allow_pending: bool) -> list[Any]:
    """The blocks of the assistant message `out[i]` that stay: its tool_use blocks only when the
    next message answers them (or, with `allow_pending`, a turn whose tools still run), once."""
    blocks = out[i]["content"]
    nxt = out[i + 1] if i + 1 < len(out) else None
    answered = (
        {b.get("tool_use_id") for b in nxt["content"] if b.get("type") == "tool_result"} if nxt is not None else None
    )
    seen: set[Any] = set()
    keep = []
    for b in blocks:
        if b.get("type") == "tool_use":
            bid = b.get("id")
            # a turn whose tools still run: results of this message only, or none
            pending_ok = allow_pending and (
                nxt is None or (i + 2 == len(out) and all(b.get("type") == "tool_result" for b in nxt["content"]))
            )
            if bid in seen or not (pending_ok or (answered is not None and bid in answered)):
                continue
            seen.add(bid)
        keep.append(b)
    return keep


def _called_results(blocks: list[Any], fixed: list[dict[str, Any]]) -> list[Any]:
    """The blocks of a user (non-assistant) message that stay after `fixed` so far: its
    tool_result blocks only for a call of the assistant message just before it, once."""
    prev = fixed[-1] if fixed and fixed[-1]["role"] == "assistant" else None
    calls = {b.get("id") for b in prev["content"] if b.get("type") == "tool_use"} if prev else set()
    keep = []
    for b in blocks:
        if b.get("type") == "tool_result":
            if b.get("tool_use_id") not in calls:
                continue
            calls.discard(b.get("tool_use_id"))
        keep.append(b)
    return keep


def _result_text(content: Any) -> str:
    """A tool result's content as the one string OpenAI takes: text joined, anything else as JSON."""
    if isinstance(content, str):
        return content
    blocks = tuple(content or ())
    if all(isinstance(b, Mapping) and b.get("type") == "text" for b in blocks):
        return "\n".join(b["text"] for b in blocks)
    return json.dumps(_thaw(blocks), ensure_ascii=False)


def _image_url(block: Block) -> str:
    if block.get("url"):
        return str(block["url"])
    return f"data:{block.get('mimeType') or 'application/octet-stream'};base64,{block.get('data', '')}"


def _openai_parts(content: Sequence[Block]) -> str | list[dict[str, Any]]:
    if all(b.get("type") == "text" for b in content):
        return "\n".join(b["text"] for b in content)
    parts: list[dict[str, Any]] = []
    for b in content:
        t = b.get("type")
        if t == "text":
            parts.append({"type": "text", "text": b["text"]})
        elif t == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b)}})
        elif t not in ("reasoning", "tool-call", "tool-result"):
            parts.append(_thaw(b))  # a provider part kept verbatim (input_audio, file …)
    return parts


def to_openai(messages: Iterable[Message], *, allow_pending_tool_calls: bool = False) -> list[dict[str, Any]]:
    """Render for OpenAI chat completions.

    Assistant: text as ``content`` (None when it only calls tools), tool-call blocks as
    ``tool_calls=[{id, type:"function", function:{name, arguments}}]``, reasoning as
    ``reasoning_content``. Every tool-result block becomes its own ``{role:"tool", tool_call_id,
    content}`` message (content a string), in order. User/system content is a string when it is
    all text, else content parts (``image_url`` for images). Plain, mutable dicts.

    The result is always a legal request: an assistant message with ``tool_calls`` is followed
    directly by one tool message per call. Where the projection is not (a cut inside a tool-call
    group, a call never answered, a message between a call and its result), the repair is:
    a tool message whose call is not in the assistant message just before it is dropped; a call
    whose tool message does not follow is dropped from its assistant message, and an assistant
    message left with neither text nor calls is dropped. With `allow_pending_tool_calls`, the
    calls of the last assistant message are kept when nothing but its own results follows (a
    turn whose tools are still running). A rendering that is legal already is left unchanged.
    """
    return _legal_openai(openai_messages(messages), allow_pending_tool_calls)


def openai_messages(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """`messages` converted one by one into OpenAI chat dicts, as `to_openai` renders them, but
    without its pairing repair: for converting single messages, not for building a request."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "assistant":
            texts = [b["text"] for b in m.content if b.get("type") == "text"]
            # reasoning_content: the unsigned reasoning (what the message had as reasoning_content),
            # else the text of its signed thinking
            reasoning = [b["text"] for b in m.content if b.get("type") == "reasoning" and not b.get("signature")]
            reasoning = reasoning or [b["text"] for b in m.content if b.get("type") == "reasoning"]
            calls = [
                {
                    "id": b.get("id"),
                    "type": "function",
                    "function": {"name": b.get("name"), "arguments": b.get("arguments")},
                }
                for b in m.content
                if b.get("type") == "tool-call"
            ]
            msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if msg["content"] is None and not calls:
                msg["content"] = ""
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
            continue
        rest: list[Block] = [b for b in m.content if b.get("type") != "tool-result"]
        for b in m.content:
            if b.get("type") == "tool-result":
                result = {
                    "role": "tool",
                    "tool_call_id": b.get("toolCallId"),
                    "content": _result_text(b.get("content")),
                }
                if m.role == "tool" and m.name is not None:
                    result["name"] = m.name  # the tool's name, as nanobot and OpenAI send it
                out.append(result)
        if m.role == "tool" or (not rest and len(rest) != len(m.content)):
            continue
        msg = {"role": m.role, "content": _openai_parts(rest)}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _anthropic_image(block: Block) -> dict[str, Any]:
    url = str(block.get("url") or "")
    if url.startswith("data:") and ";base64," in url:
        media, data = url[5:].split(";base64,", 1)
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    if url:
        return {"type": "image", "source": {"type": "url", "url": url}}
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": block.get("mimeType"), "data": block.get("data")},
    }


def _tool_input(arguments: Any) -> Any:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_value": value}


def _anthropic_result_content(content: Any) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    out: list[dict[str, Any]] = []
    for b in content or ():
        t = b.get("type") if isinstance(b, Mapping) else None
        if t == "text":
            if b["text"]:
                out.append({"type": "text", "text": b["text"]})
        elif t == "image":
            out.append(_anthropic_image(b))
        else:
            out.append({"type": "text", "text": json.dumps(_thaw(b), ensure_ascii=False)})
    return out


def _anthropic_blocks(m: Message) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for b in m.content:
        t = b.get("type")
        if t == "text":
            if b["text"]:  # Anthropic rejects empty text blocks
                out.append({"type": "text", "text": b["text"]})
        elif t == "image":
            out.append(_anthropic_image(b))
        elif t == "reasoning":
            # Thinking goes back only with its signature; unsigned reasoning would be rejected.
            if b.get("signature"):
                out.append({"type": "thinking", "thinking": b["text"], "signature": b["signature"]})
        elif t == "tool-call":
            out.append(
                {
                    "type": "tool_use",
                    "id": b.get("id"),
                    "name": b.get("name"),
                    "input": _tool_input(b.get("arguments")),
                }
            )
        elif t == "tool-result":
            res: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": b.get("toolCallId"),
                "content": _anthropic_result_content(b.get("content")),
            }
            if b.get("isError"):
                res["is_error"] = True
            out.append(res)
        else:
            out.append(_thaw(b))
    return out


def to_anthropic(messages: Iterable[Message], *, allow_pending_tool_calls: bool = False) -> dict[str, Any]:
    """Render for the Anthropic Messages API: ``{"system": str | None, "messages": [...]}``.

    System messages are joined into ``system``. Tool calls become ``tool_use`` blocks (arguments
    parsed from their JSON string), tool results ``tool_result`` blocks in a user message; signed
    reasoning becomes ``thinking``. Consecutive messages of one role are merged into one, with
    ``tool_result`` blocks first as the API requires; messages left with no blocks are dropped.

    The result is always a legal request: every ``tool_use`` is answered by a ``tool_result`` in
    the next (user) message, and every ``tool_result`` answers a ``tool_use`` of the message just
    before it, once. The repair is `to_openai`'s: orphan results are dropped, unanswered calls
    are dropped from their message (a message left with nothing, or with nothing but thinking,
    goes; neighbours of one role merge again). `allow_pending_tool_calls` keeps the unanswered
    calls of the last assistant message when at most its own results follow. A rendering that is
    legal already is left unchanged.
    """
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "system":
            if m.text:
                system.append(m.text)
            continue
        role = "assistant" if m.role == "assistant" else "user"
        blocks = _anthropic_blocks(m)
        if not blocks:
            continue
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})
    for msg in out:
        if msg["role"] == "user":
            msg["content"].sort(key=lambda b: b.get("type") != "tool_result")
    return {
        "system": "\n\n".join(system) if system else None,
        "messages": _legal_anthropic(out, allow_pending_tool_calls),
    }


__all__ = ["openai_messages", "to_anthropic", "to_openai"]
