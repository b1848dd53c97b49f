"""`Message`, what the model sees of one entry, and the rules that derive it (docs/design.md §6).

A `Message` holds neutral, dsh-shaped content blocks, deep-frozen so every cache can share it.
`derive_message` is one entry's message on its own (``user/message`` → user, ``tool/result`` → a
``tool`` message, ``context/message`` wrapped in ``<context source=…>`` …); `chat_message` reads
an OpenAI-style chat message; `cut_messages` is the front a cut puts on the projection. Surface
replaces and the last cut are the fold's business (`projection.fold`); rendering for a provider
is `projection.render`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Literal, NoReturn

import msgspec
from msgspec import Struct

from ..model import Entry

Role = Literal["system", "user", "assistant", "tool"]
Block = Mapping[str, Any]

# --------------------------------------------------------------------------- immutable content


class _FrozenDict(dict[str, Any]):
    """A dict that refuses mutation, so one Message can be shared by every cache and handle.

    A dict subclass (not a MappingProxy) so msgspec encodes it and ``==`` against plain dicts works.
    """

    __slots__ = ()

    def _readonly(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("projected message content is immutable")

    __setitem__ = _readonly
    __delitem__ = _readonly
    __ior__ = _readonly
    clear = _readonly
    pop = _readonly
    popitem = _readonly
    setdefault = _readonly
    update = _readonly

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_FrozenDict, (dict(self),))

    def __copy__(self) -> _FrozenDict:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _FrozenDict:
        return self


_ATOMS = frozenset({str, int, float, bool, type(None)})


def _freeze(value: Any) -> Any:
    """Deep-freeze JSON: dicts become `_FrozenDict`, lists become tuples."""
    # Leaves are tested inline: snapshot loads freeze every block, and calls per string add up.
    atoms = _ATOMS
    t = type(value)
    if t is dict:
        return _FrozenDict({k: v if type(v) in atoms else _freeze(v) for k, v in value.items()})
    if t is list or t is tuple:
        return tuple([v if type(v) in atoms else _freeze(v) for v in value])
    if t is _FrozenDict or t in atoms:
        return value
    if isinstance(value, dict):
        return _FrozenDict({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple([_freeze(v) for v in value])
    return value


def _thaw(value: Any) -> Any:
    """The mutable, plain-JSON twin of frozen content (renderers hand out things callers may edit)."""
    if isinstance(value, dict):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


# --------------------------------------------------------------------------- Message


class Message(Struct, frozen=True, omit_defaults=True):
    """One message as the model sees it, neutral until a renderer formats it.

    `content` is a tuple of dsh-shaped blocks (``{type:"text",text}``, ``{type:"image",url|data,
    mimeType}``, ``{type:"reasoning",text,signature?}``, ``{type:"tool-call",id,name,arguments}``,
    ``{type:"tool-result",toolCallId,content,isError}``), deep-frozen: mutating one raises
    TypeError, so caches share Message objects safely. `source` holds the n of the entries it came
    from (a cut's summary messages carry the cut's n). `name` is the OpenAI ``name`` when given.

    >>> Message("user", ({"type": "text", "text": "hi"},), (0,)).content[0]["text"]
    'hi'
    """

    role: Role
    content: tuple[Block, ...] = ()
    source: tuple[int, ...] = ()
    name: str | None = None

    def __post_init__(self) -> None:
        # Runs on construction and on decode, so no Message ever holds mutable content. Content
        # already frozen is checked in a plain loop (no call, no generator): snapshot loads build
        # thousands of messages.
        content = self.content
        frozen = type(content) is tuple
        if frozen:
            for b in content:
                if type(b) is not _FrozenDict:
                    frozen = False
                    break
        if not frozen:
            msgspec.structs.force_setattr(self, "content", _freeze(_blocks(content)))
        if type(self.source) is not tuple:
            msgspec.structs.force_setattr(self, "source", tuple(self.source))

    @property
    def text(self) -> str:
        """The text blocks joined by newlines (reasoning, tool calls and results left out)."""
        return "\n".join(b["text"] for b in self.content if b.get("type") == "text")


# --------------------------------------------------------------------------- entry → message


def _text(text: str) -> _FrozenDict:
    return _FrozenDict(type="text", text=text)


def _block(part: Any) -> Any:
    if isinstance(part, str):
        return _text(part)
    if isinstance(part, dict) and part.get("type") == "image_url":
        # OpenAI content part → neutral image block; the URL (a data: URL too) is kept verbatim.
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        extra = {k: v for k, v in part.items() if k not in ("type", "image_url")}
        return _freeze({"type": "image", "url": url, **extra})
    return _freeze(part)


def _blocks(content: Any) -> tuple[Any, ...]:
    """Normalise message content: a string is one text block ("" is none), a list is blocks."""
    if content is None or content == "":
        return ()
    if isinstance(content, str):
        return (_text(content),)
    if isinstance(content, (list, tuple)):
        return tuple([_block(p) for p in content])
    return (_freeze(content),)


def _source_kind(source: Any) -> str:
    if isinstance(source, str):
        return source
    if isinstance(source, dict) and isinstance(source.get("kind"), str):
        return str(source["kind"])
    return "context"


def _tagged(tag: str, data: dict[str, Any]) -> tuple[Any, ...]:
    # The dsh envelope: JSON-quoted kind, so a kind with quotes cannot break the tag.
    kind = json.dumps(_source_kind(data.get("source")), ensure_ascii=False)
    return (_text(f"<{tag} source={kind}>"), *_blocks(data.get("content")), _text(f"</{tag}>"))


def _tool_result(call_id: Any, content: Any, is_error: Any) -> _FrozenDict:
    return _FrozenDict(type="tool-result", toolCallId=call_id, content=_blocks(content), isError=bool(is_error))


def _arguments(raw: Any) -> str:
    return raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)


def _thinking(data: Mapping[str, Any]) -> list[Any]:
    """An assistant message's reasoning as blocks: ``reasoning_content`` (unsigned), then each of
    nanobot's ``thinking_blocks`` (Anthropic's): ``thinking`` as reasoning with its signature,
    ``redacted_thinking`` kept as it is (`to_anthropic` sends it back verbatim)."""
    blocks: list[Any] = []
    if isinstance(data.get("reasoning_content"), str) and data["reasoning_content"]:
        blocks.append(_FrozenDict(type="reasoning", text=data["reasoning_content"]))
    thinking = data.get("thinking_blocks")
    for t in thinking if isinstance(thinking, list) else ():
        if isinstance(t, Mapping) and t.get("type") == "redacted_thinking":
            blocks.append(_freeze(dict(t)))
        elif isinstance(t, Mapping) and isinstance(t.get("thinking"), str):
            r: dict[str, Any] = {"type": "reasoning", "text": t["thinking"]}
            if isinstance(t.get("signature"), str):
                r["signature"] = t["signature"]
            blocks.append(_FrozenDict(r))
    return blocks


def openai_call_blocks(calls: Any) -> list[_FrozenDict]:
    """OpenAI ``tool_calls`` (``[{id, type: "function", function: {name, arguments}}]``) as neutral
    ``tool-call`` blocks, in order. Never raises: a cut's `native` is not schema-checked."""
    blocks: list[_FrozenDict] = []
    for call in calls if isinstance(calls, list) else ():
        if not isinstance(call, Mapping):
            continue
        fn = call.get("function")
        fn = fn if isinstance(fn, Mapping) else {}
        blocks.append(
            _FrozenDict(
                type="tool-call", id=call.get("id"), name=fn.get("name"), arguments=_arguments(fn.get("arguments", ""))
            )
        )
    return blocks


def assistant_blocks(data: Mapping[str, Any]) -> tuple[Any, ...]:
    """An ``assistant/message``'s blocks: its content, then its OpenAI-shaped `tool_calls` as
    ``tool-call`` blocks (one home for the projection and the doctor's tool pairing)."""
    content = _blocks(data.get("content"))
    calls = data.get("tool_calls")
    return (*content, *openai_call_blocks(calls)) if calls else content


def chat_message(data: Mapping[str, Any], source: tuple[int, ...]) -> Message | None:
    """An OpenAI-style chat message ``{role, content, tool_calls?, tool_call_id?, name?,
    reasoning_content?}`` as a neutral `Message` (None when it carries nothing to send)."""
    role = data.get("role")
    name = data.get("name") if isinstance(data.get("name"), str) else None
    if role == "assistant":
        blocks = _thinking(data)
        blocks.extend(_blocks(data.get("content")))
        blocks.extend(openai_call_blocks(data.get("tool_calls")))
        if not blocks:
            return None
        return Message("assistant", tuple(blocks), source, name)
    if role == "tool":
        block = _tool_result(data.get("tool_call_id"), data.get("content"), data.get("isError", False))
        return Message("tool", (block,), source, name)
    if role == "user" or role == "system":
        return Message(role, _blocks(data.get("content")), source, name)
    return None


def _m_user(e: Entry) -> Message | None:
    return Message("user", _blocks(e.data.get("content")), (e.n,))


def _m_assistant(e: Entry) -> Message | None:
    content = assistant_blocks(e.data)
    return Message("assistant", content, (e.n,)) if content else None


def _m_tool(e: Entry) -> Message | None:
    d = e.data
    return Message("tool", (_tool_result(d.get("callId"), d.get("content"), d.get("isError")),), (e.n,))


def _m_context(e: Entry) -> Message | None:
    return Message("user", _tagged("context", e.data), (e.n,))


def _m_steering(e: Entry) -> Message | None:
    return Message("user", _tagged("steering", e.data), (e.n,))


def _m_chat(e: Entry) -> Message | None:
    return chat_message(e.data, (e.n,))


_DERIVE: dict[str, Callable[[Entry], Message | None]] = {
    "user/message": _m_user,
    "assistant/message": _m_assistant,
    "tool/result": _m_tool,
    "context/message": _m_context,
    "steering/message": _m_steering,
    "message": _m_chat,
}


def derive_message(entry: Entry) -> Message | None:
    """The message one entry projects to on its own, or None (a mark, a chunk, an empty assistant
    message). Surface replaces and cuts are the fold's business, not this function's."""
    f = _DERIVE.get(entry.type)
    return f(entry) if f is not None else None


def cut_messages(cut: Entry) -> tuple[Message, ...]:
    """The front a cut puts on the projection: its `native` messages when usable, else `summary`.

    `native` is usable when it is a list of chat messages, or an object ``{"messages": [...]}``
    without ``"unusable": true`` (provider fields beside ``messages`` are kept in the log, unused
    here). Anything else — None, a provider blob, ``{"unusable": true, …}``, a list holding
    something that is not a chat message — falls back to `summary`. Every message carries the cut's n.
    """
    source = (cut.n,)
    data = cut.data
    native = data.get("native")
    if isinstance(native, dict) and native.get("unusable") is not True:
        native = native.get("messages")
    if isinstance(native, list) and native and all(isinstance(m, dict) and _is_chat(m) for m in native):
        items: list[Any] = native
    else:
        items = data.get("summary") or []
    out = [chat_message(m, source) for m in items if isinstance(m, dict)]
    return tuple(m for m in out if m is not None)


def _is_chat(m: Mapping[str, Any]) -> bool:
    return m.get("role") in ("system", "user", "assistant", "tool")


__all__ = [
    "Block",
    "Message",
    "Role",
    "assistant_blocks",
    "chat_message",
    "cut_messages",
    "derive_message",
    "openai_call_blocks",
]
