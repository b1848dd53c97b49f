"""Import and export of whole sessions as JSONL files.

**Our format** (`export_session` writes it, `import_path` reads it back exactly)::

    {"_type":"redis-session","version":1,"header":{"id":…,"format_version":1,"created_at":…,…},"n":3}
    {"n":0,"time":1718000000000,"type":"user/message","data":{"content":"hi"}}
    {"n":1,"time":…,"type":"assistant/message","data":{…},"meta":{…}}
    {"n":2,"time":…,"type":"tool/result","data":{…},"surface":{"surfaceOp":"append"}}

Line 1 holds the header and the number of entries (a truncated file is caught); each further line
is one stored entry (`Entry` as JSON: ``n, time, type, data, meta?, surface?``). A branch exports
its *stitched* log (entries from 0) and its header without ``parent``/``at``: the file stands
alone and imports as a root session; line 1 records where it was branched from
(``"branched_from": {"parent", "at"}``), for information only. Export then import gives the same
header (id, format_version, created_at, delegation_depth, title, origin) and the same entries,
times included.

**Foreign formats** (detected from the first line; see `import_path`):

- ``nanobot`` — a SessionManager file: ``{"_type":"metadata","key",…,"metadata":{…},
  "last_consolidated":k}`` then one OpenAI-style message per line with a ``timestamp`` (naive
  local ISO). Each message becomes a ``message`` entry whose data is the line itself (``timestamp``,
  ``tool_calls``, ``reasoning_content``, ``thinking_blocks``, ``media``, ``_channel_delivery`` …
  all kept); its time is the timestamp. The id is the metadata ``key`` (``telegram:12345``); the
  title is ``metadata.title``; the metadata line (and a ``provider_state`` line) goes to the header's
  ``origin``. Messages with ``_command`` (never sent to the model by nanobot) become
  ``nanobot/command`` marks. ``last_consolidated`` (normalised as nanobot does: not an int in
  [0, number of messages] means 0) is kept in ``origin``, and when it is > 0 a final
  ``cut {before: k, summary: [], reason: "nanobot:last_consolidated"}`` makes the projection show
  what nanobot's ``get_history`` shows: the messages from k on.
- ``dsh`` — a dsh-session file: ``{"type":"session","version":0,"id","createdAt",cwd?,
  parentSession?,seedLength?}`` then events ``{type, seq, time, data, surfaceOp?,
  sourceEventSeqs?}`` with ``seq`` 0, 1, 2 … (a gap is an error). Each event is the entry n=seq
  with its type, time, data and surface; the header's extra fields go to ``origin``.
- ``tutorial`` — the tutorial harness / mini-dsh logs: ``{"type":"session/meta","id",…}`` then
  events ``{type, seq?, ts|at, data?|…payload}`` (``ts`` in seconds, or ms when > 1e11; ``at`` an
  ISO string; the payload is ``data`` when the event has it, else the event's other keys). The
  message events become ``message`` entries holding exactly what the tutorial's
  ``deriveMessages`` produced: ``user/message`` → user, ``assistant/message`` → assistant (with its
  ``tool_calls``), ``assistant/tool_calls`` → assistant ``{content, tool_calls:[{id, type:
  "function", function:{name, arguments: JSON}}], reasoning_content?}``, ``tool/result`` → tool
  ``{tool_call_id, content}`` (non-string content as JSON). Their meta keeps the source event type
  (``{"event": "assistant/tool_calls"}``) and any payload keys not mapped (``payload``). Later
  ``session/meta`` events stay ``session/meta`` entries; every other event becomes a mark named
  ``tutorial/<type>`` (its data the payload), so the tutorial's lifecycle events never clash with
  our schemas of the same name. A ``seq`` that is not n is kept as ``meta.seq``.

**All or nothing per session.** Each file is read and validated completely (JSON, envelope, field
types, the store's schemas and entry size limit, surface metadata, the session id) before anything
is written; a problem raises `ImportFormatError` with the file and line number and nothing of that
session is written. Sessions longer than one store batch are written as ``create`` plus expected-n
``put`` batches; if a write fails part-way (server gone, cancellation, a concurrent writer), the
partial session is deleted before the error propagates.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import IO, Any, Literal, TextIO

import anyio
import anyio.to_thread
import msgspec

from .errors import (
    ImportFormatError,
    InvalidEntryError,
    InvalidSessionIdError,
    SessionAlreadyExistsError,
    SessionError,
    SessionNotFoundError,
)
from .keys import validate_session_id
from .model import (
    CUT,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_ENTRY_BYTES,
    FORMAT_VERSION,
    EncodedEntry,
    Entry,
    NewEntry,
    SessionHeader,
    check_against_n,
    encode_entry,
)
from .projection.fold import ProjectionState, check_surface
from .store.memory import SessionStore, check_header

Format = Literal["auto", "redis-session", "nanobot", "dsh", "tutorial"]
OnExists = Literal["error", "skip", "replace"]
Progress = Callable[[int, int], object]

EXPORT_TYPE = "redis-session"
EXPORT_VERSION = 1
#: A write batch holds at most this many bytes (and at most the store's `max_batch` entries).
BATCH_BYTES = 8 << 20
_READ_PAGE = 10_000

__all__ = [
    "EXPORT_TYPE",
    "EXPORT_VERSION",
    "ImportFormatError",
    "ImportResult",
    "ParsedSession",
    "detect_format",
    "export_session",
    "import_path",
    "parse_file",
    "validate",
    "write_session",
]


# --------------------------------------------------------------------------- results and errors


@dataclass(frozen=True)
class ImportResult:
    """What happened to one file.

    `status` is ``imported``, ``replaced`` (an existing session of that id was deleted first),
    ``skipped`` (the id exists and ``on_exists="skip"``) or ``failed`` (`error` says why; only with
    ``errors="collect"``). `entries` is the number of entries written.
    """

    path: str
    session_id: str | None
    format: str
    status: Literal["imported", "replaced", "skipped", "failed"]
    entries: int = 0
    error: SessionError | None = None


@dataclass
class ParsedSession:
    """A file read and converted, ready to be written: the header, the entries and, for each
    entry, the line it came from (0 for entries the importer added)."""

    path: str
    format: str
    header: SessionHeader
    entries: list[NewEntry] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)

    @property
    def session_id(self) -> str:
        return self.header.id


# --------------------------------------------------------------------------- reading lines

_decode_json = msgspec.json.Decoder()


def _lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON object) for every non-blank line."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = _decode_json.decode(raw)
            except (msgspec.DecodeError, RecursionError) as e:
                raise ImportFormatError(path, lineno, f"invalid JSON: {e or 'nested too deeply'}") from None
            if not isinstance(obj, dict):
                raise ImportFormatError(path, lineno, f"expected a JSON object, got {_tname(obj)}")
            yield lineno, obj


def _tname(value: Any) -> str:
    if value is None:
        return "null"
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }.get(type(value), type(value).__name__)


def detect_format(first: dict[str, Any]) -> str | None:
    """The format a file's first line announces, or None."""
    if first.get("_type") == EXPORT_TYPE:
        return "redis-session"
    if first.get("_type") == "metadata":
        return "nanobot"
    if first.get("type") == "session" and "version" in first:
        return "dsh"
    if first.get("type") == "session/meta":
        return "tutorial"
    return None


# --------------------------------------------------------------------------- small parsers

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


class _Bad(Exception):
    """A field problem; the caller adds file and line."""


def _iso_ms(value: Any, what: str) -> int:
    if not isinstance(value, str):
        raise _Bad(f"{what} must be an ISO date-time string, got {_tname(value)}")
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise _Bad(f"{what} {value[:60]!r} is not an ISO date-time") from None
    if dt.tzinfo is None:
        dt = dt.astimezone()  # naive means local time (nanobot writes naive local ISO)
    ms = (dt - _EPOCH) // _MS
    if ms < 0:
        raise _Bad(f"{what} {value!r} is before 1970")
    return ms


def _int(value: Any, what: str, *, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Bad(f"{what} must be an integer, got {_tname(value)}")
    if value < minimum:
        raise _Bad(f"{what} must be >= {minimum}, got {value}")
    return value


def _ms_number(value: Any, what: str) -> int:
    """A millisecond timestamp given as a JSON number (int or float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad(f"{what} must be a number (ms), got {_tname(value)}")
    if value != value or value in (float("inf"), float("-inf")) or value < 0:
        raise _Bad(f"{what} must be a finite number >= 0, got {value!r}")
    return int(value)


def _seconds_or_ms(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad(f"{what} must be a number (seconds or ms), got {_tname(value)}")
    if value != value or value in (float("inf"), float("-inf")) or value < 0:
        raise _Bad(f"{what} must be a finite number >= 0, got {value!r}")
    return int(value) if value > 1e11 else round(value * 1000)


def _check_id(path: Path, line: int | None, session_id: Any) -> str:
    try:
        return validate_session_id(session_id)
    except InvalidSessionIdError as e:
        shown = session_id[:80] if isinstance(session_id, str) else session_id
        raise ImportFormatError(
            path, line, f"session id {shown!r} is not allowed here ({e}); nothing of this session was imported"
        ) from None


# --------------------------------------------------------------------------- format converters


class _Converter:
    """Turns a file's first line into a header and each further line into entries."""

    format = ""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: list[NewEntry] = []
        self.lines: list[int] = []
        self.session_id: Any = None
        self.id_line: int | None = 1

    def add(self, line: int, entry: NewEntry) -> None:
        self.entries.append(entry)
        self.lines.append(line)

    def header(self, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    def event(self, line: int, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    def finish(self) -> SessionHeader:
        raise NotImplementedError


class _Ours(_Converter):
    format = "redis-session"
    _HEADER_FIELDS = frozenset(SessionHeader.__struct_fields__)
    _ENTRY_KEYS = frozenset({"n", "time", "type", "data", "meta", "surface"})

    def header(self, obj: dict[str, Any]) -> None:
        unknown = set(obj) - {"_type", "version", "header", "n", "exported_at", "branched_from"}
        if unknown:
            raise _Bad(f"unknown keys in the export header line: {sorted(unknown)}")
        if obj.get("version") != EXPORT_VERSION:
            raise _Bad(f"export version {obj.get('version')!r} is not supported (expected {EXPORT_VERSION})")
        self.expected_n = _int(obj.get("n"), "n")
        hdr = obj.get("header")
        if not isinstance(hdr, dict):
            raise _Bad(f"header must be an object, got {_tname(hdr)}")
        unknown = set(hdr) - self._HEADER_FIELDS
        if unknown:
            raise _Bad(f"unknown header fields: {sorted(unknown)}")
        self.session_id = hdr.get("id")
        if not isinstance(self.session_id, str):
            raise _Bad(f"header.id must be a string, got {_tname(self.session_id)}")
        fields = {k: v for k, v in hdr.items() if k not in ("parent", "at")}  # imports as a root
        fields["id"] = "x"  # validated separately, with its own message
        try:
            self.hdr = msgspec.convert(fields, SessionHeader)
        except msgspec.ValidationError as e:
            raise _Bad(f"header: {e}") from None
        if self.hdr.format_version != FORMAT_VERSION:
            raise _Bad(f"header.format_version {self.hdr.format_version} is not supported")
        for name in ("created_at", "delegation_depth"):
            _int(getattr(self.hdr, name), f"header.{name}")

    def event(self, line: int, obj: dict[str, Any]) -> None:
        unknown = set(obj) - self._ENTRY_KEYS
        if unknown:
            raise _Bad(f"unknown entry keys: {sorted(unknown)}")
        n = _int(obj.get("n"), "n")
        if n != len(self.entries):
            raise _Bad(f"entry n={n} out of sequence: expected n={len(self.entries)}")
        t = obj.get("type")
        if not isinstance(t, str):
            raise _Bad(f"type must be a string, got {_tname(t)}")
        data = obj.get("data")
        if not isinstance(data, dict):
            raise _Bad(f"data must be an object, got {_tname(data)}")
        meta = obj.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise _Bad(f"meta must be an object, got {_tname(meta)}")
        surface = obj.get("surface")
        if surface is not None and not isinstance(surface, dict):
            raise _Bad(f"surface must be an object, got {_tname(surface)}")
        time = _int(obj.get("time"), "time")
        self.add(line, NewEntry(t, data, meta, surface, time))

    def finish(self) -> SessionHeader:
        if len(self.entries) != self.expected_n:
            raise ImportFormatError(
                self.path,
                None,
                f"the header announces n={self.expected_n} entries but the file holds "
                f"{len(self.entries)} (truncated or edited)",
                session_id=self.session_id,
            )
        return msgspec.structs.replace(self.hdr, id=self.session_id)


class _Nanobot(_Converter):
    format = "nanobot"

    def header(self, obj: dict[str, Any]) -> None:
        self.session_id = obj.get("key")
        if not isinstance(self.session_id, str):
            raise _Bad(f"metadata.key must be a string, got {_tname(self.session_id)}")
        metadata = obj.get("metadata", {})
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict):
            raise _Bad(f"metadata.metadata must be an object, got {_tname(metadata)}")
        self.created_at = 0
        if obj.get("created_at") is not None:
            self.created_at = _iso_ms(obj["created_at"], "created_at")
        if obj.get("updated_at") is not None:
            _iso_ms(obj["updated_at"], "updated_at")
        title = metadata.get("title")
        self.title = title if isinstance(title, str) and title else None
        self.origin: dict[str, Any] = {"format": "nanobot"}
        self.origin.update({k: v for k, v in obj.items() if k != "_type"})
        self.origin.setdefault("metadata", metadata)
        self.last_time: int | None = self.created_at or None

    def event(self, line: int, obj: dict[str, Any]) -> None:
        kind = obj.get("_type")
        if kind == "provider_state":
            self.origin["provider_state"] = obj.get("state")
            return
        if kind is not None:
            raise _Bad(f"unknown record _type {kind!r} (expected a message)")
        role = obj.get("role")
        if not isinstance(role, str):
            raise _Bad(f"a message needs a string role, got {_tname(role)}")
        ts = obj.get("timestamp")
        time = self.last_time if ts is None else _iso_ms(ts, "timestamp")
        self.last_time = time
        entry_type = "nanobot/command" if obj.get("_command") else "message"
        self.add(line, NewEntry(entry_type, obj, None, None, time))

    def finish(self) -> SessionHeader:
        raw = self.origin.get("last_consolidated", 0)
        count = len(self.entries)
        lc = raw if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw <= count else 0
        if lc > 0:
            self.add(
                0,
                NewEntry(
                    CUT,
                    {"before": lc, "summary": [], "reason": "nanobot:last_consolidated"},
                    None,
                    None,
                    self.last_time,
                ),
            )
        return SessionHeader(id=self.session_id, created_at=self.created_at, title=self.title, origin=self.origin)


class _Dsh(_Converter):
    format = "dsh"
    _KEYS = frozenset({"type", "seq", "time", "data", "surfaceOp", "sourceEventSeqs", "ignorable"})

    def header(self, obj: dict[str, Any]) -> None:
        if obj.get("version") != 0 or isinstance(obj.get("version"), bool):
            raise _Bad(f"dsh session version must be 0, got {obj.get('version')!r}")
        self.session_id = obj.get("id")
        if not isinstance(self.session_id, str):
            raise _Bad(f"id must be a string, got {_tname(self.session_id)}")
        self.created_at = _ms_number(obj.get("createdAt"), "createdAt")
        cwd = obj.get("cwd")
        if cwd is not None and (not isinstance(cwd, str) or not os.path.isabs(cwd)):
            raise _Bad(f"cwd must be an absolute path string, got {cwd!r}")
        parent = obj.get("parentSession")
        if parent is not None and not isinstance(parent, str):
            raise _Bad(f"parentSession must be a string, got {_tname(parent)}")
        if obj.get("seedLength") is not None:
            _int(obj["seedLength"], "seedLength")
        self.origin: dict[str, Any] = {"format": "dsh"}
        self.origin.update({k: v for k, v in obj.items() if k not in ("type", "version", "id", "createdAt")})

    def event(self, line: int, obj: dict[str, Any]) -> None:
        unknown = set(obj) - self._KEYS
        if unknown:
            raise _Bad(f"invalid event envelope: unknown keys {sorted(unknown)}")
        for k in ("type", "seq", "time", "data"):
            if k not in obj:
                raise _Bad(f"invalid event envelope: missing {k!r}")
        t = obj["type"]
        if not isinstance(t, str):
            raise _Bad(f"type must be a string, got {_tname(t)}")
        seq = _int(obj["seq"], "seq")
        if seq != len(self.entries):
            raise _Bad(f"seq gap: expected seq {len(self.entries)}, got {seq}")
        time = _int(obj["time"], "time")
        data = obj["data"]
        if not isinstance(data, dict):
            raise _Bad(f"data must be an object, got {_tname(data)}")
        surface: dict[str, Any] | None = None
        if "surfaceOp" in obj:
            surface = {"surfaceOp": obj["surfaceOp"]}
            if "sourceEventSeqs" in obj:
                surface["sourceEventSeqs"] = obj["sourceEventSeqs"]
        elif "sourceEventSeqs" in obj:
            raise _Bad("sourceEventSeqs without surfaceOp")
        meta = None
        if "ignorable" in obj:
            if not isinstance(obj["ignorable"], bool):
                raise _Bad(f"ignorable must be a boolean, got {_tname(obj['ignorable'])}")
            meta = {"ignorable": obj["ignorable"]}
        self.add(line, NewEntry(t, data, meta, surface, time))

    def finish(self) -> SessionHeader:
        return SessionHeader(id=self.session_id, created_at=self.created_at, origin=self.origin)


def _js_json(value: Any) -> str:
    """JSON.stringify: compact, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class _Tutorial(_Converter):
    format = "tutorial"
    _ENVELOPE = frozenset({"type", "seq", "ts", "at", "sessionId"})

    def header(self, obj: dict[str, Any]) -> None:
        sid = obj.get("id", obj.get("sessionId"))
        if sid is None:
            sid = self.path.stem
            self.id_line = None
        if not isinstance(sid, str):
            raise _Bad(f"id must be a string, got {_tname(sid)}")
        self.session_id = sid
        title = obj.get("title")
        if title is not None and not isinstance(title, str):
            raise _Bad(f"title must be a string, got {_tname(title)}")
        self.title = title
        self.created_at = self.last_time = 0
        if "ts" in obj or "at" in obj:
            self.created_at = self._time(obj) or 0
        if obj.get("createdAt") is not None:
            v = obj["createdAt"]
            self.created_at = _iso_ms(v, "createdAt") if isinstance(v, str) else _ms_number(v, "createdAt")
        self.last_time = self.created_at
        meta = {k: v for k, v in obj.items() if k not in ("type", "id")}
        self.origin: dict[str, Any] = {"format": "tutorial", **({"meta": meta} if meta else {})}
        self.last_seq = -1

    def _time(self, obj: dict[str, Any]) -> int | None:
        if obj.get("ts") is not None:
            return _seconds_or_ms(obj["ts"], "ts")
        if obj.get("at") is not None:
            return _iso_ms(obj["at"], "at")
        return None

    def event(self, line: int, obj: dict[str, Any]) -> None:
        t = obj.get("type")
        if not isinstance(t, str) or not t:
            raise _Bad(f"an event needs a string type, got {_tname(t)}")
        meta: dict[str, Any] = {}
        if "seq" in obj:
            seq = _int(obj["seq"], "seq")
            if seq <= self.last_seq:
                raise _Bad(f"seq {seq} does not follow seq {self.last_seq}")
            self.last_seq = seq
            if seq != len(self.entries):
                meta["seq"] = seq
        time = self._time(obj)
        if time is None:
            time = self.last_time or None
        else:
            self.last_time = time
        if "data" in obj and isinstance(obj["data"], dict) and set(obj) <= self._ENVELOPE | {"data"}:
            payload = obj["data"]
        elif "data" in obj and set(obj) <= self._ENVELOPE | {"data"}:
            raise _Bad(f"data must be an object, got {_tname(obj['data'])}")
        else:
            payload = {k: v for k, v in obj.items() if k not in self._ENVELOPE}
        message, rest = self._message(t, payload)
        if message is None:
            entry_type = t if t == "session/meta" else f"tutorial/{t}"
            self.add(line, NewEntry(entry_type, payload, meta or None, None, time))
            return
        meta["event"] = t
        if rest:
            meta["payload"] = rest
        self.add(line, NewEntry("message", message, meta, None, time))

    @staticmethod
    def _message(t: str, p: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """The chat message `deriveMessages` made of this event, and the payload keys it left."""

        def rest(*used: str) -> dict[str, Any]:
            return {k: v for k, v in p.items() if k not in used}

        if t == "user/message":
            content = p.get("content")
            return {"role": "user", "content": "" if content is None else content}, rest("content")
        if t == "assistant/message":
            content = p.get("content")
            msg: dict[str, Any] = {"role": "assistant", "content": "" if content is None else content}
            if p.get("tool_calls") is not None:
                msg["tool_calls"] = p["tool_calls"]
            return msg, rest("content", "tool_calls")
        if t == "assistant/tool_calls":
            calls = p.get("toolCalls") or []
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise _Bad("assistant/tool_calls: toolCalls must be an array of objects")
            msg = {
                "role": "assistant",
                "content": p.get("content"),
                "tool_calls": [
                    {
                        "id": c.get("id"),
                        "type": "function",
                        "function": {"name": c.get("name"), "arguments": _js_json(c.get("arguments") or {})},
                    }
                    for c in calls
                ],
            }
            if p.get("reasoningContent"):
                msg["reasoning_content"] = p["reasoningContent"]
            return msg, rest("content", "toolCalls", "reasoningContent")
        if t == "tool/result":
            call_id = p.get("tool_call_id", p.get("toolCallId"))
            content = p.get("content")
            text = content if isinstance(content, str) else _js_json(content)
            return {"role": "tool", "tool_call_id": call_id, "content": text}, rest(
                "tool_call_id", "toolCallId", "content"
            )
        return None, p

    def finish(self) -> SessionHeader:
        return SessionHeader(id=self.session_id, created_at=self.created_at, title=self.title, origin=self.origin)


_CONVERTERS: dict[str, type[_Converter]] = {
    "redis-session": _Ours,
    "nanobot": _Nanobot,
    "dsh": _Dsh,
    "tutorial": _Tutorial,
}


# --------------------------------------------------------------------------- parse + validate


def parse_file(
    path: str | os.PathLike[str],
    *,
    format: Format | str = "auto",
    session_id: str | None = None,
    store: SessionStore | None = None,
) -> ParsedSession:
    """Read one file into a `ParsedSession`, validating everything a write would check.

    With `store`, entries are checked against its vocabulary and entry size limit (else the
    defaults). Raises `ImportFormatError` (file, line, message) on the first problem.
    """
    p = Path(path)
    try:
        return _parse(p, format, session_id, store)
    except OSError as e:
        raise ImportFormatError(p, None, f"cannot read the file: {e.strerror or e}") from None


def _parse(p: Path, format: str, session_id: str | None, store: SessionStore | None) -> ParsedSession:
    it = _lines(p)
    first = next(it, None)
    if first is None:
        raise ImportFormatError(p, None, "the file is empty: no header line")
    line1, obj1 = first
    detected = detect_format(obj1)
    fmt = detected if format == "auto" else format
    if fmt is None:
        raise ImportFormatError(
            p,
            line1,
            "unrecognised header line: expected a redis-session export header "
            '({"_type":"redis-session",…}), a nanobot metadata line ({"_type":"metadata",…}), a dsh '
            'session header ({"type":"session","version":0,…}) or a tutorial meta line '
            '({"type":"session/meta",…})',
        )
    if fmt not in _CONVERTERS:
        raise ValueError(f"unknown import format {fmt!r}; expected one of {sorted(_CONVERTERS)} or 'auto'")
    if detected != fmt:
        raise ImportFormatError(p, line1, f"the header line is not a {fmt} header")
    conv = _CONVERTERS[fmt](p)
    try:
        conv.header(obj1)
    except _Bad as e:
        raise ImportFormatError(p, line1, f"bad header line: {e}") from None
    for lineno, obj in it:
        try:
            conv.event(lineno, obj)
        except _Bad as e:
            raise ImportFormatError(p, lineno, str(e), session_id=_sid(conv)) from None
    header = conv.finish()
    sid = _check_id(p, conv.id_line if session_id is None else None, header.id if session_id is None else session_id)
    header = msgspec.structs.replace(header, id=sid)
    try:
        check_header(header)
    except (InvalidEntryError, InvalidSessionIdError) as e:
        raise ImportFormatError(p, line1, f"bad header: {e}", session_id=sid) from None
    parsed = ParsedSession(str(p), fmt, header, conv.entries, conv.lines)
    validate(parsed, store)
    return parsed


def _sid(conv: _Converter) -> str | None:
    return conv.session_id if isinstance(conv.session_id, str) else None


def validate(parsed: ParsedSession, store: SessionStore | None = None) -> list[EncodedEntry]:
    """Check every entry as the store will (schemas, lossless JSON, size, cut range, surface);
    raise `ImportFormatError` naming the line of the first bad one."""
    vocabulary = store.vocabulary if store is not None else None
    if vocabulary is None:
        from .model import Vocabulary

        vocabulary = Vocabulary()
    max_bytes = int(getattr(store, "max_entry_bytes", DEFAULT_MAX_ENTRY_BYTES))
    encoded: list[EncodedEntry] = []
    for i, e in enumerate(parsed.entries):
        try:
            enc = encode_entry(e, vocabulary, index=i, max_entry_bytes=max_bytes)
            check_against_n(enc, i, i)
        except InvalidEntryError as err:
            raise _entry_error(parsed, i, err) from None
        encoded.append(enc)
    try:
        check_surface(ProjectionState(), encoded, 0)
    except InvalidEntryError as err:
        raise _entry_error(parsed, err.index or 0, err) from None
    return encoded


def _entry_error(parsed: ParsedSession, index: int, err: InvalidEntryError) -> ImportFormatError:
    msg = str(err)
    prefix = f"entry {index}: "
    if msg.startswith(prefix):
        msg = msg[len(prefix) :]
    line = parsed.lines[index] if index < len(parsed.lines) else 0
    return ImportFormatError(
        parsed.path,
        line or None,
        f"entry n={index} ({parsed.entries[index].type}): {msg}",
        session_id=parsed.session_id,
    )


# --------------------------------------------------------------------------- writing


def _batches(parsed: ParsedSession, max_batch: int, max_bytes: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of entries, each within the store's batch limits."""
    out: list[tuple[int, int]] = []
    lo = size = 0
    for i, e in enumerate(parsed.entries):
        # A cheap upper bound of the encoded size; exact sizes were checked in `validate`.
        est = len(msgspec.json.encode(e.data)) + (len(msgspec.json.encode(e.meta)) if e.meta else 0) + 64
        if i > lo and (i - lo >= max_batch or size + est > max_bytes):
            out.append((lo, i))
            lo, size = i, 0
        size += est
    out.append((lo, len(parsed.entries)))
    return out


async def write_session(
    store: SessionStore,
    parsed: ParsedSession,
    *,
    on_exists: OnExists | str = "error",
    progress: Callable[[int], object] | None = None,
) -> ImportResult:
    """Write a validated `ParsedSession`: all of it, or (after a failure part-way) none of it.

    `progress(k)` is called after each batch with the number of entries written so far.
    """
    sid = parsed.session_id
    status: Literal["imported", "replaced"] = "imported"
    if on_exists not in ("error", "skip", "replace"):
        raise ValueError("on_exists must be 'error', 'skip' or 'replace'")
    if await store.head(sid) is not None:
        if on_exists == "skip":
            return ImportResult(parsed.path, sid, parsed.format, "skipped")
        if on_exists == "error":
            raise SessionAlreadyExistsError(sid, "import with on_exists='skip' or 'replace'")
        # Decided before anything is destroyed: a branch that reads its entries, listed or deleted
        # but kept for its own branches, would keep the id taken by the deleted session.
        live, _stale = await store.links(sid)  # stale links go with the delete
        if live:
            raise SessionAlreadyExistsError(sid, "it has live branches, so it cannot be replaced")
        await store.delete(sid)
        status = "replaced"
    max_batch = int(getattr(store, "max_batch", DEFAULT_MAX_BATCH))
    ranges = _batches(parsed, max_batch, BATCH_BYTES)
    entries = parsed.entries
    token = uuid.uuid4().hex
    lo, hi = ranges[0]
    # create gives the new log a new incarnation (a replaced session never keeps the old
    # identity); the later batches go to exactly that one
    incarnation = (await store.create(parsed.header, entries[lo:hi])).header.incarnation
    created = True
    try:
        if progress is not None:
            progress(hi)
        for lo, hi in ranges[1:]:
            await store.put(
                sid, lo, entries[lo:hi], idempotency_key=f"import:{token}:{lo}", incarnation=incarnation or None
            )
            if progress is not None:
                progress(hi)
        created = False
    finally:
        if created:
            with anyio.CancelScope(shield=True):
                try:
                    await store.delete(sid)
                except Exception:  # the original error matters more; a half session is reported by it
                    pass
    return ImportResult(parsed.path, sid, parsed.format, status, len(entries))


def _files(root: Path) -> list[Path]:
    if root.is_dir():
        return sorted(p for p in root.rglob("*.jsonl") if p.is_file())
    if not root.exists():
        raise FileNotFoundError(root)
    return [root]


async def import_path(
    store: SessionStore,
    path: str | os.PathLike[str],
    *,
    format: Format | str = "auto",
    session_id: str | None = None,
    progress: Progress | None = None,
    on_exists: OnExists | str = "error",
    errors: Literal["raise", "collect"] = "raise",
) -> list[ImportResult]:
    """Import a file, or every ``*.jsonl`` file under a folder (recursively, in name order), one
    session per file.

    `format` is ``"auto"`` (from each file's first line) or one of ``"redis-session"``,
    ``"nanobot"``, ``"dsh"``, ``"tutorial"``. `session_id` overrides the id of a single file's
    session. An id that exists already raises `SessionAlreadyExistsError` unless `on_exists` is
    ``"skip"`` or ``"replace"`` (delete, then import; the file is validated first).

    Each session is written completely or not at all. With ``errors="raise"`` the first failing
    file raises (`ImportFormatError` with file and line for a bad file); sessions of earlier files
    stay imported. With ``errors="collect"`` every file is tried and failures come back as
    results with ``status="failed"``.

    `progress(done, total)` counts input bytes: `total` is the size of all files, `done` moves as
    each file's entries are written (the CLI draws the bar).
    """
    if format != "auto" and format not in _CONVERTERS:
        raise ValueError(f"unknown import format {format!r}; expected 'auto' or one of {sorted(_CONVERTERS)}")
    if on_exists not in ("error", "skip", "replace"):
        raise ValueError("on_exists must be 'error', 'skip' or 'replace'")
    if errors not in ("raise", "collect"):
        raise ValueError("errors must be 'raise' or 'collect'")
    root = Path(path)
    files = _files(root)
    if session_id is not None and len(files) != 1:
        raise ValueError("session_id can only be given when importing a single file")
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    done = 0
    results: list[ImportResult] = []
    if progress is not None:
        progress(0, total)
    for f, size in zip(files, sizes, strict=True):
        base = done
        try:
            parsed = await anyio.to_thread.run_sync(
                partial(parse_file, f, format=format, session_id=session_id, store=store)
            )
            count = max(len(parsed.entries), 1)

            def step(k: int, base: int = base, size: int = size, count: int = count) -> None:
                if progress is not None:
                    progress(base + size * k // count, total)

            result = await write_session(store, parsed, on_exists=on_exists, progress=step)
        except SessionError as e:
            if errors == "raise":
                raise
            known = getattr(e, "session_id", None)
            sid = known if isinstance(known, str) else None
            result = ImportResult(str(f), sid, format, "failed", 0, e)
        results.append(result)
        done = base + size
        if progress is not None:
            progress(done, total)
    return results


# --------------------------------------------------------------------------- export

_entry_encoder = msgspec.json.Encoder()


def _header_dict(header: SessionHeader) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": header.id,
        "format_version": header.format_version,
        "created_at": header.created_at,
        "delegation_depth": header.delegation_depth,
    }
    if header.title is not None:
        out["title"] = header.title
    if header.origin is not None:
        out["origin"] = header.origin
    return out


async def export_session(
    store: SessionStore,
    session_id: str,
    out: TextIO | str | os.PathLike[str],
    *,
    progress: Progress | None = None,
) -> int:
    """Write a session as our JSONL (see the module docstring); returns the number of entries.

    `out` is a text stream, or a path (written to a temporary file, then renamed into place).
    The export is a consistent snapshot at the session's n when it starts, even while others
    append. `progress(done, total)` counts entries. Raises `SessionNotFoundError`.
    """
    head = await store.head(session_id)
    if head is None:
        raise SessionNotFoundError(session_id)
    n = head.n
    first: dict[str, Any] = {
        "_type": EXPORT_TYPE,
        "version": EXPORT_VERSION,
        "header": _header_dict(head.header),
        "n": n,
    }
    if head.header.parent is not None:
        first["branched_from"] = {"parent": head.header.parent, "at": head.header.at}

    async def write(f: IO[str]) -> None:
        f.write(_entry_encoder.encode(first).decode() + "\n")
        if progress is not None:
            progress(0, n)
        start = 0
        while start < n:
            stop = min(start + _READ_PAGE, n)
            page: Sequence[Entry] = await store.read(session_id, start, stop)
            if len(page) != stop - start:
                raise SessionError(f"session {session_id!r}: read [{start}, {stop}) returned {len(page)} entries")
            f.write("".join(_entry_encoder.encode(e).decode() + "\n" for e in page))
            start = stop
            if progress is not None:
                progress(start, n)

    if isinstance(out, (str, os.PathLike)):
        target = Path(out)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                await write(f)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    else:
        await write(out)
    return n
