"""Imports of files the seed systems wrote themselves (tests/fixtures/seed, a copy of
../shared/fixtures), compared with what each system answered for them; exports back to each
format; and the bad files a migrating user meets (BOM, UTF-16, torn lines, empty folders, keys
that are no session id, naive timestamps, zstd)."""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from redis_session import MemorySessionStore
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
from redis_session.importers.nanobot import summary_text
from redis_session.projection import project, to_anthropic, to_openai

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
    assert (res.session_id, res.format, res.entries) == ("dsh-main", "dsh", expected["n_events"])
    assert any("torn last line 49" in r for r in res.repaired)
    assert any("closed the open turn 6 with 3 entries" in r for r in res.repaired)
    entries = await store.read("dsh-main")
    assert [e.type for e in entries[-3:]] == ["tool/result", "step/end", "turn/end"]
    assert entries[-1].data == {"turn": 6, "reason": {"kind": "interrupted"}}
    assert entries[-3].surface is not None and entries[-3].surface.source_event_seqs == [46]
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
    assert res.path.endswith(".jsonl.zstd") and res.entries == 50
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
    assert res.entries == 42 and res.repaired == (
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
    chunks = [e for e in await store.read("packed") if e.type == "assistant/chunk"]
    assert [(e.n, e.time, e.data["chunk"]["text"]) for e in chunks] == [
        (2, t + 1, "a"),
        (3, t + 2, "b"),
        (4, t + 2, "c"),
    ]


async def test_dsh_export_reimports_identically(store: Any, tmp_path: Path) -> None:
    await import_path(store, DSH_FILE)
    out = tmp_path / "back.jsonl"
    assert await export_session(store, "dsh-main", out, format="dsh") == 50
    first = json.loads(out.read_text().splitlines()[0])
    assert first == {
        "type": "session",
        "version": 0,
        "id": "dsh-main",
        "createdAt": 1796098498665,
        "cwd": "/home/dev/project",
    }
    # the committed events go back as dsh wrote them (type, seq, time, data, surface op)
    keys = ("type", "seq", "time", "data", "surfaceOp")
    original = [json.loads(x) for x in DSH_FILE.read_text(encoding="utf-8").splitlines()[1:-1]]
    exported = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()[1:48]]
    assert [{k: e.get(k) for k in keys} for e in exported] == [{k: e.get(k) for k in keys} for e in original]
    again = MemorySessionStore()
    [res] = await import_path(again, out)
    assert res.repaired == ()  # nothing left to repair
    assert await again.read("dsh-main") == await store.read("dsh-main")


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
