"""Import and export: our JSONL round trip, nanobot / dsh / tutorial files, and malformed input.

Every fixture file is written by the test itself. "Nothing of that session written" is checked
on a store that starts empty: after a failed import it still lists no session at all.
"""

from __future__ import annotations

import io
import json
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

from redis_session import (
    MemorySessionStore,
    NewEntry,
    RedisSessionStore,
    SessionAlreadyExistsError,
    SessionError,
    SessionHeader,
    SessionNotFoundError,
)
from redis_session.importers import ImportFormatError, export_session, import_path
from redis_session.projection import project, to_openai

pytestmark = pytest.mark.anyio


# --------------------------------------------------------------------------- helpers


def write_jsonl(path: Path, rows: list[Any], *, compact: bool = False) -> Path:
    """One JSON value per line; a str row is written verbatim (for broken lines). `compact`
    writes as JavaScript's JSON.stringify does (the tutorial harness)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    seps = (",", ":") if compact else None
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False, separators=seps) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


async def nothing_written(store: Any) -> bool:
    return (await store.list()).items == []


def utc_ms(iso: str) -> int:
    """An ISO time as ms; one without a zone is UTC (as the importers read it)."""
    dt = datetime.fromisoformat(iso)
    return round((dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp() * 1000)


def call(cid: str, name: str, args: str = "{}") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


# --------------------------------------------------------------------------- fixture files


def nanobot_rows(key: str = "telegram:12345", *, lc: Any = 0) -> list[Any]:
    return [
        {
            "_type": "metadata",
            "key": key,
            "created_at": "2026-03-01T10:00:00.000000",
            "updated_at": "2026-03-01T10:05:00.000000",
            "metadata": {"title": "天气", "webui": {"pinned": True}},
            "last_consolidated": lc,
        },
        {"role": "user", "content": "明天北京天气?", "timestamp": "2026-03-01T10:00:01.250000", "media": ["/m/a.png"]},
        {
            "role": "assistant",
            "content": None,
            "timestamp": "2026-03-01T10:00:02.000000",
            "tool_calls": [call("p_0_a", "weather", '{"city": "北京"}')],
            "reasoning_content": "need the forecast",
        },
        {
            "role": "tool",
            "tool_call_id": "p_0_a",
            "name": "weather",
            "content": "晴, 12°C",
            "timestamp": "2026-03-01T10:00:03.000000",
        },
        {
            "role": "assistant",
            "content": "明天晴, 12°C。",
            "timestamp": "2026-03-01T10:00:04.000000",
            "thinking_blocks": [{"type": "thinking", "thinking": "answer", "signature": "sig"}],
        },
        {"role": "user", "content": "/new", "timestamp": "2026-03-01T10:00:05.000000", "_command": True},
        {"role": "user", "content": "谢谢", "timestamp": "2026-03-01T10:00:06.000000"},
        {
            "role": "assistant",
            "content": "不客气",
            "timestamp": "2026-03-01T10:00:07.000000",
            "_channel_delivery": False,
        },
    ]


def nanobot_openai(rows: list[Any]) -> list[dict[str, Any]]:
    """What nanobot sends for these messages, in OpenAI format (commands are never sent)."""
    out = []
    for m in rows[1:]:
        if m.get("_command"):
            continue
        if m["role"] == "tool":
            tool = {"role": "tool", "tool_call_id": m["tool_call_id"], "content": m["content"]}
            out.append({**tool, "name": m["name"]} if "name" in m else tool)  # nanobot sends the name
            continue
        msg: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls"):
            msg["tool_calls"] = m["tool_calls"]
        if m.get("thinking_blocks"):
            msg["reasoning_content"] = "\n".join(b["thinking"] for b in m["thinking_blocks"])
        elif m.get("reasoning_content"):
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def dsh_rows(session_id: str = "dsh-1") -> list[Any]:
    t = 1_760_000_000_000
    text = lambda s: [{"type": "text", "text": s}]  # noqa: E731
    return [
        {"type": "session", "version": 0, "id": session_id, "createdAt": t, "cwd": "/work/repo"},
        {
            "type": "turn/start",
            "seq": 0,
            "time": t + 1,
            "data": {"turn": 1, "trigger": {"kind": "message", "source": "user"}},
        },
        {
            "type": "user/message",
            "seq": 1,
            "time": t + 2,
            "data": {"content": text("list files"), "source": "user"},
            "surfaceOp": "append",
        },
        {"type": "step/start", "seq": 2, "time": t + 3, "data": {"turn": 1, "step": 1}},
        {
            "type": "assistant/message",
            "seq": 3,
            "time": t + 4,
            "surfaceOp": "append",
            "data": {
                "turn": 1,
                "step": 1,
                "content": [*text("looking"), {"type": "tool-call", "id": "c1", "name": "ls", "arguments": "{}"}],
            },
        },
        {
            "type": "tool/call",
            "seq": 4,
            "time": t + 5,
            "data": {"turn": 1, "step": 1, "callId": "c1", "name": "ls", "arguments": "{}"},
        },
        {
            "type": "tool/result",
            "seq": 5,
            "time": t + 6,
            "surfaceOp": "append",
            "sourceEventSeqs": [4],
            "data": {"turn": 1, "step": 1, "callId": "c1", "content": text("a.txt"), "isError": False},
        },
        {"type": "step/end", "seq": 6, "time": t + 7, "data": {"turn": 1, "step": 1}},
        {
            "type": "assistant/message",
            "seq": 7,
            "time": t + 8,
            "surfaceOp": {"op": "replace", "start": 1, "end": 5},
            "sourceEventSeqs": [1, 3, 5],
            "data": {"turn": 1, "step": 1, "content": text("files: a.txt")},
        },
        {"type": "turn/end", "seq": 8, "time": t + 9, "data": {"turn": 1, "reason": {"kind": "completed"}}},
    ]


def tutorial_rows(session_id: str = "5a1b896f-beb") -> list[Any]:
    """The tutorial's own JSONL (save()): a session/meta line, then flat events with seq and ts."""
    ts = 1_760_000_000.25
    calls = [call("call_1", "run_bash", '{"cmd":"echo 1+1 | bc"}')]
    return [
        {"type": "session/meta", "id": session_id},
        {"type": "turn/start", "seq": 0, "ts": ts, "agent": session_id},
        {"type": "user/message", "seq": 1, "ts": ts + 1, "content": "1+1 等于多少?用工具算一下"},
        {"type": "step/start", "seq": 2, "ts": ts + 2, "step": 0},
        {"type": "assistant/chunk", "seq": 3, "ts": ts + 3, "delta": {"content": "让我先算"}},
        {"type": "assistant/message", "seq": 4, "ts": ts + 4, "content": "让我先算一下。", "tool_calls": calls},
        {"type": "tool/result", "seq": 5, "ts": ts + 5, "tool_call_id": "call_1", "content": "2"},
        {"type": "step/end", "seq": 6, "ts": ts + 6, "step": 0, "tool_calls": 1},
        {"type": "assistant/message", "seq": 7, "ts": ts + 7, "content": "计算完成:1+1=2。", "tool_calls": []},
        {"type": "turn/end", "seq": 8, "ts": ts + 8},
    ]


def tutorial_derive(rows: list[Any]) -> list[dict[str, Any]]:
    """The tutorial's deriveMessages(), transcribed."""
    out: list[dict[str, Any]] = []
    for ev in rows[1:]:
        if ev["type"] == "user/message":
            out.append({"role": "user", "content": ev["content"]})
        elif ev["type"] == "assistant/message":
            msg = {"role": "assistant", "content": ev.get("content") or ""}
            if "tool_calls" in ev:  # JS truthiness: [] included
                msg["tool_calls"] = ev["tool_calls"]
            out.append(msg)
        elif ev["type"] == "tool/result":
            out.append({"role": "tool", "tool_call_id": ev["tool_call_id"], "content": ev["content"]})
    return out


def mini_dsh_rows(session_id: str = "0b5c3a52-mini") -> list[Any]:
    """The mini-dsh variant: payload under `data`, ISO `at`, a global seq (not from 0)."""
    at = "2026-02-03T04:05:0{}.123Z"
    return [
        {"type": "session/meta", "id": session_id, "title": "demo", "createdAt": "2026-02-03T04:05:00.000Z"},
        {"seq": 41, "type": "session/start", "at": at.format(0), "data": {"reset": False}},
        {"seq": 42, "type": "run/start", "at": at.format(1), "data": {}},
        {"seq": 43, "type": "user/message", "at": at.format(2), "data": {"content": "读一下 README"}},
        {
            "seq": 44,
            "type": "assistant/tool_calls",
            "at": at.format(3),
            "data": {
                "content": None,
                "reasoningContent": "先读文件",
                "toolCalls": [{"id": "t1", "name": "read", "arguments": {"path": "README.md"}}],
            },
        },
        {"seq": 45, "type": "tool/result", "at": at.format(4), "data": {"toolCallId": "t1", "content": {"lines": 3}}},
        {"seq": 46, "type": "assistant/message", "at": at.format(5), "data": {"content": "README 有 3 行。"}},
        {"seq": 47, "type": "run/end", "at": at.format(6), "data": {}},
    ]


def mini_dsh_derive() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "读一下 README"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "先读文件",
            "tool_calls": [call("t1", "read", '{"path":"README.md"}')],
        },
        {"role": "tool", "tool_call_id": "t1", "content": '{"lines":3}'},
        {"role": "assistant", "content": "README 有 3 行。"},
    ]


def normalise(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-equivalent forms: an empty tool_calls list is no tool_calls; an assistant message
    that only calls tools has content None ("" in some writers)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls") == []:
            del m["tool_calls"]
        if m.get("tool_calls") and m.get("content") == "":
            m["content"] = None
        out.append(m)
    return out


async def openai_of(store: Any, session_id: str) -> list[dict[str, Any]]:
    return to_openai(project(await store.read(session_id)))


async def make_rich_session(store: Any, sid: str) -> None:
    header = SessionHeader(
        id=sid,
        created_at=1_700_000_000_123,
        title="Émoji 🎉 title",
        delegation_depth=2,
        origin={"source": "test", "nested": [1, {"a": None}]},
    )
    await store.create(
        header,
        [
            NewEntry("turn/start", {"turn": 1}, time=1_700_000_000_200),
            NewEntry("user/message", {"content": "你好", "source": "user"}, {"turn": 1}),
            NewEntry("assistant/chunk", {"chunk": "he"}),
            NewEntry(
                "assistant/message",
                {"content": [{"type": "text", "text": "hello"}], "turn": 1, "step": 1},
                {"usage": {"input": 3, "output": 1}},
                {"surfaceOp": "append", "sourceEventSeqs": [2]},
            ),
            NewEntry("message", {"role": "user", "content": "again", "extra": {"k": [1, 2.5, True]}}),
        ],
    )
    await store.put(
        sid, 5, [NewEntry("cut", {"before": 3, "summary": [{"role": "user", "content": "sum"}], "reason": "compact"})]
    )
    await store.put(
        sid,
        6,
        [
            NewEntry(
                "assistant/message",
                {"content": "replaced"},
                None,
                {"surfaceOp": {"op": "replace", "start": 3, "end": 4}, "sourceEventSeqs": [3, 4]},
            )
        ],
    )


# --------------------------------------------------------------------------- our format


async def test_export_import_round_trip(store: Any, tmp_path: Path) -> None:
    await make_rich_session(store, "chat:1")
    before_head = await store.head("chat:1")
    before = await store.read("chat:1")
    out = tmp_path / "chat.jsonl"
    assert await export_session(store, "chat:1", out) == 7
    first = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    assert first["_type"] == "redis-session" and first["version"] == 1 and first["n"] == 7
    assert "你好" in out.read_text(encoding="utf-8")  # readable, not \u-escaped

    await store.delete("chat:1")
    [res] = await import_path(store, out)
    assert (res.status, res.session_id, res.format, res.entries) == ("imported", "chat:1", "redis-session", 7)
    head = await store.head("chat:1")
    assert head is not None and before_head is not None
    # the same header, but a new life of the id: an import never keeps another log's identity
    assert head.header.incarnation != before_head.header.incarnation
    assert msgspec.structs.replace(head.header, incarnation="") == msgspec.structs.replace(
        before_head.header, incarnation=""
    )
    assert head.n == 7 and head.last_cut == 5
    assert await store.read("chat:1") == before  # same n, time, type, data, meta, surface
    # and the export of the import is byte-identical
    again = io.StringIO()
    await export_session(store, "chat:1", again)
    assert again.getvalue() == out.read_text(encoding="utf-8")


async def test_export_of_a_branch_is_stitched_and_imports_as_a_root(store: Any, tmp_path: Path) -> None:
    await store.create(
        SessionHeader(id="p"), [NewEntry("message", {"role": "user", "content": f"m{i}"}) for i in range(4)]
    )
    await store.create(SessionHeader(id="p:b", parent="p", at=2))
    await store.put("p:b", 2, [NewEntry("message", {"role": "assistant", "content": "branch"})])
    child = await store.read("p:b")
    out = tmp_path / "b.jsonl"
    assert await export_session(store, "p:b", out) == 3
    first = json.loads(out.read_text().splitlines()[0])
    assert first["branched_from"] == {"parent": "p", "at": 2}
    assert "parent" not in first["header"] and "at" not in first["header"]
    [res] = await import_path(store, out, session_id="copy")
    assert res.session_id == "copy"
    head = await store.head("copy")
    assert head is not None and head.header.parent is None and head.header.at is None
    assert await store.read("copy") == child


async def test_export_missing_session(store: Any, tmp_path: Path) -> None:
    with pytest.raises(SessionNotFoundError):
        await export_session(store, "nope", tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()


async def test_import_existing_id_error_skip_replace(store: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", nanobot_rows("cli:direct"))
    await import_path(store, path)
    with pytest.raises(SessionAlreadyExistsError):
        await import_path(store, path)
    [res] = await import_path(store, path, on_exists="skip")
    assert res.status == "skipped" and res.entries == 0
    rows = nanobot_rows("cli:direct")[:3]
    write_jsonl(path, rows)
    [res] = await import_path(store, path, on_exists="replace")
    assert res.status == "replaced"
    head = await store.head("cli:direct")
    assert head is not None and head.n == 2


async def test_a_keyed_create_retried_after_its_life_was_replaced_by_an_import_is_refused(
    store: Any, tmp_path: Path
) -> None:
    """An import that replaces a session ends that life as a delete does (r19 05): a keyed create
    of it retried afterwards (its reply lost), and the imported session deleted in turn, must not
    make the replaced life again. The replaced life's key is remembered as a deleted one's."""
    from redis_session import SessionReplacedError, Sessions

    sessions = Sessions(store)
    await sessions.create("im", title="t", entries=[("user/message", {"content": "mine"})], idempotency_key="K")
    path = write_jsonl(tmp_path / "s.jsonl", nanobot_rows("im")[:3])
    [res] = await import_path(store, path, on_exists="replace")
    assert res.status == "replaced"
    imported = await store.head("im")
    with pytest.raises(SessionReplacedError):  # while the imported life holds the id
        await sessions.create("im", title="t", entries=[("user/message", {"content": "mine"})], idempotency_key="K")
    assert await store.head("im") == imported
    await sessions.delete("im")
    with pytest.raises(SessionReplacedError):
        await sessions.create("im", title="t", entries=[("user/message", {"content": "mine"})], idempotency_key="K")
    assert await store.head("im") is None


async def test_replace_refuses_a_session_with_branches(store: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", nanobot_rows("cli:direct"))
    await import_path(store, path)
    await store.create(SessionHeader(id="cli:direct:b", parent="cli:direct", at=1))
    with pytest.raises(SessionAlreadyExistsError, match="branches"):
        await import_path(store, path, on_exists="replace")
    head = await store.head("cli:direct")
    assert head is not None and head.n == 7  # untouched


# --------------------------------------------------------------------------- nanobot


async def test_nanobot_session_file(store: Any, tmp_path: Path) -> None:
    rows = nanobot_rows()
    path = write_jsonl(tmp_path / "sessions" / "telegram_12345.jsonl", rows)
    [res] = await import_path(store, path)
    assert (res.session_id, res.format, res.status, res.entries) == ("telegram:12345", "nanobot", "imported", 7)
    head = await store.head("telegram:12345")
    assert head is not None
    assert head.header.title == "天气"
    assert head.header.created_at == utc_ms("2026-03-01T10:00:00.000000")
    assert head.header.origin["format"] == "nanobot"
    assert head.header.origin["metadata"] == {"title": "天气", "webui": {"pinned": True}}
    assert head.header.origin["last_consolidated"] == 0
    entries = await store.read("telegram:12345")
    # every message kept whole (timestamp, media, thinking_blocks, _channel_delivery …), time from it
    assert [e.data for e in entries] == rows[1:]
    assert [e.time for e in entries] == [utc_ms(m["timestamp"]) for m in rows[1:]]
    assert [e.type for e in entries] == ["message"] * 4 + ["nanobot/command", "message", "message"]
    # the projection is what nanobot sends the model
    assert await openai_of(store, "telegram:12345") == nanobot_openai(rows)


def nanobot_035_rows(key: str) -> list[Any]:
    """A file as nanobot 0.3.5 writes it: an integer past 64 bits, a message without timestamp."""
    return [
        {
            "_type": "metadata",
            "key": key,
            "created_at": "2026-12-01T04:00:00.123456",
            "updated_at": "2026-12-01T04:00:01.654321",
            "metadata": {"chat": 2**64 + 1},
            "last_archived": 0,
            "last_consolidated": 0,
        },
        {"role": "user", "content": "hi", "timestamp": "2026-12-01T04:00:00.500000", "ref": 2**64},
        {"role": "assistant", "content": "hi, no timestamp", "ids": [-(2**70)]},
    ]


@pytest.mark.parametrize(
    "key", ["telegram:big", "cli:" + " ".join(["x"] * 64)], ids=["plain-key", "key-too-long-once-escaped"]
)
async def test_nanobot_file_with_big_ints_and_no_timestamp_exports_byte_identical(
    store: Any, tmp_path: Path, key: str
) -> None:
    """Import, export byte-identical (no OverflowError, no invented timestamp), import the export:
    the same entries. A key too long once escaped is imported under the store's own mapping."""
    from redis_session.projection.nanobot import key_to_id

    path = write_jsonl(tmp_path / "s.jsonl", nanobot_035_rows(key))
    [res] = await import_path(store, path)
    assert res.session_id == key_to_id(key)
    assert key in (res.session_id, res.original_id)
    out = tmp_path / "out.jsonl"
    await export_session(store, res.session_id, out, format="nanobot")
    assert out.read_bytes() == path.read_bytes()
    before = await store.read(res.session_id)
    [again] = await import_path(store, out, on_exists="replace")
    assert again.session_id == res.session_id
    assert [(e.type, e.data, e.time) for e in await store.read(res.session_id)] == [
        (e.type, e.data, e.time) for e in before
    ]


async def test_nanobot_import_with_id_keeps_the_file(store: Any, tmp_path: Path) -> None:
    """``--id``: the file as it is under that id (its key kept in ``origin``, no "key mapped"
    note); its export is the file's own export, byte for byte."""
    path = write_jsonl(tmp_path / "s.jsonl", nanobot_rows())
    [res] = await import_path(store, path, session_id="my-id")
    assert (res.session_id, res.original_id) == ("my-id", None)
    head = await store.head("my-id")
    assert head is not None and head.header.origin["key"] == "telegram:12345"
    await import_path(store, path)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    await export_session(store, "my-id", a, format="nanobot")
    await export_session(store, "telegram:12345", b, format="nanobot")
    assert a.read_bytes() == b.read_bytes()


async def test_nanobot_last_consolidated_becomes_a_cut(store: Any, tmp_path: Path) -> None:
    rows = nanobot_rows(lc=3)
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    await import_path(store, path)
    entries = await store.read("telegram:12345")
    assert len(entries) == 8 and entries[-1].type == "cut"
    assert entries[-1].data == {
        "before": 3,
        "summary": [],
        "reason": "nanobot:last_consolidated",
        "meta": {"nanobot": {"floor": 0, "last_consolidated": 3}},  # the cut the nanobot adapter writes
    }
    assert entries[-1].time == entries[-2].time
    # from message 3 on, as nanobot's get_history shows it
    assert await openai_of(store, "telegram:12345") == nanobot_openai([rows[0], *rows[4:]])


@pytest.mark.parametrize("lc", [999, -5, "3", None, 0.5, True])
async def test_nanobot_invalid_last_consolidated_means_zero(lc: Any, tmp_path: Path) -> None:
    store = MemorySessionStore()
    await import_path(store, write_jsonl(tmp_path / "s.jsonl", nanobot_rows(lc=lc)))
    entries = await store.read("telegram:12345")
    assert all(e.type != "cut" for e in entries)
    head = await store.head("telegram:12345")
    assert head is not None and head.header.origin["last_consolidated"] == lc  # the raw value is kept


async def test_nanobot_folder(store: Any, tmp_path: Path) -> None:
    folder = tmp_path / "workspace" / "sessions"
    keys = ["telegram:12345", "cli:direct", "slack:C01:T99", "feishu:群聊"]
    for i, key in enumerate(keys):
        rows = nanobot_rows(key)[: 3 + i]
        write_jsonl(folder / f"{key.replace(':', '_')}.jsonl", rows)
    (folder / "half.jsonl.tmp").write_text("{not json", encoding="utf-8")  # a save in progress: ignored
    seen: list[tuple[int, int]] = []
    results = await import_path(store, folder, progress=lambda d, t: seen.append((d, t)))
    assert sorted(r.session_id for r in results if r.session_id) == sorted(keys)
    assert all(r.status == "imported" and r.format == "nanobot" for r in results)
    for i, key in enumerate(keys):
        head = await store.head(key)
        assert head is not None and head.n == 2 + i
    total = sum(p.stat().st_size for p in folder.glob("*.jsonl"))
    assert seen[0] == (0, total) and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


async def test_folder_collect_errors(store: Any, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", nanobot_rows("good:1"))
    bad = nanobot_rows("bad:1")
    bad[3] = "{torn"
    write_jsonl(tmp_path / "b.jsonl", bad)
    write_jsonl(tmp_path / "c.jsonl", dsh_rows("good:2"))
    results = await import_path(store, tmp_path, errors="collect")
    assert [(Path(r.path).name, r.status) for r in results] == [
        ("a.jsonl", "imported"),
        ("b.jsonl", "failed"),
        ("c.jsonl", "imported"),
    ]
    err = results[1].error
    assert isinstance(err, ImportFormatError) and err.line == 4 and err.path.endswith("b.jsonl")
    assert await store.head("bad:1") is None
    # raise mode stops at the bad file; the good one before it is in
    store2 = MemorySessionStore()
    with pytest.raises(ImportFormatError):
        await import_path(store2, tmp_path)
    assert [h.id for h in (await store2.list()).items] == ["good:1"]


# --------------------------------------------------------------------------- dsh


async def test_dsh_file(store: Any, tmp_path: Path) -> None:
    rows = dsh_rows()
    path = write_jsonl(tmp_path / "cwd-0123456789ab" / "dsh-1.jsonl", rows)
    [res] = await import_path(store, tmp_path)  # a dsh root: files are found in its cwd folders
    assert (res.session_id, res.format, res.entries) == ("dsh-1", "dsh", 9)
    assert res.path == str(path)
    head = await store.head("dsh-1")
    assert head is not None
    assert head.header.created_at == rows[0]["createdAt"]
    assert head.header.origin == {"format": "dsh", "cwd": "/work/repo"}
    entries = await store.read("dsh-1")
    for e, ev in zip(entries, rows[1:], strict=True):
        assert (e.n, e.time, e.type, e.data) == (ev["seq"], ev["time"], ev["type"], ev["data"])
        surface = {k: ev[k] for k in ("surfaceOp", "sourceEventSeqs") if k in ev}
        if surface:
            assert e.surface is not None
            assert json.loads(json.dumps({"surfaceOp": "append", **surface})) == {
                "surfaceOp": "append",
                **json.loads(_surface_json(e.surface)),
            }
        else:
            assert e.surface is None
    # the replace shadows the first exchange, as dsh's deriveMessages does
    assert await openai_of(store, "dsh-1") == [{"role": "assistant", "content": "files: a.txt"}]


def _surface_json(surface: Any) -> str:
    import msgspec

    return msgspec.json.encode(surface).decode()


# --------------------------------------------------------------------------- tutorial


async def test_tutorial_file_projects_like_derive_messages(store: Any, tmp_path: Path) -> None:
    rows = tutorial_rows()
    path = write_jsonl(tmp_path / "5a1b896f-beb.jsonl", rows, compact=True)
    [res] = await import_path(store, path)
    assert (res.session_id, res.format, res.entries) == ("5a1b896f-beb", "tutorial", 9)
    entries = await store.read("5a1b896f-beb")
    assert [e.type for e in entries] == [
        "tutorial/turn/start",
        "message",
        "tutorial/step/start",
        "tutorial/assistant/chunk",
        "message",
        "message",
        "tutorial/step/end",
        "message",
        "tutorial/turn/end",
    ]
    assert entries[0].time == 1_760_000_000_250
    assert entries[3].data == {"delta": {"content": "让我先算"}}
    assert entries[4].meta == {"event": "assistant/message"}
    assert all(e.meta is None or "seq" not in e.meta for e in entries)  # seq == n
    derived = tutorial_derive(rows)
    assert [e.data for e in entries if e.type == "message"] == derived
    assert await openai_of(store, "5a1b896f-beb") == normalise(derived)


async def test_mini_dsh_file_projects_like_derive_messages(store: Any, tmp_path: Path) -> None:
    rows = mini_dsh_rows()
    [res] = await import_path(store, write_jsonl(tmp_path / "x.jsonl", rows, compact=True))
    assert res.session_id == "0b5c3a52-mini"
    head = await store.head("0b5c3a52-mini")
    assert head is not None and head.header.title == "demo"
    assert head.header.created_at == utc_ms("2026-02-03T04:05:00.000+00:00")
    entries = await store.read("0b5c3a52-mini")
    assert entries[0].type == "tutorial/session/start" and entries[0].meta == {"seq": 41}
    assert entries[3].meta == {"event": "assistant/tool_calls", "seq": 44}
    assert entries[2].time == utc_ms("2026-02-03T04:05:02.123+00:00")
    assert await openai_of(store, "0b5c3a52-mini") == mini_dsh_derive()


# --------------------------------------------------------------------------- malformed input


def _ours_rows() -> list[Any]:
    return [
        {
            "_type": "redis-session",
            "version": 1,
            "n": 2,
            "header": {"id": "ours-1", "format_version": 1, "created_at": 1, "delegation_depth": 0},
        },
        {"n": 0, "time": 5, "type": "user/message", "data": {"content": "hi"}},
        {"n": 1, "time": 6, "type": "assistant/message", "data": {"content": "yo"}},
    ]


VALID = {"ours": _ours_rows, "nanobot": nanobot_rows, "dsh": dsh_rows, "tutorial": tutorial_rows}
BIG = "x" * (1024 * 1024 + 10)


def _set(rows: list[Any], line: int, value: Any) -> list[Any]:
    rows[line - 1] = value
    return rows


def _patch(rows: list[Any], line: int, **fields: Any) -> list[Any]:
    rows[line - 1] = {**rows[line - 1], **fields}
    return rows


MALFORMED: dict[str, tuple[str, Any, int | None, str]] = {
    # name: (format, mutate(rows) -> rows, expected line, text in the message)
    "ours-bad-json": ("ours", lambda r: _set(r, 3, '{"n": 1, "time": 6,'), 3, "invalid JSON"),
    "ours-data-not-object": ("ours", lambda r: _patch(r, 2, data=["hi"]), 2, "data must be an object"),
    "ours-schema": ("ours", lambda r: _patch(r, 3, data={"content": 5}), 3, "assistant/message"),
    "ours-n-gap": ("ours", lambda r: _patch(r, 3, n=2), 3, "out of sequence"),
    "ours-truncated": ("ours", lambda r: r[:2], None, "announces n=2"),
    "ours-bad-header": ("ours", lambda r: _patch(r, 1, version=2), 1, "export version"),
    "ours-hostile-id": ("ours", lambda r: _patch(r, 1, header={**r[0]["header"], "id": "a{b}"}), 1, "session id"),
    "ours-oversize": ("ours", lambda r: _patch(r, 2, data={"content": BIG}), 2, "limit"),
    "nanobot-bad-json": ("nanobot", lambda r: _set(r, 4, '{"role": "tool", '), 4, "invalid JSON"),
    "nanobot-not-object": ("nanobot", lambda r: _set(r, 3, "[1, 2]"), 3, "expected a JSON object"),
    "nanobot-wrong-types": (
        "nanobot",
        lambda r: _patch(r, 3, tool_calls=[{"id": "x", "function": {"name": "f", "arguments": {}}}]),
        3,
        "message",
    ),
    "nanobot-bad-role": ("nanobot", lambda r: _patch(r, 2, role="robot"), 2, "role"),
    "nanobot-bad-timestamp": ("nanobot", lambda r: _patch(r, 5, timestamp=1234), 5, "timestamp"),
    "nanobot-bad-header": ("nanobot", lambda r: _patch(r, 1, key=12345), 1, "bad header line"),
    "nanobot-oversize": ("nanobot", lambda r: _patch(r, 7, content=BIG), 7, "limit"),
    "dsh-bad-json": ("dsh", lambda r: _set(r, 5, "{"), 5, "invalid JSON"),
    "dsh-wrong-types": ("dsh", lambda r: _patch(r, 3, time="now"), 3, "time must be an integer"),
    "dsh-schema": ("dsh", lambda r: _patch(r, 7, data={"callId": 1, "content": []}), 7, "tool/result"),
    "dsh-seq-gap": ("dsh", lambda r: [*r[:4], *r[5:]], 5, "seq gap"),
    "dsh-extra-key": ("dsh", lambda r: _patch(r, 2, extra=1), 2, "envelope"),
    "dsh-bad-surface": ("dsh", lambda r: _patch(r, 9, surfaceOp={"op": "replace", "start": 1, "end": 99}), 9, "99"),
    "dsh-surface-on-mark": ("dsh", lambda r: _patch(r, 2, surfaceOp="append"), 2, "surface"),
    "dsh-bad-header": ("dsh", lambda r: _patch(r, 1, version=1), 1, "version"),
    "dsh-relative-cwd": ("dsh", lambda r: _patch(r, 1, cwd="repo"), 1, "cwd"),
    "dsh-hostile-id": ("dsh", lambda r: _patch(r, 1, id="x" * 300), 1, "session id"),
    "dsh-oversize": ("dsh", lambda r: _patch(r, 3, data={"content": BIG}), 3, "limit"),
    "tutorial-bad-json": ("tutorial", lambda r: _set(r, 6, "not json"), 6, "invalid JSON"),
    "tutorial-wrong-types": ("tutorial", lambda r: _patch(r, 3, seq="1"), 3, "seq must be an integer"),
    "tutorial-seq-backwards": ("tutorial", lambda r: _patch(r, 4, seq=0), 4, "does not follow"),
    "tutorial-bad-ts": ("tutorial", lambda r: _patch(r, 2, ts="yesterday"), 2, "ts"),
    "tutorial-bad-content": ("tutorial", lambda r: _patch(r, 3, content=5), 3, "message"),
    "tutorial-bad-header": (
        "tutorial",
        lambda r: _set(r, 1, {"type": "session/start", "id": "x"}),
        1,
        "unrecognised header line",
    ),
    "tutorial-hostile-id": ("tutorial", lambda r: _patch(r, 1, id="a\tb"), 1, "session id"),
    "tutorial-oversize": ("tutorial", lambda r: _patch(r, 7, content=BIG), 7, "limit"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_file_writes_nothing(case: str, store: Any, tmp_path: Path) -> None:
    fmt, mutate, line, text = MALFORMED[case]
    path = write_jsonl(tmp_path / f"{case}.jsonl", mutate(VALID[fmt]()))
    with pytest.raises(ImportFormatError) as info:
        await import_path(store, path)
    err = info.value
    assert err.path == str(path)
    assert err.line == line, str(err)
    assert text in str(err)
    assert str(err).startswith(f"{path}:{line}: " if line else f"{path}: ")
    assert await nothing_written(store)


async def test_empty_file_and_forced_format(store: Any, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ImportFormatError, match="empty"):
        await import_path(store, empty)
    nano = write_jsonl(tmp_path / "n.jsonl", nanobot_rows())
    with pytest.raises(ImportFormatError, match="not a dsh header"):
        await import_path(store, nano, format="dsh")
    with pytest.raises(ValueError, match="unknown import format"):
        await import_path(store, nano, format="csv")
    [res] = await import_path(store, nano, format="nanobot", session_id="renamed")
    assert res.session_id == "renamed"
    assert await nothing_written(store) is False


# --------------------------------------------------------------------------- batches


@pytest.fixture(params=["memory", "redis"])
async def small_batch_store(request: pytest.FixtureRequest, redis_url: str, prefix: str) -> Any:
    """A store whose batches hold 50 entries, so an import of a few hundred needs several."""
    if request.param == "memory":
        yield MemorySessionStore(max_batch=50)
        return
    big = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        yield RedisSessionStore(big.client, prefix=prefix, max_batch=50)
    finally:
        keys = [k async for k in big.client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await big.client.delete(*keys)
        await big.aclose()


def _long_export(tmp_path: Path, count: int) -> Path:
    rows: list[Any] = [
        {
            "_type": "redis-session",
            "version": 1,
            "n": count,
            "header": {"id": "long", "format_version": 1, "created_at": 7, "delegation_depth": 0},
        }
    ]
    rows += [
        {"n": i, "time": 1000 + i, "type": "message", "data": {"role": "user", "content": f"m{i}"}}
        for i in range(count)
    ]
    return write_jsonl(tmp_path / "long.jsonl", rows)


async def test_import_in_batches(small_batch_store: Any, tmp_path: Path) -> None:
    path = _long_export(tmp_path, 230)
    seen: list[int] = []
    [res] = await import_path(small_batch_store, path, progress=lambda d, t: seen.append(d))
    assert res.entries == 230
    entries = await small_batch_store.read("long")
    assert [e.n for e in entries] == list(range(230))
    assert [e.time for e in entries] == [1000 + i for i in range(230)]
    assert len(set(seen)) >= 6  # moved with each of the 5 batches
    out = tmp_path / "again.jsonl"
    await export_session(small_batch_store, "long", out)
    assert [json.loads(x) for x in out.read_text().splitlines()] == [
        json.loads(x) for x in path.read_text().splitlines()
    ]


async def test_failure_part_way_leaves_nothing(small_batch_store: Any, tmp_path: Path) -> None:
    path = _long_export(tmp_path, 230)
    calls = 0

    def boom(done: int, total: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:  # after the first and second batch landed
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        await import_path(small_batch_store, path, progress=boom)
    assert await small_batch_store.head("long") is None
    assert await nothing_written(small_batch_store)
    # and the same file imports cleanly afterwards
    [res] = await import_path(small_batch_store, path)
    assert res.entries == 230


async def test_replace_refuses_a_session_kept_for_a_hidden_branch_and_leaves_it_whole(
    store: Any, tmp_path: Path
) -> None:
    """X's deleted branch Y is kept (hidden) for its own branch Z: list(parent=X) shows nothing, yet
    X cannot be replaced. The refusal comes before anything is destroyed."""
    path = write_jsonl(tmp_path / "s.jsonl", nanobot_rows("cli:direct"))
    await import_path(store, path)
    await store.create(SessionHeader(id="y", parent="cli:direct", at=2))
    await store.create(SessionHeader(id="z", parent="y", at=1))
    assert await store.delete("y") is True
    assert (await store.list(parent="cli:direct")).items == []
    head = await store.head("cli:direct")
    entries = await store.read("cli:direct")
    with pytest.raises(SessionAlreadyExistsError, match="branches"):
        await import_path(store, path, on_exists="replace")
    assert await store.head("cli:direct") == head
    assert await store.read("cli:direct") == entries
    assert [e.n for e in await store.read("z")] == [0]


# --------------------------------------------------------------------------- replace: nothing lost


def _long_rows(sid: str, count: int, word: str) -> list[Any]:
    rows: list[Any] = [
        {
            "_type": "redis-session",
            "version": 1,
            "n": count,
            "header": {"id": sid, "format_version": 1, "created_at": 7, "delegation_depth": 0},
        }
    ]
    rows += [
        {"n": i, "time": 1000 + i, "type": "message", "data": {"role": "user", "content": f"{word}{i}"}}
        for i in range(count)
    ]
    return rows


async def test_failed_replace_leaves_the_old_session_exactly_as_it_was(small_batch_store: Any, tmp_path: Path) -> None:
    """A replacing import that fails part-way (after two of five batches) leaves the old session
    untouched: same incarnation, same entries, readable all along; the error says so."""
    store = small_batch_store
    await store.create(SessionHeader(id="long", title="old"), [NewEntry("message", {"role": "user", "content": "old"})])
    before, entries = await store.head("long"), await store.read("long")
    path = write_jsonl(tmp_path / "long.jsonl", _long_rows("long", 230, "new"))
    calls = 0

    def boom(done: int, total: int) -> None:
        nonlocal calls
        calls += 1
        assert [e.data["content"] for e in entries] == ["old"]
        if calls == 3:
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire") as info:
        await import_path(store, path, on_exists="replace", progress=boom)
    assert any("left as it was" in note for note in info.value.__notes__)
    assert await store.head("long") == before
    assert await store.read("long") == entries
    assert [h.id for h in (await store.list()).items] == ["long"]  # no staging copy left
    # the same import then replaces it, keeping nothing of the old one
    [res] = await import_path(store, path, on_exists="replace")
    assert res.status == "replaced"
    after = await store.head("long")
    assert after.n == 230 and after.header.incarnation != before.header.incarnation
    assert after.header.title is None
    assert [e.data["content"] for e in await store.read("long", 0, 3)] == ["new0", "new1", "new2"]
    assert [h.id for h in (await store.list()).items] == ["long"]


async def test_replace_with_a_lost_reply_loses_nothing(tmp_path: Path) -> None:
    """A multi-batch replace whose put reply is lost (the proxy cuts the connection
    after the server ran the command) fails, and the old session is exactly as it was."""
    from reliability._proxy import FaultProxy

    from redis_session.redis.embedded import start_server

    server = start_server(tmp_path / "srv", appendonly=False)
    try:
        with FaultProxy(server.port, seed=3) as proxy:
            store = RedisSessionStore.from_url(
                proxy.url, max_batch=50, client_options={"socket_timeout": 2, "retry_on_timeout": False}
            )
            direct = RedisSessionStore.from_url(server.url)
            try:
                await store.create(SessionHeader(id="long"), [NewEntry("message", {"role": "user", "content": "old"})])
                before, entries = await direct.head("long"), await direct.read("long")
                path = write_jsonl(tmp_path / "long.jsonl", _long_rows("long", 230, "new"))
                calls = 0

                def lose_next_reply(done: int, total: int) -> None:
                    nonlocal calls
                    calls += 1
                    if calls == 3:  # two batches landed: the reply of the third put is lost
                        cuts = proxy.stats.cuts
                        proxy.cut_keeps = 0  # all of it: a reply that arrived whole before the cut is no lost reply
                        proxy.cut_up, proxy.cut_down, proxy.cut_rate = False, True, 1.0

                        def heal() -> None:  # one reply lost, then the network is fine again
                            deadline = time.monotonic() + 60
                            while proxy.stats.cuts == cuts and time.monotonic() < deadline:
                                time.sleep(0.001)
                            proxy.cut_rate = 0.0

                        threading.Thread(target=heal, daemon=True).start()

                with pytest.raises(SessionError) as info:
                    await import_path(store, path, on_exists="replace", progress=lose_next_reply)
                proxy.cut_rate = 0.0
                assert any("left as it was" in note for note in info.value.__notes__)
                assert await direct.head("long") == before
                assert await direct.read("long") == entries
                assert [h.id for h in (await direct.list()).items] == ["long"]  # no staging copy left
            finally:
                await store.aclose()
                await direct.aclose()
    finally:
        server.stop()


def _one_lost_reply(proxy: Any) -> None:
    """Cut the connection after the server runs the next command (its reply is lost), once."""
    cuts = proxy.stats.cuts
    proxy.cut_keeps = 0  # all of it: a reply that arrived whole before the cut is no lost reply
    proxy.cut_up, proxy.cut_down, proxy.cut_rate = False, True, 1.0

    def heal() -> None:
        deadline = time.monotonic() + 60
        while proxy.stats.cuts == cuts and time.monotonic() < deadline:
            time.sleep(0.001)
        proxy.cut_rate = 0.0

    threading.Thread(target=heal, daemon=True).start()


async def test_replace_whose_swap_reply_is_lost_completes_once(tmp_path: Path) -> None:
    """The reply of the swap itself is lost: the retry finds it landed and finishes it. The session
    is the new one, listed once; no staging copy, no old list entry."""
    from reliability._proxy import FaultProxy

    from redis_session.redis.embedded import start_server

    server = start_server(tmp_path / "srv", appendonly=False)
    try:
        with FaultProxy(server.port, seed=5) as proxy:
            store = RedisSessionStore.from_url(proxy.url, max_batch=50, client_options={"socket_timeout": 2})
            direct = RedisSessionStore.from_url(server.url)
            try:
                await store.create(SessionHeader(id="long", created_at=5), [NewEntry("message", {"role": "user"})])
                path = write_jsonl(tmp_path / "long.jsonl", _long_rows("long", 120, "new"))

                def lose_swap_reply(done: int, total: int) -> None:
                    if done == total:  # every batch landed: the next command is the swap
                        _one_lost_reply(proxy)

                [res] = await import_path(store, path, on_exists="replace", progress=lose_swap_reply)
                assert res.status == "replaced"
                assert proxy.stats.cuts == 1  # the swap's reply was lost once
                head = await direct.head("long")
                assert head is not None and head.n == 120 and head.header.created_at == 7
                assert [(h.id, h.created_at) for h in (await direct.list()).items] == [("long", 7)]
                assert [e.data["content"] for e in await direct.read("long", 118)] == ["new118", "new119"]
            finally:
                await store.aclose()
                await direct.aclose()
    finally:
        server.stop()


async def test_replace_while_the_id_gets_another_life_leaves_that_life_alone(
    small_batch_store: Any, tmp_path: Path
) -> None:
    """Attack: the id is deleted and created again while the replacing import runs. The swap is
    refused (SessionReplacedError), the new life keeps exactly its entries, nothing is left over."""
    store = small_batch_store
    await store.create(SessionHeader(id="long"), [NewEntry("message", {"role": "user", "content": "first life"})])
    path = write_jsonl(tmp_path / "long.jsonl", _long_rows("long", 230, "new"))
    state: dict[str, Any] = {}

    async def other_life() -> None:
        await store.delete("long")
        await store.create(SessionHeader(id="long"), [NewEntry("message", {"role": "user", "content": "second"})])
        state["head"] = await store.head("long")

    calls = 0

    def meanwhile(done: int, total: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            state["go"] = True

    async def run_import() -> None:
        await import_path(store, path, on_exists="replace", progress=meanwhile)

    # the other life is made between two batches: wrap put so it runs right after the first one
    real_put = store.put

    async def put(*args: Any, **kwargs: Any) -> Any:
        if state.pop("go", False):
            await other_life()
        return await real_put(*args, **kwargs)

    store.put = put
    try:
        with pytest.raises(SessionNotFoundError) as info:  # SessionReplacedError is one
            await run_import()
    finally:
        del store.put
    assert "replaced" in str(info.value)
    assert any("left as it was" in note for note in info.value.__notes__)
    assert await store.head("long") == state["head"]
    assert [e.data["content"] for e in await store.read("long")] == ["second"]
    assert [h.id for h in (await store.list()).items] == ["long"]


# ------------------------------------------------------------- odd input: lone surrogates, torn lines, dot ids


@pytest.mark.parametrize("content", ["\\ud800", "a\\ud800b", "\\udbff", "\\udc00", "x\\ud800\\u0041"])
async def test_lone_high_surrogate_imports_as_fffd_and_exports_as_written(
    content: str, store: Any, tmp_path: Path
) -> None:
    """A lone HIGH surrogate escape (msgspec calls it "Input data was truncated") imports like a
    low one: U+FFFD in the store, the line kept for a byte-identical tutorial export."""
    text = f'{{"type":"session/meta","id":"lone"}}\n{{"type":"user/message","seq":0,"ts":1.5,"content":"{content}"}}\n'
    path = tmp_path / "lone.jsonl"
    path.write_text(text)
    [res] = await import_path(store, path, format="tutorial")
    assert res.status == "imported"
    [entry] = await store.read("lone")
    want = json.loads(f'"{content}"').encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    assert entry.data["content"] == want.replace("\ud800", "\ufffd")
    out = io.StringIO()
    await export_session(store, "lone", out, format="tutorial")
    assert out.getvalue() == text
    nb = tmp_path / "nb.jsonl"
    write_jsonl(nb, nanobot_rows("nb-lone")[:1])
    nb.write_text(nb.read_text() + f'{{"role": "user", "content": "{content}"}}\n')
    [res] = await import_path(store, nb)
    assert res.status == "imported"


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"type":"session/meta","id":"a\\ud800"}', "id"),
        ('{"type":"session/meta","id":"\\udc00"}', "id"),
        ('{"_type":"metadata","key":"k\\ud800","metadata":{},"last_consolidated":0}', "key"),
        # a redis-session export names its session in header.id: it imported as "sur\ufffdx"
        ('{"_type":"redis-session","version":1,"header":{"id":"sur\\ud800x"},"n":0}', "header.id"),
        ('{"_type":"redis-session","version":1,"header":{"id":"\\udc00"},"n":0}', "header.id"),
    ],
)
async def test_lone_surrogate_session_id_is_refused_naming_the_field(
    line: str, field: str, store: Any, tmp_path: Path
) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ImportFormatError) as info:
        await import_path(store, path)
    msg = str(info.value)
    assert f"{field}: " in msg and "lone surrogate" in msg and "truncated" not in msg
    assert ":1:" in msg
    assert await nothing_written(store)


async def test_truncated_line_is_still_reported_as_invalid_json(store: Any, tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    path.write_text('{"type":"session/meta","id":"cut"}\n{"type":"user/message","seq":0,"content":"ab\n')
    with pytest.raises(ImportFormatError, match="invalid JSON: Input data was truncated"):
        await import_path(store, path)
    assert await nothing_written(store)


@pytest.mark.parametrize("lc", ["50", '"3"', "true", "-5", "0.5", "null"])
async def test_nanobot_out_of_range_last_consolidated_loads_as_nanobot_and_exports_as_written(
    lc: str, store: Any, tmp_path: Path
) -> None:
    """nanobot 0.3.5 loads a last_consolidated that is not an int in [0, len(messages)] as 0
    (Session.__post_init__); the import does the same and the export writes the value back as
    the file held it, while it still loads as that watermark."""
    text = (
        '{"_type": "metadata", "key": "nb-lc", "created_at": "2026-01-01T00:00:00", '
        f'"updated_at": "2026-01-01T00:00:00", "metadata": {{}}, "last_consolidated": {lc}}}\n'
        '{"role": "user", "content": "a", "timestamp": "2026-01-01T00:00:00"}\n'
        '{"role": "assistant", "content": "b", "timestamp": "2026-01-01T00:00:01"}\n'
        '{"role": "user", "content": "c", "timestamp": "2026-01-01T00:00:02"}\n'
    )
    path = tmp_path / "nb-lc.jsonl"
    path.write_text(text)
    await import_path(store, path)
    assert all(e.type != "cut" for e in await store.read("nb-lc"))  # nothing consolidated, as nanobot
    out = io.StringIO()
    await export_session(store, "nb-lc", out, format="nanobot")
    assert out.getvalue() == text


@pytest.mark.parametrize("sid", [".", ".."])
async def test_dot_ids_are_refused_everywhere(sid: str, tmp_path: Path) -> None:
    """URL parsers drop a "." or ".." path segment (/sessions/./entries reaches /sessions/entries),
    so such a session could be created over HTTP but never used: the id rule refuses them."""
    import httpx

    from redis_session import InvalidSessionIdError

    from support import running_gateway

    store = MemorySessionStore()
    with pytest.raises(InvalidSessionIdError, match="dots"):
        await store.create(SessionHeader(id=sid))
    path = tmp_path / "dots.jsonl"
    path.write_text(json.dumps({"type": "session/meta", "id": sid}) + "\n")
    with pytest.raises(ImportFormatError, match="not allowed"):
        await import_path(store, path)
    async with running_gateway(store) as base, httpx.AsyncClient(base_url=base) as client:
        r = await client.post("/sessions", json={"id": sid})
        assert r.status_code == 400 and "dots" in r.text
    assert (await store.list()).items == []
    for ok in ("a.", ".a", "...", "a/../b"):
        await store.create(SessionHeader(id=ok))


# ------------------------------------------------------------- the redis-session format is I-JSON


def _native(path: Path, entry: str, header: str = '{"id":"ij"}') -> Path:
    path.write_text(f'{{"_type":"redis-session","version":1,"header":{header},"n":1}}\n{entry}\n')
    return path


_E = '{"n":0,"time":1,"type":"x/y","data":%s}'
_H = '{"id":"ij",%s}'


@pytest.mark.parametrize(
    ("entry", "header", "where", "says"),
    [
        (_E % '{"v":99999999999999999999999}', None, ":2: data.v: ", "2^53"),
        (_E % '{"v":[1,-9007199254740992]}', None, ":2: data.v[1]: ", "2^53"),
        (_E % '{"content":"x","content":"y"}', None, ":2: data: ", "'content' appears twice"),
        ('{"n":0,"n":0,"time":1,"type":"x/y","data":{}}', None, ":2: the line: ", "'n' appears twice"),
        (_E % ('{"v":' + "[" * 70 + "]" * 70 + "}"), None, ":2: data.v[0]", "deeper than 64"),
        (_E % "{}", _H % '"origin":{"o":1,"o":2}', ":1: bad header line: header.origin: ", "'o' appears twice"),
        (_E % "{}", _H % '"id":"other"', ":1: bad header line: header: ", "'id' appears twice"),
    ],
)
async def test_redis_session_format_is_refused_where_the_gateway_refuses_a_body(
    store: Any, tmp_path: Path, entry: str, header: str | None, where: str, says: str
) -> None:
    """An integer beyond ±(2^53 - 1) (stored, then served as JavaScript cannot read it), a
    duplicate member name (the later one silently won) and nesting deeper than 64 imported,
    though the gateway answers the same entry 422: the file is refused, naming the field, as the
    gateway does (`redis_session.model.check_ijson`, its own check)."""
    path = _native(tmp_path / "ij.jsonl", entry, header or '{"id":"ij"}')
    with pytest.raises(ImportFormatError) as info:
        await import_path(store, path)
    msg = str(info.value)
    assert msg.startswith(str(path) + where) and says in msg, msg
    assert await nothing_written(store)


async def test_redis_session_format_within_i_json_still_imports(store: Any, tmp_path: Path) -> None:
    big = 2**53 - 1
    path = _native(tmp_path / "ok.jsonl", _E % f'{{"v":[{big},-{big}],"k":{{"k":1}}}}')
    await import_path(store, path)
    assert [e.data for e in await store.read("ij")] == [{"v": [big, -big], "k": {"k": 1}}]


# ------------------------------------------------------------- a file is read as a stream, within bounds


async def test_a_file_over_the_line_or_size_bound_is_refused_naming_the_line(
    store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The importer read the whole decompressed file into memory before any limit applied. It
    reads a stream now, within documented bounds (`MAX_FILE_LINES` lines, blank ones included;
    `MAX_FILE_BYTES` decompressed; a line at most `line_limit` of the entry limit): over one, the
    file is refused naming the line where it was reached, and nothing is written."""
    import zstandard

    from redis_session.importers import common

    head = (
        '{"_type":"redis-session","version":1,"header":{"id":"big"},"n":1}\n'
        '{"n":0,"time":1,"type":"user/message","data":{"content":"hi"}}\n'
    )
    monkeypatch.setattr(common, "MAX_FILE_LINES", 1000)
    lines = tmp_path / "lines.jsonl"
    lines.write_text(head + "\n" * 998)  # 1000 lines: within
    await import_path(store, lines)
    await store.delete("big")
    lines.write_text(head + "\n" * 999 + "\n")  # 1001
    with pytest.raises(ImportFormatError, match=r"lines\.jsonl:1001: the file has more than 1,000 lines"):
        await import_path(store, lines)
    monkeypatch.setattr(common, "MAX_FILE_LINES", 10_000_000)
    monkeypatch.setattr(common, "MAX_FILE_BYTES", 1 << 20)
    packed = tmp_path / "packed.jsonl.zstd"  # 1 MiB + 1 decompressed: over
    packed.write_bytes(zstandard.ZstdCompressor().compress(head.encode() + b" " * ((1 << 20) - len(head) + 1)))
    with pytest.raises(ImportFormatError, match=r"packed\.jsonl\.zstd:3: the file is over 1 MiB \(decompressed\)"):
        await import_path(store, packed)
    monkeypatch.setattr(common, "MAX_FILE_BYTES", 1 << 30)
    long = tmp_path / "long.jsonl"
    limit = common.line_limit(int(getattr(store, "max_entry_bytes", 1 << 20)))
    long.write_bytes(head.encode() + b'{"n":1,' + b"x" * limit + b"\n")
    with pytest.raises(ImportFormatError, match=rf"long\.jsonl:3: the line is over {limit:,} bytes"):
        await import_path(store, long)
    # the bound is on a line's text: a CRLF line exactly at it is not "over" (the CR was counted)
    for end in (b"\r\n", b"\n", b"\r"):
        long.write_bytes(head.encode() + b'{"n":1,' + b"x" * (limit - 7) + end)
        with pytest.raises(ImportFormatError) as caught:
            await import_path(store, long)
        assert "the line is over" not in str(caught.value), (end, str(caught.value)[:200])
    long.write_bytes(head.encode() + b'{"n":1,' + b"x" * (limit - 6) + b"\r\n")
    with pytest.raises(ImportFormatError, match=rf"long\.jsonl:3: the line is over {limit:,} bytes"):
        await import_path(store, long)
    assert await nothing_written(store)
