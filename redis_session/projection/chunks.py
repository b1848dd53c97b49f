"""Streamed answers, pure (no I/O): deltas, the live records that carry them, and the packed
``assistant/chunk`` rows that keep them in the log (docs/design.md §8.2).

A streamed answer has an id (`new_answer_id`). Its deltas are numbered 0, 1, 2 … and travel twice:

- **live**, one record each on the session's ``live`` stream (`LiveRecord`: a ``begin``, the
  deltas, an ``end`` naming the n of the entry that closed the answer), for tailing readers;
- **durable**, many per ``assistant/chunk`` row in the log (`chunk_row`)::

      {"turn": 1, "step": 1, "answer": "a1b2c3d4e5", "seq": 40, "chunks": ["Let ", "me ", …]}

  ``seq`` is the index of the row's first delta in its answer; each element of ``chunks`` is a
  dsh ``StreamChunk`` object, or a bare string for the commonest one,
  ``{"type": "text-delta", "text": s}`` (a third of the bytes of an entry per delta).

`unpack_row` turns a row (packed or a classic one-chunk row) back into dsh chunks, so a replay of
the log yields every delta in order; `assemble` builds the assistant message content from
chunks. The projection never looks at chunk rows (they are marks).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec
from msgspec import Struct

from ..errors import (
    AnswerAliveError,
    AnswerBatchMismatchError,
    AnswerClosedError,
    AnswerIncompleteError,
    AnswerNotFoundError,
    AnswerOrderError,
    AnswerTooLargeError,
    IdempotencyKeyReusedError,
    SessionConflictError,
    SessionCorruptError,
    SessionError,
    SessionNotFoundError,
    SessionReplacedError,
)
from ..model import Entry, NewEntry

CHUNK = "assistant/chunk"
INTERRUPTED = "assistant/interrupted"

TEXT = "text"
REASONING = "reasoning"
TOOL_CALL = "tool-call"
DELTA_KINDS = (TEXT, REASONING, TOOL_CALL)

# live wire codes of the record kinds
_KIND_CODE = {TEXT: "t", REASONING: "r", TOOL_CALL: "c"}
_CODE_KIND = {v: k for k, v in _KIND_CODE.items()}
# the kinds whose delta records are one field (`compact_value`): those with no call id or name
_COMPACT = (TEXT, REASONING)


def compact_value(answer: str, index: int, life: str, text: str) -> str | None:
    """The one field value of a text or reasoning delta's live record,
    ``"<answer> <index> <life> <text>"``: the text last, as it is (spaces, newlines, empty), so
    a reader splits off three spaces. None when the answer id is empty or the answer id or the
    life holds a space (the record then goes as ``a i t l`` fields: never misread)."""
    if not answer or " " in answer or " " in life:
        return None
    return f"{answer} {index} {life} {text}"


def new_answer_id() -> str:
    """A fresh answer id: 10 hex digits (unique enough within one session's live window)."""
    return os.urandom(5).hex()


class Delta(Struct, frozen=True, kw_only=True):
    """One streamed delta as a reader gets it (`live.follow(..., deltas=True)`).

    `answer` names the answer (its chunk rows and its closing entry carry the same id), `index`
    is the delta's place in it (0, 1, 2 …), `kind` one of ``text``, ``reasoning``, ``tool-call``
    (`call_id` and `name` set; `text` is a piece of the call's JSON arguments). `cursor` is the
    live stream id it came with (resume after it)."""

    answer: str
    index: int
    kind: str
    text: str
    call_id: str | None = None
    name: str | None = None
    cursor: str = ""

    def chunk(self) -> dict[str, Any]:
        """The dsh ``StreamChunk`` of this delta."""
        return delta_chunk(self.kind, self.text, self.call_id, self.name)


class DeltaGap(Struct, frozen=True, kw_only=True):
    """A reader could not be given deltas [`start`, `stop`) of `answer` (the live stream no
    longer holds them: trimmed after the grace, capped, or never sent live). The log's chunk rows
    hold every delta of the answer in order (`replay`): re-read it from there. `stop` is the
    index of the next delta the reader gets (None: the answer ended without more). An empty
    `answer`: a resumed reader's cursor is gone from the live stream, so records after it may be
    gone too, of answers it cannot name (re-read the answers it followed). `cursor` is the live
    stream id it came with."""

    answer: str
    start: int
    stop: int | None
    cursor: str = ""


class AnswerState(Struct, frozen=True, kw_only=True):
    """The server's state of one streamed answer (``lua/answer.lua``): the life it began in, the
    log's n at its begin, its next live / logged delta index, the server ms of its writer's last
    write or heartbeat, and once ended the closing entry's n (-1: none) and the reason."""

    answer: str
    incarnation: str
    n: int
    live: int
    logged: int
    beat_ms: int
    ended: int | None = None
    reason: str | None = None


class AnswerBegun(Struct, frozen=True, kw_only=True):
    answer: str
    n: int
    begin_id: str
    incarnation: str
    retry: bool = False


class AnswerAck(Struct, frozen=True, kw_only=True):
    """A delta batch's outcome: the answer's next logged and live index, the row's n (None: no
    row was written now), `retry` when everything in it had landed already."""

    logged: int
    live: int
    row_n: int | None = None
    retry: bool = False


class AnswerEnded(Struct, frozen=True, kw_only=True):
    """An end's outcome: `n` is the closing entry (None: none), `retry` when it had ended."""

    n: int | None
    reason: str
    retry: bool = False


class LiveRecord(Struct, frozen=True, kw_only=True):
    """One record of a session's live stream: ``kind`` is ``begin``, ``end`` or a delta kind.

    begin: `turn`, `step`, `n` (the log's n when the answer began), `incarnation`.
    every record: `incarnation`, the life the answer began in (``inc`` on a begin, ``l`` on the
    others), so a reader never takes a record of another life of the id for its own.
    delta: `index`, `text` (+ `call_id`, `name` for a tool call).
    end:   `n` (the entry that closed the answer: its message or its interrupted mark), `index`
           (how many deltas it had), `reason` (``committed``, ``interrupted``)."""

    answer: str
    kind: str
    id: str = ""
    index: int | None = None
    text: str = ""
    call_id: str | None = None
    name: str | None = None
    turn: int | None = None
    step: int | None = None
    n: int | None = None
    incarnation: str | None = None
    reason: str | None = None

    @property
    def is_delta(self) -> bool:
        return self.kind in _KIND_CODE

    def delta(self) -> Delta:
        assert self.index is not None
        return Delta(
            answer=self.answer,
            index=self.index,
            kind=self.kind,
            text=self.text,
            call_id=self.call_id,
            name=self.name,
            cursor=self.id,
        )

    def fields(self) -> list[str]:
        """The record as XADD field/value pairs: a text or reasoning delta that names its life is
        one field, its kind code (``t``, ``r``) -> ``"<answer> <index> <life> <text>"``
        (`compact_value`); any other record short names (``a i t l``, ``k`` for its kind)."""
        if self.incarnation is not None and self.index is not None and self.kind in _COMPACT:
            one = compact_value(self.answer, self.index, self.incarnation, self.text)
            if one is not None:
                return [_KIND_CODE[self.kind], one]
        f = ["a", self.answer]
        life = [] if self.incarnation is None else ["l", self.incarnation]
        if self.kind == TEXT:
            return [*f, "i", str(self.index), "t", self.text, *life]
        if self.kind in _KIND_CODE:
            f += ["k", _KIND_CODE[self.kind], "i", str(self.index), "t", self.text, *life]
            if self.call_id is not None:
                f += ["c", self.call_id]
            if self.name is not None:
                f += ["m", self.name]
            return f
        f += ["k", "b" if self.kind == "begin" else "e"]
        for name, value in (
            ("i", self.index),
            ("turn", self.turn),
            ("step", self.step),
            ("n", self.n),
            ("inc", self.incarnation),
            ("r", self.reason),
        ):
            if value is not None:
                f += [name, str(value)]
        return f

    @classmethod
    def from_fields(cls, rid: str, f: Mapping[str, str]) -> LiveRecord:
        if len(f) == 1 and "a" not in f:
            ((one_code, one),) = f.items()
            one_kind = _CODE_KIND.get(one_code)
            parts = one.split(" ", 3) if one_kind in _COMPACT else []
            if one_kind is not None and len(parts) == 4 and parts[1].isascii() and parts[1].isdigit():
                answer, index, life, text = parts
                return cls(answer=answer, kind=one_kind, id=rid, index=int(index), text=text, incarnation=life)
        code = f.get("k", "t")
        kind = _CODE_KIND.get(code) or ("begin" if code == "b" else "end" if code == "e" else code)

        def num(key: str) -> int | None:
            v = f.get(key)
            return None if v is None or not v.lstrip("-").isdigit() else int(v)

        return cls(
            answer=f.get("a", ""),
            kind=kind,
            id=rid,
            index=num("i"),
            text=f.get("t", ""),
            call_id=f.get("c"),
            name=f.get("m"),
            turn=num("turn"),
            step=num("step"),
            n=num("n"),
            incarnation=f.get("inc") or f.get("l"),
            reason=f.get("r"),
        )


def answer_refusal(
    code: int, res: Sequence[Any], session_id: str, answer: str, first: int = 0, expected: int = -1
) -> Exception:
    """The typed error of a refusal ``lua/answer.lua`` (or the memory store) answered with."""
    if code == 3:
        return SessionNotFoundError(session_id)
    if code == 8:
        return SessionReplacedError(session_id, f"answer {answer!r} belongs to another life of the id")
    if code == 9:
        return AnswerNotFoundError(session_id, answer)
    if code == 10:
        closing = int(res[1])
        return AnswerClosedError(session_id, answer, None if closing < 0 else closing)
    if code == 11:
        return AnswerOrderError(session_id, answer, int(res[1]), first)
    if code == 12:
        return AnswerIncompleteError(session_id, answer, int(res[1]), int(res[2]))
    if code == 2:
        return SessionConflictError(session_id, expected, int(res[1]))
    if code == 13:
        return AnswerAliveError(session_id, answer)
    if code == 14:
        return AnswerBatchMismatchError(session_id, answer, int(res[1]))
    if code == 15:
        return IdempotencyKeyReusedError(session_id, f"answer {answer}")
    if code == 16:
        return AnswerTooLargeError(session_id, answer, int(res[1]), int(res[2]), int(res[3]))
    if code == 6:
        return SessionError(f"session {session_id!r}: the stream is ahead of the header; run `redis-session doctor`")
    if code == 17:
        return SessionCorruptError.header_field(
            session_id, res[1].decode() if isinstance(res[1], bytes) else str(res[1])
        )
    return SessionError(f"unexpected reply from answer.lua: {res!r}")


ANSWER_RESERVE = 16 << 10
"""Bytes of the entry limit kept for what a closing message holds besides its content (turn,
step, usage, meta): an answer's content may fill the rest (`answer_budget`)."""
_TOOL_CALL_COST = 64  # a tool-call block's own JSON: {"type":"tool-call","id":,"name":,"arguments":}
_json = msgspec.json.Encoder()


def answer_budget(max_entry_bytes: int) -> int:
    """The most content bytes (`delta_cost` summed) one answer may hold: its closing message
    (or interrupted mark) then always fits an entry of `max_entry_bytes`."""
    return max_entry_bytes - min(ANSWER_RESERVE, max_entry_bytes // 4)


def delta_cost(kind: str, text: str, call_id: str | None = None, name: str | None = None) -> int:
    """What a delta adds, at most, to the JSON of its answer's assembled content (`assemble`):
    its text as escaped in a JSON string, and for a tool call its call's id, name and block (so
    the sum over an answer's deltas, plus `ANSWER_RESERVE`, bounds its closing entry).
    `UnicodeEncodeError` for text that is not valid UTF-8 (a lone surrogate)."""
    cost = len(_json.encode(text)) - 2
    if kind == TOOL_CALL:
        cost += len(_json.encode(call_id or "")) + len(_json.encode(name or "")) + _TOOL_CALL_COST
    return cost


def deltas_cost(deltas: Iterable[Delta]) -> int:
    """`delta_cost` of a batch."""
    return sum(delta_cost(d.kind, d.text, d.call_id, d.name) for d in deltas)


def delta_chunk(kind: str, text: str, call_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    """The dsh ``StreamChunk`` of a delta."""
    if kind == TEXT:
        return {"type": "text-delta", "text": text}
    if kind == REASONING:
        return {"type": "reasoning-delta", "text": text}
    if kind == TOOL_CALL:
        c: dict[str, Any] = {"type": "tool-call-delta", "callId": call_id}
        if name is not None:
            c["name"] = name
        c["argsDelta"] = text
        return c
    raise ValueError(f"unknown delta kind {kind!r}")


def _packed(chunk: Any) -> Any:
    """A chunk as a row element: a plain text delta shrinks to its string."""
    if isinstance(chunk, dict) and chunk.get("type") == "text-delta" and len(chunk) == 2 and "text" in chunk:
        text = chunk["text"]
        if isinstance(text, str):
            return text
    return chunk


def _unpacked(element: Any) -> Any:
    return {"type": "text-delta", "text": element} if isinstance(element, str) else element


def chunk_row(chunks: Sequence[Any], *, turn: int | None, step: int | None, answer: str | None, seq: int) -> NewEntry:
    """One packed ``assistant/chunk`` row holding `chunks` (dsh StreamChunks), the first of them
    delta number `seq` of `answer`."""
    data: dict[str, Any] = {}
    if turn is not None:
        data["turn"] = turn
    if step is not None:
        data["step"] = step
    if answer is not None:
        data["answer"] = answer
    data["seq"] = seq
    data["chunks"] = [_packed(c) for c in chunks]
    return NewEntry(CHUNK, data)


def unpack_row(data: Mapping[str, Any]) -> list[Any]:
    """The dsh StreamChunks of one ``assistant/chunk`` row's data: a packed row's ``chunks``, or
    a classic row's single ``chunk`` (as it is)."""
    packed = data.get("chunks")
    if isinstance(packed, list):
        return [_unpacked(e) for e in packed]
    if "chunk" in data:
        return [data["chunk"]]
    return []


def end_row(answer: str, turn: int | None, step: int | None, deltas: int, reason: str) -> NewEntry:
    """The entry that closes an answer ending without a message (its commit was refused: someone
    else wrote first, and the caller may commit the message itself): an ``assistant/chunk`` row
    with no chunks, ``seq`` the answer's number of deltas, and ``ended`` the reason. A mark the
    projection ignores, it tells a reader that lagged behind the live stream that the answer
    ended and how many deltas it had (a gap names those it missed), and `repair` that it is no
    dead writer's."""
    row = chunk_row([], turn=turn, step=step, answer=answer, seq=deltas)
    return NewEntry(CHUNK, {**row.data, "ended": reason})


def row_ended(data: Any) -> bool:
    """Whether an ``assistant/chunk`` row's data closes its answer (`end_row`)."""
    return isinstance(data, Mapping) and isinstance(data.get("ended"), str)


def closes_answer(e: Entry) -> bool:
    """Whether `e` closes the streamed answer it belongs to (`entry_answer`): its
    ``assistant/message`` or ``assistant/interrupted``, or an `end_row`."""
    if e.type == CHUNK:
        return row_ended(e.data)
    return entry_answer(e) is not None


def row_end(data: Any) -> int | None:
    """The index after the last delta an ``assistant/chunk`` row of a streamed answer holds
    (``seq`` + its chunks), None for a row without ``seq``."""
    if not isinstance(data, Mapping):
        return None
    seq = data.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        return None
    return seq + len(unpack_row(data))


def replay(entries: Iterable[Any]) -> dict[str, list[Any]]:
    """Every streamed answer's chunks in order, from log entries (any ``Entry``-like objects with
    ``type`` and ``data``): ``{answer id: [chunk, …]}``. Rows without an answer id (imported,
    classic) are keyed ``"<turn>/<step>"``."""
    out: dict[str, list[Any]] = {}
    for e in entries:
        if e.type != CHUNK or not isinstance(e.data, Mapping):
            continue
        key = e.data.get("answer")
        if not isinstance(key, str):
            key = f"{e.data.get('turn')}/{e.data.get('step')}"
        out.setdefault(key, []).extend(unpack_row(e.data))
    return out


def assemble(chunks: Iterable[Any]) -> list[dict[str, Any]]:
    """Assistant message content built from dsh chunks: a ``reasoning`` block, a ``text`` block,
    then one ``tool-call`` block per call id (in order of first appearance); empty parts left out.
    Chunks of other types are ignored."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: dict[str, dict[str, Any]] = {}
    for c in chunks:
        if not isinstance(c, Mapping):
            continue
        t = c.get("type")
        piece = c.get("text", c.get("delta", c.get("textDelta")))
        if t == "text-delta" and isinstance(piece, str):
            text.append(piece)
        elif t == "reasoning-delta" and isinstance(piece, str):
            reasoning.append(piece)
        elif t == "tool-call-delta":
            cid = str(c.get("callId") or c.get("id") or "")
            call = calls.setdefault(cid, {"type": "tool-call", "id": cid, "name": "", "arguments": ""})
            if c.get("name"):
                call["name"] = c["name"]
            args = c.get("argsDelta", c.get("argsTextDelta"))
            if isinstance(args, str):
                call["arguments"] += args
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "reasoning", "text": "".join(reasoning)})
    if text:
        blocks.append({"type": "text", "text": "".join(text)})
    blocks.extend(calls.values())
    return blocks


def assemble_deltas(deltas: Iterable[Delta]) -> list[dict[str, Any]]:
    return assemble(d.chunk() for d in deltas)


class PackedChunks(Struct, frozen=True):
    """What `pack_chunks` made: the entries to write and, for each input position, the position
    of the entry that holds it (a chunk maps to its row)."""

    entries: list[NewEntry]
    positions: list[int]


def pack_chunks(entries: Sequence[Any], *, max_chunks: int = 256, max_bytes: int | None = 64 << 10) -> PackedChunks:
    """Pack runs of consecutive ``assistant/chunk`` entries of one turn and step into rows of at
    most `max_chunks` chunks (for importers: a dsh file holds one event per chunk).

    `entries` are `NewEntry` objects (or anything with ``type``, ``data``, ``time``); other
    entries pass through unchanged, and so does a chunk entry with meta or surface metadata (it
    is no classic one-chunk row). A row keeps its first chunk's time, and ``seq`` is the
    input position of its first chunk, so every chunk's original position stays recoverable:
    ``row.data["seq"] + i`` for the i-th chunk of the row (with `positions` to remap
    ``sourceEventSeqs`` that named chunks). When the chunks' times differ, the row's ``dt`` lists
    the ms from each chunk to the next (as dsh's own storage rows do; `row_times` reads them).
    A row also closes before its chunks' JSON would pass `max_bytes` (a bigger chunk gets a row
    of its own), so a row stays far below any entry size limit."""
    out: list[NewEntry] = []
    positions: list[int] = []
    run: list[Any] = []
    times: list[Any] = []
    run_key: tuple[Any, Any] | None = None
    run_start = 0
    run_bytes = 0

    def close() -> None:
        nonlocal run, run_key, times
        if run:
            turn, step = run_key or (None, None)
            row = chunk_row(run, turn=turn, step=step, answer=None, seq=run_start)
            if all(isinstance(t, int) for t in times) and len(set(times)) > 1:
                row.data["dt"] = [b - a for a, b in itertools.pairwise(times)]
            out.append(NewEntry(row.type, row.data, time=times[0]))
        run, run_key, times = [], None, []

    for i, e in enumerate(entries):
        data = e.data if isinstance(e.data, Mapping) else None
        is_chunk = (
            e.type == CHUNK
            and data is not None
            and set(data) <= {"turn", "step", "chunk"}
            and "chunk" in data
            and getattr(e, "meta", None) is None
            and getattr(e, "surface", None) is None
        )
        if not is_chunk:
            close()
            positions.append(len(out))
            out.append(e if isinstance(e, NewEntry) else NewEntry(e.type, e.data, getattr(e, "meta", None)))
            continue
        assert data is not None
        key = (data.get("turn"), data.get("step"))
        size = len(msgspec.json.encode(_packed(data["chunk"]))) + 1 if max_bytes is not None else 0
        if run and (
            key != run_key or len(run) >= max_chunks or (max_bytes is not None and run_bytes + size > max_bytes)
        ):
            close()
        if not run:
            run_key, run_start, run_bytes = key, i, 0
        positions.append(len(out))
        run.append(data["chunk"])
        times.append(getattr(e, "time", None))
        run_bytes += size
    close()
    return PackedChunks(out, positions)


def row_times(time: int, data: Mapping[str, Any]) -> list[int]:
    """The time of each chunk of a row (entry time `time`): the row's ``dt`` applied, or `time`
    for every chunk when it has none."""
    count = len(unpack_row(data))
    dt = data.get("dt")
    out = [time] * count
    if isinstance(dt, list) and len(dt) == count - 1 and all(isinstance(d, int) for d in dt):
        for k, d in enumerate(dt, 1):
            out[k] = out[k - 1] + d
    return out


def entry_answer(e: Entry) -> str | None:
    """The streamed answer an entry belongs to: a chunk row's ``data.answer``, a closing entry's
    (``assistant/message``, ``assistant/interrupted``) ``meta.answer``; None for any other."""
    src = e.data if e.type == CHUNK else e.meta
    a = src.get("answer") if isinstance(src, Mapping) else None
    return a if isinstance(a, str) else None


def _record_ms(rid: str) -> int:
    ms = rid.partition("-")[0]
    return int(ms) if ms.isdigit() else 0


class Merged(Struct, frozen=True):
    """What `merge_live` ordered: `items`, holding the first `entries` entries and the first
    `records` records it was given (the rest wait for the next read)."""

    items: list[Entry | LiveRecord]
    entries: int
    records: int


def merge_live(
    entries: Sequence[Entry],
    records: Sequence[LiveRecord],
    *,
    more_entries: bool = False,
    more_records: bool = False,
) -> Merged:
    """Log entries and live records (each in its own order) as one sequence in the order they
    happened: the one rule of every reader that gives both (`RedisSessionStore.tail_live`, the
    memory store's, `streaming.tail_deltas`, the gateway's catch-up reads).

    A live record's id is the server's ms when it landed, an entry's `time` the same server's
    clock when it was written: the earlier comes first. At the same ms a record of the entry's
    own answer (its begin, a delta) comes first — an answer's deltas come before the chunk row
    and the message that close it — and any other record (another answer's, the answer's own
    end record, which lands after its closing entry) after it. Whatever the clocks say, the
    deltas of an answer given here come before the entry that closes it (its
    ``assistant/message`` or ``assistant/interrupted``): a live stream whose ids run ahead of the
    clock (after a failover to a server whose clock is behind) never puts an answer's deltas
    after its end.

    `more_entries` / `more_records`: that side was cut short (a read's COUNT), so what comes
    after its last item is not known yet: the items that would follow that last item are held
    back (not in `items`, not counted) for the next read; at least one item is always taken."""
    last_own: dict[str, int] = {}  # answer -> position of its last begin or delta in `records`
    for k, r in enumerate(records):
        if r.kind != "end":
            last_own[r.answer] = k
    out: list[Entry | LiveRecord] = []
    i = j = 0
    last_e = last_r = -1  # positions in `out` of the last entry and the last record
    ne, nr = len(entries), len(records)
    while i < ne or j < nr:
        take_record = i >= ne
        if not take_record and j < nr:
            e, r = entries[i], records[j]
            a = entry_answer(e)
            if a is not None and closes_answer(e) and last_own.get(a, -1) >= j:
                take_record = True  # the answer's own records before its closing entry
            else:
                ms = _record_ms(r.id)
                take_record = ms < e.time or (ms == e.time and r.answer == a and r.kind != "end")
        if take_record:
            last_r = len(out)
            out.append(records[j])
            j += 1
        else:
            last_e = len(out)
            out.append(entries[i])
            i += 1
    cut = len(out)
    if more_entries and ne:
        cut = min(cut, last_e + 1)
    if more_records and nr:
        cut = min(cut, last_r + 1)
    if cut == len(out):
        return Merged(out, ne, nr)
    items = out[:cut]
    taken = sum(1 for x in items if isinstance(x, Entry))
    return Merged(items, taken, cut - taken)


def answers_to_skip(records: Iterable[LiveRecord], start: int, incarnation: str | None) -> set[str]:
    """Answers of a live backlog a reader starting at log position `start` must not be sent as
    deltas: those already closed before `start` (their entries are behind the reader), and those
    begun by another incarnation of the session."""
    skip: set[str] = set()
    for r in records:
        if r.kind == "end" and r.n is not None and r.n < start:
            skip.add(r.answer)
        elif r.kind == "begin" and incarnation and r.incarnation and r.incarnation != incarnation:
            skip.add(r.answer)
    return skip


def open_answers(records: Sequence[LiveRecord]) -> dict[str, tuple[LiveRecord | None, list[Delta]]]:
    """Every answer of a live backlog without an end: its begin (None if trimmed) and deltas."""
    out: dict[str, tuple[LiveRecord | None, list[Delta]]] = {}
    ended: set[str] = set()
    for r in records:
        if r.kind == "end":
            ended.add(r.answer)
            out.pop(r.answer, None)
        elif r.answer in ended:
            continue
        elif r.kind == "begin":
            out[r.answer] = (r, out.get(r.answer, (None, []))[1])
        elif r.is_delta and r.index is not None:  # (a record with no index is no delta: skipped)
            got = out.setdefault(r.answer, (None, []))[1]
            if not got or got[-1].index < r.index:  # each index once, in order
                got.append(r.delta())
    return out


def live_draft(records: Sequence[LiveRecord], incarnation: str | None = None) -> dict[str, Any] | None:
    """The draft view of a live backlog: the last open answer so far, as
    ``{"answer", "turn", "step", "content"}`` (content: the text, or blocks when the answer has
    reasoning or tool calls), or None when no answer is open."""
    if incarnation:  # records of another life of the id are not this session's
        records = [r for r in records if r.incarnation in (None, incarnation)]
    answers = open_answers(records)
    if not answers:
        return None
    answer, (begin, deltas) = list(answers.items())[-1]
    blocks = assemble_deltas(deltas)
    content: Any = blocks
    if all(b["type"] == "text" for b in blocks):
        content = blocks[0]["text"] if blocks else ""
    draft: dict[str, Any] = {"answer": answer}
    if begin is not None:
        draft["turn"], draft["step"] = begin.turn, begin.step
    draft["content"] = content
    return draft


__all__ = [
    "ANSWER_RESERVE",
    "CHUNK",
    "DELTA_KINDS",
    "INTERRUPTED",
    "REASONING",
    "TEXT",
    "TOOL_CALL",
    "AnswerAck",
    "AnswerBegun",
    "AnswerEnded",
    "AnswerState",
    "Delta",
    "DeltaGap",
    "LiveRecord",
    "Merged",
    "PackedChunks",
    "answer_budget",
    "answer_refusal",
    "answers_to_skip",
    "assemble",
    "assemble_deltas",
    "chunk_row",
    "closes_answer",
    "compact_value",
    "delta_chunk",
    "delta_cost",
    "deltas_cost",
    "end_row",
    "entry_answer",
    "live_draft",
    "merge_live",
    "new_answer_id",
    "open_answers",
    "pack_chunks",
    "replay",
    "row_end",
    "row_ended",
    "row_times",
    "unpack_row",
]
