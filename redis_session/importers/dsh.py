"""dsh session logs (deepseek-ai/deepseek-harness, ``session-persistence-jsonl``): ``*.jsonl`` or,
dsh's default since 2026-07, ``*.jsonl.zstd`` (concatenated zstd frames, one per durable batch).

Line 1 is ``{"type":"session","version":0,"id","createdAt",cwd?,parentSession?,seedLength?}``;
every further line is an event ``{type, seq, time, data, surfaceOp?, sourceEventSeqs?,
ignorable?}`` with ``seq`` 0, 1, 2 …, or one of dsh's packed storage rows (``text-chunks``,
``reasoning-chunks``, ``tool-call-chunks``: a run of ``assistant/chunk`` events), expanded back
into its events. Each event becomes an entry with its type, time, data and surface, except that
runs of chunk events of one turn and step are packed into ``assistant/chunk`` rows
(`projection.chunks.pack_chunks`: ``{turn, step, seq, chunks, dt?}``, up to 256 chunks or 64 KiB a
row), so n and dsh's seq part ways after the first row. Every seq stays recoverable: a row's
``seq`` is its first chunk's seq (``seq + i`` the i-th chunk's, ``dt`` their times), any other
entry whose seq is not its n keeps it as ``meta.seq`` (`dsh_seqs` walks the log to the same
numbers). Surface references (``sourceEventSeqs``, a replace's start/end) are remapped to n; one
that named a chunk inside a row is also kept as written in ``meta.sourceEventSeqs``. The header's
other fields go to ``origin``.

The export (`export_lines`) writes a row back as its one-chunk events, numbers the events 0, 1,
2 … and maps surface references back to seqs: a file imported from dsh goes back as dsh wrote it.

**A file dsh loads imports as dsh loads it** (its ``scanLog`` + ``interruptedTurnClosers``):

- only newline-terminated lines count; the longest prefix of parseable, seq-contiguous events is
  kept. A hole (an unparseable line, a seq gap) *after* the last ``turn/end`` is the torn tail of
  a crash: it and everything after it are dropped. A hole at or before the last ``turn/end`` is
  corruption: the file is refused (dsh refuses it too). A zstd file whose last frame was cut
  short keeps the complete lines of that frame, as dsh does.
- a turn left open is closed with dsh's synthetic closers: an error ``tool/result`` ("Tool call
  interrupted by a crash; no result was recorded.") for each unanswered call, ``step/end`` if a
  step is open, ``turn/end {reason: {kind: "interrupted"}}``, all at the last event's time.

The import reports both repairs (`ImportResult.repaired`).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from ..errors import ImportFormatError
from ..model import Entry, NewEntry, SessionHead, SessionHeader, Surface, SurfaceReplace
from ..projection.chunks import CHUNK, pack_chunks, row_times, unpack_row
from ..projection.invariants import interrupted_turn_closers
from ..projection.messages import Message
from .common import Bad, Line, ParsedSession, Source, convert, json_object, number_ms

FORMAT = "dsh"
NonNeg = Annotated[int, Meta(ge=0)]
ROW_TYPES = ("text-chunks", "reasoning-chunks", "tool-call-chunks")


class HeaderLine(Struct):
    type: Literal["session"]
    version: int
    id: str
    createdAt: int | float
    cwd: str | None = None
    parentSession: str | None = None
    seedLength: NonNeg | None = None


class Event(Struct, forbid_unknown_fields=True):
    type: str
    seq: NonNeg
    time: NonNeg
    data: dict[str, Any]
    surfaceOp: Any = UNSET
    sourceEventSeqs: Any = UNSET
    ignorable: bool | UnsetType = UNSET


class RunData(Struct, forbid_unknown_fields=True):
    turn: int
    step: int
    index: int
    dt: list[int]
    texts: list[str] | UnsetType = UNSET
    id: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    args: list[str] | UnsetType = UNSET


class ChunkRow(Struct, forbid_unknown_fields=True):
    type: Literal["text-chunks", "reasoning-chunks", "tool-call-chunks"]
    seq0: NonNeg
    time0: NonNeg
    data: RunData


def detect(first: dict[str, Any]) -> bool:
    return first.get("type") == "session" and "version" in first


def expand_row(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """A packed storage row as the ``assistant/chunk`` events it stands for (dsh ``expandRow``)."""
    row = convert(obj, ChunkRow, f"malformed {obj.get('type')} storage row: ")
    d = row.data
    members = d.args if row.type == "tool-call-chunks" else d.texts
    if isinstance(members, UnsetType) or not members or len(d.dt) != len(members) - 1:
        raise Bad(f"malformed {row.type} storage row: members and dt do not match")
    if row.type == "tool-call-chunks" and isinstance(d.id, UnsetType):
        raise Bad(f"malformed {row.type} storage row: no call id")
    out: list[dict[str, Any]] = []
    time = row.time0
    for k, member in enumerate(members):
        if k:
            time += d.dt[k - 1]
        chunk: dict[str, Any]
        if row.type == "tool-call-chunks":
            chunk = {"type": "tool-call-delta", "index": d.index, "id": d.id}
            if not isinstance(d.name, UnsetType):
                chunk["name"] = d.name
            chunk["argumentsDelta"] = member
        else:
            kind = "text-delta" if row.type == "text-chunks" else "reasoning-delta"
            chunk = {"type": kind, "index": d.index, "text": member}
        out.append(
            {
                "type": "assistant/chunk",
                "seq": row.seq0 + k,
                "time": time,
                "data": {"turn": d.turn, "step": d.step, "chunk": chunk},
            }
        )
    return out


@dataclass
class _Parsed:
    line: Line
    events: list[dict[str, Any]] | None  # None: the line does not parse
    error: str = ""


def _parse_lines(lines: Sequence[Line]) -> list[_Parsed]:
    out: list[_Parsed] = []
    for line in lines:
        try:
            obj = json_object(line)
            out.append(_Parsed(line, expand_row(obj) if obj.get("type") in ROW_TYPES else [obj]))
        except Bad as e:
            out.append(_Parsed(line, None, str(e)))
    return out


def _committed(source: Source) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    """dsh's ``scanLog``: the kept events (with their line numbers) and what was dropped."""
    body = list(source.nonblank())[1:]  # the events after the header line (read to the end)
    complete = [ln for ln in body if ln.complete]
    notes: list[str] = []
    torn = [ln for ln in body if not ln.complete]
    if torn:
        what = "the last frame was cut short" if source.torn_frame else "no newline at its end"
        notes.append(f"dropped the torn last line {torn[0].no} ({what}), as dsh does")
    elif source.torn_frame:
        notes.append("the last zstd frame was cut short; kept its complete lines, as dsh does")
    parsed = _parse_lines(complete)
    last_end = -1
    for i, p in enumerate(parsed):
        if p.events is not None and any(e.get("type") == "turn/end" for e in p.events):
            last_end = i
    kept: list[tuple[int, dict[str, Any]]] = []
    for i, p in enumerate(parsed):
        seq = p.events[0].get("seq") if p.events else None
        if p.events is None or seq != len(kept):
            if i <= last_end:  # committed data damaged: dsh refuses the file too
                raise ImportFormatError(
                    source.path, p.line.no, p.error or f"seq gap: expected seq {len(kept)}, got {seq}"
                )
            dropped = [q.line.no for q in parsed[i:]]
            why = p.error or f"seq gap: expected seq {len(kept)}, got {seq}"
            notes.append(
                f"dropped line{'s' if len(dropped) > 1 else ''} {_ranges(dropped)} after the last turn/end "
                f"(line {p.line.no}: {why}), as dsh does"
            )
            break
        for k, ev in enumerate(p.events):
            if k and ev.get("seq") != len(kept):
                raise ImportFormatError(source.path, p.line.no, f"malformed storage row: seq {ev.get('seq')}")
            kept.append((p.line.no, ev))
    return kept, notes


def _ranges(numbers: list[int]) -> str:
    return str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]}"


def _entry(obj: dict[str, Any], expected: int) -> NewEntry:
    ev = convert(obj, Event, "invalid event envelope: ")
    if ev.seq != expected:
        raise Bad(f"seq gap: expected seq {expected}, got {ev.seq}")
    surface: dict[str, Any] | None = None
    if not isinstance(ev.surfaceOp, UnsetType):
        surface = {"surfaceOp": ev.surfaceOp}
        if not isinstance(ev.sourceEventSeqs, UnsetType):
            surface["sourceEventSeqs"] = ev.sourceEventSeqs
    elif not isinstance(ev.sourceEventSeqs, UnsetType):
        raise Bad("sourceEventSeqs without surfaceOp")
    meta: dict[str, Any] | None = None if isinstance(ev.ignorable, UnsetType) else {"ignorable": ev.ignorable}
    keys = list(obj)
    if keys != _envelope_order(keys):  # written in another order than dsh's: kept for the export
        meta = {**(meta or {}), "keys": keys}
    return NewEntry(ev.type, ev.data, meta, surface, ev.time)


#: The order dsh's JSON.stringify writes an event's keys in (its event objects are built so).
_ORDER = ("type", "seq", "time", "data", "ignorable", "sourceEventSeqs", "surfaceOp")


def _envelope_order(keys: Sequence[str]) -> list[str]:
    return [k for k in _ORDER if k in keys]


def _header(obj: dict[str, Any]) -> tuple[HeaderLine, dict[str, Any]]:
    line = convert(obj, HeaderLine)
    if line.version != 0 or isinstance(obj.get("version"), bool):
        raise Bad(f"dsh session version must be 0, got {line.version!r}")
    number_ms(line.createdAt, "createdAt")
    if line.cwd is not None and not os.path.isabs(line.cwd):
        raise Bad(f"cwd must be an absolute path string, got {line.cwd!r}")
    origin: dict[str, Any] = {"format": FORMAT}
    origin.update({k: v for k, v in obj.items() if k not in ("type", "version", "id", "createdAt")})
    return line, origin


def parse(source: Source, session_id: str | None) -> ParsedSession:
    first = next(source.nonblank())
    try:
        hdr, origin = _header(json_object(first))
    except Bad as e:
        raise ImportFormatError(source.path, first.no, f"bad header line: {e}") from None
    kept, notes = _committed(source)
    events: list[NewEntry] = []  # one per dsh event: its position is its dsh seq
    lines: list[int] = []
    for no, obj in kept:
        try:
            events.append(_entry(obj, len(events)))
        except Bad as e:
            raise ImportFormatError(source.path, no, str(e), session_id=hdr.id) from None
        lines.append(no)
    closers = interrupted_turn_closers(
        [Entry(i, e.time or 0, e.type, e.data if isinstance(e.data, dict) else {}) for i, e in enumerate(events)]
    )
    if closers:
        names = ", ".join(c.type for c in closers)
        turn = closers[-1].data.get("turn")
        notes.append(f"closed the open turn {turn} with {len(closers)} entries ({names}), as dsh's load() does")
        events.extend(closers)
        lines.extend([0] * len(closers))
    entries, entry_lines = _pack(events, lines)
    header = SessionHeader(id=session_id or hdr.id, created_at=int(hdr.createdAt), origin=origin)
    return ParsedSession(str(source.path), FORMAT, header, entries, entry_lines, repaired=notes)


def _pack(events: list[NewEntry], lines: list[int]) -> tuple[list[NewEntry], list[int]]:
    """The events (position = dsh seq) with their runs of chunk events packed into rows
    (`pack_chunks`: a row's ``seq`` is its first chunk's dsh seq), every seq a surface names
    remapped to the n of its entry, and each other entry's dsh seq kept as ``meta.seq`` where it
    is not its n. A ``sourceEventSeqs`` naming a chunk inside a row (no n names it) is kept as
    written in ``meta.sourceEventSeqs``, for the export."""
    packed = pack_chunks(events)
    pos = packed.positions
    entries = list(packed.entries)
    entry_lines = [0] * len(entries)
    firsts = [0] * len(entries)  # the dsh seq of each entry's first event
    for seq in range(len(events) - 1, -1, -1):
        firsts[pos[seq]] = seq
        entry_lines[pos[seq]] = lines[seq]
    for n, e in enumerate(entries):
        seq = firsts[n]
        if e is not events[seq]:
            continue  # a row: its data.seq is its first chunk's seq
        if e.surface is not None:
            e = _remapped(e, seq, pos, firsts)
        if n != seq:
            e = msgspec.structs.replace(e, meta={**(e.meta or {}), "seq": seq})
        entries[n] = e
    return entries, entry_lines


def _remapped(e: NewEntry, seq: int, pos: list[int], firsts: list[int]) -> NewEntry:
    """`e` with the dsh seqs its surface names as the n of their entries."""
    try:
        surface = e.surface if isinstance(e.surface, Surface) else msgspec.convert(e.surface, Surface)
    except msgspec.ValidationError:
        return e  # malformed: the validation reports it in the store's words
    op, seqs = surface.op, surface.source_event_seqs
    named = ([op.start, op.end] if isinstance(op, SurfaceReplace) else []) + list(seqs or ())
    if any(s >= seq for s in named) or (seqs is not None and len(set(seqs)) != len(seqs)):
        return e  # names no earlier event, or twice: the validation reports it as written
    if isinstance(op, SurfaceReplace):
        op = SurfaceReplace("replace", pos[op.start], pos[op.end])
    meta = e.meta
    if seqs is not None:
        mapped = list(dict.fromkeys(pos[s] for s in seqs))
        if [firsts[n] for n in mapped] != seqs:
            meta = {**(meta or {}), "sourceEventSeqs": list(seqs)}
        seqs = mapped
    return msgspec.structs.replace(e, surface=Surface(op, seqs), meta=meta)


# --------------------------------------------------------------------------- messages and export


def dsh_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as dsh's ``deriveMessages()`` returns them: ``{role, content: [blocks]}``, a tool
    result a user message holding its ``tool-result`` block."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "user" if m.role == "tool" else m.role
        out.append({"role": role, "content": [_plain(b) for b in m.content]})
    return out


def _plain(value: Any) -> Any:
    """A frozen block as plain dicts and lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def dsh_seqs(entries: Sequence[Entry]) -> list[int]:
    """The dsh seq of each entry's (first) event, as the export numbers them: seqs run 0, 1, 2 …
    over the events, a packed chunk row standing for one event per chunk. For a session imported
    from dsh these are the seqs of the file (a row's ``data.seq``, an entry's ``meta.seq`` where
    it is not its n)."""
    out: list[int] = []
    seq = 0
    for e in entries:
        out.append(seq)
        seq += len(unpack_row(e.data)) if _is_row(e) else 1
    return out


def _is_row(e: Entry) -> bool:
    return e.type == CHUNK and isinstance(e.data, dict) and isinstance(e.data.get("chunks"), list)


def _events(e: Entry, seq: int, seqs: Sequence[int]) -> Iterator[dict[str, Any]]:
    """Entry `e` as dsh events from `seq` on (a packed chunk row as its one-chunk events);
    `seqs` maps the n a surface names to its dsh seq."""
    if _is_row(e):
        d = e.data
        head = {k: d[k] for k in ("turn", "step") if k in d}
        for k, (chunk, time) in enumerate(zip(unpack_row(d), row_times(e.time, d), strict=True)):
            yield {"type": CHUNK, "seq": seq + k, "time": time, "data": {**head, "chunk": chunk}}
        return
    ev: dict[str, Any] = {"type": e.type, "seq": seq, "time": e.time, "data": e.data}
    meta = e.meta if isinstance(e.meta, dict) else {}
    if e.surface is not None:
        op = e.surface.op
        ev["surfaceOp"] = op if isinstance(op, str) else {"op": op.op, "start": seqs[op.start], "end": seqs[op.end]}
        refs = e.surface.source_event_seqs
        if refs is not None:
            # as written when the import kept them (they named chunks inside a row) and still fit
            written = meta.get("sourceEventSeqs")
            fits = isinstance(written, list) and list(dict.fromkeys(_rows_of(written, seqs))) == refs
            ev["sourceEventSeqs"] = list(written) if fits and isinstance(written, list) else [seqs[n] for n in refs]
    if isinstance(meta.get("ignorable"), bool):
        ev["ignorable"] = meta["ignorable"]
    written = meta.get("keys")
    order = written if isinstance(written, list) and set(written) == set(ev) else _envelope_order(list(ev))
    yield {k: ev[k] for k in order}


def _rows_of(written: list[Any], seqs: Sequence[int]) -> Iterator[int]:
    """The n of the entry holding each dsh seq of `written` (`seqs`: first dsh seq per n)."""
    for s in written:
        yield bisect.bisect_right(seqs, s) - 1 if isinstance(s, int) and not isinstance(s, bool) and s >= 0 else -1


def export_lines(head: SessionHead, entries: Sequence[Entry]) -> Iterator[str]:
    """The session as a dsh JSONL log: the header line, then one event per entry, a packed chunk
    row as one ``assistant/chunk`` event per chunk (times from its ``dt``), seqs 0, 1, 2 … and
    surface references as those seqs (`dsh_seqs`).

    A session imported from dsh goes back as the file it came from (what the import's repair
    added included); dsh's loader reads any other types but its invariants accept only its own
    vocabulary."""
    origin = head.header.origin if isinstance(head.header.origin, dict) else {}
    first: dict[str, Any] = {"type": "session", "version": 0, "id": head.header.id, "createdAt": head.header.created_at}
    for k in ("cwd", "parentSession", "seedLength"):
        if k in origin:
            first[k] = origin[k]
    yield _js(first)
    seqs = dsh_seqs(entries)
    for e, seq in zip(entries, seqs, strict=True):
        for ev in _events(e, seq, seqs):
            yield _js(ev)


def _js(value: Any) -> str:
    """JSON.stringify: compact, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n"
