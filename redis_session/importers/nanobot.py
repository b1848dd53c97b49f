"""nanobot's session files (HKUDS/nanobot ``SessionManager``, ``<workspace>/sessions/*.jsonl``).

Line 1 is ``{"_type":"metadata","key","created_at","updated_at","metadata":{…},
"last_consolidated":k}`` (times naive ISO, read as UTC); newer nanobot may write
``{"_type":"provider_state","state":…}`` next; then one OpenAI-style message per line with a
``timestamp``. The import keeps everything nanobot would send:

- each message → a ``message`` entry whose data is the line itself (``name``, list content,
  ``tool_calls``, ``reasoning_content``, ``thinking_blocks`` with signatures and
  ``redacted_thinking``, ``media``, ``cli_apps``, ``_channel_delivery`` … all kept), its time the
  timestamp; a ``_command`` message → a ``nanobot/command`` mark (nanobot never sends it to the
  model, but counts it);
- the metadata line (and ``provider_state``) → the header's ``origin``; ``metadata.title`` → the
  title;
- ``last_consolidated`` (normalised as nanobot does: not an int in [0, messages] means 0) and
  ``metadata._last_summary`` → a final ``cut {before: k, summary: [the summary nanobot puts in the
  prompt], reason: "nanobot:last_consolidated", meta: {nanobot: {floor: 0, last_consolidated: k}}}``
  — the cut `redis_session.adapters.nanobot` writes for the same session, so the adapter's
  ``get_history`` and the generic projection both show what nanobot shows;
- the session id is the nanobot store's own mapping of the key
  (`redis_session.projection.nanobot.key_to_id`: a key that is not a valid session id has its
  whitespace, braces and ``%`` percent-encoded, and one too long once encoded lives under
  ``nanobot~<sha256>``), so the store finds an imported session by its key; ``origin.key`` keeps
  the key;
- ``--id ID`` (a single file) imports the file as it is under that id (its export is still
  the file, byte for byte); nanobot's store lists, loads and saves it under the key that maps to
  ``ID`` (``id_to_key``: for an id without ``%`` the id itself), as a copy of the file's session,
  never under the file's key (whose own session that is). An id no key maps to (``nanobot~…``,
  a ``%`` the mapping never writes) is a session nanobot's store does not list;
- a message without ``timestamp`` stays without one (the export is byte-identical; nanobot
  writes such a message as it is).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from msgspec import Struct, field

from ..errors import ImportFormatError
from ..model import CUT, Entry, NewEntry, OpenAIToolCall, SessionHead, SessionHeader
from ..projection import nanobot as nanobot_log
from ..projection.fold import project
from ..projection.render import openai_messages
from .common import Bad, ParsedSession, Source, convert, iso_ms, json_object, ms_iso, session_id_to_key

FORMAT = "nanobot"
MESSAGE = "message"
COMMAND = "nanobot/command"
METADATA = "nanobot/metadata"
REASON = "nanobot:last_consolidated"


class MetadataLine(Struct):
    """Line 1 (other keys are kept in ``origin`` as they are)."""

    type_: Literal["metadata"] = field(name="_type")
    key: str
    created_at: str | None = None
    updated_at: str | None = None
    metadata: dict[str, Any] | None = None
    last_archived: Any = None
    last_consolidated: Any = 0


class MessageLine(Struct):
    """A message line: the fields the import reads or the store checks; all others are kept."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    timestamp: str | None = None
    tool_calls: list[OpenAIToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None
    thinking_blocks: list[dict[str, Any]] | None = None


def detect(first: dict[str, Any]) -> bool:
    return first.get("_type") == "metadata"


def summary_text(metadata: dict[str, Any]) -> str | None:
    """The consolidation summary nanobot puts in the prompt for this metadata (its context
    builder's ``[Archived Context Summary]`` block, AutoCompact's ``Previous conversation summary
    (last active …)`` text), or None. The same text as `redis_session.adapters.nanobot.summary_text`."""
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


def _lc(raw: Any, count: int) -> int:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw <= count else 0


class _Reader:
    def __init__(self, source: Source, session_id: str | None) -> None:
        self.source = source
        self.session_id = session_id
        self.entries: list[NewEntry] = []
        self.lines: list[int] = []

    def header(self, obj: dict[str, Any]) -> None:
        line = convert(obj, MetadataLine)
        self.key = line.key
        self.metadata = line.metadata or {}
        self.created_at = iso_ms(line.created_at, "created_at") if line.created_at is not None else 0
        if line.updated_at is not None:
            iso_ms(line.updated_at, "updated_at")
        title = self.metadata.get("title")
        self.title = title if isinstance(title, str) and title else None
        self.origin: dict[str, Any] = {"format": FORMAT, **{k: v for k, v in obj.items() if k != "_type"}}
        self.origin.setdefault("metadata", self.metadata)
        self.last_time: int | None = self.created_at or None

    def line(self, no: int, obj: dict[str, Any]) -> None:
        kind = obj.get("_type")
        if kind == "provider_state":
            self.origin["provider_state"] = obj.get("state")
            return
        if kind is not None:
            raise Bad(f"unknown record _type {kind!r} (expected a message)")
        msg = convert(obj, MessageLine, "bad message: ")
        time = self.last_time if msg.timestamp is None else iso_ms(msg.timestamp, "timestamp")
        self.last_time = time
        self.entries.append(NewEntry(COMMAND if obj.get("_command") else MESSAGE, obj, None, None, time))
        self.lines.append(no)

    def finish(self) -> ParsedSession:
        lc = _lc(nanobot_log.archive_offset(self.origin), len(self.entries))
        summary = summary_text(self.metadata)
        if lc > 0 or summary is not None:
            data = {
                "before": lc,
                "summary": [{"role": "user", "content": summary}] if summary is not None else [],
                "reason": REASON,
                "meta": {"nanobot": {"floor": 0, "last_consolidated": lc}},
            }
            self.entries.append(NewEntry(CUT, data, None, None, self.last_time))
            self.lines.append(0)
        path = self.source.path
        # the store's own mapping (`projection.nanobot.key_to_id`: a key too long once escaped
        # lives under nanobot~<sha256>), so imported files and the store share sessions
        if self.session_id is None:
            sid = nanobot_log.key_to_id(self.key)
            original = self.key if sid != self.key else None
        else:  # --id (see the module doc)
            sid, original = self.session_id, None
        header = SessionHeader(id=sid, created_at=self.created_at, title=self.title, origin=self.origin)
        return ParsedSession(str(path), FORMAT, header, self.entries, self.lines, original_id=original)


def parse(source: Source, session_id: str | None) -> ParsedSession:
    reader = _Reader(source, session_id)
    lines = source.nonblank()
    first = next(lines)
    try:
        reader.header(json_object(first))
    except Bad as e:
        raise ImportFormatError(source.path, first.no, f"bad header line: {e}") from None
    for line in lines:
        try:
            reader.line(line.no, json_object(line))
        except Bad as e:
            raise ImportFormatError(source.path, line.no, str(e), session_id=reader.key) from None
    return reader.finish()


# --------------------------------------------------------------------------- export


def fold(head: SessionHead, entries: Sequence[Entry]) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """The messages, metadata and ``last_archived`` nanobot would load for this log (the one
    rule, `redis_session.projection.nanobot.fold`). A log with none of nanobot's entries (a dsh
    or generic session) gives its projection as OpenAI messages, each with the time of its entry
    as ``timestamp``."""
    state = nanobot_log.fold(head, entries)
    return _messages(state, entries, _native(head)), state.metadata, state.archived


def _native(head: SessionHead) -> bool:
    origin = head.header.origin
    return isinstance(origin, dict) and origin.get("format") == FORMAT


def _messages(state: nanobot_log.NanobotState, entries: Sequence[Entry], native: bool = False) -> list[dict[str, Any]]:
    """The messages of the file: a nanobot session's (`native`: its header says so) exactly as
    nanobot holds them (a message nanobot wrote without ``timestamp`` stays without one: the file
    is byte-identical and imports back the same); another tool's messages get their entry's time
    as ``timestamp``, as nanobot's ``add_message`` would have set it."""
    if native:
        return state.messages
    times = {e.n: e.time for e in entries}
    if state.messages or state.nanobot_entries or not entries:
        out = []
        for n, m in zip(state.ns, state.messages, strict=True):
            out.append(m if "timestamp" in m else {**m, "timestamp": ms_iso(times.get(n, 0))})
        return out
    generic: list[dict[str, Any]] = []
    for pm in project(entries):
        stamp = ms_iso(max((times.get(n, 0) for n in pm.source), default=0))
        for msg in openai_messages([pm]):
            generic.append({**msg, "timestamp": stamp})
    return generic


def export_lines(head: SessionHead, entries: Sequence[Entry]) -> Iterator[str]:
    """The session as a nanobot session file, as nanobot's ``JsonlSessionStore`` writes it: line 1
    with ``last_archived`` (0.3.x; a file imported from an older nanobot keeps its layout without
    it), then ``provider_state`` when there is one, then one message a line."""
    origin = head.header.origin if isinstance(head.header.origin, dict) else {}
    state = nanobot_log.fold(head, entries)
    messages = _messages(state, entries, _native(head))
    la = state.archived
    # a file of an older nanobot (no last_archived on line 1) keeps its layout until 0.3 saves it
    legacy = (
        origin.get("format") == FORMAT
        and "last_consolidated" in origin
        and "last_archived" not in origin
        and not state.seam
    )
    first: dict[str, Any] = {
        "_type": "metadata",
        "key": state.key if isinstance(origin.get("key"), str) else session_id_to_key(head.header.id),
        "created_at": state.created_at or ms_iso(head.header.created_at),
        "updated_at": state.updated_at or ms_iso(head.updated_at),
        "metadata": state.metadata,
    }
    # the watermark values line 1 held, as written (nanobot reads an out-of-range or non-integer
    # one as 0 and so does the import): kept while they still load as the watermark this log
    # holds, so an untouched file exports byte-identical; once they would load otherwise (50
    # after the 50th message), the value nanobot would save
    raw = {k: origin[k] for k in ("last_archived", "last_consolidated") if k in origin}
    kept = origin.get("format") == FORMAT and _lc(nanobot_log.archive_offset(raw), len(messages)) == la
    if not legacy:
        first["last_archived"] = raw["last_archived"] if kept and "last_archived" in raw else la
    first["last_consolidated"] = raw["last_consolidated"] if kept and "last_consolidated" in raw else la
    yield json.dumps(first, ensure_ascii=False) + "\n"
    if state.provider_state is not None:
        yield json.dumps({"_type": "provider_state", "state": state.provider_state}, ensure_ascii=False) + "\n"
    for m in messages:
        yield json.dumps(m, ensure_ascii=False) + "\n"
