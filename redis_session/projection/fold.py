"""The projection: what the model sees, folded from the log. Pure functions, no I/O.

``project(entries)`` folds a log from scratch; `ProjectionState` is the same fold kept incrementally
(one entry at a time, serialisable for the projector's cache). Both produce `Message` Structs in a
neutral, dsh-shaped block format; `to_openai` and `to_anthropic` render them for a provider, and
`history` cuts a legal suffix out of them.

The rules (docs/design.md §6):

- message entries become messages: ``user/message`` → user; ``assistant/message`` → assistant
  (skipped when its content is empty); ``tool/result`` → a ``tool`` message with one
  ``tool-result`` block; ``context/message`` / ``steering/message`` → a user message wrapped in
  ``<context source="KIND">`` … ``</context>`` (``<steering …>`` for steering); ``message`` (an
  OpenAI-style chat message) → itself, in neutral blocks. Everything else never reaches it.
- message entries are dsh *surface nodes*: an entry without surface metadata is appended; a surface
  ``replace {start, end}`` shadows the inclusive range of nodes between start and end (by position)
  and takes its place.
- the last ``cut`` c decides the front: the projection is c's summary (or its usable ``native``)
  followed by the surface nodes with n ≥ c.before, in surface order.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NoReturn, TypeAlias

import msgspec
from msgspec import Struct

from ..errors import InvalidEntryError
from ..model import CUT, MESSAGE_TYPES, EncodedEntry, Entry, SurfaceReplace

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
_FOLDED = frozenset(_DERIVE.keys() & MESSAGE_TYPES | {CUT})


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


def needs_rebuild(entry: Entry | EncodedEntry) -> bool:
    """Whether `entry` rewrites the projection instead of extending it (a `cut` or a surface
    ``replace``): after it, ``messages()`` is no longer the old list plus new messages, so a cache
    of the message list (or of a rendered request) must be rebuilt. `ProjectionState` itself folds
    these entries incrementally; its `generation` moves when one lands."""
    return entry.type == CUT or (entry.surface is not None and isinstance(entry.surface.op, SurfaceReplace))


# --------------------------------------------------------------------------- the fold


_Atom: TypeAlias = str | int | float | bool | None


class _StoredResult(Struct, forbid_unknown_fields=True, gc=False):
    """A tool-result block as `_tool_result` builds it, its content blocks all flat: every tool
    result folded from a ``tool/result`` entry or a ``tool`` chat message with plain content."""

    toolCallId: str | None
    content: tuple[dict[str, _Atom], ...]
    isError: bool


class _StoredMessage(Struct, omit_defaults=True, forbid_unknown_fields=True, gc=False):
    """A Message as a snapshot holds it (format v2), shaped so that loading it is one typed
    decode plus a `_FrozenDict` per block: the decoder itself proves which blocks need no deep
    freeze. A row holds one of:

    - `content`: blocks whose values are all JSON atoms (text, reasoning, tool-call, image: nearly
      every message);
    - `result`: one tool-result block with flat content blocks (a tool message);
    - `nested`: any other blocks, in order, deep-frozen on load (a provider part holding objects;
      even a block that is no object, which only a cut's unchecked `native` can bring).

    `source` is not stored: a surface node's message comes from that node, a summary message from
    the cut.
    """

    role: Role
    content: tuple[dict[str, _Atom], ...] = ()
    result: _StoredResult | None = None
    nested: tuple[Any, ...] = ()
    name: str | None = None


class _Snapshot(Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True, gc=False):
    """The snapshot layout, scalars first so redis-cli shows them on the first line. `crc` is only
    read: `to_bytes` encodes the rest and puts the CRC in front."""

    crc: str = ""
    v: int
    n: int
    floor: int
    cut: int | None
    before: int
    generation: int
    nodes: list[int]
    summary: list[_StoredMessage]
    msgs: list[_StoredMessage | None]


_RESULT_KEYS = ["type", "toolCallId", "content", "isError"]


def _stored(m: Message) -> _StoredMessage:
    """The row of `m`: `content` when every block is flat, else `result` or `nested`."""
    blocks: Any = m.content
    atoms = _ATOMS
    for b in blocks:
        if type(b) is not _FrozenDict or not atoms.issuperset(map(type, b.values())):
            break
    else:
        return _StoredMessage(m.role, blocks, None, (), m.name)
    if len(blocks) == 1 and type(b) is _FrozenDict and list(b) == _RESULT_KEYS and b["type"] == "tool-result":
        call_id, inner, is_error = b["toolCallId"], b["content"], b["isError"]
        if (
            (call_id is None or type(call_id) is str)
            and type(is_error) is bool
            and type(inner) is tuple
            and all(type(x) is _FrozenDict and atoms.issuperset(map(type, x.values())) for x in inner)
        ):
            return _StoredMessage(m.role, (), _StoredResult(call_id, inner, is_error), (), m.name)
    return _StoredMessage(m.role, (), None, blocks, m.name)


def _stored_as(m: Message, result: bool) -> _StoredMessage:
    """The row of `m`, known to be a `result` row (True) or a `nested` one (False)."""
    blocks: Any = m.content
    if not result:
        return _StoredMessage(m.role, (), None, blocks, m.name)
    b = blocks[0]
    return _StoredMessage(m.role, (), _StoredResult(b["toolCallId"], b["content"], b["isError"]), (), m.name)


def _special(r: _StoredMessage) -> tuple[_FrozenDict, ...]:
    """The blocks of a `result` or `nested` row."""
    res = r.result
    if r.content or (res is not None and r.nested):
        raise ValueError("inconsistent projection snapshot: a message row with more than one kind of blocks")
    if res is None:
        blocks: tuple[_FrozenDict, ...] = _freeze(r.nested)
        return blocks
    frozen = _FrozenDict
    inner = res.content
    content = (frozen(inner[0]),) if len(inner) == 1 else tuple(map(frozen, inner))
    return (frozen(type="tool-result", toolCallId=res.toolCallId, content=content, isError=res.isError),)


def _loaded(
    rows: Iterable[_StoredMessage | None], nodes: Iterable[int], special: dict[int, bool]
) -> list[Message | None]:
    """Messages from stored rows, each from its node (one loop, inlined: it runs per message);
    `special` maps the nodes of `result` rows to True, of `nested` rows to False."""
    frozen, message = _FrozenDict, Message
    out: list[Message | None] = []
    append = out.append
    for r, k in zip(rows, nodes, strict=True):
        if r is None:
            append(None)
            continue
        if r.result is not None or r.nested:
            blocks = _special(r)
            special[k] = r.result is not None
        elif len(c := r.content) == 1:
            blocks = (frozen(c[0]),)
        else:
            blocks = tuple(map(frozen, c))
        append(message(r.role, blocks, (k,), r.name))
    return out


class _Version(Struct):
    v: Any = None


_SNAPSHOT_VERSION = 2
_SNAPSHOT_ENCODER = msgspec.json.Encoder()
_SNAPSHOT_DECODER = msgspec.json.Decoder(_Snapshot)
_CRC_HEAD = b'{"crc":"'
_CRC_LEN = len(_CRC_HEAD) + 8 + 2  # 8 hex digits, then '",'
_BODY_AT = _CRC_LEN - 1  # the state's own JSON object, its "{" turned into the "," above
_CRC_SEED = zlib.crc32(b"{")  # the CRC covers the rest with its leading "{" restored


class ProjectionState:
    """The projection fold, kept incrementally: ``apply``/``extend`` entries in order (contiguous n
    from `n`), read ``messages()``.

    ``state.messages()`` after folding entries [0, k) equals ``project(entries[:k])``, however the
    entries were split into `extend` calls, copies or `to_bytes` round trips.

    **Surface.** Message entries are surface nodes in position order. A ``replace {start, end}``
    removes the nodes from start to end (inclusive, by position) and puts the new node where they
    were. A replace is applied only when start and end are *visible* nodes (n ≥ the last cut's
    ``before``) and start is not after end: that is what `check_surface` lets into a log. Should a
    log hold any other replace (one written around the check), the fold appends it instead — it
    never fails — and `check_invariants` reports it.

    **Cuts.** Only the last cut counts: the projection is its summary followed by the visible nodes.
    A cut does not touch the surface, so a later cut with a smaller ``before`` shows older nodes again.

    **Caches and snapshots.** ``to_bytes()`` / ``from_bytes()`` carry the whole state (JSON with a
    CRC; a damaged blob raises ValueError). A snapshot is extended by folding the entries after its
    `n`; cuts and replaces are folded too, so nothing ever forces a replay from 0. `needs_rebuild`
    only tells a cache of the *message list* that it cannot simply append.

    **Rebuilding from the last cut** (cold cache, long log): ``ProjectionState.from_cut(cut, window)``
    with ``window`` = entries [cut.before, cut.n), then ``extend(entries after the cut)``. This
    equals the fold of the whole log because nodes before ``before`` are hidden for good: every
    node appended since ``before`` sits after them, and a replace after the cut cannot name them.
    The one thing the window cannot tell is where a replace *inside the window* put its node when
    it named a node older than ``before`` (possible when the window's replaces predate the cut); the
    fold then raises ValueError rather than guess, as it does for a later cut whose ``before`` falls
    under the window's start. Fold from 0 in that case.
    """

    __slots__ = (
        "_before",
        "_classified",
        "_cut",
        "_floor",
        "_generation",
        "_msgs",
        "_n",
        "_nodes",
        "_open_floor",
        "_special",
        "_summary",
        "_view",
    )

    def __init__(self) -> None:
        self._n = 0
        self._floor = 0  # history below this n is unknown (a state built from a cut)
        self._open_floor = False  # True while from_cut folds the window before its cut
        self._nodes: list[int] = []
        self._msgs: dict[int, Message | None] = {}
        self._cut: int | None = None
        self._before = 0
        self._summary: tuple[Message, ...] = ()
        self._view: list[Message] | None = []
        self._generation = 0
        # What `to_bytes` knows of its rows (see `_stored`): a node under `_classified` holds a
        # message of flat blocks unless `_special` maps it to True (a `result` row) or False
        # (`nested`). A snapshot load fills both for free, so the projector's load, extend, store
        # only classifies the messages folded in between.
        self._classified = 0
        self._special: dict[int, bool] = {}

    # ------------------------------------------------------------------ reading

    @property
    def n(self) -> int:
        """The n of the next entry this state expects (= the number of entries folded)."""
        return self._n

    @property
    def last_cut(self) -> int | None:
        """The n of the last cut folded, or None."""
        return self._cut

    @property
    def generation(self) -> int:
        """Moves on every cut and applied replace: while it stays put, ``messages()`` only grows."""
        return self._generation

    @property
    def surface(self) -> list[int]:
        """The surface nodes (entry n) in position order, hidden ones included."""
        return list(self._nodes)

    def messages(self) -> list[Message]:
        """The projection: a new list each call, of shared immutable Messages."""
        view = self._view
        if view is None:
            msgs = self._msgs
            before = self._before
            view = list(self._summary)
            view.extend(m for n in self._nodes if n >= before and (m := msgs[n]) is not None)
            self._view = view
        return list(view)

    # ------------------------------------------------------------------ folding

    def apply(self, entry: Entry) -> None:
        """Fold one entry; its n must be `n` (ValueError otherwise, and nothing changes)."""
        if entry.n != self._n:
            raise ValueError(f"projection expects entry n={self._n}, got n={entry.n}")
        if entry.type in _FOLDED:
            self._fold(entry)
        self._n += 1

    def extend(self, entries: Iterable[Entry]) -> None:
        """Fold entries in order (contiguous n from `n`). On a gap it raises ValueError, keeping
        what was folded before it."""
        n = self._n
        folded = _FOLDED
        try:
            for e in entries:
                if e.n != n:
                    raise ValueError(f"projection expects entry n={n}, got n={e.n}")
                if e.type in folded:
                    self._fold(e)
                n += 1
        finally:
            self._n = n

    def _fold(self, e: Entry) -> None:
        if e.type == CUT:
            self._fold_cut(e)
            return
        msg = _DERIVE[e.type](e)
        n = e.n
        surface = e.surface
        if surface is not None and type(surface.op) is SurfaceReplace:
            span = self._replace_span(surface.op)
            if span is not None:
                i, j = span
                msgs = self._msgs
                for old in self._nodes[i : j + 1]:
                    del msgs[old]
                    self._special.pop(old, None)
                self._nodes[i : j + 1] = [n]
                msgs[n] = msg
                self._view = None
                self._generation += 1
                return
        self._nodes.append(n)
        self._msgs[n] = msg
        if msg is not None and self._view is not None:
            self._view.append(msg)

    def _fold_cut(self, e: Entry) -> None:
        before = e.data.get("before")
        if not isinstance(before, int) or isinstance(before, bool):
            before = e.n
        before = min(max(before, 0), e.n)
        if before < self._floor and not self._open_floor:
            raise ValueError(
                f"cut n={e.n} shows entries from n={before}, but this state was rebuilt from "
                f"n={self._floor}: fold the log from 0"
            )
        # Nodes under a cut never come back unless a later cut lowers `before`, and only the
        # visible ones can be replaced; they are kept because such a cut can show them again.
        self._cut = e.n
        self._before = before
        self._summary = cut_messages(e)
        self._view = None
        self._generation += 1

    def _locate(self, ref: int) -> int | None:
        """The position of visible node `ref`, or None when it is not one.

        Raises ValueError when the answer depends on history this state does not hold.
        """
        if ref < self._before:
            return None  # hidden by the last cut (or never a node): either way not visible
        if ref < self._floor:
            raise ValueError(
                f"a surface replace names n={ref}, older than n={self._floor} where this state was "
                "rebuilt from a cut: fold the log from 0"
            )
        if ref not in self._msgs:
            return None
        return self._nodes.index(ref)

    def _replace_span(self, op: SurfaceReplace) -> tuple[int, int] | None:
        i = self._locate(op.start)
        j = self._locate(op.end)
        if i is None or j is None or i > j:
            return None
        return i, j

    # ------------------------------------------------------------------ checks

    def surface_error(self, entry: Entry | EncodedEntry, own_n: int | None = None) -> str | None:
        """Why `entry`, appended next (at `own_n`, default `n`), has surface metadata a log must
        not hold — or None when it is fine. ValueError when this state lacks the history to tell."""
        surface = entry.surface
        if surface is None:
            return None
        n = self._n if own_n is None else own_n
        seqs = surface.source_event_seqs
        op = surface.op
        shadowed: list[int] = []
        if isinstance(op, SurfaceReplace):
            i = self._locate(op.start)
            if i is None:
                return f"surface replace: start seq {op.start} not found in surface"
            j = self._locate(op.end)
            if j is None:
                return f"surface replace: end seq {op.end} not found in surface"
            if i > j:
                return f"surface replace: start seq {op.start} (position {i}) is after end seq {op.end} (position {j})"
            if seqs is None:
                return "surface replace: sourceEventSeqs must list every replaced surface node"
            shadowed = self._nodes[i : j + 1]
        if seqs is None:
            return None
        if not seqs and isinstance(op, SurfaceReplace):
            return "sourceEventSeqs must not be empty"
        if len(set(seqs)) != len(seqs):
            return "sourceEventSeqs must not contain duplicates"
        for s in seqs:
            if s >= n:
                return f"sourceEventSeqs must reference earlier entries: {s} >= own n {n}"
            if s < 0:
                return f"sourceEventSeqs references unknown seq {s}"
        have = set(seqs)
        missing = [s for s in shadowed if s not in have]
        if missing:
            return (
                "surface replace: sourceEventSeqs must include every replaced surface node; "
                f"missing {', '.join(map(str, missing))}"
            )
        return None

    # ------------------------------------------------------------------ copies, snapshots

    def copy(self) -> ProjectionState:
        """An independent state (O(surface size); the Messages themselves are shared)."""
        new = ProjectionState.__new__(ProjectionState)
        new._n = self._n
        new._floor = self._floor
        new._open_floor = self._open_floor
        new._nodes = self._nodes.copy()
        new._msgs = self._msgs.copy()
        new._cut = self._cut
        new._before = self._before
        new._summary = self._summary
        new._view = None if self._view is None else self._view.copy()
        new._generation = self._generation
        new._classified = self._classified
        new._special = self._special.copy()
        return new

    def to_bytes(self) -> bytes:
        """The state as JSON (readable in redis-cli), headed by a CRC of the rest."""
        msgs = self._msgs
        known, special = self._classified, self._special
        rows: list[_StoredMessage | None] = []
        append = rows.append
        for k in self._nodes:
            m = msgs[k]
            if m is None:
                append(None)
            elif k >= known:
                append(row := _stored(m))
                if row.result is not None or row.nested:
                    special[k] = row.result is not None
            elif (kind := special.get(k)) is None:
                append(_StoredMessage(m.role, m.content, None, (), m.name))  # type: ignore[arg-type]
            else:
                append(_stored_as(m, kind))
        self._classified = self._n
        snap = _Snapshot(
            v=_SNAPSHOT_VERSION,
            n=self._n,
            floor=self._floor,
            cut=self._cut,
            before=self._before,
            generation=self._generation,
            nodes=self._nodes,
            summary=[_stored(m) for m in self._summary],
            msgs=rows,
        )
        # Encoded straight after a placeholder CRC member, then patched in place: no copy of the
        # (megabytes of) body but the final bytes(). The CRC covers the body as encoded, "{" first;
        # that "{" then becomes the "," after the CRC member.
        buf = bytearray(_CRC_HEAD + b"00000000" + b'"')
        _SNAPSHOT_ENCODER.encode_into(snap, buf, _BODY_AT)
        crc = zlib.crc32(memoryview(buf)[_BODY_AT:])
        buf[_BODY_AT] = ord(",")
        buf[len(_CRC_HEAD) : len(_CRC_HEAD) + 8] = b"%08x" % crc
        return bytes(buf)

    @classmethod
    def from_bytes(cls, blob: bytes) -> ProjectionState:
        """Load a `to_bytes` snapshot; anything damaged, foreign or inconsistent raises ValueError.

        Older snapshot formats are refused too (readers then fold from the log)."""
        try:
            blob = bytes(blob)
        except TypeError as e:
            raise ValueError(f"projection snapshot must be bytes: {e}") from None
        if len(blob) < _CRC_LEN or not blob.startswith(_CRC_HEAD) or blob[_CRC_LEN - 2 : _CRC_LEN] != b'",':
            raise ValueError("not a projection snapshot (no CRC header)")
        try:
            crc = int(blob[len(_CRC_HEAD) : _CRC_LEN - 2], 16)
        except ValueError:
            raise ValueError("projection snapshot: bad CRC header") from None
        if zlib.crc32(memoryview(blob)[_CRC_LEN:], _CRC_SEED) != crc:
            raise ValueError("projection snapshot is damaged (CRC mismatch)")
        # The CRC proves these are the bytes `to_bytes` wrote (or a writer as careful): the typed
        # decode and the structural checks below catch the rest. No per-block walk is needed.
        try:
            snap = _SNAPSHOT_DECODER.decode(blob)
        except msgspec.DecodeError as e:
            _check_version(blob)
            raise ValueError(f"projection snapshot does not decode: {e}") from None
        _check_snapshot(snap)
        nodes = snap.nodes
        special: dict[int, bool] = {}
        msgs = _loaded(snap.msgs, nodes, special)
        summary = snap.summary  # empty without a cut (checked)
        state = cls.__new__(cls)
        state._n = snap.n
        state._floor = snap.floor
        state._open_floor = False
        state._nodes = nodes
        state._msgs = dict(zip(nodes, msgs, strict=True))
        if len(state._msgs) != len(nodes):
            raise ValueError("inconsistent projection snapshot: a surface node listed twice")
        state._cut = snap.cut
        state._before = snap.before
        state._summary = tuple(m for m in _loaded(summary, [snap.cut or 0] * len(summary), {}) if m is not None)
        # The view now, at list speed: nearly every load reads messages() next.
        before = snap.before
        if not nodes or min(nodes) >= before:  # no hidden node (a state rebuilt from its cut)
            state._view = [*state._summary, *[m for m in msgs if m is not None]]
        else:
            state._view = [
                *state._summary,
                *[m for k, m in zip(nodes, msgs, strict=True) if k >= before and m is not None],
            ]
        state._generation = snap.generation
        state._classified = snap.n
        state._special = special
        return state

    @classmethod
    def from_cut(cls, cut: Entry, window: Iterable[Entry] = ()) -> ProjectionState:
        """The state right after `cut`, from the cut and the entries [cut.before, cut.n) alone.

        Fold the entries after the cut on top (``extend``) to reach the end of the log. Raises
        ValueError when `window` is not exactly those entries, or when the window holds a replace
        whose effect depends on older history (see the class docstring).
        """
        if cut.type != CUT:
            raise ValueError(f"from_cut needs a cut entry, got {cut.type!r}")
        before = cut.data.get("before")
        if not isinstance(before, int) or isinstance(before, bool) or not 0 <= before <= cut.n:
            raise ValueError(f"cut n={cut.n} has an invalid before={before!r}")
        state = cls()
        state._n = state._floor = before
        # Which older nodes were visible during the window is unknown: `_locate` must treat every
        # reference below the floor as unanswerable until a cut settles it.
        state._before = 0
        state._view = None
        state._open_floor = True
        try:
            state.extend(window)
        finally:
            state._open_floor = False
        if state._n != cut.n:
            raise ValueError(f"from_cut needs the entries [{before}, {cut.n}); they stop at n={state._n}")
        state.apply(cut)
        return state


def _check_version(blob: bytes) -> None:
    """A clearer error than the decoder's for a snapshot of another format version."""
    try:
        v = msgspec.json.decode(blob, type=_Version).v
    except msgspec.DecodeError:
        return
    if v != _SNAPSHOT_VERSION:
        raise ValueError(f"projection snapshot has format version {v!r}, expected {_SNAPSHOT_VERSION}")


def _check_snapshot(s: _Snapshot) -> None:
    def bad(why: str) -> NoReturn:
        raise ValueError(f"inconsistent projection snapshot: {why}")

    if s.v != _SNAPSHOT_VERSION:
        bad(f"format version {s.v}, expected {_SNAPSHOT_VERSION}")
    if not 0 <= s.floor <= s.n or s.generation < 0:
        bad("n/floor/generation out of range")
    nodes = s.nodes
    if len(nodes) != len(s.msgs):  # (`from_bytes` checks that they are distinct)
        bad("surface nodes do not match their messages")
    if nodes and (min(nodes) < s.floor or max(nodes) >= s.n):
        bad("a surface node outside [floor, n)")
    if s.cut is None:
        if s.before != 0 or s.summary or s.floor != 0:
            bad("a cut front without a cut")
    elif not s.floor <= s.before <= s.cut < s.n:
        bad("cut/before out of range")


def project(entries: Iterable[Entry]) -> list[Message]:
    """The projection of a whole log (entries with n = 0, 1, 2 …), folded from scratch."""
    state = ProjectionState()
    state.extend(entries)
    return state.messages()


def check_surface(state: ProjectionState, entries: Sequence[EncodedEntry | Entry], first_n: int) -> None:
    """Reject a batch whose surface metadata must not reach the log.

    `state` is the projection at `first_n` (not modified); the batch's entries apply one after
    another, so a replace may name a node appended earlier in the same batch. Raises
    `InvalidEntryError` (``index`` = batch position) for a replace whose start or end is not a
    visible surface node, whose start comes after its end by position, or whose sourceEventSeqs
    are missing, empty, duplicated, not earlier than the entry, unknown, or miss a replaced node;
    and for appends whose sourceEventSeqs are duplicated, unknown or not earlier.
    """
    if state.n != first_n:
        raise ValueError(f"check_surface needs the state at n={first_n}; it is at n={state.n}")
    last_replace = -1
    for i, e in enumerate(entries):
        if e.surface is not None and isinstance(e.surface.op, SurfaceReplace):
            last_replace = i
    scratch = state.copy() if last_replace >= 0 else state
    for i, e in enumerate(entries):
        own_n = first_n + i
        if isinstance(e, Entry) and e.n != own_n:
            raise InvalidEntryError(f"entry has n={e.n} at batch position of n={own_n}", index=i)
        why = scratch.surface_error(e, own_n)
        if why is not None:
            raise InvalidEntryError(why, index=i)
        if i >= last_replace:
            continue  # nothing later in the batch depends on this entry's effect
        stored = e if isinstance(e, Entry) else e.stored(own_n, e.time or 0)
        scratch.apply(stored)


# --------------------------------------------------------------------------- history


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


# --------------------------------------------------------------------------- renderers


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


__all__ = [
    "Block",
    "Message",
    "ProjectionState",
    "Role",
    "chat_message",
    "check_surface",
    "cut_messages",
    "derive_message",
    "estimate_tokens",
    "history",
    "needs_rebuild",
    "openai_messages",
    "project",
    "to_anthropic",
    "to_openai",
]
