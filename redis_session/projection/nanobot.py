"""nanobot sessions on a log: the one rule that reads a nanobot session out of a log, and the key
mapping. The nanobot store adapter (`redis_session.adapters.nanobot_store`), the legacy drop-in
and the nanobot importer/exporter all read logs through `fold`, so they cannot drift apart.

A nanobot session is ``messages`` (the whole transcript nanobot keeps), ``last_archived`` (the
Memory watermark; ``last_consolidated`` in older nanobot), ``metadata``, ``provider_state``,
``created_at`` and ``updated_at``. On the log:

- ``message`` entries (and ``nanobot/command`` marks for ``_command`` messages, which nanobot
  never sends to a model, and ``nanobot/record`` marks for messages our ``message`` schema does
  not take) are the messages, their data the nanobot message itself; ``meta.nanobot.at = i``
  inserts one at list index i instead of appending (nanobot's hidden summary checkpoint is
  inserted at its boundary);
- ``nanobot/state`` marks change the rest: ``metadata_set`` (top-level keys, merged in order),
  ``metadata_unset``, ``metadata`` (the whole dict, when key order moved), ``provider_state``
  (nanobot's private record; null clears it), ``created_at``, ``updated_at``; the legacy
  ``nanobot/metadata`` mark replaces the whole metadata;
- a ``cut`` with ``meta.nanobot = {floor, last_archived}`` drops the messages of entries below
  ``floor`` (``/new``, a rewrite) and sets ``last_archived`` (an index into the messages kept);
  a cut written by anyone else (a compactor) archives the messages below its ``before``;
- the header's ``origin`` (``{"format": "nanobot", "key", "created_at", "updated_at",
  "metadata", "last_archived", "last_consolidated", "provider_state"}``, as line 1 of the file
  or the first save had them) is where the fold starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..errors import InvalidEntryError, InvalidSessionIdError
from ..keys import escape_key, unescape_key, validate_session_id
from ..model import CUT, Entry, SessionHead

FORMAT = "nanobot"
MESSAGE = "message"
COMMAND = "nanobot/command"
RECORD = "nanobot/record"
STATE = "nanobot/state"
METADATA = "nanobot/metadata"  # the legacy drop-in's whole-metadata mark
#: the mark types nanobot logs carry (registered as "any JSON object")
MARK_TYPES = (COMMAND, RECORD, STATE, METADATA)
MESSAGE_TYPES = frozenset({MESSAGE, COMMAND, RECORD})

_HASHED = "nanobot~"


def encode(value: Any, what: str = "value") -> bytes:
    """The JSON of a value, key order kept: what tells two versions of a message (or a metadata
    value) apart. A value JSON cannot hold (nested past msgspec's depth limit, a lone surrogate,
    an arbitrary object) raises `InvalidEntryError` naming `what`: nothing is written."""
    try:
        return msgspec.json.encode(value)
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError) as e:
        raise InvalidEntryError(f"{what} is not JSON-serializable: {e}") from None


def clone(value: Any) -> Any:
    """A deep copy of JSON data: a msgpack round trip (many times faster than `copy.deepcopy`),
    or a JSON one when an integer is past msgpack's 64 bits (JSON, nanobot's files and the log
    hold any integer: ``2**64`` is a channel id like any other)."""
    try:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(value))
    except OverflowError:
        return msgspec.json.decode(msgspec.json.encode(value))


def key_to_id(key: str) -> str:
    """The session id a nanobot key lives under: the key itself when it is a valid id without
    ``%``, else each forbidden character, invisible format character and ``%`` as its UTF-8 bytes
    in ``%XX`` (`redis_session.keys.escape_key`: ``discord:guild 42`` → ``discord:guild%2042``);
    `id_to_key` reverses it. A key whose escaped form is longer than an id may be is stored under
    ``nanobot~<sha256>`` (the key itself stays in the header's ``origin``)."""
    import hashlib

    if not isinstance(key, str):
        raise TypeError(f"a nanobot key is a str, got {type(key).__name__}")
    mapped = escape_key(key)
    if mapped and not mapped.startswith(_HASHED):
        try:
            return validate_session_id(mapped)
        except InvalidSessionIdError:
            pass  # too long (or a lone surrogate): hashed
    return _HASHED + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def id_to_key(session_id: str) -> str | None:
    """The key `key_to_id` mapped to `session_id` (None for a hashed id: read ``origin.key``)."""
    if session_id.startswith(_HASHED):
        return None
    return unescape_key(session_id)


def listed_key(session_id: str, stored: str, mapping: Callable[[str], str] = key_to_id) -> str | None:
    """The key nanobot finds session `session_id` under (with `mapping`, a store's key mapping):
    the key stored in its header when it maps to the id, else the key `id_to_key` gives for the
    id when that maps back (a file imported with ``--id``: a copy, never listed under the file's
    key, whose own session that is), else None (no key reaches it: a listing leaves it out, as
    nanobot could not load it)."""

    def maps(key: str) -> bool:
        try:
            return mapping(key) == session_id
        except ValueError:  # a mapping that refuses the key (an invalid id)
            return False

    if maps(stored):
        return stored
    try:
        key = id_to_key(session_id)
    except UnicodeDecodeError:  # a "%" escape of no UTF-8 text: no key maps to it
        return None
    return key if key is not None and maps(key) else None


def summary_text(metadata: dict[str, Any]) -> str | None:
    """The consolidation summary nanobot puts in the prompt for this metadata (its context
    builder's ``[Archived Context Summary]`` block, AutoCompact's ``Previous conversation summary
    (last active …)`` text), or None."""
    meta = metadata.get("_last_summary")
    if isinstance(meta, dict) and isinstance(meta.get("text"), str) and meta["text"]:
        text = meta["text"]
        last_active = meta.get("last_active")
        if isinstance(last_active, str) and last_active:
            text = f"Previous conversation summary (last active {last_active}):\n{text}"
        return f"[Archived Context Summary]\n\n{text}"
    if isinstance(meta, str) and meta:
        return f"[Archived Context Summary]\n\n{meta}"
    return None


def summary_messages(metadata: dict[str, Any]) -> list[dict[str, Any]]:
    """`summary_text` as the one user message a cut's summary holds (or none)."""
    text = summary_text(metadata)
    return [{"role": "user", "content": text}] if text is not None else []


_SUMMARY_HEAD = "[Archived Context Summary]\n\n"


def _summary_of(messages: Any) -> str:
    """The text of a cut's summary messages (without the heading nanobot's prompt adds again)."""
    parts: list[str] = []
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            content = "\n".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
        if isinstance(content, str) and content:
            parts.append(content.removeprefix(_SUMMARY_HEAD))
    return "\n\n".join(parts)


def _offset(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def archive_offset(data: dict[str, Any]) -> int:
    """nanobot's watermark across its field rename: ``last_archived``, else
    ``last_consolidated``, else 0."""
    for name in ("last_archived", "last_consolidated"):
        offset = _offset(data.get(name))
        if offset is not None:
            return offset
    return 0


@dataclass
class NanobotState:
    """What nanobot loads from a log (and where in the log each message came from)."""

    session_id: str
    key: str
    incarnation: str
    n: int = 0  # entries folded
    created_at: str | None = None
    updated_at: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    ns: list[int] = field(default_factory=list)  # the entry n of each message
    last_archived: int = 0
    provider_state: Any = None
    nanobot_entries: int = 0  # entries of nanobot's own types (0: a generic log)
    seam: bool = False  # written through nanobot 0.3's store seam (its files carry last_archived)
    foreign_summary: str | None = None  # the summary of the last cut, when another tool wrote it
    foreign_active: str | None = None  # nanobot's updated_at when that cut landed

    @classmethod
    def start(cls, head: SessionHead) -> NanobotState:
        """The state before the first entry: what the header's ``origin`` says."""
        header = head.header
        origin = header.origin if isinstance(header.origin, dict) else {}
        key = origin.get("key")
        if not isinstance(key, str):
            key = id_to_key(header.id) or header.id
        metadata = origin.get("metadata")
        created = origin.get("created_at")
        updated = origin.get("updated_at")
        return cls(
            session_id=header.id,
            key=key,
            incarnation=header.incarnation,
            created_at=created if isinstance(created, str) else None,
            updated_at=updated if isinstance(updated, str) else None,
            metadata=clone(metadata) if isinstance(metadata, dict) else {},
            last_archived=archive_offset(origin),
            provider_state=clone(origin.get("provider_state")),
        )

    def copy(self) -> NanobotState:
        return NanobotState(
            session_id=self.session_id,
            key=self.key,
            incarnation=self.incarnation,
            n=self.n,
            created_at=self.created_at,
            updated_at=self.updated_at,
            metadata=clone(self.metadata),
            messages=clone(self.messages),
            ns=list(self.ns),
            last_archived=self.last_archived,
            provider_state=clone(self.provider_state),
            nanobot_entries=self.nanobot_entries,
            seam=self.seam,
            foreign_summary=self.foreign_summary,
            foreign_active=self.foreign_active,
        )

    def apply(self, entries: Iterable[Entry]) -> None:
        """Fold entries (contiguous, from `n`) into the state."""
        for e in entries:
            self.n = e.n + 1
            if e.type in MESSAGE_TYPES:
                self._message(e)
            elif e.type == STATE:
                self._state(e.data)
            elif e.type == METADATA:
                value = e.data.get("metadata")
                self.metadata = clone(value) if isinstance(value, dict) else {}
                self.nanobot_entries += 1
            elif e.type == CUT:
                self._cut(e.data)

    def _message(self, e: Entry) -> None:
        msg = clone(e.data)
        if e.type != MESSAGE:
            self.nanobot_entries += 1
        nb = e.meta.get("nanobot") if isinstance(e.meta, dict) else None
        at = _offset(nb.get("at")) if isinstance(nb, dict) else None
        if at is None or not 0 <= at < len(self.messages):
            self.messages.append(msg)
            self.ns.append(e.n)
            return
        self.messages.insert(at, msg)
        self.ns.insert(at, e.n)

    def _state(self, data: dict[str, Any]) -> None:
        self.nanobot_entries += 1
        self.seam = True
        whole = data.get("metadata")
        if isinstance(whole, dict):
            self.metadata = clone(whole)
        changes = data.get("metadata_set")
        if isinstance(changes, dict):
            self.metadata.update(clone(changes))
        if isinstance(whole, dict) or (isinstance(changes, dict) and "_last_summary" in changes):
            self.foreign_summary = None  # nanobot's own summary from here on
        gone = data.get("metadata_unset")
        if isinstance(gone, list):
            for k in gone:
                if isinstance(k, str):
                    self.metadata.pop(k, None)
        if "provider_state" in data:
            self.provider_state = clone(data["provider_state"])
        for name in ("created_at", "updated_at"):
            value = data.get(name)
            if isinstance(value, str):
                setattr(self, name, value)

    def _cut(self, data: dict[str, Any]) -> None:
        meta = data.get("meta")
        nb = meta.get("nanobot") if isinstance(meta, dict) else None
        if isinstance(nb, dict):
            self.nanobot_entries += 1
            floor = _offset(nb.get("floor"))
            if floor is not None:
                kept = [i for i, n in enumerate(self.ns) if n >= floor]
                self.messages = [self.messages[i] for i in kept]
                self.ns = [self.ns[i] for i in kept]
            self.last_archived = archive_offset(nb)
            self.foreign_summary = None
            return
        # Another tool compacted (a compactor, `Session.compact`): nanobot archives what the cut
        # hides (keeping every message); its summary is `foreign_summary` (until nanobot cuts
        # again), for nanobot's prompt to carry in place of what was archived.
        before = _offset(data.get("before")) or 0
        self.last_archived = sum(1 for n in self.ns if n < before)
        self.foreign_summary = _summary_of(data.get("summary")) or None
        self.foreign_active = self.updated_at  # the last activity the summary covers

    @property
    def archived(self) -> int:
        """`last_archived` as nanobot's `Session` normalises it (out of range: 0)."""
        la = self.last_archived
        return la if 0 <= la <= len(self.messages) else 0


def fold(head: SessionHead, entries: Iterable[Entry]) -> NanobotState:
    """The nanobot session a log holds (pure: the same log gives the same state)."""
    state = NanobotState.start(head)
    state.apply(entries)
    return state


__all__ = [
    "COMMAND",
    "FORMAT",
    "MARK_TYPES",
    "MESSAGE",
    "METADATA",
    "RECORD",
    "STATE",
    "NanobotState",
    "archive_offset",
    "encode",
    "fold",
    "id_to_key",
    "key_to_id",
    "listed_key",
    "summary_messages",
    "summary_text",
]
