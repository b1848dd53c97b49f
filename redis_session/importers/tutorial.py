"""The tutorial harness's logs (its ``session.ts``; and the mini-dsh variant).

The harness's ``save()`` writes ``JSON.stringify({type:"session/meta", id})`` then one
``JSON.stringify(event)`` per line, each event ``{type, seq, ts, ...payload}`` (``ts`` is
``Date.now() / 1000``); ``load()`` reads every line, a ``session/meta`` line setting the id and
every other line becoming an event as written. The variant writes the payload under ``data``
and an ISO ``at``; both are read (``ts`` in seconds, or ms when > 1e11; ``at`` as UTC without a
zone).

**Messages exactly as ``deriveMessages`` makes them.** ``user/message`` → ``{role:"user",
content}`` (a missing content stays missing, null stays null); ``assistant/message`` →
``{role:"assistant", content: content ?? "", tool_calls?}`` (``tool_calls`` whenever JS finds it
truthy: ``[]`` included); ``tool/result`` → ``{role:"tool", tool_call_id, content}`` (a missing
``tool_call_id`` stays missing). These are ``message`` entries whose data is that message; a tool
result's content that a chat message cannot hold (a number, an object) is its JSON text there, as
the model is sent it, and kept as written for the export. Every other event becomes a mark
``tutorial/<type>`` whose data is the payload. The variant's ``assistant/tool_calls`` becomes the
assistant message with OpenAI ``tool_calls`` its ``deriveMessages`` makes.

**Byte for byte back.** Each entry's meta keeps what the message does not say: ``event`` (the
event type), ``payload`` (payload keys the message does not reproduce exactly), ``keys`` (the
payload's key order, when not the usual one), ``seq`` (when it is not n), ``ts``/``at`` (a time
not reproduced by the entry's ms), and — for a line the rules above still would not write back
identically (a lone surrogate escape, which the store holds as U+FFFD; key orders no rule
predicts) — ``line``, the line as written. ``export --format tutorial`` of an imported session is
the file as the harness wrote it; a session written through our API exports as the harness would
see it (its projection, cuts applied, as ``user/message`` / ``assistant/message`` /
``tool/result`` events).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any

from msgspec import UNSET, Meta, Struct, UnsetType

from ..errors import ImportFormatError
from ..model import Entry, NewEntry, SessionHead, SessionHeader
from ..projection import derive_message, openai_messages, project
from .common import Bad, ParsedSession, Source, convert, iso_ms, json_object, number_ms, seconds_or_ms

FORMAT = "tutorial"
_ENVELOPE = frozenset({"type", "seq", "ts", "at", "sessionId"})
NonNeg = Annotated[int, Meta(ge=0)]

#: The payload keys each message event's message is made of (payload key = message key).
_MAPPED: dict[str, tuple[str, ...]] = {
    "user/message": ("content",),
    "assistant/message": ("content", "tool_calls"),
    "tool/result": ("tool_call_id", "content"),
}


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


# --------------------------------------------------------------------------- JSON.stringify


def _js_number(x: int | float) -> str:
    """A number as JavaScript's ``JSON.stringify`` writes it (ECMAScript Number::toString)."""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    if not math.isfinite(x):
        return "null"
    if x == 0:
        return "0"
    if x.is_integer() and abs(x) < 2**53:
        return str(int(x))
    sign = "-" if x < 0 else ""
    t = Decimal(repr(abs(x))).normalize().as_tuple()
    digits = "".join(map(str, t.digits))
    k = len(digits)
    n = k + int(t.exponent)  # the decimal point sits after n digits
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * (-n) + digits
    e = n - 1
    mant = digits[0] + ("." + digits[1:] if k > 1 else "")
    return f"{sign}{mant}e{'+' if e >= 0 else '-'}{abs(e)}"


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


_SURROGATE = re.compile("[\ud800-\udfff]")


def _js_string(s: str) -> str:
    if _SURROGATE.search(s):  # a high and a low surrogate side by side are one character to JS
        s = s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch < " " or "\ud800" <= ch <= "\udfff":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def js_json(value: Any) -> str:
    """``JSON.stringify(value)``: compact, non-ASCII kept, numbers as JavaScript writes them."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return _js_string(value)
    if isinstance(value, (bool, int, float)):
        return _js_number(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{_js_string(str(k))}:{js_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(js_json(v) for v in value) + "]"
    raise TypeError(f"not JSON: {type(value).__name__}")


def _iso(ms: int) -> str:
    """``new Date(ms).toISOString()``."""
    dt = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)
    return f"{dt:%Y-%m-%dT%H:%M:%S}.{ms % 1000:03d}Z"


def _truthy(v: Any) -> bool:
    """JavaScript truthiness of a JSON value ([] and {} are true)."""
    if v is None or v is False or v == "":
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v != 0 and v == v
    return True


def _fits(content: Any) -> bool:
    """Whether a chat message's content can hold `content` as it is."""
    return (
        content is None
        or isinstance(content, str)
        or (isinstance(content, list) and all(isinstance(p, dict) for p in content))
    )


# --------------------------------------------------------------------------- import


def _time(ev: EventLine | MetaLine) -> int | None:
    if ev.ts is not None and not isinstance(ev.ts, UnsetType):
        return seconds_or_ms(ev.ts, "ts")
    if ev.at is not None and not isinstance(ev.at, UnsetType):
        return iso_ms(ev.at, "at")
    return None


def _derive(t: str, p: dict[str, Any]) -> dict[str, Any] | None:
    """The message ``deriveMessages`` makes of this event (as JSON.stringify shows it), or None."""
    if t == "user/message":
        msg: dict[str, Any] = {"role": "user"}
        if "content" in p:
            msg["content"] = p["content"]
        return msg
    if t == "assistant/message":
        content = p.get("content")
        msg = {"role": "assistant", "content": "" if content is None else content}
        if _truthy(p.get("tool_calls")):
            msg["tool_calls"] = p["tool_calls"]
        return msg
    if t == "tool/result":
        msg = {"role": "tool"}
        if "tool_call_id" in p:
            msg["tool_call_id"] = p["tool_call_id"]
        elif "toolCallId" in p:  # the variant
            msg["tool_call_id"] = p["toolCallId"]
        if "content" in p:
            msg["content"] = p["content"]
        return msg
    if t == "assistant/tool_calls":  # the variant
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
                    "function": {"name": c.get("name"), "arguments": js_json(c.get("arguments") or {})},
                }
                for c in calls
            ],
        }
        if p.get("reasoningContent"):
            msg["reasoning_content"] = p["reasoningContent"]
        return msg
    return None


def _storable(t: str, msg: dict[str, Any]) -> dict[str, Any]:
    """`msg` as a ``message`` entry holds it: a tool result's content no chat message can hold is
    its JSON text (what the model is sent); a user or assistant content of the wrong type is an
    error (the harness types it as a string)."""
    if "content" not in msg or _fits(msg["content"]):
        return msg
    if t == "tool/result":
        return {**msg, "content": js_json(msg["content"])}
    raise Bad(f"{t}: content must be a string, null or a list of content parts, got {type(msg['content']).__name__}")


def _split(t: str, payload: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """The meta that, with `data`, gives back `payload` exactly (key order included)."""
    meta: dict[str, Any] = {}
    if t == "assistant/tool_calls":
        rest = {k: v for k, v in payload.items() if k not in ("content", "toolCalls", "reasoningContent")}
        if rest:
            meta["payload"] = rest
        if list(_message_payload(t, data, meta)) != list(payload):
            meta["keys"] = list(payload)
        return meta
    mapped = _MAPPED[t]
    rest = {k: v for k, v in payload.items() if not (k in mapped and k in data and js_json(data[k]) == js_json(v))}
    if rest:
        meta["payload"] = rest
    if list(payload) != _payload_order(t, data, rest):
        meta["keys"] = list(payload)
    return meta


def _payload_order(t: str, data: dict[str, Any], rest: dict[str, Any]) -> list[str]:
    mapped = _MAPPED[t]
    return [k for k in mapped if k in data or k in rest] + [k for k in rest if k not in mapped]


def _envelope_of(obj: dict[str, Any], flat: bool) -> list[str]:
    """The order of a line's envelope keys, ``*`` standing for a flat payload's keys."""
    out: list[str] = []
    for k in obj:
        if k in _ENVELOPE or (k == "data" and not flat):
            out.append(k)
        elif "*" not in out:
            out.append("*")
    if flat and "*" not in out:
        out.append("*")
    return out


class _Reader:
    def __init__(self, source: Source) -> None:
        self.source = source
        self.entries: list[NewEntry] = []
        self.lines: list[int] = []
        self.raw: list[str] = []
        self.last_seq = -1
        self.envelope: dict[str, Any] = {}

    def header(self, obj: dict[str, Any], raw: str) -> None:
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
        if _first_line(self.session_id, meta) != raw:
            self.origin["line"] = raw

    def later_meta(self, obj: dict[str, Any]) -> None:
        """A ``session/meta`` line after the first: ``load()`` takes its id and keeps no event."""
        sid = obj.get("id")
        if isinstance(sid, str):
            self.session_id = sid
            self.id_from_line = True
            self.origin.pop("line", None)

    def _payload(self, obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        if "data" in obj and set(obj) <= _ENVELOPE | {"data"}:
            if not isinstance(obj["data"], dict):
                raise Bad(f"data must be an object, got {type(obj['data']).__name__}")
            self.envelope.setdefault("payload", "data")
            return dict(obj["data"]), False
        self.envelope.setdefault("payload", "flat")
        return {k: v for k, v in obj.items() if k not in _ENVELOPE}, True

    def line(self, no: int, obj: dict[str, Any], raw: str) -> None:
        if obj.get("type") == "session/meta":
            self.later_meta(obj)
            return
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
        payload, flat = self._payload(obj)
        order = _envelope_of(obj, flat)
        self.envelope.setdefault("order", order)
        if order != self.envelope["order"]:
            meta["envelope"] = order
        if isinstance(ev.ts, (int, float)) and time is not None:
            unit = self.envelope.get("ts_unit")
            if js_json(time if unit == "ms" else time / 1000) != js_json(ev.ts):
                meta["ts"] = ev.ts
        if isinstance(ev.at, str) and time is not None and _iso(time) != ev.at:
            meta["at"] = ev.at
        message = _derive(ev.type, payload)
        if message is None:
            self.entries.append(NewEntry(f"tutorial/{ev.type}", payload, meta or None, None, time))
        else:
            data = _storable(ev.type, message)
            meta = {"event": ev.type, **_split(ev.type, payload, data), **meta}
            self.entries.append(NewEntry("message", data, meta, None, time))
        self.lines.append(no)
        self.raw.append(raw)

    def finish(self, session_id: str | None) -> ParsedSession:
        if self.envelope:
            self.origin["envelope"] = self.envelope
        # the safety net: a line the rules above would not write back as it was keeps its text
        for i, (e, raw) in enumerate(zip(self.entries, self.raw, strict=True)):
            stored = Entry(i, e.time or 0, e.type, e.data, e.meta)
            if _event_line(stored, self.envelope) != raw:
                meta = dict(e.meta or {})
                meta["line"] = raw
                self.entries[i] = NewEntry(e.type, e.data, meta, None, e.time)
        header = SessionHeader(
            id=session_id or self.session_id, created_at=self.created_at, title=self.title, origin=self.origin
        )
        return ParsedSession(str(self.source.path), FORMAT, header, self.entries, self.lines)


def parse(source: Source, session_id: str | None) -> tuple[ParsedSession, bool]:
    """The session, and whether its id came from a ``session/meta`` line (else the file name)."""
    reader = _Reader(source)
    lines = source.nonblank()
    first = next(lines)
    try:
        reader.header(json_object(first), first.raw.decode("utf-8", "surrogateescape"))
    except Bad as e:
        raise ImportFormatError(source.path, first.no, f"bad header line: {e}") from None
    for line in lines:
        try:
            reader.line(line.no, json_object(line), line.raw.decode("utf-8", "surrogateescape"))
        except Bad as e:
            raise ImportFormatError(source.path, line.no, str(e), session_id=reader.session_id) from None
    return reader.finish(session_id), reader.id_from_line


# --------------------------------------------------------------------------- export


def _first_line(session_id: str, meta: dict[str, Any]) -> str:
    return js_json({"type": "session/meta", "id": session_id, **meta})


def _message_payload(event: str, data: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The payload of the event ``deriveMessages`` turned into `data` (the reverse of `_derive`)."""
    stored = meta.get("payload")
    rest: dict[str, Any] = stored if isinstance(stored, dict) else {}
    if event == "assistant/tool_calls":
        calls = []
        for c in data.get("tool_calls") or []:
            fn = c.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = fn.get("arguments")
            calls.append({"id": c.get("id"), "name": fn.get("name"), "arguments": args})
        p: dict[str, Any] = {"content": data.get("content")}
        if data.get("reasoning_content"):
            p["reasoningContent"] = data["reasoning_content"]
        p = {**p, "toolCalls": calls, **rest}
        keys = meta.get("keys")
        return {k: p.get(k) for k in keys} if isinstance(keys, list) else p
    if event not in _MAPPED:
        event = {"user": "user/message", "tool": "tool/result"}.get(str(data.get("role")), "assistant/message")
    keys = meta.get("keys")
    order = keys if isinstance(keys, list) else _payload_order(event, data, rest)
    return {k: rest[k] if k in rest else data.get(k) for k in order}


def _event_line(e: Entry, env: dict[str, Any]) -> str:
    """Entry `e` of a session imported from the harness, as the line it was read from."""
    meta = e.meta if isinstance(e.meta, dict) else {}
    if isinstance(meta.get("line"), str):
        return str(meta["line"])
    if e.type == "message":
        event = str(meta.get("event") or "")
        payload = _message_payload(event, dict(e.data), meta)
        if event not in _MAPPED and event != "assistant/tool_calls":
            event = {"user": "user/message", "tool": "tool/result"}.get(str(e.data.get("role")), "assistant/message")
    else:
        event = e.type.removeprefix("tutorial/")
        payload = dict(e.data)
    written = meta.get("envelope") or env.get("order")
    order: list[str] = written if isinstance(written, list) else ["type", "seq", "ts", "*"]
    ev: dict[str, Any] = {}
    for k in order:
        if k == "type":
            ev["type"] = event
        elif k == "seq":
            ev["seq"] = meta.get("seq", e.n)
        elif k == "ts":
            ev["ts"] = meta["ts"] if "ts" in meta else (e.time if env.get("ts_unit") == "ms" else e.time / 1000)
        elif k == "at":
            ev["at"] = meta["at"] if "at" in meta else _iso(e.time)
        elif k == "data":
            ev["data"] = payload
        elif k == "*":
            for pk, pv in payload.items():
                ev.setdefault(pk, pv)
    return js_json(ev)


def _is_tutorial(e: Entry) -> bool:
    return e.type.startswith("tutorial/") or (
        e.type == "message" and isinstance(e.meta, dict) and isinstance(e.meta.get("event"), str)
    )


def _openai_events(messages: Sequence[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """OpenAI chat messages as the harness's message events (the ones its deriveMessages reads)."""
    for m in messages:
        role = m.get("role")
        if role == "tool":
            yield "tool/result", {"tool_call_id": m.get("tool_call_id"), "content": m.get("content")}
        elif role == "assistant":
            p: dict[str, Any] = {"content": m.get("content") if m.get("content") is not None else ""}
            if m.get("tool_calls"):
                p["tool_calls"] = m["tool_calls"]
            yield "assistant/message", p
        else:  # user, and system (a summary): the harness has no other message the model sees
            content = m.get("content")
            yield "user/message", {"content": content if isinstance(content, str) else js_json(content)}


def export_lines(head: SessionHead, entries: Sequence[Entry]) -> Iterator[str]:
    """The session as the harness's log.

    A session imported from the harness (and never compacted) goes back as the file it came
    from, byte for byte; entries appended since through our API follow as the message events
    their messages are. Any other session is written as the harness would see it: its projection
    (cuts applied, a summary as a user message), rendered for OpenAI, one ``user/message``,
    ``assistant/message`` (``content`` a string, ``tool_calls``) or ``tool/result``
    (``tool_call_id``, string ``content``) event per message, ``seq`` 0, 1, 2 … and ``ts`` the
    time of the entry it came from."""
    origin = head.header.origin if isinstance(head.header.origin, dict) else {}
    env_value, meta_value = origin.get("envelope"), origin.get("meta")
    env: dict[str, Any] = env_value if isinstance(env_value, dict) else {}
    meta: dict[str, Any] = meta_value if isinstance(meta_value, dict) else {}
    line = origin.get("line")
    first = _first_line(head.header.id, meta)
    if isinstance(line, str) and origin.get("format") == FORMAT and _same_id(line, head.header.id):
        first = line
    yield first + "\n"
    if origin.get("format") == FORMAT and head.last_cut is None:
        for e in entries:
            if _is_tutorial(e):
                yield _event_line(e, env) + "\n"
                continue
            own = derive_message(e)
            for event, payload in _openai_events(openai_messages([own] if own is not None else [])):
                yield js_json({"type": event, "seq": e.n, "ts": e.time / 1000, **payload}) + "\n"
        return
    times = {e.n: e.time for e in entries}
    seq = 0
    for m in project(entries):
        ts = times.get(m.source[-1] if m.source else -1, head.header.created_at) / 1000
        for event, payload in _openai_events(openai_messages([m])):
            yield js_json({"type": event, "seq": seq, "ts": ts, **payload}) + "\n"
            seq += 1


def _same_id(line: str, session_id: str) -> bool:
    try:
        return bool(json.loads(line).get("id") == session_id)
    except ValueError:
        return False
