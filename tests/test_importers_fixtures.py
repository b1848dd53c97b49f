"""Imports of files the seed systems wrote themselves (tests/fixtures/seed), compared with what
each system answered for them; exports back to each
format; and the bad files a migrating user meets (BOM, UTF-16, torn lines, empty folders, keys
that are no session id, naive timestamps, zstd)."""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from redis_session import MemorySessionStore, NewEntry, Sessions
from redis_session.adapters.nanobot import SessionManager
from redis_session.adapters.nanobot import summary_text as adapter_summary_text
from redis_session.importers import (
    ImportFormatError,
    dsh_messages,
    export_session,
    import_path,
    key_to_session_id,
    session_id_to_key,
)
from redis_session.importers.dsh import dsh_seqs, expand_row
from redis_session.importers.nanobot import summary_text
from redis_session.projection import project, to_anthropic, to_openai
from redis_session.projection.chunks import replay, row_times, unpack_row

pytestmark = pytest.mark.anyio

SEED = Path(__file__).parent / "fixtures" / "seed"
NANOBOT = json.loads((SEED / "nanobot" / "expected_get_history.json").read_text())
DSH = json.loads((SEED / "dsh" / "expected_messages.json").read_text())
TUTORIAL = json.loads((SEED / "tutorial" / "expected_messages.json").read_text())


def _history_cases() -> Iterator[Any]:
    for key, s in NANOBOT["sessions"].items():
        for i, r in enumerate(s["results"]):
            yield pytest.param(key, i, id=f"{key}-{json.dumps(r['settings'], sort_keys=True)}")


async def _entries(store: Any, sid: str) -> list[Any]:
    return list(await store.read(sid))


def _get_history(store: MemorySessionStore, key: str, settings: dict[str, Any]) -> list[dict[str, Any]]:
    with SessionManager(store) as manager:
        return manager.get_or_create(key).get_history(**settings)


# --------------------------------------------------------------------------- nanobot


@pytest.mark.parametrize(("key", "index"), list(_history_cases()))
async def test_nanobot_fixture_get_history_after_import_and_after_export_reimport(
    key: str, index: int, tmp_path: Path
) -> None:
    recorded = NANOBOT["sessions"][key]
    result = recorded["results"][index]
    store = MemorySessionStore()
    [res] = await import_path(store, SEED / "nanobot" / recorded["file"])
    assert (res.session_id, res.format, res.status) == (key, "nanobot", "imported")
    # the adapter reads the imported log as nanobot reads the file (run in a thread: it has its own loop)
    import anyio.to_thread

    got = await anyio.to_thread.run_sync(_get_history, store, key, result["settings"])
    assert got == result["history"]
    # export → nanobot's file → import again: the same entries and the same answers
    out = tmp_path / "exported.jsonl"
    await export_session(store, key, out, format="nanobot")
    again = MemorySessionStore()
    await import_path(again, out)
    assert await _entries(again, key) == await _entries(store, key)
    assert (await again.head(key)).header.origin == (await store.head(key)).header.origin  # type: ignore[union-attr]
    assert await anyio.to_thread.run_sync(_get_history, again, key, result["settings"]) == result["history"]


@pytest.mark.parametrize("name", sorted(p.name for p in (SEED / "nanobot").glob("*.jsonl")))
async def test_nanobot_export_is_the_file_nanobot_wrote(name: str, tmp_path: Path) -> None:
    """Byte for byte: nanobot's key order and separators, every field of every message."""
    store = MemorySessionStore()
    [res] = await import_path(store, SEED / "nanobot" / name)
    buf = io.StringIO()
    assert res.session_id is not None
    await export_session(store, res.session_id, buf, format="nanobot")
    assert buf.getvalue() == (SEED / "nanobot" / name).read_text(encoding="utf-8")


async def test_nanobot_fields_reach_the_renderers(store: Any) -> None:
    """name on tool messages, reasoning_content beside signed thinking, redacted_thinking."""
    await import_path(store, SEED / "nanobot" / "cli_reasoning.jsonl")
    msgs = project(await store.read("cli:reasoning"))
    openai = to_openai(msgs)
    tool = next(m for m in openai if m["role"] == "tool")
    assert tool == {"role": "tool", "tool_call_id": "call_f", "content": "13 × 17", "name": "factor"}
    first = openai[1]
    assert first["reasoning_content"] == "Check divisors up to 9: 2,3,5,7 don't divide 97."
    anthropic = to_anthropic(msgs)["messages"]
    signed = [b for m in anthropic for b in m["content"] if b["type"] in ("thinking", "redacted_thinking")]
    assert signed == [
        {"type": "thinking", "thinking": "91/7 = 13.", "signature": "EqQBCkYIBxgCKkB..."},
        {"type": "thinking", "thinking": "tool said 13x17", "signature": "sigA"},
        {"type": "redacted_thinking", "data": "opaque=="},
    ]
    await import_path(store, SEED / "nanobot" / "cli_tools.jsonl")
    named = [m for m in to_openai(project(await store.read("cli:tools"))) if m["role"] == "tool"]
    assert [m.get("name") for m in named] == ["get_weather", "get_weather", "generate_image"]


async def test_nanobot_last_summary_is_a_cut_the_model_sees(store: Any) -> None:
    await import_path(store, SEED / "nanobot" / "slack_consolidated.jsonl")
    entries = await store.read("slack:consolidated")
    cut = entries[-1]
    assert cut.type == "cut" and cut.data["before"] == 16
    meta = (await store.head("slack:consolidated")).header.origin["metadata"]
    text = summary_text(meta)
    assert text is not None and text == adapter_summary_text(meta)  # the adapter writes the same cut
    assert cut.data["summary"] == [{"role": "user", "content": text}]
    msgs = project(entries)
    assert "User asked u0..u3; answers a0..a3." in msgs[0].text
    assert [m.text for m in msgs[1:3]] == ["u4", ""]


async def test_nanobot_key_that_is_no_session_id_is_mapped_reversibly(tmp_path: Path) -> None:
    key = "slack:{T01} general chat\t%x"
    path = tmp_path / "odd.jsonl"
    lines = [
        {"_type": "metadata", "key": key, "created_at": "2026-01-01T00:00:00", "metadata": {}, "last_consolidated": 0},
        {"role": "user", "content": "hi", "timestamp": "2026-01-01T00:00:01"},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    store = MemorySessionStore()
    [res] = await import_path(store, path)
    sid = key_to_session_id(key)
    assert sid == "slack:%7BT01%7D%20general%20chat%09%25x"
    assert (res.session_id, res.original_id) == (sid, key)
    assert session_id_to_key(sid) == key
    head = await store.head(sid)
    assert head is not None and head.header.origin["key"] == key
    # valid keys are their own id; ids without % are their own key
    assert key_to_session_id("telegram:12345") == "telegram:12345" == session_id_to_key("telegram:12345")
    # the nanobot adapter finds the session under its key with the same mapping
    import anyio.to_thread

    def history() -> list[dict[str, Any]]:
        with SessionManager(store, key_to_id=key_to_session_id) as manager:
            return manager.get_or_create(key).get_history()

    assert await anyio.to_thread.run_sync(history) == [{"role": "user", "content": "hi"}]
    # and the nanobot export names the original key
    buf = io.StringIO()
    await export_session(store, sid, buf, format="nanobot")
    assert json.loads(buf.getvalue().splitlines()[0])["key"] == key


async def test_naive_timestamps_are_utc_whatever_the_local_zone(tmp_path: Path) -> None:
    path = tmp_path / "tz.jsonl"
    lines = [
        {"_type": "metadata", "key": "tz:1", "created_at": "2026-01-01T00:00:00", "metadata": {}},
        {"role": "user", "content": "hi", "timestamp": "2026-01-01T12:00:00.500000"},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    old = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Shanghai"
    time.tzset()
    try:
        store = MemorySessionStore()
        await import_path(store, path)
    finally:
        if old is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = old
        time.tzset()
    head = await store.head("tz:1")
    assert head is not None and head.header.created_at == 1_767_225_600_000  # 2026-01-01T00:00:00Z
    [entry] = await store.read("tz:1")
    assert entry.time == 1_767_225_600_000 + 12 * 3_600_000 + 500


# --------------------------------------------------------------------------- dsh

DSH_FILE = SEED / "dsh" / "dsh-main.crashed.jsonl"


async def test_dsh_crashed_file_imports_repaired_as_dsh_loads_it(store: Any) -> None:
    [res] = await import_path(store, DSH_FILE)
    expected = DSH["sessions"]["dsh-main"]
    # 50 events (47 kept, 3 closers); its two chunk events (seqs 3, 4) are one packed row
    assert (res.session_id, res.format, res.entries) == ("dsh-main", "dsh", expected["n_events"] - 1)
    assert any("torn last line 49" in r for r in res.repaired)
    assert any("closed the open turn 6 with 3 entries" in r for r in res.repaired)
    entries = await store.read("dsh-main")
    assert entries[3].type == "assistant/chunk" and entries[3].data["seq"] == 3
    assert len(entries[3].data["chunks"]) == 2
    assert [e.type for e in entries[-3:]] == ["tool/result", "step/end", "turn/end"]
    assert entries[-1].data == {"turn": 6, "reason": {"kind": "interrupted"}}
    # the closer names the n of the tool/call (dsh seq 46); every entry keeps its dsh seq
    assert entries[-3].surface is not None and entries[-3].surface.source_event_seqs == [45]
    assert entries[45].type == "tool/call" and entries[45].meta == {"seq": 46}
    assert [(e.meta or {}).get("seq", e.n) for e in entries if e.n != 3] == [*range(3), *range(5, 50)]
    assert dsh_seqs(entries) == [0, 1, 2, 3, *range(5, 50)]
    assert dsh_messages(project(entries)) == expected["messages"]


def _zstd_frames(path: Path, *, tear: int = 0) -> bytes:
    """The file as dsh writes it compressed: one checksummed frame for the header line, one per
    durable batch (here: per turn); `tear` bytes cut off the end."""
    cctx = zstandard.ZstdCompressor(write_checksum=True)
    lines = path.read_bytes().splitlines(keepends=True)
    batches: list[list[bytes]] = [[lines[0]], []]
    for line in lines[1:]:
        batches[-1].append(line)
        if b'"turn/end"' in line:
            batches.append([])
    data = b"".join(cctx.compress(b"".join(b)) for b in batches if b)
    return data[: len(data) - tear] if tear else data


async def test_dsh_zstd_file_imports_like_the_plain_one(tmp_path: Path) -> None:
    plain = MemorySessionStore()
    await import_path(plain, DSH_FILE)
    folder = tmp_path / "cwd-0123456789ab"
    folder.mkdir()
    (folder / "dsh-main.jsonl.zstd").write_bytes(_zstd_frames(DSH_FILE))
    store = MemorySessionStore()
    [res] = await import_path(store, tmp_path)  # found in the folder by its suffix
    assert res.path.endswith(".jsonl.zstd") and res.entries == 49
    assert await store.read("dsh-main") == await plain.read("dsh-main")
    # a last frame cut short (here in its checksum) keeps the complete lines it holds, as dsh does
    (folder / "dsh-main.jsonl.zstd").write_bytes(_zstd_frames(DSH_FILE, tear=2))
    torn = MemorySessionStore()
    [res] = await import_path(torn, folder / "dsh-main.jsonl.zstd")
    assert any("frame was cut short" in r for r in res.repaired)
    assert dsh_messages(project(await torn.read("dsh-main"))) == DSH["sessions"]["dsh-main"]["messages"]
    # torn inside its only block: nothing of that frame is decodable; the frames before it stay
    (folder / "dsh-main.jsonl.zstd").write_bytes(_zstd_frames(DSH_FILE, tear=40))
    cut = MemorySessionStore()
    [res] = await import_path(cut, folder / "dsh-main.jsonl.zstd")
    assert res.entries == 41 and res.repaired == (
        "the last zstd frame was cut short; kept its complete lines, as dsh does",
    )
    assert [m["content"][0]["text"] for m in dsh_messages(project(await cut.read("dsh-main")))][-1] == (
        "Continuing after compaction."
    )
    # a corrupt complete frame is refused
    data = bytearray(_zstd_frames(DSH_FILE))
    data[60] ^= 0xFF
    (folder / "dsh-main.jsonl.zstd").write_bytes(bytes(data))
    with pytest.raises(ImportFormatError, match="corrupt zstd frame"):
        await import_path(MemorySessionStore(), folder / "dsh-main.jsonl.zstd")


async def test_dsh_hole_before_the_last_turn_end_is_refused(tmp_path: Path) -> None:
    lines = DSH_FILE.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[10] = '{"type":"step/end","seq":10,"ti\n'  # a torn line inside a committed turn
    path = tmp_path / "corrupt.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    store = MemorySessionStore()
    with pytest.raises(ImportFormatError) as info:
        await import_path(store, path)
    assert info.value.line == 11 and "invalid JSON" in str(info.value)
    assert (await store.list()).items == []


async def test_dsh_packed_chunk_rows_expand_to_their_events(tmp_path: Path) -> None:
    t = 1_800_000_000_000
    rows = [
        {"type": "session", "version": 0, "id": "packed", "createdAt": t},
        {"type": "turn/start", "seq": 0, "time": t, "data": {"turn": 1, "trigger": {"kind": "message"}}},
        {"type": "step/start", "seq": 1, "time": t, "data": {"turn": 1, "step": 1}},
        {
            "type": "text-chunks",
            "seq0": 2,
            "time0": t + 1,
            "data": {"turn": 1, "step": 1, "index": 0, "dt": [1, 0], "texts": ["a", "b", "c"]},
        },
        {"type": "step/end", "seq": 5, "time": t + 3, "data": {"turn": 1, "step": 1}},
        {"type": "turn/end", "seq": 6, "time": t + 3, "data": {"turn": 1, "reason": {"kind": "completed"}}},
    ]
    path = tmp_path / "packed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    store = MemorySessionStore()
    await import_path(store, path)
    entries = await store.read("packed")
    assert [e.type for e in entries] == ["turn/start", "step/start", "assistant/chunk", "step/end", "turn/end"]
    row = entries[2]
    assert (row.time, row.data["seq"], row.data["dt"]) == (t + 1, 2, [1, 0])
    assert [c["text"] for c in unpack_row(row.data)] == ["a", "b", "c"]
    assert row_times(row.time, row.data) == [t + 1, t + 2, t + 2]
    assert [e.meta for e in entries[3:]] == [{"seq": 5}, {"seq": 6}]


async def test_dsh_export_reimports_identically(store: Any, tmp_path: Path) -> None:
    await import_path(store, DSH_FILE)
    out = tmp_path / "back.jsonl"
    assert await export_session(store, "dsh-main", out, format="dsh") == 49  # entries; 50 events
    first = json.loads(out.read_text().splitlines()[0])
    assert first == {
        "type": "session",
        "version": 0,
        "id": "dsh-main",
        "createdAt": 1796098498665,
        "cwd": "/home/dev/project",
    }
    # the committed events go back as dsh wrote them, field by field (the packed row as its two
    # chunk events); then the import's repair: the closers, seqs 47-49, naming the tool/call's seq
    original = [json.loads(x) for x in DSH_FILE.read_text(encoding="utf-8").splitlines()[1:-1]]
    exported = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()[1:]]
    assert exported[:47] == original
    assert [(e["type"], e["seq"]) for e in exported[47:]] == [("tool/result", 47), ("step/end", 48), ("turn/end", 49)]
    assert exported[47]["sourceEventSeqs"] == [46]
    again = MemorySessionStore()
    [res] = await import_path(again, out)
    assert res.repaired == ()  # nothing left to repair
    assert await again.read("dsh-main") == await store.read("dsh-main")


def _streamed_dsh_file(t: int) -> list[dict[str, Any]]:
    """A dsh log of 481 events, 460 of them chunk events: turn 1 streams reasoning, text and
    tool-call deltas (one step), then a storage row, a chunk marked ignorable and more deltas
    (step 2); turn 2 holds a context message naming a chunk and a replace of it; turn 3 was
    cut off mid-answer by a crash (its 300 deltas, then a torn line)."""
    out: list[dict[str, Any]] = [{"type": "session", "version": 0, "id": "streamed", "createdAt": t}]

    def ev(type_: str, data: dict[str, Any], **extra: Any) -> None:
        seq = len(out) - 1 if out[-1]["type"] == "session" else _next(out)
        # in dsh's key order: ignorable, sourceEventSeqs, then surfaceOp
        order = [k for k in ("ignorable", "sourceEventSeqs", "surfaceOp") if k in extra]
        rest = {k: extra[k] for k in order}
        out.append({"type": type_, "seq": seq, "time": t + 3 * seq + seq % 2, "data": data, **rest})

    def chunks(turn: int, step: int, n: int, make: Any) -> None:
        for i in range(n):
            ev("assistant/chunk", {"turn": turn, "step": step, "chunk": make(i)})

    text = lambda s: [{"type": "text", "text": s}]  # noqa: E731
    ev("turn/start", {"turn": 1, "trigger": {"kind": "message", "source": {"kind": "user"}}})
    ev("user/message", {"content": text("go"), "source": {"kind": "user"}}, surfaceOp="append")
    ev("step/start", {"turn": 1, "step": 1})
    chunks(1, 1, 40, lambda i: {"type": "reasoning-delta", "index": 0, "text": f"r{i} "})
    chunks(1, 1, 60, lambda i: {"type": "text-delta", "index": 1, "text": f"w{i} "})
    chunks(1, 1, 20, lambda i: {"type": "tool-call-delta", "index": 2, "id": "c1", "argumentsDelta": f"{i}"})
    call = {"type": "tool-call", "id": "c1", "name": "ls", "arguments": "{}"}
    ev("assistant/message", {"turn": 1, "step": 1, "content": [*text("w"), call]}, surfaceOp="append")
    ev("tool/call", {"turn": 1, "step": 1, "callId": "c1", "name": "ls", "arguments": "{}"})
    result = {"turn": 1, "step": 1, "callId": "c1", "content": text("a.txt"), "isError": False}
    ev("tool/result", result, surfaceOp="append", sourceEventSeqs=[_next(out) - 1])
    ev("step/end", {"turn": 1, "step": 1})
    ev("step/start", {"turn": 1, "step": 2})
    seq0 = _next(out)
    texts = [f"s{i} " for i in range(30)]
    out.append(
        {
            "type": "text-chunks",
            "seq0": seq0,
            "time0": t + 3 * seq0,
            "data": {"turn": 1, "step": 2, "index": 0, "dt": [2] * 29, "texts": texts},
        }
    )
    ev("assistant/chunk", {"turn": 1, "step": 2, "chunk": {"type": "text-delta", "text": "?"}}, ignorable=True)
    chunks(1, 2, 10, lambda i: {"type": "text-delta", "text": f"e{i} "})
    ev("assistant/message", {"turn": 1, "step": 2, "content": text("done")}, surfaceOp="append")
    ev("step/end", {"turn": 1, "step": 2})
    ev("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    ev("turn/start", {"turn": 2, "trigger": {"kind": "injection", "source": {"kind": "plugin", "plugin": "w"}}})
    ctx = {"content": text("changed"), "source": {"kind": "plugin", "plugin": "w"}}
    ev("context/message", ctx, surfaceOp="append", sourceEventSeqs=[50, 60])  # two chunks of one row
    replaced = _next(out) - 1
    ev(
        "context/message",
        {**ctx, "content": text("changed twice")},
        surfaceOp={"op": "replace", "start": replaced, "end": replaced},
        sourceEventSeqs=[replaced],
    )
    ev("turn/end", {"turn": 2, "reason": {"kind": "completed"}})
    ev("turn/start", {"turn": 3, "trigger": {"kind": "message", "source": {"kind": "user"}}})
    ev("user/message", {"content": text("again"), "source": {"kind": "user"}}, surfaceOp="append")
    ev("step/start", {"turn": 3, "step": 1})
    chunks(3, 1, 300, lambda i: {"type": "text-delta", "text": f"x{i} "})
    return out


def _next(rows: list[dict[str, Any]]) -> int:
    last = rows[-1]
    return last["seq0"] + len(last["data"]["texts"]) if "seq0" in last else last["seq"] + 1


def _dsh_events(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events dsh's loader sees in `rows` (its storage rows expanded)."""
    return [e for r in rows[1:] for e in (expand_row(r) if "seq0" in r else [r])]


async def test_dsh_chunk_events_import_packed_and_export_as_written(tmp_path: Path) -> None:
    t = 1_800_000_000_000
    rows = _streamed_dsh_file(t)
    events = _dsh_events(rows)
    assert [e["seq"] for e in events] == list(range(479))
    path = tmp_path / "streamed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"type":"assistant/chunk","seq":479,"ti')
    store = MemorySessionStore()
    [res] = await import_path(store, path)
    entries = await store.read("streamed")

    # 479 events + 2 closers = 481 events in 26 entries
    chunk_events = [e for e in events if e["type"] == "assistant/chunk"]
    assert len(chunk_events) == 461 and res.entries == len(entries) == 26
    rows_ = [e for e in entries if e.type == "assistant/chunk" and "chunks" in e.data]
    assert [(e.data["seq"], len(e.data["chunks"])) for e in rows_] == [
        (3, 120),
        (128, 30),
        (159, 10),
        (179, 256),
        (435, 44),
    ]
    assert [e.type for e in entries[-2:]] == ["step/end", "turn/end"]

    # replay: every chunk, in order (the ignorable one stays a classic row of its own)
    by_step: dict[str, list[Any]] = {}
    for e in chunk_events:
        by_step.setdefault(f"{e['data']['turn']}/{e['data']['step']}", []).append(e["data"]["chunk"])
    assert replay(entries) == by_step

    # every dsh seq is recoverable: a row's data.seq + i, another entry's meta.seq (or its n)
    seq_of: dict[int, tuple[int, Any]] = {}
    for e in entries:
        if e.type == "assistant/chunk" and "chunks" in e.data:
            times = row_times(e.time, e.data)
            for i, c in enumerate(unpack_row(e.data)):
                seq_of[e.data["seq"] + i] = (times[i], c)
        else:
            seq_of[(e.meta or {}).get("seq", e.n)] = (e.time, e.data.get("chunk", e.type))
    assert sorted(seq_of) == list(range(481))
    for ev in events:
        assert seq_of[ev["seq"]] == (ev["time"], ev["data"].get("chunk", ev["type"]))
    # ... and the walk over the log (what the export numbers by) agrees with both
    assert dsh_seqs(entries) == [
        e.data["seq"] if "chunks" in e.data else (e.meta or {}).get("seq", e.n) for e in entries
    ]

    # surfaces name the n of their entries; a seq inside a row is kept as written in meta
    ctx, again = (e for e in entries if e.type == "context/message")
    assert ctx.surface is not None and ctx.surface.source_event_seqs == [3]
    assert ctx.meta == {"seq": 173, "sourceEventSeqs": [50, 60]}
    assert again.surface is not None and again.surface.op.start == again.surface.op.end == ctx.n  # type: ignore[union-attr]
    result = next(e for e in entries if e.type == "tool/result")
    assert result.surface is not None and result.surface.source_event_seqs == [result.n - 1]

    # the projection is what the unpacked events give
    assert dsh_messages(project(entries)) == [
        {"role": "user", "content": [{"type": "text", "text": "go"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "w"},
                {"type": "tool-call", "id": "c1", "name": "ls", "arguments": "{}"},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool-result",
                    "toolCallId": "c1",
                    "content": [{"type": "text", "text": "a.txt"}],
                    "isError": False,
                }
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": x} for x in ('<context source="plugin">', "changed twice", "</context>")
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "again"}]},
    ]

    # export: dsh's own events back, field by field, seqs and times included; then the closers
    out = tmp_path / "back.jsonl"
    assert await export_session(store, "streamed", out, format="dsh") == 26
    exported = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert exported[0] == rows[0]
    assert exported[1:480] == events
    last = events[-1]["time"]
    assert exported[480:] == [
        {"type": "step/end", "seq": 479, "time": last, "data": {"turn": 3, "step": 1}},
        {"type": "turn/end", "seq": 480, "time": last, "data": {"turn": 3, "reason": {"kind": "interrupted"}}},
    ]
    again_store = MemorySessionStore()
    [res] = await import_path(again_store, out)
    assert res.repaired == () and await again_store.read("streamed") == entries


async def test_dsh_packed_session_is_repaired_and_exported_with_its_seqs(tmp_path: Path) -> None:
    """dsh crash repair on a packed log: the store's repair closes the turn after the rows, and the
    export numbers the closers after the last chunk event."""
    t = 1_800_000_000_000
    rows = _streamed_dsh_file(t)
    path = tmp_path / "streamed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = MemorySessionStore()
    await import_path(store, path)
    entries = await store.read("streamed")
    sessions = Sessions(store)
    s = await sessions.open("crashed")
    await s.append_many([NewEntry(e.type, e.data, e.meta, e.surface, e.time) for e in entries[:-2]])
    appended = await sessions.repair("crashed")
    assert [e.type for e in appended] == ["step/end", "turn/end"]
    assert await store.read("crashed") == [*entries[:-2], *appended]
    out = tmp_path / "back.jsonl"
    await export_session(store, "crashed", out, format="dsh")
    exported = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [(e["type"], e["seq"]) for e in exported[-3:]] == [
        ("assistant/chunk", 478),
        ("step/end", 479),
        ("turn/end", 480),
    ]


# --------------------------------------------------------------------------- tutorial


@pytest.mark.parametrize("sid", sorted(TUTORIAL))
async def test_tutorial_fixture_messages_and_round_trip(sid: str, store: Any, tmp_path: Path) -> None:
    recorded = TUTORIAL[sid]
    [res] = await import_path(store, SEED / "tutorial" / recorded["file"])
    assert (res.session_id, res.entries) == (sid, recorded["events"])
    entries = await store.read(sid)
    # exactly what deriveMessages() returned: tool_calls [] and "" content as the harness wrote them
    assert [e.data for e in entries if e.type == "message"] == recorded["messages"]
    out = tmp_path / "back.jsonl"
    await export_session(store, sid, out, format="tutorial")
    events = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert _derive(events) == recorded["messages"]
    again = MemorySessionStore()
    await import_path(again, out)
    assert await again.read(sid) == entries


def _derive(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tutorial's deriveMessages(), transcribed (flat events)."""
    out: list[dict[str, Any]] = []
    for ev in events[1:]:
        if ev["type"] == "user/message":
            out.append({"role": "user", "content": ev["content"]})
        elif ev["type"] == "assistant/message":
            msg = {"role": "assistant", "content": ev.get("content") or ""}
            if "tool_calls" in ev:
                msg["tool_calls"] = ev["tool_calls"]
            out.append(msg)
        elif ev["type"] == "tool/result":
            out.append({"role": "tool", "tool_call_id": ev["tool_call_id"], "content": ev["content"]})
    return out


# --------------------------------------------------------------------------- bad files


def _nanobot_lines(key: str) -> bytes:
    rows = [
        {"_type": "metadata", "key": key, "metadata": {}},
        {"role": "user", "content": "hi", "timestamp": "2026-01-01T00:00:00"},
    ]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


async def test_utf8_bom_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _nanobot_lines("bom:1"))
    store = MemorySessionStore()
    [res] = await import_path(store, path)
    assert res.status == "imported" and any("byte-order mark" in r for r in res.repaired)


@pytest.mark.parametrize(
    ("encoding", "text"),
    [
        ("utf-16", "UTF-16 (little-endian): it starts with that byte-order mark"),
        ("utf-16-be", "UTF-16 or UTF-32 without a byte-order mark"),
        ("utf-32", "UTF-32 (little-endian)"),
    ],
)
async def test_utf16_file_says_so(encoding: str, text: str, tmp_path: Path) -> None:
    path = tmp_path / "wide.jsonl"
    path.write_bytes(_nanobot_lines("wide:1").decode().encode(encoding))
    store = MemorySessionStore()
    with pytest.raises(ImportFormatError) as info:
        await import_path(store, path)
    assert text in str(info.value) and "save it as UTF-8" in str(info.value)
    assert "byte 0" not in str(info.value)
    assert (await store.list()).items == []


async def test_empty_folder_says_so(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a session")
    with pytest.raises(ImportFormatError, match=r"no \.jsonl or \.jsonl\.zstd files in this folder"):
        await import_path(MemorySessionStore(), tmp_path)


def _bad_folder(tmp_path: Path) -> Path:
    (tmp_path / "a.jsonl").write_bytes(_nanobot_lines("good:a"))
    (tmp_path / "b.jsonl").write_bytes(_nanobot_lines("bad:b") + b'{"role": "user", "content": \n')
    (tmp_path / "c.jsonl").write_bytes(_nanobot_lines("good:c"))
    (tmp_path / "d.jsonl").write_bytes(_nanobot_lines("bad:d").replace(b'"user"', b'"robot"'))
    return tmp_path


async def test_folder_stop_and_collect(tmp_path: Path) -> None:
    folder = _bad_folder(tmp_path)
    store = MemorySessionStore()
    results = await import_path(store, folder, errors="stop")
    assert [(Path(r.path).name, r.status) for r in results] == [("a.jsonl", "imported"), ("b.jsonl", "failed")]
    assert str(results[-1].error).endswith("b.jsonl:3: invalid JSON: Input data was truncated")
    store = MemorySessionStore()
    results = await import_path(store, folder, errors="collect")
    assert [r.status for r in results] == ["imported", "failed", "imported", "failed"]
    assert "d.jsonl:2: bad message: role has an unknown value 'robot'" in str(results[3].error)
    # raise: the exception says which files were imported before it
    store = MemorySessionStore()
    with pytest.raises(ImportFormatError) as info:
        await import_path(store, folder)
    assert any("a.jsonl (good:a)" in note for note in info.value.__notes__)


async def test_line_errors_name_the_field_path(tmp_path: Path) -> None:
    t = 1_800_000_000_000
    rows = [
        {"type": "session", "version": 0, "id": "typed", "createdAt": t},
        {"type": "turn/start", "seq": 0, "time": t, "data": {"turn": 1}},
        {"type": "step/start", "seq": 1, "time": -5, "data": {"turn": 1, "step": 1}},
    ]
    path = tmp_path / "typed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(ImportFormatError) as info:
        await import_path(MemorySessionStore(), path)
    assert str(info.value) == f"{path}:3: invalid event envelope: time must be an integer >= 0"
    bad = tmp_path / "n.jsonl"
    bad.write_bytes(
        _nanobot_lines("n:1")
        + b'{"role": "assistant", "content": "", '
        + b'"tool_calls": [{"id": "c", "function": {"name": 5, "arguments": "{}"}}]}\n'
    )
    with pytest.raises(ImportFormatError) as info:
        await import_path(MemorySessionStore(), bad)
    assert str(info.value) == f"{bad}:3: bad message: tool_calls[0].function.name must be a string, got an integer"


async def test_conflict_names_the_cli_flag(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(_nanobot_lines("dup:1"))
    store = MemorySessionStore()
    await import_path(store, path)
    with pytest.raises(Exception, match="--on-exists skip or --on-exists replace"):
        await import_path(store, path)


# --------------------------------------------------------------------------- dsh, byte for byte


def _dsh_clean_prefixes(raw: bytes) -> Iterator[bytes]:
    """The file cut after each ``turn/end`` line: logs dsh itself had written at those moments
    (every turn closed, nothing to repair)."""
    lines = raw.split(b"\n")
    for i, line in enumerate(lines):
        if b'"type":"turn/end"' in line:
            yield b"\n".join(lines[: i + 1]) + b"\n"


@pytest.mark.parametrize("name", sorted(p.name for p in (SEED / "dsh").glob("*.jsonl")))
async def test_dsh_export_is_byte_identical_to_the_file_dsh_wrote(name: str, tmp_path: Path) -> None:
    """An imported dsh log exports as the bytes dsh wrote (each event's keys in dsh's
    order: sourceEventSeqs before surfaceOp): every closed-turn prefix of each fixture exactly, and
    the crashed file as its complete lines followed by the events the repair added."""
    raw = (SEED / "dsh" / name).read_bytes()
    prefixes = list(_dsh_clean_prefixes(raw))
    assert prefixes
    for k, prefix in enumerate(prefixes):
        path = tmp_path / f"p{k}.jsonl"
        path.write_bytes(prefix)
        store = MemorySessionStore()
        [res] = await import_path(store, path)
        out = io.StringIO()
        await export_session(store, res.session_id, out, format="dsh")
        assert out.getvalue().encode() == prefix, f"prefix {k}"
    store = MemorySessionStore()
    [res] = await import_path(store, SEED / "dsh" / name)
    out = io.StringIO()
    await export_session(store, res.session_id, out, format="dsh")
    complete = raw[: raw.rfind(b"\n") + 1]  # a torn last line is what dsh's loader drops too
    assert out.getvalue().encode().startswith(complete)
    assert len(out.getvalue().encode()) > len(complete)  # the crash repair's events follow


async def test_dsh_keys_written_in_another_order_export_as_written(tmp_path: Path) -> None:
    raw = (SEED / "dsh" / "dsh-main.crashed.jsonl").read_bytes()
    prefix = next(_dsh_clean_prefixes(raw))
    lines = prefix.decode().splitlines()
    shuffled = [lines[0]]
    for line in lines[1:]:
        obj = json.loads(line)
        shuffled.append(json.dumps(dict(reversed(list(obj.items()))), ensure_ascii=False, separators=(",", ":")))
    text = "\n".join(shuffled) + "\n"
    path = tmp_path / "shuffled.jsonl"
    path.write_text(text, encoding="utf-8")
    store = MemorySessionStore()
    [res] = await import_path(store, path)
    out = io.StringIO()
    await export_session(store, res.session_id, out, format="dsh")
    assert out.getvalue() == text


# --------------------------------------------------------------------------- the tutorial harness's own code

HARNESS = Path(__file__).parent / "fixtures" / "tutorial_harness" / "session.mjs"
needs_node = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (CI installs nodejs)")


def _harness_write(tmp_path: Path, sid: str, events: list[Any]) -> Path:
    """A log written by the harness's own Session.append + save() (under node)."""
    spec = tmp_path / f"{sid}.spec.json"
    spec.write_text(json.dumps({"id": sid, "events": events}), encoding="ascii")  # \\ud800 stays an escape
    out = tmp_path / f"{sid}.jsonl"
    subprocess.run(["node", str(HARNESS), "write", str(spec), str(out)], check=True, timeout=60)
    return out


def _harness_load(path: Path) -> dict[str, Any]:
    """What the harness's own load() + deriveMessages() make of a file (under node)."""
    run = subprocess.run(["node", str(HARNESS), "load", str(path)], check=True, timeout=60, capture_output=True)
    loaded: dict[str, Any] = json.loads(run.stdout)
    return loaded


def _fffd(value: Any) -> Any:
    """`value` with each lone surrogate as U+FFFD (what the store holds for one)."""
    if isinstance(value, str):
        return re.sub("[\ud800-\udfff]", "\ufffd", value)
    if isinstance(value, dict):
        return {k: _fffd(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fffd(v) for v in value]
    return value


_CALL = {"id": "call_9", "type": "function", "function": {"name": "run_bash", "arguments": '{"command":"ls"}'}}
HARNESS_EDGES: list[Any] = [
    ["turn/start", {"agent": "a-1"}],
    ["user/message", {"content": None}],
    ["user/message", {}],
    ["user/message", {"content": "half a pair: \ud800 and a whole one: \ud83d\ude00, a line sep \u2028"}],
    ["step/start", {"step": 0, "budget": 1e21, "tiny": 1e-7, "sum": 0.1 + 0.2, "neg": -2.5e-10, "big": 2**53}],
    ["assistant/message", {"tool_calls": [_CALL]}],
    ["tool/result", {"tool_call_id": "call_9", "content": {"ok": True, "files": ["a", "b"], "n": 1.5}}],
    ["tool/result", {"content": 42}],
    ["tool/result", {"tool_call_id": "call_9", "content": None}],
    ["assistant/message", {"content": "", "tool_calls": []}],
    ["assistant/message", {"content": None}],
    ["assistant/message", {"content": "done", "tool_calls": None, "extra": {"k": [1, 2.0, "x"]}}],
    ["assistant/chunk", {"delta": {"content": "d"}}],
    ["step/end", {"step": 0, "tool_calls": 1}],
    ["turn/end", {}],
]


@needs_node
async def test_tutorial_harness_edge_cases_import_as_derive_messages_and_export_byte_identical(
    tmp_path: Path,
) -> None:
    """Tested with the harness's own code writing and reading: null and missing user content
    stay so, non-string tool results and a missing tool_call_id stay as written, tool_calls [] is
    kept, a lone surrogate escape imports, and the export is the very bytes save() wrote."""
    path = _harness_write(tmp_path, "edges-1", HARNESS_EDGES)
    harness = _harness_load(path)
    store = MemorySessionStore()
    [res] = await import_path(store, path)
    assert (res.session_id, res.entries) == ("edges-1", len(HARNESS_EDGES))
    entries = await store.read("edges-1")
    data = [e.data for e in entries if e.type == "message"]
    want = _fffd(harness["messages"])
    # the harness's messages, except the JSON text of a tool result no chat message holds as it is
    tool_json = {4: '{"ok":true,"files":["a","b"],"n":1.5}', 5: "42"}
    assert data == [{**m, "content": tool_json[i]} if i in tool_json else m for i, m in enumerate(want)]
    assert data[0] == {"role": "user", "content": None}
    assert data[1] == {"role": "user"}
    assert data[3] == {"role": "assistant", "content": "", "tool_calls": [_CALL]}
    assert data[5] == {"role": "tool", "content": "42"}  # no tool_call_id: missing, as written
    assert data[7] == {"role": "assistant", "content": "", "tool_calls": []}
    out = io.StringIO()
    await export_session(store, "edges-1", out, format="tutorial")
    assert out.getvalue().encode("utf-8", "surrogatepass") == path.read_bytes()
    # and the harness reads the export back to its own messages
    back = tmp_path / "back.jsonl"
    back.write_bytes(out.getvalue().encode("utf-8", "surrogatepass"))
    assert _harness_load(back) == harness


@needs_node
async def test_sessions_written_through_our_api_export_to_what_the_harness_reads(store: Any, tmp_path: Path) -> None:
    """A session written through our API (typed entries, a tool call, a cut) exports to a file
    the harness's load() + deriveMessages() read as the messages our projection sends."""
    sessions = Sessions(store)
    s = await sessions.create("api-1")
    await s.append("user/message", {"content": [{"type": "text", "text": "old question"}]})
    await s.append("assistant/message", {"content": [{"type": "text", "text": "old answer"}]})
    await s.append("user/message", {"content": "list files"})
    await s.append(
        "assistant/message",
        {"content": [{"type": "tool-call", "id": "c1", "name": "ls", "arguments": '{"path":"."}'}]},
    )
    await s.append("tool/result", {"callId": "c1", "content": [{"type": "text", "text": "a.txt"}]})
    await s.append("assistant/message", {"content": "one file: a.txt"})
    await s.compact(before=2, summary=[{"role": "user", "content": "summary: asked, answered"}], reason="test")
    await s.append("user/message", {"content": "thanks"})
    entries = list(await store.read("api-1"))
    out = tmp_path / "api-1.jsonl"
    await export_session(store, "api-1", out, format="tutorial")
    harness = _harness_load(out)
    assert harness["id"] == "api-1"
    ours = [{**m, "content": m["content"] if m.get("content") is not None else ""} for m in to_openai(project(entries))]
    assert harness["messages"] == ours
    assert ours[0] == {"role": "user", "content": "summary: asked, answered"}  # the cut, as the model sees it
    assert {"role": "tool", "tool_call_id": "c1", "content": "a.txt"} in harness["messages"]


@needs_node
async def test_an_imported_harness_log_continued_through_our_api_exports_for_the_harness(tmp_path: Path) -> None:
    """A harness log imported, then continued through our API: the export keeps the harness's
    lines byte for byte and adds the new turn as the message events its deriveMessages reads."""
    path = SEED / "tutorial" / "16e6b2b0-131.jsonl"
    store = MemorySessionStore()
    await import_path(store, path)
    s = await Sessions(store).open("16e6b2b0-131")
    await s.append("user/message", {"content": "and now?"})
    await s.append("assistant/message", {"content": [{"type": "text", "text": "now: 04:01"}]})
    out = tmp_path / "more.jsonl"
    await export_session(store, "16e6b2b0-131", out, format="tutorial")
    written = out.read_bytes()
    assert written.startswith(path.read_bytes())
    harness = _harness_load(out)
    assert harness["messages"] == [
        *TUTORIAL["16e6b2b0-131"]["messages"],
        {"role": "user", "content": "and now?"},
        {"role": "assistant", "content": "now: 04:01"},
    ]
    assert [e["seq"] for e in harness["events"]][-2:] == [26, 27]


@needs_node
def test_js_json_writes_what_json_stringify_writes() -> None:
    """The exporter's JSON.stringify (tutorial.js_json) against node's own, on 20 000 random
    doubles (every exponent range, integers past 2^53, -0.0, subnormals) and strings with control
    characters, lone surrogates, U+2028 and emoji."""
    from redis_session.importers.tutorial import js_json

    rng = random.Random(7)
    nums: list[Any] = []
    while len(nums) < 20_000:
        x = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        if math.isfinite(x):
            nums.append(x)
    nums += [1e21, -1e21, 1e-7, 1e-6, 5e-324, -0.0, 0.1 + 0.2, 2.0**53, 2.0**53 + 2, 1796098545.412]
    nums += [float(rng.randint(-(10**25), 10**25)) for _ in range(500)] + [rng.randint(-(2**53), 2**53)]
    alphabet = ["a", "é", "\x00", "\x1f", "\x7f", '"', "\\", "\n", "\u2028", "\ud800", "\udfff", "😀", "\t"]
    strings = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(2000)]
    value: Any = {"nums": nums, "strings": strings, "nested": {"k\u2028": [None, True, False, {}], "": []}}
    echo = "let s='';process.stdin.on('data',d=>s+=d).on('end',()=>process.stdout.write(JSON.stringify(JSON.parse(s))))"
    node = subprocess.run(
        ["node", "-e", echo],
        input=json.dumps(value).encode(),
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode("utf-8", "surrogatepass")
    assert js_json(value) == node
