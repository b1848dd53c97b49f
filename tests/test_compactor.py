"""The compactor: a session over its token budget gets one cut at a legal boundary, with the
summary in front; a session that moves on, a racing compactor, a failing summarizer, a lost
reply and a re-created id never produce a wrong or a second cut. Real server; the summarizer is
a deterministic local function or a local HTTP server speaking the chat-completions shape."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import pytest

from redis_session import NewEntry, RedisSessionStore, SessionHeader, StoreUnavailableError, Surface, SurfaceReplace
from redis_session.cli import main as cli_main
from redis_session.compactor import (
    BUSY,
    COMPACTED,
    DELETED,
    FAILED,
    SUMMARY_PREFIX,
    UNCUTTABLE,
    UNDER,
    Compactor,
    chat_completions,
    load_summarizer,
    status,
)
from redis_session.projection import Message, estimate_tokens, project, to_openai
from redis_session.projector import quiescent

from support import wait_for

pytestmark = pytest.mark.anyio

TEXT = "x" * 36  # with a 4-character label: 40 characters, 10 tokens


# --------------------------------------------------------------------------- helpers


def um(label: str) -> NewEntry:
    return NewEntry("user/message", {"content": f"{label:<4}{TEXT}"})


def am(label: str) -> NewEntry:
    return NewEntry("assistant/message", {"content": [{"type": "text", "text": f"{label:<4}{TEXT}"}]})


def call(cid: str) -> NewEntry:
    fn = {"name": "grep", "arguments": json.dumps({"q": TEXT})}
    return NewEntry(
        "message", {"role": "assistant", "content": "", "tool_calls": [{"id": cid, "type": "function", "function": fn}]}
    )


def result(cid: str) -> NewEntry:
    return NewEntry("message", {"role": "tool", "tool_call_id": cid, "content": f"hit {TEXT}"})


def turns(first: int, count: int) -> list[NewEntry]:
    out: list[NewEntry] = []
    for t in range(first, first + count):
        out += [um(f"q{t}"), am(f"a{t}")]
    return out


class Recorder:
    """A deterministic summarizer that remembers what it was asked; optionally waits on `release`
    (set `started` first) or fails its first `fail` calls."""

    def __init__(self, *, gate: bool = False, fail: int = 0, label: str = "") -> None:
        self.calls: list[list[dict[str, Any]]] = []
        self.started = anyio.Event()
        self.release = anyio.Event()
        if not gate:
            self.release.set()
        self.fail = fail
        self.label = label

    async def __call__(self, messages: list[dict[str, Any]]) -> str:
        self.calls.append(messages)
        self.started.set()
        await self.release.wait()
        if self.fail > 0:
            self.fail -= 1
            raise RuntimeError("summarizer down")
        return f"summary{self.label} of {len(messages)} messages"


async def create(store: RedisSessionStore, sid: str, entries: list[NewEntry]) -> None:
    await store.create(SessionHeader(id=sid), entries)


async def cuts(store: RedisSessionStore, sid: str) -> list[Any]:
    head = await store.head(sid)
    assert head is not None
    return [e for e in await store.read(sid, 0, head.n) if e.type == "cut"]


async def projection(store: RedisSessionStore, sid: str) -> list[Message]:
    head = await store.head(sid)
    assert head is not None
    return project(await store.read(sid, 0, head.n))


def tokens(messages: list[Message]) -> int:
    return sum(estimate_tokens(m) for m in messages)


async def drain(store: RedisSessionStore, *workers: Compactor, group: str = "compactor") -> None:
    with anyio.fail_after(90):
        while True:
            for w in workers:
                await w.run_once()
            if await quiescent(store, group=group) and not any(w.deferred for w in workers):
                return
            await anyio.sleep(0.02)


def compactor(store: RedisSessionStore, summarize: Any, **kw: Any) -> Compactor:
    # from_start: these tests write their sessions before the worker's first read
    opts: dict[str, Any] = {
        "budget_tokens": 150,
        "keep_recent": 4,
        "keep_tokens": 1000,
        "block_ms": 50,
        "from_start": True,
    }
    opts.update(kw)
    return Compactor(store, summarize=summarize, **opts)


def assert_cut_shape(entries_before_cut: list[Any], cut: Any, after: list[Message]) -> None:
    """The cut is at a user message, separates no tool result from its call, and the projection
    after it is exactly the summary followed by the messages of entries >= before."""
    before = cut.data["before"]
    by_n = {e.n: e for e in entries_before_cut}
    assert by_n[before].type == "user/message" or by_n[before].data.get("role") == "user"
    old = project(entries_before_cut)
    kept = [m for m in old if min(m.source) >= before]
    dropped = [m for m in old if max(m.source) < before]
    assert len(kept) + len(dropped) == len(old)
    kept_calls = {b["id"] for m in kept for b in m.content if b.get("type") == "tool-call"}
    for m in kept:
        for b in m.content:
            if b.get("type") == "tool-result":
                assert b["toolCallId"] in kept_calls, "a kept tool result lost its call"
    dropped_calls = {b["id"] for m in dropped for b in m.content if b.get("type") == "tool-call"}
    kept_results = {b["toolCallId"] for m in kept for b in m.content if b.get("type") == "tool-result"}
    assert not dropped_calls & kept_results, "the cut split a tool-call group"
    assert len(after) == len(cut.data["summary"]) + len(kept)
    assert after[len(cut.data["summary"]) :] == kept
    assert all(m.source == (cut.n,) for m in after[: len(cut.data["summary"])])


# --------------------------------------------------------------------------- trigger and shape


async def test_compacts_over_budget_and_not_under(redis_store: RedisSessionStore) -> None:
    s = redis_store
    rec = Recorder()
    c = compactor(s, rec, consumer="c1")
    await create(s, "small", turns(0, 6))  # 12 messages, 120 tokens
    await create(s, "big", turns(0, 10))  # 20 messages, 200 tokens
    await drain(s, c)
    assert await cuts(s, "small") == []
    assert len(rec.calls) == 1
    assert await c.check("small") == UNDER

    [cut] = await cuts(s, "big")
    assert cut.n == 20 and cut.data["before"] == 16  # keep_recent=4: the last two turns
    assert cut.data["reason"] == "compactor"
    assert cut.data["summary"] == [{"role": "user", "content": SUMMARY_PREFIX + "summary of 16 messages"}]
    entries = await s.read("big", 0, 20)
    assert rec.calls[0] == to_openai(project(entries)[:16])
    after = await projection(s, "big")
    assert_cut_shape(entries, cut, after)
    assert after[0].text.startswith("[Archived Context Summary]")
    assert tokens(after) <= 150
    assert await c.check("big") == UNDER  # the cut's own feed entry: nothing more to do

    # More turns: the next summary rolls the previous one forward.
    await s.put("big", None, turns(10, 10))
    await drain(s, c)
    first, second = await cuts(s, "big")
    assert first == cut
    assert second.data["before"] == 37
    assert rec.calls[1][0]["content"].startswith(SUMMARY_PREFIX + "summary of 16 messages")
    assert len(rec.calls[1]) == 1 + 4 + 16  # the old summary, the two turns it kept, 8 new turns
    st = await status(s)
    assert st["counters"]["compacted"] == 2
    assert st["counters"]["checked"] >= 4 and st["counters"]["under"] >= 2
    assert c.metrics.value("checks_total", outcome="compacted") == 2


async def test_cut_is_at_a_legal_boundary_around_tool_calls(redis_store: RedisSessionStore) -> None:
    s = redis_store
    log: list[NewEntry] = []
    for t in range(6):  # user, a tool call, its result, the answer: 4 messages per turn
        log += [um(f"q{t}"), call(f"c{t}"), result(f"c{t}"), am(f"a{t}")]
    for keep in (1, 2, 3, 5, 6, 7, 9):
        sid = f"tools-{keep}"
        await create(s, sid, log)
        rec = Recorder()
        c = compactor(s, rec, budget_tokens=100, keep_recent=keep)
        assert await c.check(sid) == COMPACTED, keep
        [cut] = await cuts(s, sid)
        entries = await s.read(sid, 0, cut.n)
        assert_cut_shape(entries, cut, await projection(s, sid))
        kept_turns = max(1, keep // 4)
        assert cut.data["before"] == len(log) - 4 * kept_turns, keep
        rendered = to_openai(await projection(s, sid))
        assert rendered[1]["role"] == "user"


async def test_nothing_to_cut_when_one_turn_is_over_budget(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await create(s, "huge", [um("q"), am("a"), call("c1"), result("c1"), am("b")])
    rec = Recorder()
    c = compactor(s, rec, budget_tokens=20)
    assert await c.check("huge") == UNCUTTABLE
    assert rec.calls == [] and await cuts(s, "huge") == []


async def test_no_cut_that_would_show_a_summarised_replace_again(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await create(s, "rep", turns(0, 10))
    # Entry 20 replaces nodes 2..5: it sits at position 2 with an n above any boundary before it.
    surface = Surface(op=SurfaceReplace(op="replace", start=2, end=5), source_event_seqs=[2, 3, 4, 5])
    await s.put("rep", 20, [NewEntry("user/message", {"content": "R   " + TEXT}, None, surface)])
    rec = Recorder()
    c = compactor(s, rec)
    assert await c.check("rep") == UNCUTTABLE  # before=16 would bring entry 20 back after the summary
    assert rec.calls == [] and await cuts(s, "rep") == []
    await s.put("rep", None, turns(10, 4))  # n 21..28: a boundary past entry 20 exists now
    assert await c.check("rep") == COMPACTED
    [cut] = await cuts(s, "rep")
    assert cut.data["before"] == 25
    after = await projection(s, "rep")
    assert [m.text[:4].strip() for m in after[1:]] == ["q12", "a12", "q13", "a13"]
    assert len(rec.calls[0]) == 2 + 1 + 14 + 4 and rec.calls[0][2]["content"].startswith("R ")


# --------------------------------------------------------------------------- races


async def test_append_during_summary_is_retried_and_cut_once(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await create(s, "busy", turns(0, 10))
    rec = Recorder(gate=True)
    c = compactor(s, rec)
    got: list[str] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            got.append(await c.check("busy"))

        tg.start_soon(run)
        await rec.started.wait()
        await s.put("busy", 20, [um("late"), am("ans")])  # the session moves on meanwhile
        rec.release.set()
    assert got == [COMPACTED]
    assert len(rec.calls) == 1  # the range did not change: the same summary, no second call
    [cut] = await cuts(s, "busy")
    assert cut.n == 22 and cut.data["before"] == 16
    after = await projection(s, "busy")
    assert [m.text[:4].strip() for m in after[1:]] == ["q8", "a8", "q9", "a9", "late", "ans"]
    assert (await status(s))["counters"]["conflicts"] == 1
    assert await c.check("busy") == UNDER


async def test_a_cut_written_meanwhile_is_not_cut_again(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await create(s, "other", turns(0, 10))
    rec = Recorder(gate=True)
    c = compactor(s, rec)
    got: list[str] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            got.append(await c.check("other"))

        tg.start_soon(run)
        await rec.started.wait()
        summary = [{"role": "user", "content": "someone else's summary"}]
        await s.put("other", 20, [NewEntry("cut", {"before": 18, "summary": summary, "reason": "manual"})])
        rec.release.set()
    assert got == [UNDER]
    [cut] = await cuts(s, "other")
    assert cut.data["reason"] == "manual"


async def test_two_compactors_racing_cut_once(redis_store: RedisSessionStore) -> None:
    s = redis_store
    # With the lock: the second finds the session busy, and under budget once the first is done.
    await create(s, "locked", turns(0, 10))
    rec_a, rec_b = Recorder(gate=True), Recorder()
    a, b = compactor(s, rec_a, consumer="a"), compactor(s, rec_b, consumer="b")
    got: list[str] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            got.append(await a.check("locked"))

        tg.start_soon(run)
        await rec_a.started.wait()
        assert await b.check("locked") == BUSY
        rec_a.release.set()
    assert got == [COMPACTED]
    assert await b.check("locked") == UNDER
    assert rec_b.calls == [] and len(await cuts(s, "locked")) == 1

    # Without the lock both summarise the same range; expected n and the range's idempotency key
    # let one cut land. Same summary: the second put returns the first one's cut; different
    # summaries: the second is refused and decides again.
    assert await race_unlocked(s, "free-same", same=True) == [COMPACTED, COMPACTED]
    assert await race_unlocked(s, "free-differ", same=False) == [COMPACTED, UNDER]


async def race_unlocked(s: RedisSessionStore, sid: str, *, same: bool) -> list[str]:
    await create(s, sid, turns(0, 10))
    both = anyio.Event()
    entered: list[str] = []

    def gated(label: str) -> Any:
        async def summarize(messages: list[dict[str, Any]]) -> str:
            entered.append(label)
            if len(entered) == 2:
                both.set()
            await both.wait()
            return f"summary{'' if same else label} of {len(messages)}"

        return summarize

    outcomes: list[str] = []

    async def run(w: Compactor) -> None:
        outcomes.append(await w.check(sid))

    async with anyio.create_task_group() as tg:
        for label in "ab":
            tg.start_soon(run, compactor(s, gated(label), consumer=label, lock_ms=0))
    assert entered == ["a", "b"] or entered == ["b", "a"]
    assert len(await cuts(s, sid)) == 1
    return sorted(outcomes)


async def test_recreated_session_is_not_cut_with_the_old_summary(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await create(s, "reborn", turns(0, 10))
    rec = Recorder(gate=True)
    c = compactor(s, rec)
    got: list[str] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            got.append(await c.check("reborn"))

        tg.start_soon(run)
        await rec.started.wait()
        assert await s.delete("reborn")
        await create(s, "reborn", turns(0, 10))  # same id, same n, same range: another life
        rec.release.set()
    assert got == [DELETED]
    assert await cuts(s, "reborn") == []
    # The new life is compacted on its own merits, with its own summary.
    assert await c.check("reborn") == COMPACTED
    assert len(rec.calls) == 2


# --------------------------------------------------------------------------- failures


async def test_summarizer_failure_cuts_nothing_and_is_retried(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await create(s, "flaky", turns(0, 10))
    rec = Recorder(fail=1)
    c = compactor(s, rec, claim_idle_ms=150)
    await c.run_once()
    assert await cuts(s, "flaky") == []
    st = await status(s)
    assert st["pending"] == 1 and st["counters"]["errors"] == 1 and st["counters"]["summarizer_errors"] == 1
    await drain(s, c)  # the entry is reclaimed once idle (150 ms) and checked again
    assert len(await cuts(s, "flaky")) == 1
    assert len(rec.calls) == 2
    assert (await status(s))["counters"]["compacted"] == 1

    # A summarizer that hangs past the timeout, one that returns nothing, one that raises
    # synchronously: no cut.
    async def slow(messages: list[dict[str, Any]]) -> str:
        await anyio.sleep(10)
        return "late"

    for fn, sid in ((slow, "slow"), (lambda m: "  ", "empty"), (lambda m: 1 / 0, "boom")):
        await create(s, sid, turns(0, 10))
        w = compactor(s, fn, timeout=0.2)
        assert await w.check(sid) == FAILED
        assert await cuts(s, sid) == []


async def test_sync_summarizer_and_message_list(redis_store: RedisSessionStore) -> None:
    s = redis_store
    await create(s, "sync", turns(0, 10))

    def summarize(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": f"{len(messages)} messages happened"}]

    assert await compactor(s, summarize).check("sync") == COMPACTED
    [cut] = await cuts(s, "sync")
    assert cut.data["summary"] == [{"role": "system", "content": "16 messages happened"}]


async def test_lost_reply_is_retried_with_the_range_key(
    redis_store: RedisSessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = redis_store
    await create(s, "lost", turns(0, 10))
    real_put = s.put
    keys: list[str | None] = []

    async def put(*args: Any, **kw: Any) -> Any:
        keys.append(kw.get("idempotency_key"))
        stored = await real_put(*args, **kw)
        if len(keys) == 1:
            raise StoreUnavailableError("reply lost")  # the cut landed, the reply did not
        return stored

    monkeypatch.setattr(s, "put", put)
    assert await compactor(s, Recorder()).check("lost") == COMPACTED
    assert len(keys) == 2 and keys[0] == keys[1] and keys[0] is not None
    assert keys[0].startswith("compactor:") and keys[0].endswith(":-:16")
    assert len(await cuts(s, "lost")) == 1


async def test_run_follows_the_feed_until_stopped(redis_store: RedisSessionStore) -> None:
    s = redis_store
    c = compactor(s, Recorder())
    async with anyio.create_task_group() as tg:
        tg.start_soon(c.run)
        await create(s, "live", turns(0, 6))
        await s.put("live", None, turns(6, 4))  # over budget once this lands
        await wait_for(lambda: _nonempty(cuts(s, "live")))
        c.stop()
    assert (await status(s))["counters"]["compacted"] == 1


async def _nonempty(items: Any) -> bool:
    return bool(await items)


# --------------------------------------------------------------------------- the URL summarizer


class _ChatServer:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.reply: tuple[int, Any] = (200, {"choices": [{"message": {"role": "assistant", "content": "FROM SERVER"}}]})
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, dict(self.headers), body))
                code, payload = outer.reply
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def chat_server() -> Iterator[_ChatServer]:
    srv = _ChatServer()
    try:
        yield srv
    finally:
        srv.close()


async def test_chat_completions_url(
    redis_store: RedisSessionStore, chat_server: _ChatServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = redis_store
    monkeypatch.setenv("RS_TEST_SUMMARIZER_KEY", "sk-test")
    summarize = chat_completions(chat_server.url, "tiny-model", api_key_env="RS_TEST_SUMMARIZER_KEY", timeout=5)
    log: list[NewEntry] = [um("q0"), call("c0"), result("c0"), am("a0"), *turns(1, 9)]
    await create(s, "remote", log)
    c = compactor(s, summarize)
    assert await c.check("remote") == COMPACTED
    [(path, headers, body)] = chat_server.requests
    assert path == "/v1/chat/completions"
    assert headers["Authorization"] == "Bearer sk-test"
    assert headers["Content-Type"] == "application/json"
    assert body["model"] == "tiny-model"
    assert set(body) == {"model", "messages"}
    system, *rest = body["messages"]
    assert system["role"] == "system" and "summary" in system["content"]
    entries = await s.read("remote", 0, len(log))
    assert rest == to_openai(project(entries)[:18])
    assert rest[1]["tool_calls"][0]["id"] == "c0" and rest[2] == {
        "role": "tool",
        "tool_call_id": "c0",
        "content": f"hit {TEXT}",
    }
    [cut] = await cuts(s, "remote")
    assert cut.data["summary"] == [{"role": "user", "content": SUMMARY_PREFIX + "FROM SERVER"}]

    # An HTTP error or an answer without content: logged, no cut, retried later.
    for reply in (
        (500, {"error": "overloaded"}),
        (200, {"choices": []}),
        (200, {"choices": [{"message": {"content": ""}}]}),
    ):
        chat_server.reply = reply
        sid = f"remote-{len(chat_server.requests)}"
        await create(s, sid, turns(0, 10))
        assert await c.check(sid) == FAILED, reply
        assert await cuts(s, sid) == []
    assert (await status(s))["counters"]["summarizer_errors"] == 3

    # No key, a full endpoint URL: no Authorization header.
    chat_server.reply = (200, {"choices": [{"message": {"content": "ok"}}]})
    plain = chat_completions(chat_server.url + "/chat/completions", "m")
    await plain([{"role": "user", "content": "hi"}])
    path, headers, _ = chat_server.requests[-1]
    assert path == "/v1/chat/completions" and "Authorization" not in headers


# --------------------------------------------------------------------------- CLI


async def test_cli_status_and_usage(
    redis_store: RedisSessionStore, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    s = redis_store
    await create(s, "cli", turns(0, 10))
    await drain(s, compactor(s, Recorder()))

    def cli(*args: str) -> int:
        try:
            cli_main(["compactor", "--url", redis_url, "--prefix", s.prefix, *args])
        except SystemExit as e:
            return int(e.code or 0)
        return 0

    assert await anyio.to_thread.run_sync(cli, "--status") == 0
    st = json.loads(capsys.readouterr().out)
    assert st["group"] == "compactor" and st["counters"]["compacted"] == 1 and st["lag"] == 0
    assert await anyio.to_thread.run_sync(cli) == 1
    assert "--summarizer-url" in capsys.readouterr().err
    assert await anyio.to_thread.run_sync(cli, "--summarizer-url", "http://127.0.0.1:9/v1") == 1
    assert "--model" in capsys.readouterr().err


def test_load_summarizer_names_a_callable() -> None:
    fn = load_summarizer("json:dumps")
    assert fn is json.dumps
    for bad in ("json", "json:", "json:decoder"):
        with pytest.raises(ValueError):
            load_summarizer(bad)


# --------------------------------------------------------------------------- first start


async def test_a_first_start_leaves_sessions_written_before_it_alone_and_says_so(
    redis_store: RedisSessionStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A new user's compactor summarised 236 messages of sessions written long before it existed.
    A new group starts at the feed's end; an old session is checked when it is next written."""
    s = redis_store
    await create(s, "old", turns(0, 10))  # over budget, written before any compactor
    rec = Recorder()
    c = compactor(s, rec, from_start=False)
    with caplog.at_level("INFO", logger="redis_session.compactor"):
        await drain(s, c)
        assert await cuts(s, "old") == [] and rec.calls == []
        assert "created group 'compactor' at the end of the feed" in caplog.text
        assert "--from-start" in caplog.text
        await s.put("old", None, turns(10, 1))  # written again: now it is the compactor's business
        await drain(s, c)
    [cut] = await cuts(s, "old")
    assert cut.data["before"] == 18
    line = next(r.getMessage() for r in caplog.records if "compacted 'old'" in r.getMessage())
    assert "at before=18: ~220 tokens over the 150 budget; 18 messages summarised" in line


async def test_an_existing_group_resumes_where_it_left_off(redis_store: RedisSessionStore) -> None:
    """The end-of-feed start is for a *new* group: a compactor restarted (a deploy, a crash) still
    checks what was written while it was down."""
    s = redis_store
    first = compactor(s, Recorder(), from_start=False, consumer="c1")
    await drain(s, first)  # creates the group at the (empty) feed's end
    await create(s, "while-down", turns(0, 10))
    second = compactor(s, Recorder(), from_start=False, consumer="c2")
    await drain(s, second)
    [cut] = await cuts(s, "while-down")
    assert cut.data["before"] == 16


async def test_from_start_checks_the_retained_feed_and_says_so(
    redis_store: RedisSessionStore, caplog: pytest.LogCaptureFixture
) -> None:
    s = redis_store
    await create(s, "old", turns(0, 10))
    c = compactor(s, Recorder(), from_start=True)
    with caplog.at_level("INFO", logger="redis_session.compactor"):
        await drain(s, c)
    assert len(await cuts(s, "old")) == 1
    assert "created group 'compactor' at the start of the feed" in caplog.text
