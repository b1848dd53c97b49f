"""The data model: headers, entries and the entry vocabulary, as msgspec Structs.

Data enters through `encode_batch`, which checks each entry against its schema and proves it is
lossless JSON, so nothing malformed ever reaches a store. Entries read back are decoded in one
pass (`ENTRY_LIST_DECODER`) without re-validation: the log only ever holds validated data.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct, field

from .checks import MAX_TTL as MAX_TTL
from .checks import check_seconds
from .errors import InvalidEntryError

FORMAT_VERSION = 1
DEFAULT_MAX_ENTRY_BYTES = 1 << 20
DEFAULT_MAX_BATCH = 10_000

MAX_TITLE_BYTES = 1024
"""A header's `title` is at most this many bytes of UTF-8: a list page (up to 1 000 headers)
stays bounded."""
MAX_ORIGIN_BYTES = 64 << 10
"""A header's `origin` is at most this many bytes of JSON: a list page stays bounded."""

NonNeg = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]

# --------------------------------------------------------------------------- headers


class SessionHeader(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a session is. Every field but `id` has a default; `created_at=0` means "now".

    `incarnation` names this life of the id: the store assigns a fresh random one at every
    create (a value given to `create` is ignored), so a session deleted and created again, or
    replaced by an import, never passes for the one before it. A header stored before
    incarnations existed reads as `legacy_incarnation(created_at)`.

    `create_key` is `create_key_digest` of the idempotency key the session was created with (None
    without one): a retry of that create finds its own creation; any other request, another."""

    id: str
    format_version: int = FORMAT_VERSION
    created_at: int = 0
    parent: str | None = None
    at: int | None = None
    delegation_depth: int = 0
    title: str | None = None
    origin: Any = None
    incarnation: str = ""
    create_key: str | None = None


def check_entries(items: object) -> None:
    """A batch is an iterable of entries (a list, a tuple, a generator), not one entry or None."""
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
        raise InvalidEntryError(f"entries must be a sequence of entries, got {type(items).__name__}")


def check_idempotency_key(key: object) -> None:
    """An idempotency key is None or a str of 1-256 characters without NUL (`InvalidEntryError`)."""
    if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= 256 or "\x00" in key):
        raise InvalidEntryError("idempotency_key must be a str of 1-256 characters (no NUL)")


def create_key_digest(key: str) -> str:
    """What a header keeps of a create's idempotency key: 32 hex digits of its SHA-256 (the key
    itself is the client's and stays with it)."""
    check_idempotency_key(key)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def new_incarnation() -> str:
    """A fresh incarnation: 64 random bits as 16 hex characters."""
    return secrets.token_hex(8)


def legacy_incarnation(created_at: int) -> str:
    """The incarnation of a header written before incarnations existed (both stores, and the Lua
    scripts, derive the same value)."""
    return f"legacy-{created_at}"


def ttl_ms(ttl: float) -> int:
    return max(1, round(check_seconds(ttl, "ttl") * 1000))


class SessionHead(Struct, frozen=True, kw_only=True):
    """A header plus where the log stands: `n` entries, the last `cut` at `last_cut`."""

    header: SessionHeader
    n: int
    updated_at: int
    last_cut: int | None = None

    @property
    def id(self) -> str:
        return self.header.id


T = TypeVar("T")


class Page(Struct, Generic[T], frozen=True):
    """One page of a listing; `cursor` is None on the last page. `unreadable`: ids listed on
    this page whose header could not be read (a key edited outside redis-session: another kind
    of value, or a field that is no number); `redis-session doctor` says what is wrong with each."""

    items: list[T]
    cursor: str | None = None
    unreadable: list[str] = []


# --------------------------------------------------------------------------- surface (dsh)


class SurfaceReplace(Struct, frozen=True, forbid_unknown_fields=True):
    """Shadow surface nodes `start..end` (inclusive, by position; named by their n)."""

    op: Literal["replace"]
    start: NonNeg
    end: NonNeg


class Surface(
    Struct,
    frozen=True,
    omit_defaults=True,
    forbid_unknown_fields=True,
    rename={"op": "surfaceOp", "source_event_seqs": "sourceEventSeqs"},
):
    """dsh surface metadata of a message entry: stored as
    ``{"surfaceOp": "append" | {"op": "replace", "start": n, "end": n}, "sourceEventSeqs": [n…]}``."""

    op: Literal["append"] | SurfaceReplace = "append"
    source_event_seqs: list[NonNeg] | None = None

    @property
    def is_replace(self) -> bool:
        return isinstance(self.op, SurfaceReplace)


# --------------------------------------------------------------------------- entries

MESSAGE_TYPES: frozenset[str] = frozenset(
    {
        "user/message",
        "assistant/message",
        "tool/result",
        "context/message",
        "steering/message",
        "message",
    }
)
CUT = "cut"


def kind_of(entry_type: str) -> Literal["message", "cut", "mark"]:
    if entry_type in MESSAGE_TYPES:
        return "message"
    if entry_type == CUT:
        return "cut"
    return "mark"


class Entry(Struct, frozen=True, omit_defaults=True, gc=False):
    """One stored entry. `n` is 0-based and contiguous; `time` is ms since the epoch."""

    n: int
    time: int
    type: str
    data: dict[str, Any]
    meta: dict[str, Any] | None = None
    surface: Surface | None = None

    @property
    def kind(self) -> Literal["message", "cut", "mark"]:
        return kind_of(self.type)


class NewEntry(Struct, frozen=True):
    """An entry to append: ``NewEntry(type, data, meta=None, surface=None, time=None)``."""

    type: str
    data: Any
    meta: Any = None
    surface: Surface | Mapping[str, Any] | None = None
    time: int | None = None


NewEntryLike = NewEntry | tuple[Any, ...] | Mapping[str, Any]

# --------------------------------------------------------------------------- vocabulary


class _Schema(Struct, kw_only=True):
    """Base of every payload schema: unknown extra fields are allowed and kept."""


class TextBlock(_Schema, tag="text", tag_field="type"):
    text: str


class ImageBlock(_Schema, tag="image", tag_field="type"):
    url: str | None = None
    data: str | None = None
    mimeType: str | None = None

    def __post_init__(self) -> None:
        if self.url is None and self.data is None:
            raise ValueError("an image block needs `url` or `data`")


class ReasoningBlock(_Schema, tag="reasoning", tag_field="type"):
    text: str
    signature: str | None = None


class ToolCallBlock(_Schema, tag="tool-call", tag_field="type"):
    id: str
    name: str
    arguments: str


class ToolResultBlock(_Schema, tag="tool-result", tag_field="type"):
    toolCallId: str
    content: Any = None
    isError: bool = False


ContentBlock = TextBlock | ImageBlock | ReasoningBlock | ToolCallBlock | ToolResultBlock
Content = str | list[ContentBlock]


class UserMessageData(_Schema):
    content: Content
    source: Any = None


class ToolResultData(_Schema):
    callId: str
    content: Content
    isError: bool = False
    turn: int | None = None
    step: int | None = None
    error: dict[str, Any] | None = None
    meta: Any = None


class ContextMessageData(_Schema):
    content: Content
    source: Any = None


class SteeringMessageData(_Schema):
    content: Content
    turn: int | None = None
    source: Any = None


TOOL_CALLS_SHAPE = (
    '"tool_calls": [{"id": "call_1", "type": "function", '
    '"function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}] '
    "(arguments a JSON string), answered by a tool/result with the same callId"
)
"""The OpenAI tool-call shape, named in the error that refuses a malformed one."""


class OpenAIFunction(_Schema):
    name: str
    arguments: str


class OpenAIToolCall(_Schema):
    id: str
    function: OpenAIFunction
    type: str = "function"


class AssistantMessageData(_Schema):
    """An assistant message: `content` (text or blocks, ``tool-call`` blocks included) and, in the
    OpenAI shape, `tool_calls` — each projected as the tool-call block it is, so `to_openai` and
    `to_anthropic` both send it and its ``tool/result`` (``callId`` = the call's id) stays paired."""

    content: Content | None = None
    tool_calls: list[OpenAIToolCall] | None = None
    turn: int | None = None
    step: int | None = None
    usage: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant/message needs `content` or `tool_calls`")
        check_tool_calls(self.tool_calls, self.content)


TOOL_CALL_BLOCK_SHAPE = '{"type": "tool-call", "id": "call_1", "name": "get_weather", "arguments": "{}"}'


def check_tool_calls(tool_calls: Sequence[OpenAIToolCall] | None, content: Any) -> None:
    """The one rule for the tool calls of a message, whatever its type (``assistant/message``,
    ``message``): each ``tool-call`` content block has a string `id`, `name` and `arguments` (a
    JSON string), and no id repeats across the OpenAI `tool_calls` and those blocks. Raises
    `ValueError` (msgspec reports it as the payload's validation error)."""
    ids = [c.id for c in tool_calls or ()]
    for i, b in enumerate(content if isinstance(content, list) else ()):
        if isinstance(b, ToolCallBlock):
            ids.append(b.id)
        elif isinstance(b, dict) and b.get("type") == "tool-call":
            try:
                ids.append(msgspec.convert(b, ToolCallBlock).id)
            except msgspec.ValidationError as e:
                raise ValueError(
                    f"content[{i}] is a malformed tool-call block: {e} (accepted: {TOOL_CALL_BLOCK_SHAPE})"
                ) from None
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"tool call ids must be unique within a message: {', '.join(map(repr, repeated))} repeats")


class ChatMessageData(_Schema):
    """A plain chat message as ChatLuna, nanobot and OpenAI write it."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[OpenAIToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def __post_init__(self) -> None:
        check_tool_calls(self.tool_calls, self.content)


class CutData(_Schema):
    """Compaction: the projection becomes `summary` (or a usable `native`) + messages from `before`."""

    before: NonNeg
    summary: list[ChatMessageData]
    reason: str
    native: Any = None
    meta: dict[str, Any] | None = None


TURN_END_REASONS = frozenset({"completed", "aborted", "error", "disposed", "max-tokens", "rejected", "interrupted"})


class TurnStartData(_Schema):
    turn: Positive
    trigger: dict[str, Any] | None = None


class TurnEndData(_Schema):
    turn: Positive
    reason: str | dict[str, Any]

    def __post_init__(self) -> None:
        kind = self.reason if isinstance(self.reason, str) else self.reason.get("kind")
        if kind not in TURN_END_REASONS:
            raise ValueError(f"turn/end reason must be one of {sorted(TURN_END_REASONS)}, got {kind!r}")


class StepData(_Schema):
    turn: Positive
    step: Positive


class AssistantChunkData(_Schema):
    turn: int | None = None
    step: int | None = None
    chunk: Any = None


class ToolCallData(_Schema):
    callId: str
    name: str
    arguments: str
    turn: int | None = None
    step: int | None = None


class PromptBlockedData(_Schema):
    content: Content
    reason: str
    source: Any = None


class TodoItem(_Schema):
    content: str
    status: Literal["pending", "in_progress", "completed"]


class TodoWriteData(_Schema):
    todos: list[TodoItem]


class RequestHeaderData(_Schema):
    header: dict[str, Any]
    reason: Any = None


class RequestHeaderDeltaData(_Schema):
    system: dict[str, Any] | None = None
    tools: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    messagePrefix: list[dict[str, Any]] | None = None


class PresetSelectedData(_Schema):
    presetId: str
    revision: str | None = None


class RequestContextData(_Schema):
    provider: str
    model: str
    contextWindow: int | None = None


class InputEnqueuedData(_Schema):
    messageId: str
    message: Any = None
    target: Literal["next-turn", "next-step"] | None = None
    wakeup: bool | None = None
    enqueuedAt: int | None = None


class InputAdmittedData(_Schema):
    messageId: str
    n: NonNeg


class InputDiscardedData(_Schema):
    messageId: str
    reason: str


class TurnSkipData(_Schema):
    reason: str
    detail: str | None = None
    turn: int | None = None


class AssistantInterruptedData(_Schema):
    """A streamed answer cut short (docs/design.md §8.2): its id, why (cancelled, error, crashed),
    how many deltas it had and the content they make; the chunk rows before it hold every delta."""

    answer: str
    reason: str
    deltas: int
    content: list[Any]
    turn: int | None = None
    step: int | None = None


#: `None` as a schema means "any JSON object".
DEFAULT_SCHEMAS: dict[str, Any] = {
    "user/message": UserMessageData,
    "assistant/message": AssistantMessageData,
    "tool/result": ToolResultData,
    "context/message": ContextMessageData,
    "steering/message": SteeringMessageData,
    "message": ChatMessageData,
    "cut": CutData,
    "turn/start": TurnStartData,
    "turn/end": TurnEndData,
    "step/start": StepData,
    "step/end": StepData,
    "assistant/chunk": AssistantChunkData,
    "assistant/interrupted": AssistantInterruptedData,
    "tool/call": ToolCallData,
    "prompt/blocked": PromptBlockedData,
    "todo/write": TodoWriteData,
    "request/header": RequestHeaderData,
    "request/header-delta": RequestHeaderDeltaData,
    "prompt": None,
    "preset/selected": PresetSelectedData,
    "request/context": RequestContextData,
    "agent/input-enqueued": InputEnqueuedData,
    "agent/input-admitted": InputAdmittedData,
    "agent/input-discarded": InputDiscardedData,
    "turn-skip": TurnSkipData,
    "session/meta": None,
}


class StrictPresetSelectedData(_Schema):
    """ChatLuna's ``preset/selected`` as its doc writes it: both fields required."""

    presetId: str
    revision: str


class StrictInputEnqueuedData(_Schema):
    """ChatLuna's ``agent/input-enqueued`` as its doc writes it: every field required."""

    messageId: str
    message: Any
    target: Literal["next-turn", "next-step"]
    wakeup: bool
    enqueuedAt: int


#: What a strict vocabulary checks beyond `DEFAULT_SCHEMAS`: ChatLuna's marks with every field
#: its doc lists (the lenient defaults accept older writers that left some out).
STRICT_SCHEMAS: dict[str, Any] = {
    **DEFAULT_SCHEMAS,
    "preset/selected": StrictPresetSelectedData,
    "agent/input-enqueued": StrictInputEnqueuedData,
}

_TYPE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/|+-]{0,127}$")


def validate_type_name(entry_type: object) -> str:
    if not isinstance(entry_type, str) or not _TYPE_NAME.match(entry_type):
        raise InvalidEntryError(
            f"entry type {entry_type!r} is not a valid type name "
            "(1-128 characters: letters, digits and _ . : / | + -, starting with a letter or digit)"
        )
    return entry_type


class Vocabulary:
    """The schemas of entry types. `define()` adds or replaces one.

    In strict mode a type without a schema is rejected, and ChatLuna's ``preset/selected`` and
    ``agent/input-enqueued`` need every field their doc lists (`STRICT_SCHEMAS`); otherwise an
    unknown type is accepted as a mark whose data must be a JSON object.
    """

    def __init__(self, *, strict: bool = False, schemas: Mapping[str, Any] | None = None) -> None:
        self.strict = strict
        self._decoders: dict[str, msgspec.json.Decoder[Any] | None] = {}
        defaults = STRICT_SCHEMAS if strict else DEFAULT_SCHEMAS
        for name, schema in (defaults if schemas is None else schemas).items():
            self.define(name, schema)
        # `cut` is part of every vocabulary: the projection and the stores' bound checks depend on it.
        self._decoders.setdefault(CUT, _CUT_DECODER)

    def define(self, entry_type: str, schema: Any = None) -> None:
        """Register `entry_type` with a schema: a msgspec Struct, any type msgspec can decode into
        (TypedDict, dataclass, ``dict[str, int]`` …), or None for "any JSON object"."""
        validate_type_name(entry_type)
        if entry_type == CUT and entry_type in self._decoders:
            raise ValueError("the `cut` schema is fixed: the projection depends on it")
        self._decoders[entry_type] = None if schema is None else msgspec.json.Decoder(schema)

    def __contains__(self, entry_type: object) -> bool:
        return entry_type in self._decoders

    def copy(self) -> Vocabulary:
        new = Vocabulary.__new__(Vocabulary)
        new.strict = self.strict
        new._decoders = dict(self._decoders)
        return new

    def check(self, entry_type: str, raw: bytes, index: int | None) -> None:
        try:
            decoder = self._decoders[entry_type]
        except KeyError:
            if self.strict:
                raise InvalidEntryError(
                    f"unknown entry type {entry_type!r} (strict mode: define() it first)", index=index
                ) from None
            return
        if decoder is not None:
            try:
                decoder.decode(raw)
            except msgspec.ValidationError as e:
                hint = f" (accepted: {TOOL_CALLS_SHAPE})" if "tool_calls" in str(e) else ""
                raise InvalidEntryError(f"{entry_type}: {e}{hint}", index=index) from None


# --------------------------------------------------------------------------- encoding

_encoder = msgspec.json.Encoder()
_decode_any = msgspec.json.Decoder()
_surface_decoder = msgspec.json.Decoder(Surface)
_CUT_DECODER: msgspec.json.Decoder[Any] = msgspec.json.Decoder(CutData)


def lossless_json(value: Any, what: str, index: int | None = None) -> bytes:
    """Encode `value` as JSON, or raise `InvalidEntryError` if JSON cannot hold it exactly.

    NaN, Infinity, bytes, sets, tuples, non-string keys, arbitrary objects and cycles are
    all rejected: the encoded form must decode back equal to the input.
    """
    return _lossless(value, what, index)[0]


def _lossless(value: Any, what: str, index: int | None = None) -> tuple[bytes, Any]:
    """`lossless_json`, also returning the decoded twin it compared: a snapshot of `value` that
    later changes by the caller cannot reach."""
    if isinstance(value, Struct):
        value = msgspec.to_builtins(value)
    try:
        raw = _encoder.encode(value)
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError) as e:
        raise InvalidEntryError(f"{what} is not JSON-serializable: {e}", index=index) from None
    try:
        back = _decode_any.decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:
        raise InvalidEntryError(f"{what} is not JSON-serializable: {e}", index=index) from None
    if back != value:
        raise InvalidEntryError(
            f"{what} is not lossless JSON (NaN/Infinity, bytes, sets, tuples or non-string keys)",
            index=index,
        )
    return raw, back


class EncodedEntry(Struct, frozen=True):
    """A validated entry, ready for a store: the wire bytes and their decoded twins."""

    type: str
    time: int | None
    data_raw: bytes
    data: dict[str, Any]
    meta_raw: bytes | None = None
    meta: dict[str, Any] | None = None
    surface_raw: bytes | None = None
    surface: Surface | None = None
    # The largest n this entry refers to, exclusive: a cut's `before`; a surface's max(sourceEventSeqs)
    # + 1 (and a replace's end + 1). Valid only while it is <= the entry's own n; the stores check it
    # once n is known (append.lua's 6th per-entry value).
    bound: int | None = None

    @property
    def size(self) -> int:
        return len(self.type) + len(self.data_raw) + len(self.meta_raw or b"") + len(self.surface_raw or b"")

    def stored(self, n: int, time: int) -> Entry:
        return Entry(
            n=n,
            time=self.time if self.time is not None else time,
            type=self.type,
            data=self.data,
            meta=self.meta,
            surface=self.surface,
        )


def as_new_entry(item: NewEntryLike, index: int | None = None) -> NewEntry:
    """Accept a NewEntry, a ``(type, data[, meta[, surface[, time]]])`` tuple or a mapping."""
    if isinstance(item, NewEntry):
        return item
    if isinstance(item, tuple):
        if not 2 <= len(item) <= 5:
            raise InvalidEntryError("an entry tuple is (type, data[, meta[, surface[, time]]])", index=index)
        return NewEntry(*item)
    if isinstance(item, Mapping):
        try:
            return NewEntry(**item)
        except TypeError as e:
            raise InvalidEntryError(f"bad entry mapping: {e}", index=index) from None
    raise InvalidEntryError(
        f"expected a NewEntry, a (type, data) tuple or a mapping, got {type(item).__name__}", index=index
    )


def _surface(value: Any, index: int) -> tuple[Surface | None, bytes | None]:
    if value is None:
        return None, None
    try:
        if isinstance(value, Surface):
            surface = value
        else:
            surface = _surface_decoder.decode(lossless_json(value, "surface", index))
    except msgspec.ValidationError as e:
        raise InvalidEntryError(f"invalid surface metadata: {e}", index=index) from None
    seqs = surface.source_event_seqs
    if seqs is not None and len(set(seqs)) != len(seqs):
        raise InvalidEntryError("surface sourceEventSeqs has duplicates", index=index)
    if surface.is_replace and not seqs:
        raise InvalidEntryError("a surface replace must list the replaced nodes in sourceEventSeqs", index=index)
    return surface, _encoder.encode(surface)


def encode_entry(
    item: NewEntryLike,
    vocabulary: Vocabulary,
    *,
    index: int = 0,
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
) -> EncodedEntry:
    e = as_new_entry(item, index)
    entry_type = validate_type_name(e.type)
    data_raw, data = _lossless(e.data, "data", index)
    if not isinstance(data, dict):
        raise InvalidEntryError(f"data must be a JSON object, got {type(e.data).__name__}", index=index)
    vocabulary.check(entry_type, data_raw, index)
    meta_raw = meta = None
    if e.meta is not None:
        meta_raw, meta = _lossless(e.meta, "meta", index)
        if not isinstance(meta, dict):
            raise InvalidEntryError("meta must be a JSON object", index=index)
    surface, surface_raw = _surface(e.surface, index)
    if surface is not None and entry_type not in MESSAGE_TYPES:
        raise InvalidEntryError(
            f"{entry_type!r} is not surface-eligible and cannot carry surface metadata", index=index
        )
    if e.time is not None and (not isinstance(e.time, int) or isinstance(e.time, bool) or not 0 <= e.time < 1 << 53):
        raise InvalidEntryError(f"time must be a non-negative int (ms), got {e.time!r}", index=index)
    bound: int | None = None
    if entry_type == CUT:
        # whatever the vocabulary says: a cut the projection cannot read never reaches the log
        try:
            bound = _CUT_DECODER.decode(data_raw).before
        except msgspec.ValidationError as err:
            raise InvalidEntryError(f"cut: {err}", index=index) from None
    elif surface is not None:
        bound = surface_bound(surface)
    enc = EncodedEntry(
        type=entry_type,
        time=e.time,
        data_raw=data_raw,
        data=data,
        meta_raw=meta_raw,
        meta=meta,
        surface_raw=surface_raw,
        surface=surface,
        bound=bound,
    )
    if enc.size > max_entry_bytes:
        raise InvalidEntryError(f"entry is {enc.size} bytes; the limit is {max_entry_bytes}", index=index)
    return enc


def encode_batch(
    items: Iterable[NewEntryLike],
    vocabulary: Vocabulary,
    *,
    first_n: int | None = None,
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> list[EncodedEntry]:
    """Validate a whole batch before anything is written. `first_n`, when known (an
    expected-n append), lets cuts and surface source seqs be checked against their own n."""
    check_entries(items)
    out: list[EncodedEntry] = []
    for i, item in enumerate(items):
        if i >= max_batch:
            raise InvalidEntryError(f"a batch holds at most {max_batch} entries")
        enc = encode_entry(item, vocabulary, index=i, max_entry_bytes=max_entry_bytes)
        if first_n is not None:
            own_n = first_n + i
            check_against_n(enc, own_n, i)
        elif enc.surface is not None and enc.surface.is_replace:
            raise InvalidEntryError(
                "a surface replace depends on the log before it: append it with an expected_n",
                index=i,
            )
        out.append(enc)
    return out


def batch_digest(batch: Sequence[EncodedEntry]) -> bytes:
    """A 64-bit digest of a batch (16 hex digits), stored with its idempotency key: a retry of the
    same batch matches it, a key reused for another batch does not. Covers each entry's type, given
    time, data, meta and surface (length-prefixed, so no two batches share an encoding)."""
    parts: list[bytes] = []
    for e in batch:
        t = b"" if e.time is None else b"%d" % e.time
        m = e.meta_raw or b""
        sf = e.surface_raw or b""
        parts.append(
            b"%d:%b%d:%b%d:%b%d:%b%d:%b"
            % (len(e.type), e.type.encode(), len(t), t, len(e.data_raw), e.data_raw, len(m), m, len(sf), sf)
        )
    return hashlib.blake2b(b"".join(parts), digest_size=8).hexdigest().encode()


def surface_bound(surface: Surface) -> int | None:
    """The largest n a surface refers to, plus one (None when it names none)."""
    seqs = surface.source_event_seqs
    hi = max(seqs) + 1 if seqs else None
    if isinstance(surface.op, SurfaceReplace):
        hi = max(hi or 0, surface.op.end + 1)
    return hi


def bound_error(enc: EncodedEntry, own_n: int, index: int) -> InvalidEntryError:
    """The error for an entry whose `bound` is beyond its own n (one wording for every store)."""
    if enc.type == CUT:
        return InvalidEntryError(f"cut.before={enc.bound} is outside [0, {own_n}] (the cut's own n)", index=index)
    seqs = enc.surface.source_event_seqs if enc.surface is not None else None
    if enc.surface is not None and isinstance(enc.surface.op, SurfaceReplace):
        op = enc.surface.op
        return InvalidEntryError(
            f"surface replace {op.start}..{op.end} and sourceEventSeqs {seqs} must name earlier entries (< {own_n})",
            index=index,
        )
    return InvalidEntryError(f"surface sourceEventSeqs {seqs} must name earlier entries (< {own_n})", index=index)


def check_against_n(enc: EncodedEntry, own_n: int, index: int) -> None:
    if enc.bound is not None and enc.bound > own_n:
        raise bound_error(enc, own_n, index)


# --------------------------------------------------------------------------- I-JSON

MAX_JSON_DEPTH = 64
"""Arrays and objects nest at most this deep in a document from outside (a request body, a line
of an imported file)."""
MAX_SAFE_INT = 2**53 - 1
"""Integers beyond ±this lose precision in JavaScript (and every IEEE-double JSON reader)."""


class NotIJsonError(ValueError):
    """A decoded JSON document that is not I-JSON (RFC 7493), what every client reads back as it
    was written: `path` is the field (``$.data.a[1]``; for a duplicate member name, the object
    holding it, and `key` the name), `problem` what is wrong with it; the message is both."""

    def __init__(self, problem: str, path: str, key: str | None = None) -> None:
        self.problem, self.path, self.key = problem, path, key
        super().__init__(f"{problem} in the object at {path}" if key is not None else problem)


class _Duplicate:
    """Stands, in a re-parsed document, for an object holding a duplicate member name `key`."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> Any:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                return _Duplicate(k)  # its place in the document is found once the whole is parsed
            seen.add(k)
    return d


def _find_duplicate(value: Any) -> tuple[str, str] | None:
    """(path of the object, member name) of the first object, in document order, that holds a
    duplicate member name; without recursion (the document's depth is already bounded)."""
    stack: list[tuple[Any, str]] = [(value, "$")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, _Duplicate):
            return path, v.key
        if isinstance(v, dict):
            stack.extend((x, f"{path}.{k}") for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def _audit(value: dict[str, Any] | list[Any]) -> None:
    """Depth and integer range of a decoded document, without recursion."""
    stack: list[tuple[Any, str, int]] = [(value, "$", 1)]
    while stack:
        v, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise NotIJsonError(f"arrays and objects nest deeper than {MAX_JSON_DEPTH} levels", path)
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, x in items:
            if isinstance(x, (dict, list)):
                stack.append((x, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]", depth + 1))
            elif type(x) is int and not -MAX_SAFE_INT <= x <= MAX_SAFE_INT:
                where = f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]"
                raise NotIJsonError(
                    "integers are within ±(2^53 - 1), so every JSON client reads them exactly; "
                    "send a larger one as a string",
                    where,
                )


def _scan(value: dict[str, Any] | list[Any]) -> int | None:
    """The members of every object in `value` plus the colons inside its strings (member names
    included), when it nests at most `MAX_JSON_DEPTH` deep and holds no integer beyond
    ±`MAX_SAFE_INT`; None when it does not (`_audit` then says where). One pass, no paths: the
    common case costs a walk, not a second parse."""
    count = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        v, depth = pop()
        if depth > MAX_JSON_DEPTH:
            return None
        if type(v) is dict:
            count += len(v)
            for k in v:
                if ":" in k:
                    count += k.count(":")
            items: Any = v.values()
        else:
            items = v
        for x in items:
            t = type(x)
            if t is str:
                if ":" in x:
                    count += x.count(":")
            elif t is dict or t is list:
                push((x, depth + 1))
            elif t is int and not -MAX_SAFE_INT <= x <= MAX_SAFE_INT:
                return None
    return count


def check_ijson(value: Any, raw: bytes) -> None:
    """Raise `NotIJsonError` unless `value`, decoded from `raw`, is I-JSON beyond what a decoder
    checks: nesting at most `MAX_JSON_DEPTH` deep, integers within ±`MAX_SAFE_INT`, and no
    duplicate member name (a decoder keeps the last one silently: `raw` is parsed again to find
    it). NaN, Infinity, invalid UTF-8 and lone surrogates are the decoder's to refuse."""
    if not isinstance(value, (dict, list)):
        return
    counted = _scan(value)
    if counted is None:
        _audit(value)  # names the path of what `_scan` refused
    colons = raw.count(b":")
    if counted == colons and b"\\u" not in raw:
        # every colon of `raw` is a member's or inside a string the decoder kept: no member
        # was dropped, so no name appears twice (a \u escape could spell a colon: never here)
        return
    if colons > 1:  # duplicate names need two members somewhere
        found = _find_duplicate(json.loads(raw, object_pairs_hook=_unique))
        if found is not None:
            where, key = found
            raise NotIJsonError(f"the member name {key!r} appears twice", where, key)


# --------------------------------------------------------------------------- decoding


ENTRY_DECODER = msgspec.json.Decoder(Entry)
ENTRY_LIST_DECODER = msgspec.json.Decoder(list[Entry])
ENTRY_ENCODER = msgspec.json.Encoder()


def now_ms() -> int:
    import time

    return time.time_ns() // 1_000_000


def entries_equal_ignoring_time(a: Sequence[Entry], b: Sequence[Entry]) -> bool:
    return [msgspec.structs.replace(x, time=0) for x in a] == [msgspec.structs.replace(x, time=0) for x in b]


def new_header(session_id: str, **fields: Any) -> SessionHeader:
    return SessionHeader(id=session_id, **fields)


__all__ = [
    "CUT",
    "MAX_JSON_DEPTH",
    "MAX_SAFE_INT",
    "MESSAGE_TYPES",
    "Content",
    "ContentBlock",
    "EncodedEntry",
    "Entry",
    "NewEntry",
    "NotIJsonError",
    "Page",
    "SessionHead",
    "SessionHeader",
    "Surface",
    "SurfaceReplace",
    "Vocabulary",
    "check_ijson",
    "encode_batch",
    "field",
    "kind_of",
]
