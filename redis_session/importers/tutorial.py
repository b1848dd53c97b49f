"""The tutorial harness's logs (and the mini-dsh variant): ``{"type":"session/meta","id",…}`` then
events ``{type, seq?, ts|at, data?|…payload}`` (``ts`` in seconds, or ms when > 1e11; ``at`` an
ISO string, read as UTC without a zone; the payload is ``data`` when the event has it, else the
event's other keys).

The message events become ``message`` entries holding exactly what the tutorial's
``deriveMessages`` produced (``tool_calls: []`` and ``""`` content kept as written):
``user/message`` → user, ``assistant/message`` → assistant (with its ``tool_calls``),
``assistant/tool_calls`` → assistant ``{content, tool_calls:[{id, type:"function", function:{name,
arguments: JSON}}], reasoning_content?}``, ``tool/result`` → tool ``{tool_call_id, content}``
(non-string content as JSON). Their meta keeps the source event type (``{"event":
"assistant/tool_calls"}``) and any payload keys not mapped (``payload``). Later ``session/meta``
events stay ``session/meta`` entries; every other event becomes a mark named ``tutorial/<type>``
(its data the payload). A ``seq`` that is not n is kept as ``meta.seq``. ``origin.envelope``
records how the file wrote its events, so the export writes them the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

from msgspec import UNSET, Meta, Struct, UnsetType

from ..errors import ImportFormatError
from ..model import Entry, NewEntry, SessionHead, SessionHeader
from .common import Bad, ParsedSession, Source, convert, iso_ms, json_object, ms_iso, number_ms, seconds_or_ms

FORMAT = "tutorial"
_ENVELOPE = frozenset({"type", "seq", "ts", "at", "sessionId"})
NonNeg = Annotated[int, Meta(ge=0)]


class MetaLine(Struct):
    type: str
    id: str | UnsetType = UNSET
    sessionId: str | UnsetType = UNSET
    title: str | None = None
    createdAt: str | int | float | None = None
    ts: int | float | UnsetType = UNSET
    at: str | UnsetType = UNSET


class EventLine(Struct):
    """The envelope of an event line (payload keys are read separately)."""

    type: Annotated[str, Meta(min_length=1)]
    seq: NonNeg | UnsetType = UNSET
    ts: int | float | UnsetType | None = UNSET
    at: str | UnsetType | None = UNSET


def detect(first: dict[str, Any]) -> bool:
    return first.get("type") == "session/meta"


def _js_json(value: Any) -> str:
    """JSON.stringify: compact, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _time(ev: EventLine | MetaLine) -> int | None:
    if ev.ts is not None and not isinstance(ev.ts, UnsetType):
        return seconds_or_ms(ev.ts, "ts")
    if ev.at is not None and not isinstance(ev.at, UnsetType):
        return iso_ms(ev.at, "at")
    return None


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
            raise Bad("assistant/tool_calls: toolCalls must be an array of objects")
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
        return {"role": "tool", "tool_call_id": call_id, "content": text}, rest("tool_call_id", "toolCallId", "content")
    return None, p


class _Reader:
    def __init__(self, source: Source) -> None:
        self.source = source
        self.entries: list[NewEntry] = []
        self.lines: list[int] = []
        self.last_seq = -1
        self.envelope: dict[str, Any] = {}

    def header(self, obj: dict[str, Any]) -> None:
        line = convert(obj, MetaLine)
        sid = line.id if not isinstance(line.id, UnsetType) else line.sessionId
        self.id_from_line = not isinstance(sid, UnsetType)
        self.session_id = (
            sid if isinstance(sid, str) else self.source.path.name.removesuffix(".zstd").removesuffix(".jsonl")
        )
        self.title = line.title
        self.created_at = _time(line) or 0
        if isinstance(line.createdAt, str):
            self.created_at = iso_ms(line.createdAt, "createdAt")
        elif line.createdAt is not None:
            self.created_at = number_ms(line.createdAt, "createdAt")
        self.last_time = self.created_at
        meta = {k: v for k, v in obj.items() if k not in ("type", "id")}
        self.origin: dict[str, Any] = {"format": FORMAT, **({"meta": meta} if meta else {})}

    def _payload(self, obj: dict[str, Any]) -> dict[str, Any]:
        if "data" in obj and set(obj) <= _ENVELOPE | {"data"}:
            if not isinstance(obj["data"], dict):
                raise Bad(f"data must be an object, got {type(obj['data']).__name__}")
            self.envelope.setdefault("payload", "data")
            return dict(obj["data"])
        self.envelope.setdefault("payload", "flat")
        return {k: v for k, v in obj.items() if k not in _ENVELOPE}

    def line(self, no: int, obj: dict[str, Any]) -> None:
        ev = convert(obj, EventLine)
        meta: dict[str, Any] = {}
        if not isinstance(ev.seq, UnsetType):
            if ev.seq <= self.last_seq:
                raise Bad(f"seq {ev.seq} does not follow seq {self.last_seq}")
            self.last_seq = ev.seq
            if ev.seq != len(self.entries):
                meta["seq"] = ev.seq
        time = _time(ev)
        if time is None:
            time = self.last_time or None
        else:
            self.last_time = time
            self.envelope.setdefault("time", "at" if ev.ts in (None, UNSET) else "ts")
            if isinstance(ev.ts, (int, float)):
                self.envelope.setdefault("ts_unit", "ms" if ev.ts > 1e11 else "s")
        payload = self._payload(obj)
        message, rest = _message(ev.type, payload)
        if message is None:
            entry_type = ev.type if ev.type == "session/meta" else f"tutorial/{ev.type}"
            self.entries.append(NewEntry(entry_type, payload, meta or None, None, time))
        else:
            meta["event"] = ev.type
            if rest:
                meta["payload"] = rest
            self.entries.append(NewEntry("message", message, meta, None, time))
        self.lines.append(no)

    def finish(self, session_id: str | None) -> ParsedSession:
        if self.envelope:
            self.origin["envelope"] = self.envelope
        header = SessionHeader(
            id=session_id or self.session_id, created_at=self.created_at, title=self.title, origin=self.origin
        )
        return ParsedSession(str(self.source.path), FORMAT, header, self.entries, self.lines)


def parse(source: Source, session_id: str | None) -> tuple[ParsedSession, bool]:
    """The session, and whether its id came from the file's first line (else its name)."""
    reader = _Reader(source)
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
            raise ImportFormatError(source.path, line.no, str(e), session_id=reader.session_id) from None
    return reader.finish(session_id), reader.id_from_line


# --------------------------------------------------------------------------- export


def _unmessage(event: str, msg: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """The payload of the event `deriveMessages` turned into `msg` (the reverse of `_message`)."""
    if event == "assistant/tool_calls":
        calls = []
        for c in msg.get("tool_calls") or []:
            fn = c.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = fn.get("arguments")
            calls.append({"id": c.get("id"), "name": fn.get("name"), "arguments": args})
        p: dict[str, Any] = {"content": msg.get("content"), "toolCalls": calls}
        if msg.get("reasoning_content"):
            p["reasoningContent"] = msg["reasoning_content"]
        return {**p, **rest}
    if event == "tool/result":
        key = "toolCallId" if "toolCallId" in rest or msg.get("_camel") else "tool_call_id"
        return {key: msg.get("tool_call_id"), "content": msg.get("content"), **rest}
    p = {"content": msg.get("content")}
    if "tool_calls" in msg:
        p["tool_calls"] = msg["tool_calls"]
    return {**p, **rest}


def _event_of(e: Entry) -> tuple[str, dict[str, Any]]:
    meta = e.meta if isinstance(e.meta, dict) else {}
    if e.type == "message":
        role = e.data.get("role")
        event = meta.get("event") or {"user": "user/message", "tool": "tool/result"}.get(str(role), "assistant/message")
        payload = meta.get("payload")
        rest: dict[str, Any] = payload if isinstance(payload, dict) else {}
        return str(event), _unmessage(str(event), dict(e.data), rest)
    if e.type.startswith("tutorial/"):
        return e.type.removeprefix("tutorial/"), dict(e.data)
    return e.type, dict(e.data)


def export_lines(head: SessionHead, entries: Sequence[Entry]) -> Iterator[str]:
    """The session as a tutorial log: the meta line, then each entry as the event it came from
    (``message`` entries as the event ``deriveMessages`` read; other sessions' entries under their
    own type), ``seq`` and ``ts``/``at`` as the original file wrote them."""
    origin = head.header.origin if isinstance(head.header.origin, dict) else {}
    env_value, meta_value = origin.get("envelope"), origin.get("meta")
    env: dict[str, Any] = env_value if isinstance(env_value, dict) else {}
    meta: dict[str, Any] = meta_value if isinstance(meta_value, dict) else {}
    first: dict[str, Any] = {"type": "session/meta", "id": head.header.id, **meta}
    yield json.dumps(first, ensure_ascii=False, separators=(",", ":")) + "\n"
    for e in entries:
        event, payload = _event_of(e)
        m = e.meta if isinstance(e.meta, dict) else {}
        ev: dict[str, Any] = {"type": event, "seq": m.get("seq", e.n)}
        if env.get("time") == "at":
            ev["at"] = ms_iso(e.time) + "Z"
        else:
            ev["ts"] = e.time if env.get("ts_unit") == "ms" else e.time / 1000
        if env.get("payload") == "data":
            ev["data"] = payload
        else:
            ev.update({k: v for k, v in payload.items() if k not in ev})
        yield json.dumps(ev, ensure_ascii=False, separators=(",", ":")) + "\n"
