"""A LangChain chat history on redis-session: `RedisChatMessageHistory`.

A `langchain_core.chat_history.BaseChatMessageHistory` (``messages``, ``add_messages``,
``clear`` and the async ``aget_messages``, ``aadd_messages``, ``aclear``), usable with
``RunnableWithMessageHistory`` or on its own::

    store = redis_session.open_store("redis://localhost:6379/0")
    history = RedisChatMessageHistory("chat-1", store)
    await history.aadd_messages([HumanMessage("hi"), AIMessage("hello")])

Each LangChain message is one ``message`` entry: an OpenAI-style chat message ``{role, content,
tool_calls?, tool_call_id?, name?, reasoning_content?}`` (so the session's projection and every
other reader understand it), plus ``langchain: {type, id?, additional_kwargs?, response_metadata?,
usage_metadata?, invalid_tool_calls?, status?, artifact?}`` holding what LangChain needs to give
the same message back (fields that are not JSON are left out). ``clear()`` appends a ``cut``
(``before`` = its own n, empty summary): the history is empty, the log keeps everything.

``messages`` is the session's projection (`redis_session.project`), so it honours cuts and dsh
surface replaces, and shows sessions written by other writers (dsh events, importers) too: a
``message`` entry comes back as the LangChain message it was stored from; anything else goes
through the OpenAI rendering. An empty message comes back as it was added (the projection leaves
out an assistant message with nothing in it; the history puts LangChain's back in place). Writes
are expected-n appends, retried after a conflict with another writer. The session is created on
the first write.

The async methods run on the caller's event loop; the sync ones on a private event-loop thread.
One history works from any number of loops (a sync call, then ``asyncio.run`` twice): a
`RedisSessionStore` is bound to the loop that first used it, so every other loop gets a clone of
it with its own connections (`redis_session.adapters._loops`). Needs the ``langchain`` extra.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import msgspec

try:
    from langchain_core.chat_history import BaseChatMessageHistory
    from langchain_core.messages import (
        AIMessage,
        BaseMessage,
        ChatMessage,
        FunctionMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
    )
except ImportError as e:  # pragma: no cover - exercised in a subprocess without the extra
    raise ImportError(
        "redis_session.adapters.langchain needs LangChain: pip install 'redis-agent-session[langchain]' "
        f"(or langchain-core); {e}"
    ) from e

from ..errors import InvalidSessionIdError
from ..keys import validate_session_id
from ..model import CUT, Entry, NewEntry
from ..projection import Message, ProjectionState, openai_messages
from ..store import SessionStore
from ._log import Life, SessionLog, resolve_store
from ._loops import LoopStores, run_sync

CLEAR_REASON = "langchain:clear"
_ROLES = {
    "human": "user",
    "user": "user",
    "ai": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}

__all__ = ["CLEAR_REASON", "RedisChatMessageHistory", "from_chat_message", "to_chat_message"]

T = TypeVar("T")


# --------------------------------------------------------------------------- conversion


def _json_or_none(value: Any) -> Any:
    """`value` when it is lossless JSON, else None (left out)."""
    try:
        raw = msgspec.json.encode(value)
        return value if msgspec.json.decode(raw) == value else None
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError, RecursionError):
        return None


def _content(content: Any) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": p} if isinstance(p, str) else dict(p) for p in content or ()]


def to_chat_message(message: BaseMessage) -> dict[str, Any]:
    """A LangChain message as the data of a ``message`` entry (see the module docstring)."""
    role = _chat_role(message)
    data: dict[str, Any] = {"role": role, "content": _content(message.content)}
    if message.name:
        data["name"] = message.name
    lc: dict[str, Any] = {"type": message.type}
    if isinstance(message, ChatMessage):
        lc["role"] = message.role
    if message.id is not None:
        lc["id"] = message.id
    _put_json(lc, message, ("additional_kwargs", "response_metadata"))
    if isinstance(message, AIMessage):
        _put_ai_fields(message, data, lc)
    if isinstance(message, ToolMessage):
        _put_tool_fields(message, data, lc)
    data["langchain"] = lc
    return data


def _chat_role(message: BaseMessage) -> str:
    """The chat-message role of a LangChain message; ValueError when it has none."""
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, (ToolMessage, FunctionMessage)):
        return "tool"
    if isinstance(message, ChatMessage):
        if message.role not in _ROLES:
            raise ValueError(
                f"a ChatMessage with role {message.role!r} has no chat-message equivalent (use one of {sorted(_ROLES)})"
            )
        return _ROLES[message.role]
    raise ValueError(f"unsupported message type {type(message).__name__}")


def _put_json(lc: dict[str, Any], message: BaseMessage, keys: tuple[str, ...]) -> None:
    """`message`'s fields `keys` into `lc`, each when it is set and lossless JSON."""
    for key in keys:
        value = _json_or_none(getattr(message, key, None) or None)
        if value:
            lc[key] = value


def _put_ai_fields(message: AIMessage, data: dict[str, Any], lc: dict[str, Any]) -> None:
    """An AIMessage's tool calls and reasoning into `data`, its usage and invalid calls into `lc`."""
    if message.tool_calls:
        data["tool_calls"] = [
            {
                "id": call.get("id") or "",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["args"], ensure_ascii=False)},
            }
            for call in message.tool_calls
        ]
    reasoning = message.additional_kwargs.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        data["reasoning_content"] = reasoning
    _put_json(lc, message, ("usage_metadata", "invalid_tool_calls"))


def _put_tool_fields(message: ToolMessage, data: dict[str, Any], lc: dict[str, Any]) -> None:
    """A ToolMessage's call id into `data`, its status (unless success) and artifact into `lc`."""
    data["tool_call_id"] = message.tool_call_id
    if message.status != "success":
        lc["status"] = message.status
    artifact = _json_or_none(message.artifact)
    if artifact is not None:
        lc["artifact"] = artifact


def _args(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) and arguments else {}
    except ValueError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_value": value}


def from_chat_message(data: dict[str, Any]) -> BaseMessage:
    """The LangChain message of a chat message (a ``message`` entry's data, or an OpenAI-format
    message); the ``langchain`` extras, when present, restore what the format cannot hold."""
    lc = data.get("langchain") if isinstance(data.get("langchain"), dict) else {}
    assert isinstance(lc, dict)
    role = data.get("role")
    kwargs = _message_kwargs(data, lc)
    kind = lc.get("type")
    if kind == "chat" and isinstance(lc.get("role"), str):
        return ChatMessage(role=lc["role"], **kwargs)
    if role == "assistant":
        return _ai_message(data, lc, kwargs)
    if role == "tool":
        return _tool_message(data, lc, kind, kwargs)
    if role == "system":
        return SystemMessage(**kwargs)
    return HumanMessage(**kwargs)


def _message_kwargs(data: dict[str, Any], lc: dict[str, Any]) -> dict[str, Any]:
    """The fields every LangChain message takes: content, name, id, and the dict extras."""
    content = data.get("content")
    if content is None:
        content = ""
    kwargs: dict[str, Any] = {"content": content}
    if data.get("name"):
        kwargs["name"] = data["name"]
    if lc.get("id") is not None:
        kwargs["id"] = lc["id"]
    for key in ("additional_kwargs", "response_metadata"):
        if isinstance(lc.get(key), dict):
            kwargs[key] = lc[key]
    return kwargs


def _ai_message(data: dict[str, Any], lc: dict[str, Any], kwargs: dict[str, Any]) -> AIMessage:
    """An assistant chat message as an AIMessage: its tool calls, reasoning, usage."""
    calls = []
    for call in data.get("tool_calls") or ():
        fn = call.get("function") or {}
        calls.append(
            {
                "name": fn.get("name") or "",
                "args": _args(fn.get("arguments")),
                "id": call.get("id") or None,
                "type": "tool_call",
            }
        )
    if calls:
        kwargs["tool_calls"] = calls
    if data.get("reasoning_content") and "additional_kwargs" not in kwargs:
        kwargs["additional_kwargs"] = {"reasoning_content": data["reasoning_content"]}
    for key in ("usage_metadata", "invalid_tool_calls"):
        if lc.get(key):
            kwargs[key] = lc[key]
    return AIMessage(**kwargs)


def _tool_message(data: dict[str, Any], lc: dict[str, Any], kind: Any, kwargs: dict[str, Any]) -> BaseMessage:
    """A tool chat message as a ToolMessage (a FunctionMessage when it was stored from one)."""
    if kind == "function":
        return FunctionMessage(**{**kwargs, "name": data.get("name") or ""})
    if lc.get("status") in ("success", "error"):
        kwargs["status"] = lc["status"]
    if "artifact" in lc:
        kwargs["artifact"] = lc["artifact"]
    return ToolMessage(tool_call_id=data.get("tool_call_id") or "", **kwargs)


# --------------------------------------------------------------------------- the history


def _empty_assistant(data: dict[str, Any]) -> bool:
    return data.get("role") == "assistant" and not data.get("content") and not data.get("tool_calls")


class _View:
    """The log as this history sees it on one event loop: the projection, kept incrementally."""

    def __init__(self, history: RedisChatMessageHistory, store: SessionStore) -> None:
        self.state = ProjectionState()
        self.chat: dict[int, dict[str, Any]] = {}
        self.before = 0  # the last cut's `before`
        self.lock = anyio.Lock()
        self.log = SessionLog(
            store,
            history.session_id,
            origin=history._origin,
            fold=self.fold,
            reset=self.reset,
            ttl_ms=history.ttl * 1000 if history.ttl else None,
            life=history._life,
        )

    def reset(self) -> None:
        self.state = ProjectionState()
        self.chat.clear()
        self.before = 0

    def fold(self, entries: Sequence[Entry]) -> None:
        self.state.extend(entries)
        for e in entries:
            if e.type == "message":
                self.chat[e.n] = e.data
            elif e.type == CUT:
                self.before = int(e.data.get("before", e.n))

    def convert(self, m: Message) -> list[BaseMessage]:
        if len(m.source) == 1 and m.source[0] in self.chat:
            data = self.chat[m.source[0]]
            if data.get("role") == m.role:
                return [from_chat_message(data)]
        return [from_chat_message(d) for d in openai_messages([m])]

    def current(self) -> list[BaseMessage]:
        """The projection, plus the empty assistant messages that LangChain wrote (the projection
        leaves out an assistant message with nothing in it; LangChain gives it back as added)."""
        projected = self.state.messages()
        shown = {n for m in projected for n in m.source}
        empty = sorted(n for n, d in self.chat.items() if n >= self.before and n not in shown and _empty_assistant(d))
        out: list[BaseMessage] = []
        i = 0
        for m in projected:
            first = min(m.source) if m.source else -1
            while i < len(empty) and empty[i] < first:
                out.append(from_chat_message(self.chat[empty[i]]))
                i += 1
            out.extend(self.convert(m))
        out.extend(from_chat_message(self.chat[n]) for n in empty[i:])
        return out

    async def messages(self) -> list[BaseMessage]:
        async with self.lock:
            await self.log.catch_up()
            return self.current()

    async def add(self, messages: Sequence[BaseMessage]) -> None:
        data = [to_chat_message(m) for m in messages]
        if not data:
            return
        async with self.lock:
            await self.log.append("message", data)

    async def clear(self) -> None:
        def build() -> list[NewEntry]:
            if not self.current():
                return []
            return [NewEntry(CUT, {"before": self.log.n, "summary": [], "reason": CLEAR_REASON})]

        async with self.lock:
            await self.log.write(build, fresh=True)


class RedisChatMessageHistory(BaseChatMessageHistory):
    """LangChain chat history of one redis-session session (see the module docstring).

    `store` is a `SessionStore` or a `Sessions` service. As in langchain-redis: `key_prefix`
    starts the session's id (``key_prefix + session_id``; any length, as long as the whole id
    stays a valid session id of at most 256 characters), `ttl` (seconds; 0 or None: never) makes
    a session this history creates expire `ttl` after its last write (a session that exists
    already keeps its own expiry: the store has no call that changes it), `id` is the session id, ``len(history)``
    counts the messages, `search_messages` finds messages by text and `delete` removes the
    session. `origin` goes into the header of the session when this history creates it.

    One history works from any number of event loops: each loop gets its own client (see
    `redis_session.adapters._loops`), and the sync methods run on a private loop thread.
    """

    def __init__(
        self,
        session_id: str,
        store: Any,
        *,
        key_prefix: str = "",
        ttl: int | None = None,
        origin: Any = None,
    ) -> None:
        super().__init__()
        if not session_id or not isinstance(session_id, str):
            # langchain-redis's own check and words ("" and None never name a session)
            raise InvalidSessionIdError("session_id must be a non-empty, valid string")
        if not isinstance(key_prefix, str):
            raise TypeError("key_prefix must be a str")
        full = f"{key_prefix}{session_id}"
        try:
            validate_session_id(full)
        except InvalidSessionIdError as e:
            raise InvalidSessionIdError(
                f"key_prefix + session_id must form a valid session id ({e}); a prefix is part of "
                "the id, so the whole id is limited to 256 characters without braces, whitespace "
                "or control characters (braces would move the session's keys to another cluster slot)"
            ) from None
        if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 0):
            raise ValueError(f"ttl must be a non-negative number of seconds, got {ttl!r}")
        self.session_id = full
        self.key_prefix = key_prefix
        self.ttl = ttl  # 0: no expiry, as in langchain-redis (it sets a TTL only when truthy)
        self._stores = LoopStores(resolve_store(store))
        self._origin = {"adapter": "langchain"} if origin is None else origin
        self._views: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _View] = weakref.WeakKeyDictionary()
        self._life = Life()  # the one life of the id every view (one per loop) belongs to

    @property
    def id(self) -> str:
        """The session id (langchain-redis's accessor)."""
        return self.session_id

    @property
    def store(self) -> SessionStore:
        return self._stores.store

    def _view(self) -> _View:
        loop = asyncio.get_running_loop()
        view = self._views.get(loop)
        if view is None:
            view = self._views[loop] = _View(self, self._stores.get())
        return view

    # -- sync API: on the private loop thread
    def _sync(self, fn: Callable[[_View], Awaitable[T]]) -> T:
        async def call() -> T:
            return await fn(self._view())

        return run_sync(call)

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        """The history (the session's projection, as LangChain messages)."""
        return self._sync(lambda v: v.messages())

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        """Append the messages, in order, in one expected-n write."""
        self._sync(lambda v: v.add(list(messages)))

    def clear(self) -> None:
        """Empty the history with a ``cut``; the log keeps every entry."""
        self._sync(lambda v: v.clear())

    def __len__(self) -> int:
        """How many messages the history holds."""
        return len(self.messages)

    def __bool__(self) -> bool:
        return True  # a history is an object, not a container: an empty one is not "missing"

    def search_messages(self, query: str, limit: int = 10) -> list[dict[str, Any]]:
        """The messages whose text contains `query` (case-insensitive), oldest first, as dicts
        ``{type, content, ...}`` (langchain-redis's full-text search, without an index); at most
        `limit` of them (none for a limit <= 0)."""
        if not query or not isinstance(query, str) or limit <= 0:
            return []
        needle = query.casefold()
        out: list[dict[str, Any]] = []
        for m in self.messages:
            if needle in m.text.casefold():
                out.append({"type": m.type, "content": m.content, "additional_kwargs": m.additional_kwargs})
                if len(out) >= limit:
                    break
        return out

    def delete(self) -> None:
        """Delete the session (the store's delete; an empty history after): only the life this
        history belongs to, else `SessionReplacedError`."""
        run_sync(lambda: self.adelete())

    # -- async API: on the caller's loop
    async def aget_messages(self) -> list[BaseMessage]:
        return await self._view().messages()

    async def aadd_messages(self, messages: Sequence[BaseMessage]) -> None:
        await self._view().add(list(messages))

    async def aclear(self) -> None:
        await self._view().clear()

    async def adelete(self) -> None:
        """Delete the session (the store's delete): only the life this history belongs to
        (`SessionReplacedError` when the id names another one now; nothing is deleted)."""
        view = self._view()
        async with view.lock:
            await view.log.delete()
