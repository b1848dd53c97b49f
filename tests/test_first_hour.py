"""The CLI as a new user meets it, every command a real subprocess
whose stdout and stderr are pipes.

- one embedded server per user (a data dir, a stable port with a fallback, said once on stderr,
  `server status`, `cli`, reconnecting or exiting when the server goes away);
- output that pipes (``--json`` lines, no wrapping, one-line errors);
- the README's Python example as a file, then `doctor`; its redis-cli section through `cli`.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from redis_session import NewEntry, RedisSessionStore, SessionHeader
from redis_session.redis.embedded import default_data_dir, ensure_server, free_port, running_server, stop_server

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
LONG_ID = "a-rather-long-session-id-" + "x" * 150


def run(*args: str, home: Path | None = None, timeout: float = 120, cwd: Any = None, **env: str) -> Any:
    """`redis-session ARGS` with pipes for stdout and stderr (never a terminal)."""
    full = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    full.pop("COLUMNS", None)
    if home is not None:
        full["REDIS_SESSION_HOME"] = str(home)
    full.update(env)
    cmd = [sys.executable, "-m", "redis_session.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full, cwd=cwd)


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A private user data dir: the embedded server a test starts there is stopped after it."""
    d = tmp_path / "home"
    try:
        yield d
    finally:
        stop_server(d)


# --------------------------------------------------------------------------- 1. the embedded server


def test_the_default_data_dir_is_per_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REDIS_SESSION_HOME", str(tmp_path / "h"))
    assert default_data_dir() == tmp_path / "h"
    monkeypatch.delenv("REDIS_SESSION_HOME")
    monkeypatch.delenv("REDIS_SESSION_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    if sys.platform != "darwin":
        assert default_data_dir() == tmp_path / "xdg" / "redis-session"
        monkeypatch.delenv("XDG_DATA_HOME")
        assert default_data_dir() == Path.home() / ".local" / "share" / "redis-session"


def test_the_tests_never_use_the_real_data_dir() -> None:
    real = Path.home() / ".local" / "share" / "redis-session"
    assert default_data_dir() != real
    assert os.environ["REDIS_SESSION_PORT"] == "0"


def test_stable_default_port_with_a_fallback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    port = free_port()
    monkeypatch.setenv("REDIS_SESSION_PORT", str(port))
    first = ensure_server(tmp_path / "a")
    try:
        assert first.port == port and first.started and first.note is None
        second = ensure_server(tmp_path / "b")  # the port is taken now: a free one, and a note why
        try:
            assert second.port != port and second.started
            assert second.note == f"port {port} is taken; the embedded server uses port {second.port}"
            again = ensure_server(tmp_path / "a")
            assert (again.port, again.pid, again.started) == (port, first.pid, False)
        finally:
            stop_server(tmp_path / "b")
    finally:
        stop_server(tmp_path / "a")


def test_every_folder_sees_the_same_server_and_it_is_announced_once(home: Path, tmp_path: Path, redis_url: str) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    r = run("import", str(_seed_file(tmp_path)), home=home, cwd=one)
    assert r.returncode == 0, r.stderr
    started = [line for line in r.stderr.splitlines() if line.startswith("started the embedded server at redis://")]
    assert len(started) == 1 and f"data in {home.resolve()}" in started[0], r.stderr
    r = run("ls", home=home, cwd=two)
    assert r.returncode == 0, r.stderr
    assert "seeded" in r.stdout
    assert "started" not in r.stderr  # attached: nothing to say
    assert not (one / ".redis-session").exists() and not (two / ".redis-session").exists()
    # --dir: a project-local server, separate from the user's
    r = run("--dir", str(two / ".redis-session"), "ls", home=home, cwd=two)
    try:
        assert r.returncode == 0, r.stderr
        assert "seeded" not in r.stdout and "started the embedded server" in r.stderr
        assert (two / ".redis-session" / "server.json").exists()
    finally:
        stop_server(two / ".redis-session")


def _seed_file(tmp_path: Path) -> Path:
    f = tmp_path / "seeded.jsonl"
    f.write_text(
        '{"_type":"redis-session","version":1,"n":1,'
        '"header":{"id":"seeded","title":"seeded","format_version":1,"created_at":1}}\n'
        '{"n":0,"type":"user/message","time":1,"data":{"content":"hi"}}\n'
    )
    return f


def test_server_status_says_url_dir_pid_and_memory(home: Path) -> None:
    r = run("server", "status", home=home)
    assert r.returncode == 1 and "not running" in r.stdout
    r = run("server", "start", home=home)
    assert r.returncode == 0, r.stderr
    url = r.stdout.strip()
    r = run("server", "status", home=home)
    assert r.returncode == 0, r.stderr
    found = running_server(home)
    assert found is not None and found.url == url
    assert url in r.stdout and str(home.resolve()) in r.stdout and str(found.pid) in r.stdout
    assert "memory" in r.stdout
    status = json.loads(run("server", "status", "--json", home=home).stdout)
    assert status["url"] == url and status["pid"] == found.pid and status["memory"].endswith(("B", "K", "M", "G"))


def test_up_follows_a_replaced_server_and_exits_when_it_is_gone(home: Path) -> None:
    first = run("server", "start", home=home).stdout.strip()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    # the grace covers a CLI's `server start` on a loaded machine; the watch looks every second
    env.update(REDIS_SESSION_HOME=str(home), REDIS_SESSION_GONE_GRACE="10")
    up = subprocess.Popen(
        [sys.executable, "-m", "redis_session.cli", "up", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        _wait_healthy(port)
        assert run("server", "stop", home=home).returncode == 0
        second = run("server", "start", home=home).stdout.strip()  # REDIS_SESSION_PORT=0: another port
        assert second != first
        _wait_healthy(port, path="/readyz")  # ready again: the watch noticed and reconnected
        assert run("server", "stop", home=home).returncode == 0
        _, stderr = up.communicate(timeout=90)  # gone for good: a clear exit, not a loop
        assert up.returncode == 1
        assert f"the embedded server moved to {second}; reconnected" in stderr
        last = stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: the embedded server at {second} stopped"), stderr
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def _wait_healthy(port: int, seconds: float = 60, path: str = "/healthz") -> None:
    """Until the gateway on `port` answers `path` (/readyz: and its store answers too)."""
    import urllib.request

    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as res:
                if json.loads(res.read()) == {"ok": True}:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"gateway on {port} never healthy")
        time.sleep(0.2)


# --------------------------------------------------------------------------- 2. output that pipes


async def _seed(store: RedisSessionStore) -> None:
    await store.create(
        SessionHeader(id=LONG_ID, title="a title with some words " * 4),
        [NewEntry("user/message", {"content": "word " * 60}), NewEntry("assistant/message", {"content": "ok"})],
    )
    await store.create(SessionHeader(id="short"), [NewEntry("user/message", {"content": "hi"})])


def _json_lines(text: str) -> list[Any]:
    return [json.loads(line) for line in text.splitlines()]


async def test_json_output_is_one_document_per_line(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    await _seed(redis_store)
    base = ("--url", redis_url, "--prefix", prefix)
    r = run("ls", "--json", *base)
    assert r.returncode == 0, r.stderr
    rows = _json_lines(r.stdout)
    assert {row["id"] for row in rows} == {LONG_ID, "short"}
    assert next(row for row in rows if row["id"] == LONG_ID)["n"] == 2

    r = run("show", LONG_ID, "--json", *base)
    head, *entries = _json_lines(r.stdout)
    assert head["id"] == LONG_ID and head["last_cut"] is None and [e["n"] for e in entries] == [0, 1]

    r = run("show", LONG_ID, "--messages", "--json", *base)
    assert [m["role"] for m in _json_lines(r.stdout)[0]] == ["user", "assistant"]

    r = run("doctor", "--all", "--json", *base)
    assert r.returncode == 0, r.stderr
    assert {d["session"]: d["ok"] for d in _json_lines(r.stdout)} == {LONG_ID: True, "short": True}

    out = tmp_path / "long.jsonl"
    r = run("export", LONG_ID, "-o", str(out), "--json", *base)
    assert _json_lines(r.stdout) == [{"session": LONG_ID, "entries": 2, "output": str(out)}]
    r = run("export", LONG_ID, *base)
    assert len(_json_lines(r.stdout)) == 3

    r = run("import", str(out), "--json", "--prefix", prefix + "x", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    assert _json_lines(r.stdout) == [
        {"path": str(out), "session": LONG_ID, "format": "redis-session", "status": "imported", "entries": 2}
    ]
    assert r.stderr == ""
    copy = RedisSessionStore.from_url(redis_url, prefix=prefix + "x")
    try:
        await copy.delete(LONG_ID)
    finally:
        await copy.aclose()


async def test_human_output_is_not_wrapped_when_piped(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    await _seed(redis_store)
    base = ("--url", redis_url, "--prefix", prefix)
    r = run("ls", *base)
    lines = r.stdout.splitlines()
    assert len(lines) == 3, r.stdout  # the header and one line per session, whatever the widths
    assert any(line.startswith(LONG_ID + " ") for line in lines)

    r = run("show", LONG_ID, *base)
    first, *entries = r.stdout.splitlines()
    assert "last_cut=-" in first and "None" not in first
    assert len(entries) == 2 and json.loads(entries[0])["data"]["content"] == "word " * 60

    out = tmp_path / "short.jsonl"
    run("export", "short", "-o", str(out), *base)
    r = run("import", str(out), "--prefix", prefix + "y", "--url", redis_url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"imported short (1 entries, redis-session) from {out}"]
    assert r.stderr == ""  # no stray blank line from a progress bar


@pytest.mark.parametrize(
    "args",
    [
        ("show", LONG_ID + "-missing"),
        ("show", "bad{" + "y" * 200 + "}"),
        ("branch", LONG_ID + "-missing", "--at", "0"),
        ("show",),
        ("ls", "--limit", "0"),
    ],
)
def test_errors_are_exactly_one_line(redis_url: str, prefix: str, args: tuple[str, ...]) -> None:
    r = run(*args, "--url", redis_url, "--prefix", prefix)
    assert r.returncode != 0
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- 5. saying what happened


async def test_unknown_parent_missing_folder_and_empty_folder_say_so(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    await _seed(redis_store)
    base = ("--url", redis_url, "--prefix", prefix)
    r = run("ls", "--parent", "nope", *base)
    assert r.returncode == 1 and r.stderr.strip() == "error: session 'nope' not found"
    r = run("ls", "--parent", "short", *base)
    assert r.returncode == 0 and r.stdout == "" and r.stderr.strip() == "session 'short' has no branches"
    empty = tmp_path / "emptydir"
    empty.mkdir()
    r = run("import", str(empty), *base)
    assert r.returncode == 1
    assert (
        r.stderr.strip()
        == f"error: {empty}: no .jsonl or .jsonl.zstd files in this folder (or below it); nothing imported"
    )


def test_tail_beyond_the_end_says_it_waits(redis_url: str, prefix: str, tmp_path: Path) -> None:
    base = ("--url", redis_url, "--prefix", prefix)
    assert run("import", str(_seed_file(tmp_path)), *base).returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    cmd = [sys.executable, "-m", "redis_session.cli", "tail", "seeded", "--from", "999", *base]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        seen = ""
        deadline = time.monotonic() + 60
        while "nothing to show until entry 999" not in seen and time.monotonic() < deadline:
            seen += proc.stdout.readline()
        assert "seeded has 1 entries (0..0): nothing to show until entry 999 is written" in seen
    finally:
        proc.kill()
        proc.wait()


def _tail_lines(args: tuple[str, ...], want: int, timeout: float = 60) -> list[str]:
    """`redis-session tail ARGS` with its stdout a pipe: the first `want` lines, then it is stopped."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "COLUMNS")}
    cmd = [sys.executable, "-m", "redis_session.cli", "tail", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while len(lines) < want and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert len(lines) == want, (lines, err)
    return lines


async def test_tail_piped_is_one_line_per_entry_never_wrapped_nor_padded(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    """Piped, `tail` wrapped at 80 columns and padded lines with spaces."""
    long = "word " * 60
    entries = [
        NewEntry("user/message", {"content": long.strip()}),
        NewEntry("test/mark", {"i": 1, "note": "x" * 150}),
        NewEntry("assistant/message", {"content": "short"}),
    ]
    await redis_store.create(SessionHeader(id="piped"), entries)
    base = ("--url", redis_url, "--prefix", prefix)
    first, *lines = _tail_lines(("piped", "--from", "0", *base), 4)
    assert first.startswith("following piped")
    assert [line.split()[2] for line in lines] == ["user/message", "test/mark", "assistant/message"]
    assert lines[0].endswith(long.strip()) and len(lines[0]) > 300
    assert '"note":"' + "x" * 150 + '"' in lines[1]
    assert all(line == line.rstrip() for line in [first, *lines])  # no padding

    first, *lines = _tail_lines(("piped", "--from", "0", "--messages", *base), 3)
    assert lines[0].split(None, 1) == ["user", long.strip()]


async def test_tail_json_prints_one_entry_per_line(redis_store: RedisSessionStore, redis_url: str, prefix: str) -> None:
    await redis_store.create(
        SessionHeader(id="tj"), [NewEntry("user/message", {"content": "hi"}), NewEntry("test/mark", {"i": 1})]
    )
    lines = _tail_lines(("tj", "--from", "0", "--json", "--url", redis_url, "--prefix", prefix), 2)
    docs = [json.loads(line) for line in lines]  # the "following" note went to stderr
    assert [(d["n"], d["type"]) for d in docs] == [(0, "user/message"), (1, "test/mark")]
    assert docs[0]["data"] == {"content": "hi"}


def test_version_and_short_help() -> None:
    """`--version` and `-h` (on the app and on a command)."""
    from redis_session import __version__

    r = run("--version")
    assert r.returncode == 0 and r.stdout == f"redis-session {__version__}\n", r.stdout + r.stderr
    r = run("-h")
    assert r.returncode == 0 and "Usage:" in r.stdout and "tail" in r.stdout
    r = run("tail", "-h")
    assert r.returncode == 0 and "--json" in r.stdout


def test_server_stop_when_already_stopped_exits_0(home: Path) -> None:
    r = run("server", "stop", home=home)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("not running (data dir ")
    assert run("server", "start", home=home).returncode == 0
    r = run("server", "stop", home=home)
    assert r.returncode == 0 and r.stdout.strip() == "stopped"
    assert run("server", "stop", home=home).returncode == 0


def test_adapters_without_their_extra_name_it() -> None:
    code = (
        "import sys; sys.modules['langchain_core'] = None\n"
        "try:\n"
        "    import redis_session.adapters.langchain\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'redis-agent-session[langchain]'" in r.stdout, r.stdout + r.stderr


async def test_fork_after_a_compact_says_which_boundary_is_valid(redis_store: RedisSessionStore) -> None:
    from redis_session import SessionForkError, Sessions

    sessions = Sessions(redis_store)
    s = await sessions.open("chat-1")
    await s.append_many(
        [
            ("turn/start", {"turn": 1}),
            ("user/message", {"content": "q"}),
            ("assistant/message", {"turn": 1, "content": "a"}),
            ("turn/end", {"turn": 1, "reason": "completed"}),
        ]
    )
    await s.compact(before=2, summary=[{"role": "user", "content": "summary"}], reason="token_limit")
    with pytest.raises(SessionForkError) as info:
        await sessions.fork("chat-1")
    assert str(info.value) == (
        "fork boundary 4 must be turn/end, got cut: fork('chat-1', 3) forks after the last completed turn (entry 3)"
    )
    f = await sessions.fork("chat-1", 3)
    assert f.n == 4


async def test_an_openai_tool_call_round_trip_is_kept_and_a_malformed_one_refused(
    redis_store: RedisSessionStore,
) -> None:
    """`tool_calls` on an assistant/message was accepted, then vanished (and its
    tool/result with it) while doctor said clean."""
    from redis_session import InvalidEntryError, Sessions, to_anthropic, to_openai

    sessions = Sessions(redis_store)
    s = await sessions.open("tools-1")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    await s.append("user/message", {"content": "Weather in Paris?"})
    await s.append("assistant/message", {"content": None, "tool_calls": [call]})
    await s.append("tool/result", {"callId": "call_1", "content": "18 °C"})
    await s.commit({"content": "18 °C in Paris."})
    openai = to_openai(await s.messages())
    assert [m["role"] for m in openai] == ["user", "assistant", "tool", "assistant"]
    assert openai[1]["tool_calls"] == [call] and openai[2]["tool_call_id"] == "call_1"
    anthropic = to_anthropic(await s.messages())["messages"]
    assert anthropic[1]["content"][0]["type"] == "tool_use" and anthropic[2]["content"][0]["tool_use_id"] == "call_1"
    assert (await sessions.doctor("tools-1")).ok
    bad = {"content": None, "tool_calls": [{"id": "call_2", "name": "f", "arguments": {"x": 1}}]}
    with pytest.raises(InvalidEntryError) as info:
        await s.append("assistant/message", bad)
    assert "$.tool_calls[0]" in str(info.value) and '"type": "function", "function": {"name"' in str(info.value)
    assert (await redis_store.head("tools-1")).n == 4  # type: ignore[union-attr]


# --------------------------------------------------------------------------- 5. the README, run


def readme_redis_cli_lines() -> list[list[str]]:
    """The commands of the README's redis-cli section, exactly as written there (shell-split,
    comments dropped): the test runs what a reader would paste."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Inspect with redis-cli") :]
    block = section[section.index("```text") + len("```text") : section.index("```", section.index("```text") + 7)]
    lines = []
    for raw in block.strip().splitlines():
        words = shlex.split(raw, comments=True)
        assert words[:2] == ["redis-session", "cli"], raw
        if len(words) > 2:
            lines.append(words[2:])
    return lines


@pytest.mark.parametrize("client", ["builtin", "redis-cli"])
def test_readme_example_is_doctor_clean_and_its_redis_cli_section_runs(home: Path, client: str) -> None:
    if client == "redis-cli":
        from redis_session.cli.rediscli import find_redis_cli

        if find_redis_cli() is None:
            pytest.skip("no redis-cli installed")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["REDIS_SESSION_HOME"] = str(home)
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "Two meetings." in r.stdout
    r = run("doctor", "chat-1", home=home)
    assert r.returncode == 0 and "1 session(s) checked, 0 with problems" in r.stdout, r.stdout + r.stderr
    extra = ("--builtin",) if client == "builtin" else ()
    replies = {}
    commands = readme_redis_cli_lines()
    assert len(commands) >= 8
    for words in commands:
        line = " ".join(words)
        r = run("cli", *extra, "--no-raw", *words, home=home)
        assert r.returncode == 0 or line.startswith("XINFO"), (line, r.stdout, r.stderr)
        replies[line] = r.stdout
    hdr = replies["HGETALL rs:{chat-1}:hdr"]
    assert '"id"' in hdr and '"chat-1"' in hdr and '"n"' in hdr and '"incarnation"' in hdr
    assert replies["XRANGE rs:{chat-1}:log 5 9"].strip() == "(empty array)"  # the example has 2 entries
    r = run("cli", *extra, "--no-raw", "XRANGE", "rs:{chat-1}:log", "0", "1", home=home)
    assert '"user/message"' in r.stdout and '1) 1) "0-1"' in r.stdout
    assert replies["XLEN rs:{chat-1}:log"].strip() == "(integer) 2"
    assert replies["XRANGE rs:{chat-1}:live - +"].strip() == "(empty array)"  # no answer streaming now
    assert replies["ZRANGE rs:{chat-1}:kids - + BYLEX"].strip() == "(empty array)"
    shards = [
        run("cli", *extra, "ZRANGE", f"rs:sessions:{{{k}}}", "-", "+", "BYLEX", home=home).stdout for k in range(4)
    ]
    assert sum(":chat-1" in text for text in shards) == 1  # in exactly one shard of the list
    if client == "builtin":
        r = run("cli", "--builtin", "XLEN", "rs:{chat-1}:log", home=home)  # piped: raw, as redis-cli does
        assert r.stdout == "2\n"


# --------------------------------------------------------------------------- 4. the demo


def _demo(*args: str, home: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["REDIS_SESSION_HOME"] = str(home)
    cmd = [sys.executable, "-m", "redis_session.cli", "demo", "--pods", "2", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_demo_takes_a_free_port_and_prints_each_answer_once(home: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = _demo("--duration", "2", "--port", str(port), home=home)
        out, err = proc.communicate(timeout=180)
    finally:
        taken.close()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert f"port {port} is taken" in out
    viewer = next(line for line in out.splitlines() if line.startswith("viewer:"))
    assert f":{port}/" not in viewer
    # the coding agent's first answer, streamed: printed once (no draft line, no repeat of the entry)
    assert out.count("Found it: parse() read ISO dates as day-month-year.") == 1, out
    assert out.count("CI says test_parse_dates fails on main. Can you fix it?") == 1
    assert "→ run_tests(" in out and "← 1 failed: test_parse_dates" in out
    assert "doctor                clean" in out


def test_demo_prints_the_summary_on_ctrl_c(home: Path) -> None:
    import signal

    proc = _demo("--duration", "120", "--port", "0", home=home)
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + 120
    while "assistant" not in seen and time.monotonic() < deadline:
        seen += proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    out = seen + out
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "stopping: finishing the turns in flight" in out
    assert "summary" in out and "doctor                clean" in out
    assert "interrupted" not in err and "Traceback" not in err


def _in_a_terminal(cmd: list[str], env: dict[str, str], timeout: float = 180) -> tuple[int, str]:
    """Run `cmd` with a pseudo-terminal as stdout and stderr (a user's terminal, 100 columns)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, b"".join(chunks).decode(errors="replace")


def test_demo_in_a_terminal_shows_no_raw_markup(home: Path) -> None:
    """The status line was drawn inside the print of a streamed piece (markup off,
    style blue): `help[bold]24[/bold] sessions …`, glued to a half word of the answer."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "COLUMNS", "LINES")}
    env["REDIS_SESSION_HOME"] = str(home)
    env["TERM"] = "xterm-256color"
    cmd = [sys.executable, "-m", "redis_session.cli", "demo", "--pods", "2", "--duration", "4", "--port", "0"]
    code, screen = _in_a_terminal(cmd, env)
    assert code == 0, screen[-3000:]
    assert "sessions (" in screen  # the status line was drawn
    for raw in ("[bold]", "[/bold]", "[dim]", "[/dim]", "[/"):
        assert raw not in screen, screen[max(0, screen.find(raw) - 300) : screen.find(raw) + 300]
    # the first answer of the coding agent, streamed in the status display, then printed whole
    assert "Found it: parse() read ISO dates as day-month-year." in screen
    assert "Traceback" not in screen


def test_the_demo_summary_viewer_link_works_after_up(home: Path) -> None:
    """The summary's viewer link pointed at the demo's stopped gateway."""
    import urllib.request

    port = free_port()
    proc = _demo("--duration", "1", "--port", str(port), "--quiet", home=home)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("viewer ") and "stopped" in line)
    command = line[line.index("`") + 1 : line.rindex("`")]
    link = line.split("then open ")[1].strip()
    assert command == f"redis-session up --prefix demo --port {port}"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["REDIS_SESSION_HOME"] = str(home)
    up = subprocess.Popen(
        [sys.executable, "-m", "redis_session.cli", *command.split()[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        sid = link.split("#", 1)[1]
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/sessions/{sid}", timeout=2) as r:
                    assert r.status == 200 and json.loads(r.read())["id"] == sid
                with urllib.request.urlopen(link.split("#")[0], timeout=2) as r:
                    assert r.status == 200 and b"<html" in r.read().lower()
                break
            except OSError:
                assert up.poll() is None and time.monotonic() < deadline, "`up` did not serve the viewer"
                time.sleep(0.2)
    finally:
        up.terminate()
        up.wait(timeout=30)


async def test_show_in_a_terminal_is_one_line_per_entry(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    """In a terminal `show` printed each entry as pretty JSON over many lines;
    now one line per entry cut to the width (piped and --json keep the whole entry per line)."""
    entries = [NewEntry("user/message", {"content": "word " * 60}), NewEntry("test/mark", {"i": 1, "k": [1, 2]})]
    await redis_store.create(SessionHeader(id="shown"), entries)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "COLUMNS", "LINES")}
    env["TERM"] = "dumb"
    cmd = [sys.executable, "-m", "redis_session.cli", "show", "shown", "--url", redis_url, "--prefix", prefix]
    code, screen = await anyio.to_thread.run_sync(lambda: _in_a_terminal(cmd, env, 60))
    assert code == 0, screen
    lines = [line for line in screen.replace("\r", "").splitlines() if line.strip()]
    assert len(lines) == 3, screen  # the header, then one line per entry
    assert "user/message" in lines[1] and lines[1].rstrip().endswith("…") and len(lines[1]) <= 100
    assert "test/mark" in lines[2] and '{"i":1,"k":[1,2]}' in lines[2]


async def test_a_streamed_answer_without_its_step_start_is_one_doctor_line(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    """Streaming inside a turn without a step/start passed at write time, then
    `doctor` printed one step-mismatch line per chunk row. Now the run is one problem that says
    what is missing."""
    from redis_session import Sessions

    sessions = Sessions(redis_store)
    s = await sessions.open("no-step")
    await s.append_many([("turn/start", {"turn": 1}), ("user/message", {"content": "hi"})])
    async with s.stream(turn=1, step=1, max_chunks=2) as w:
        for i in range(9):
            await w.delta(f"piece {i} ")
    await s.append("turn/end", {"turn": 1, "reason": "completed"})
    r = run("doctor", "no-step", "--url", redis_url, "--prefix", prefix)
    assert r.returncode == 1
    mismatches = [line for line in r.stdout.splitlines() if "step-mismatch" in line]
    assert len(mismatches) == 1, r.stdout
    # however many rows the writer packed the 9 deltas into (the run ends at the assistant/message)
    end = (await redis_store.head("no-step")).n - 2  # type: ignore[union-attr]
    chunks = f"assistant/chunk ×{end - 2}" if end - 2 > 1 else "assistant/chunk"
    assert f"entries 2..{end} ({chunks}, assistant/message) name step 1, but no step is open" in mismatches[0]
    assert "step/start" in mismatches[0]
    # a lone entry naming a step is still reported as itself, and a second run separately
    await s.append_many([("turn/start", {"turn": 2}), ("tool/result", {"callId": "c", "content": "x", "step": 3})])
    report = await sessions.doctor("no-step")
    mismatched = [p for p in report.problems if p.code == "step-mismatch"]
    assert len(mismatched) == 2
    assert mismatched[-1].message == "tool/result names step 3, but no step is open"


async def test_the_gateway_takes_an_openai_tool_call_and_refuses_a_malformed_one(
    redis_store: RedisSessionStore,
) -> None:
    import httpx

    from support import running_gateway

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base) as http:
        assert (await http.post("/sessions", json={"id": "tools-http"})).status_code == 201
        bad = {"type": "assistant/message", "data": {"content": None, "tool_calls": [{"id": "c", "arguments": "{}"}]}}
        r = await http.post("/sessions/tools-http/entries", json=bad)
        assert r.status_code == 422, r.text
        assert "tool_calls" in r.text and '\\"type\\": \\"function\\"' in r.text  # the accepted shape, JSON-escaped
        batch = {
            "entries": [
                {"type": "user/message", "data": {"content": "q"}},
                {"type": "assistant/message", "data": {"content": None, "tool_calls": [call]}},
                {"type": "tool/result", "data": {"callId": "call_1", "content": "ok"}},
            ]
        }
        assert (await http.post("/sessions/tools-http/entries", json=batch)).status_code == 201
        r = await http.get("/sessions/tools-http/messages", params={"format": "openai"})
        messages = r.json()
        messages = messages["messages"] if isinstance(messages, dict) else messages
        assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
        assert messages[1]["tool_calls"] == [call]


async def test_tail_json_carries_the_deltas_of_a_streamed_answer(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    from redis_session import Sessions

    sessions = Sessions(redis_store)
    s = await sessions.open("tj-live")
    await s.append_many([("turn/start", {"turn": 1}), ("step/start", {"turn": 1, "step": 1})])
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "COLUMNS")}
    cmd = [sys.executable, "-m", "redis_session.cli", "tail", "tj-live", "--json", "--url", redis_url]
    proc = subprocess.Popen([*cmd, "--prefix", prefix], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)  # noqa: ASYNC220 - starting it does not block
    try:
        assert proc.stderr is not None and proc.stdout is not None
        await anyio.to_thread.run_sync(proc.stderr.readline)  # "following tj-live …": it is reading
        async with s.stream(turn=1, step=1) as w:
            for piece in ("It ", "is ", "sunny."):
                await w.delta(piece)
        docs: list[dict[str, Any]] = []
        with anyio.fail_after(60):
            while not any(d.get("type") == "assistant/message" for d in docs):
                docs.append(json.loads(await anyio.to_thread.run_sync(proc.stdout.readline)))
    finally:
        proc.kill()
        proc.communicate()
    text = "".join(d["delta"]["text"] for d in docs if "delta" in d)
    assert text == "It is sunny."
    assert "It is sunny." in json.dumps(docs[-1]["data"])  # the committed message, after its deltas


# --------------------------------------------------------------------------- tail across a moved server


def _tail_proc(home: Path, *args: str) -> Any:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "COLUMNS")}
    env["REDIS_SESSION_HOME"] = str(home)
    # the tail looks for a moved server every 4 s: what the test writes right after the move
    # lands (nearly always) before the tail has reconnected — the case that lost or repeated entries
    env["REDIS_SESSION_WATCH_INTERVAL"] = "4"
    cmd = [sys.executable, "-m", "redis_session.cli", "tail", *args, "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


async def _write(url: str, sid: str, *texts: str, recreate: bool = False) -> None:
    from redis_session import connect

    sessions = await connect(url)
    async with sessions:
        if recreate:
            await sessions.store.delete(sid)
        s = await sessions.open(sid)
        for t in texts:
            await s.append("user/message", {"content": t})


def _move_server(home: Path) -> str:
    """Stop the embedded server and start it again (REDIS_SESSION_PORT=0: on another port)."""
    assert run("server", "stop", home=home).returncode == 0
    r = run("server", "start", "--port", str(free_port()), home=home)
    assert r.returncode == 0, r.stderr
    return str(r.stdout.strip())


@pytest.mark.parametrize("from_zero", [True, False], ids=["from-0", "from-the-end"])
async def test_tail_resumes_after_the_server_moved_without_gap_or_repeat(home: Path, from_zero: bool) -> None:
    """`tail --from 0` printed 0,1,0,1,2 after the embedded server moved to another port (it
    started over from its argument); plain `tail` skipped the entry written right after the move
    (it started over at the new end)."""
    url = run("server", "start", home=home).stdout.strip()
    await _write(url, "rt-1", "a0", "a1")
    proc = _tail_proc(home, "rt-1", *(("--from", "0") if from_zero else ()))
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert "following rt-1" in await anyio.to_thread.run_sync(proc.stderr.readline)
        got: list[int] = []
        with anyio.fail_after(60):
            while from_zero and len(got) < 2:
                got.append(json.loads(await anyio.to_thread.run_sync(proc.stdout.readline))["n"])
            url2 = await anyio.to_thread.run_sync(_move_server, home)
            assert url2 != url
            await _write(url2, "rt-1", "a2")  # lands before the tail has noticed the move
            while 2 not in got:
                got.append(json.loads(await anyio.to_thread.run_sync(proc.stdout.readline))["n"])
        assert got == ([0, 1, 2] if from_zero else [2])
    finally:
        proc.kill()
        proc.communicate()


async def test_tail_after_the_server_moved_refuses_the_next_life_of_the_id(home: Path) -> None:
    """The id deleted and created again before the tail reconnected to the moved server: the
    tail followed the new life silently; it must end with "was replaced"."""
    url = run("server", "start", home=home).stdout.strip()
    await _write(url, "life-1", "A0", "A1")
    proc = _tail_proc(home, "life-1")
    try:
        assert proc.stderr is not None
        assert "following life-1" in await anyio.to_thread.run_sync(proc.stderr.readline)
        url2 = await anyio.to_thread.run_sync(_move_server, home)
        await _write(url2, "life-1", "B0", "B1", "B2", recreate=True)
        out, errs = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1
    assert out == ""  # nothing of life B
    assert errs.strip().splitlines()[-1] == "error: session 'life-1' was replaced (deleted and created again)"
    assert "Traceback" not in errs


# --------------------------------------------------------------------------- a reader closing the pipe


@pytest.mark.parametrize(
    "args",
    [
        ("show", "long-1"),
        ("show", "long-1", "--json"),
        ("export", "long-1"),
        ("tail", "long-1", "--from", "0"),
        ("tail", "long-1", "--from", "0", "--json"),
    ],
    ids=" ".join,
)
def test_a_closed_stdout_is_a_quiet_exit_141(redis_url: str, prefix: str, args: tuple[str, ...]) -> None:
    """`… | head -n 1`: tail printed a 95-line exception-group traceback (exit 1), tail --json
    "error: [Errno 32] Broken pipe", show/export exited 1 silently. Every command: exit 141
    (128 + SIGPIPE, as coreutils), nothing on stderr."""
    anyio.run(_fill, redis_url, prefix, "long-1", 3000)
    cli = shlex.join([sys.executable, "-m", "redis_session.cli", *args, "--url", redis_url, "--prefix", prefix])
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "COLUMNS")}
    r = subprocess.run(
        ["bash", "-c", f"timeout 60 {cli} | head -n 1 >/dev/null; echo ${{PIPESTATUS[0]}}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
    )
    assert r.stdout.strip() == "141", r.stdout + r.stderr
    assert [line for line in r.stderr.splitlines() if not line.startswith("following ")] == []


async def _fill(url: str, prefix: str, sid: str, n: int) -> None:
    store = RedisSessionStore.from_url(url, prefix=prefix)
    try:
        if await store.head(sid) is None:
            rows = [NewEntry("user/message", {"content": f"line {i} " + "x" * 200}) for i in range(n)]
            await store.create(SessionHeader(id=sid), rows)
    finally:
        await store.aclose()
