"""The `redis-session` CLI, run as a real subprocess against a real server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from redis_session import NewEntry, RedisSessionStore, SessionHeader

pytestmark = pytest.mark.anyio


def cli(*args: str, url: str | None = None, prefix: str | None = None, timeout: float = 120, cwd: Any = None) -> Any:
    cmd = [sys.executable, "-m", "redis_session.cli", *args]
    if url is not None:
        cmd += ["--url", url]
    if prefix is not None:
        cmd += ["--prefix", prefix]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["COLUMNS"] = "200"
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


async def seed(store: RedisSessionStore) -> None:
    await store.create(
        SessionHeader(id="chat-1", title="hello"),
        [
            NewEntry("turn/start", {"turn": 1}),
            NewEntry("user/message", {"content": "What is on my calendar?"}),
            NewEntry("step/start", {"turn": 1, "step": 1}),
            NewEntry("assistant/chunk", {"turn": 1, "step": 1, "chunk": {"text": "Two"}}),
            NewEntry("assistant/message", {"turn": 1, "step": 1, "content": "Two meetings."}),
            NewEntry("step/end", {"turn": 1, "step": 1}),
            NewEntry("turn/end", {"turn": 1, "reason": {"kind": "completed"}}),
        ],
    )


def test_main_module_is_the_console_script() -> None:
    r = cli("--help")
    assert r.returncode == 0
    for cmd in (
        "demo",
        "up",
        "server",
        "ls",
        "show",
        "tail",
        "doctor",
        "branch",
        "export",
        "import",
        "projector",
        "gateway",
    ):
        assert cmd in r.stdout


@pytest.mark.parametrize("args", [("-h",), ("--help",), ("gateway", "--help"), ("tail", "-h"), ("server", "-h")])
def test_piped_help_is_plain_click_text(args: tuple[str, ...]) -> None:
    """``redis-session -h | cat`` printed rich's help: ANSI escapes (with a colour terminal's
    TERM), boxes, and every line padded with spaces to 80 columns, wrapped there. Piped, help is
    click's plain text: no escape, no box drawing, no trailing padding, long lines whole."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "NO_COLOR", "FORCE_COLOR", "TERM")}
    env["TERM"] = "xterm-256color"  # what a user's terminal sets; the pipe is what matters
    line = " ".join([sys.executable, "-m", "redis_session.cli", *args]) + " | cat"
    r = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert text.startswith("Usage: "), text[:200]
    assert "\x1b" not in text and not any(c in text for c in "╭╮╰╯│─"), text[:400]
    assert not [ln for ln in text.splitlines() if ln != ln.rstrip()], "lines padded with spaces"
    assert "Options:" in text and "-h, --help" in text
    if args == ("gateway", "--help"):  # a long option help stays on its line, not wrapped at 80
        allowed = next(ln for ln in text.splitlines() if ln.lstrip().startswith("--allowed-host"))
        assert len(allowed) > 100 and "$REDIS_SESSION_ALLOWED_HOSTS" in allowed, allowed


@pytest.mark.parametrize("bad", ["abc", "0:x", "-1", "1e400:x"])
async def test_ls_refuses_a_cursor_no_listing_printed(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, bad: str
) -> None:
    """`redis-session ls --cursor abc` listed nothing ("-1": the first page again), exit 0. A cursor
    that is not one `ls` printed is a usage error: exit 2, one line on stderr."""
    await seed(redis_store)
    r = cli("ls", "--cursor", bad, url=redis_url, prefix=prefix)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "cursor" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


async def test_ls_show_doctor_branch(redis_store: RedisSessionStore, redis_url: str, prefix: str) -> None:
    await seed(redis_store)
    r = cli("ls", url=redis_url, prefix=prefix)
    assert r.returncode == 0, r.stderr
    assert "chat-1" in r.stdout and "hello" in r.stdout

    r = cli("show", "chat-1", url=redis_url, prefix=prefix)
    assert r.returncode == 0, r.stderr
    assert "user/message" in r.stdout and "turn/end" in r.stdout

    r = cli("show", "chat-1", "--messages", "--format", "openai", url=redis_url, prefix=prefix)
    assert r.returncode == 0, r.stderr
    msgs = json.loads(r.stdout)
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert msgs[1]["content"] == "Two meetings."

    r = cli("doctor", "chat-1", url=redis_url, prefix=prefix)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 with problems" in r.stdout

    r = cli("branch", "chat-1", "--at", "2", "--id", "chat-1-alt", url=redis_url, prefix=prefix)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "chat-1-alt"
    assert [e.n for e in await redis_store.read("chat-1-alt")] == [0, 1]


async def test_doctor_reports_a_broken_log(redis_store: RedisSessionStore, redis_url: str, prefix: str) -> None:
    await redis_store.create(
        SessionHeader(id="bad"), [NewEntry("turn/start", {"turn": 1}), NewEntry("turn/start", {"turn": 2})]
    )
    r = cli("doctor", "--all", url=redis_url, prefix=prefix)
    assert r.returncode == 1
    assert "bad" in r.stdout and "1 with problems" in r.stdout


async def test_doctor_all_checks_many_sessions_and_reports_in_order(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    """`doctor --all` over more sessions than it checks at once (`DOCTOR_WINDOW`), some broken:
    each is checked once and reported in the listing's order (newest first), the broken ones with
    their problem, the count right."""
    from redis_session.cli.inspection import DOCTOR_WINDOW

    total = DOCTOR_WINDOW + 8
    for i in range(total):
        bad = i % 9 == 0
        turns = [NewEntry("turn/start", {"turn": 1})] + ([NewEntry("turn/start", {"turn": 2})] if bad else [])
        await redis_store.create(SessionHeader(id=f"s{i:03d}"), turns)
    r = cli("doctor", "--all", "--json", url=redis_url, prefix=prefix)
    assert r.returncode == 1, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    listed = [h.id for h in (await redis_store.list(limit=1000)).items]
    assert [x["session"] for x in lines] == listed and len(listed) == total
    assert {x["session"] for x in lines if not x["ok"]} == {f"s{i:03d}" for i in range(0, total, 9)}
    assert f"{total} session(s) checked, {len(range(0, total, 9))} with problems" in r.stderr


async def test_doctor_repair_removes_a_stale_branch_link(
    redis_store: RedisSessionStore, redis_url: str, prefix: str
) -> None:
    from redis_session.keys import index_member

    await seed(redis_store)
    k = redis_store.keys
    # a branch whose process died between link.lua and its create
    await redis_store._eval(
        "link",
        [k.hdr("chat-1"), k.kids("chat-1"), k.log("chat-1"), k.idem("chat-1"), k.proj("chat-1"), k.draft("chat-1")],
        [2, index_member(1_700_000_000_000, "chat-1:branch:dead")],
    )
    r = cli("doctor", "chat-1", url=redis_url, prefix=prefix)
    assert r.returncode == 1 and "stale-link" in r.stdout and "chat-1:branch:dead" in r.stdout
    r = cli("doctor", "--repair", "chat-1", url=redis_url, prefix=prefix)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "removed the stale link" in r.stdout
    assert await redis_store.links("chat-1") == ([], [])


async def test_export_import_round_trip(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    await seed(redis_store)
    out = tmp_path / "chat.jsonl"
    r = cli("export", "chat-1", "-o", str(out), url=redis_url, prefix=prefix)
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 8  # header + 7 entries
    other = prefix + "x"
    r = cli("import", str(out), url=redis_url, prefix=other)
    assert r.returncode == 0, r.stderr
    copy = RedisSessionStore.from_url(redis_url, prefix=other)
    try:
        assert await copy.read("chat-1") == await redis_store.read("chat-1")
        await copy.delete("chat-1")
    finally:
        await copy.aclose()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("show", "ghost"), "not found"),
        (("show", "bad{id}"), "braces"),
        (("branch", "ghost", "--at", "0"), "not found"),
        (("doctor",), "SESSION or --all"),
        (("show", "x", "--format", "yaml"), "--format"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(redis_url: str, prefix: str, args: tuple[str, ...], needle: str) -> None:
    r = cli(*args, url=redis_url, prefix=prefix)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2  # one line (rich may wrap a long one)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("compactor", "--summarizer", "no_such_mod_xq:summarize"), "cannot import module 'no_such_mod_xq'"),
        (("compactor", "--summarizer", "os:no_such_fn"), "'os' has no attribute 'no_such_fn'"),
        (("server", "start", "--port", "99999"), "--port"),
        (("server", "start", "--port", "-1"), "--port"),
        (("up", "--port", "99999"), "--port"),
        (("demo", "--port", "99999", "--duration", "2"), "--port"),
        (("projector", "--metrics-port", "99999"), "--metrics-port"),
        (("compactor", "--metrics-port", "0", "--summarizer", "json:dumps"), "--metrics-port"),
        (("gateway", "--port", "70000"), "--port"),
    ],
)
def test_a_first_day_mistake_is_one_line_never_a_traceback(
    prefix: str, tmp_path: Path, args: tuple[str, ...], needle: str
) -> None:
    """An unimportable summarizer, a missing function, an out-of-range port: each printed a 60-100
    line traceback (`gateway --port 70000` even listened on 4464); now one line naming the cause,
    refused before anything starts (no server is started in the empty data dir)."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "COLUMNS")}
    env["REDIS_SESSION_HOME"] = str(tmp_path / "home")
    cmd = [sys.executable, "-m", "redis_session.cli", *args, "--prefix", prefix]
    if args[0] == "server":
        cmd = cmd[:-2]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert not (tmp_path / "home" / "server.json").exists()


def test_unreachable_server_is_one_line(prefix: str) -> None:
    r = cli("ls", url="redis://127.0.0.1:1/0", prefix=prefix, timeout=60)
    assert r.returncode == 1
    assert "unreachable" in r.stderr and "Traceback" not in r.stderr


def test_malformed_import_file_names_the_line(redis_url: str, prefix: str, tmp_path: Path) -> None:
    f = tmp_path / "broken.jsonl"
    f.write_text('{"_type":"metadata","key":"tg:1","metadata":{}}\n{"role":"user","content":"hi"}\n{not json\n')
    r = cli("import", str(f), url=redis_url, prefix=prefix)
    assert r.returncode == 1
    assert "broken.jsonl:3" in r.stderr and "Traceback" not in r.stderr
    r = cli("ls", url=redis_url, prefix=prefix)
    assert "tg:1" not in r.stdout


def test_server_start_status_stop(tmp_path: Path) -> None:
    d = tmp_path / "data"
    r = cli("server", "status", "--data-dir", str(d))
    assert r.returncode == 1 and "not running" in r.stdout
    r = cli("server", "start", "--data-dir", str(d))
    assert r.returncode == 0, r.stderr
    url = r.stdout.strip()
    assert url.startswith("redis://127.0.0.1:")
    try:
        again = cli("server", "start", "--data-dir", str(d))
        assert again.stdout.strip() == url  # attaches, never a second server
        r = cli("server", "status", "--data-dir", str(d))
        assert r.returncode == 0 and url in r.stdout
    finally:
        r = cli("server", "stop", "--data-dir", str(d))
    assert r.returncode == 0
    assert cli("server", "status", "--data-dir", str(d)).returncode == 1


def test_demo_runs_on_the_embedded_server_and_leaves_consistent_sessions(tmp_path: Path) -> None:
    """The quick start's main job, on a fresh embedded server in an empty folder."""
    try:
        local = ("--dir", ".redis-session")  # a project-local server (the default is the user's)
        r = cli(*local, "demo", "--duration", "3", "--pods", "2", "--port", "0", "--quiet", cwd=tmp_path, timeout=180)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "doctor                clean" in r.stdout
        assert "conflicts retried" in r.stdout
        assert (tmp_path / ".redis-session" / "server.json").exists()
        r = cli(*local, "doctor", "--all", "--prefix", "demo", cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        checked = int(r.stdout.strip().splitlines()[-1].split()[0])
        assert checked >= 5
    finally:
        cli("server", "stop", "--data-dir", str(tmp_path / ".redis-session"))


def test_piped_demo_prints_each_entry_whole_in_log_order(tmp_path: Path) -> None:
    """`demo | cat` printed a streamed answer before the question it answers, split around other
    entries, two answers glued on one line. Piped, each session block is whole entries in log
    order: every line `#n …`, n increasing, the first user message before any answer."""
    try:
        local = ("--dir", ".redis-session")
        r = cli(*local, "demo", "--duration", "3", "--pods", "1", "--port", "0", cwd=tmp_path, timeout=180)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    finally:
        cli("server", "stop", "--data-dir", str(tmp_path / ".redis-session"))
    blocks: list[list[str]] = []
    for line in r.stdout.split("summary")[0].splitlines():
        if line.startswith("─"):
            blocks.append([])
        elif blocks and line.strip():
            blocks[-1].append(line)
    assert any(blocks), r.stdout
    for block in filter(None, blocks):  # (a session begun at the deadline has no turn)
        assert all(line.startswith("#") for line in block), block
        ns = [int(line[1:].split()[0]) for line in block]
        assert ns == sorted(set(ns)), block
        roles = [line.split()[1] for line in block]
        assert roles[0] == "user", block  # the question, then its answer
        answers = [line for line in block if line.split()[1] == "assistant"]
        assert all(line.count("#") <= 2 for line in answers)  # never two answers glued on one line


def _nanobot_file(path: Path, key: str, *, broken: bool = False) -> None:
    rows = [
        json.dumps({"_type": "metadata", "key": key, "metadata": {}}),
        json.dumps({"role": "user", "content": "hi", "timestamp": "2026-01-01T00:00:00"}),
    ]
    path.write_text("\n".join(rows) + ("\n{torn\n" if broken else "\n"), encoding="utf-8")


def test_import_folder_stops_or_keeps_going(redis_url: str, prefix: str, tmp_path: Path) -> None:
    folder = tmp_path / "sessions"
    folder.mkdir()
    _nanobot_file(folder / "a.jsonl", "tg:a")
    _nanobot_file(folder / "b.jsonl", "tg:b", broken=True)
    _nanobot_file(folder / "c.jsonl", "tg:c")
    _nanobot_file(folder / "d.jsonl", "tg:d", broken=True)
    r = cli("import", str(folder), url=redis_url, prefix=prefix)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "imported tg:a" in r.stdout and "tg:c" not in r.stdout
    assert "b.jsonl:3: invalid JSON" in r.stderr and "imported before it: a.jsonl" in r.stderr
    assert "--keep-going" in r.stderr
    r = cli("import", str(folder), "--keep-going", "--on-exists", "skip", url=redis_url, prefix=prefix)
    assert r.returncode == 1
    assert "skipped tg:a" in r.stdout and "imported tg:c" in r.stdout
    assert "2 file(s) imported, 2 failed:" in r.stderr
    assert "b.jsonl:3: invalid JSON" in r.stderr and "d.jsonl:3: invalid JSON" in r.stderr
    r = cli("import", str(folder / "a.jsonl"), url=redis_url, prefix=prefix)
    assert r.returncode == 1 and "--on-exists skip or --on-exists replace" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = cli("import", str(empty), url=redis_url, prefix=prefix)
    assert r.returncode == 1 and "no .jsonl or .jsonl.zstd files in this folder" in r.stderr


def test_import_dsh_reports_the_repair_export_formats_and_repair(redis_url: str, prefix: str, tmp_path: Path) -> None:
    crashed = Path(__file__).parent / "fixtures" / "seed" / "dsh" / "dsh-main.crashed.jsonl"
    r = cli("import", str(crashed), "--json", url=redis_url, prefix=prefix)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["entries"] == 49 and len(doc["repaired"]) == 2  # 50 events, two chunks packed in one row
    for fmt in ("dsh", "nanobot", "tutorial", "redis-session"):
        out = tmp_path / f"back.{fmt}.jsonl"
        r = cli("export", "dsh-main", "-o", str(out), "--format", fmt, url=redis_url, prefix=prefix)
        assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "back.dsh.jsonl").read_text().splitlines()[0])["type"] == "session"
    assert json.loads((tmp_path / "back.nanobot.jsonl").read_text().splitlines()[0])["_type"] == "metadata"
    r = cli("repair", "dsh-main", url=redis_url, prefix=prefix)
    assert r.returncode == 0 and "nothing to repair in dsh-main" in r.stdout


async def test_repair_closes_an_open_turn(redis_store: RedisSessionStore, redis_url: str, prefix: str) -> None:
    await redis_store.create(
        SessionHeader(id="crashed"),
        [
            NewEntry("turn/start", {"turn": 1}),
            NewEntry("user/message", {"content": "go"}),
            NewEntry("step/start", {"turn": 1, "step": 1}),
        ],
    )
    r = cli("repair", "crashed", url=redis_url, prefix=prefix)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "repaired crashed: appended 2 entries (step/end, turn/end)"
    assert [e.type for e in await redis_store.read("crashed")][-2:] == ["step/end", "turn/end"]


@pytest.mark.parametrize("args", [("show", "chat-1", "--start"), ("tail", "chat-1", "--from")])
async def test_an_n_beyond_any_log_is_an_option_error_not_a_redis_one(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, args: tuple[str, ...]
) -> None:
    # `--start 99999999999999999999` reached Redis ("Invalid stream ID ..."), exit 1
    await seed(redis_store)
    r = cli(*args, "99999999999999999999", url=redis_url, prefix=prefix, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Invalid value for" in r.stderr and "stream ID" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args",
    [
        ("projector", "--status", "--batch"),
        ("projector", "--status", "--concurrency"),
        ("projector", "--status", "--lock-ms"),
        ("compactor", "--status", "--claim-idle-ms"),
        ("compactor", "--status", "--concurrency"),
        ("compactor", "--status", "--budget"),
    ],
)
def test_worker_options_beyond_any_use_are_option_errors(redis_url: str, prefix: str, args: tuple[str, ...]) -> None:
    # they were taken (and with --status ignored), or failed at the worker's first read
    r = cli(*args, "100000000000000000000", url=redis_url, prefix=prefix, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert f"Invalid value for '{args[-1]}'" in r.stderr and "Traceback" not in r.stderr


async def test_wrong_type_handle_arguments_are_typed_errors_nothing_written(redis_store: RedisSessionStore) -> None:
    from redis_session import InvalidArgumentError, Sessions

    await seed(redis_store)
    s = await Sessions(redis_store).open("chat-1")
    n = s.n
    for call in (
        lambda: s.lease(ttl=None),  # type: ignore[arg-type]
        lambda: s.lease(ttl=0),
        lambda: s.lease(ttl=True),
    ):
        with pytest.raises(InvalidArgumentError):
            call()
    for kw in ({"max_messages": "3"}, {"max_messages": -1}, {"max_tokens": "a"}, {"max_tokens": 1.5}):
        with pytest.raises(InvalidArgumentError):
            await s.history(**kw)  # type: ignore[arg-type]
    assert len(await s.history(max_messages=0)) >= 1  # never empty while there is a user message
    assert (await redis_store.head("chat-1")).n == n  # type: ignore[union-attr]


async def test_reads_and_tails_refuse_an_n_beyond_any_log_before_asking_redis(redis_store: RedisSessionStore) -> None:
    from redis_session import InvalidArgumentError, SessionError

    await seed(redis_store)
    for bad in (10**20, 2**53, -1):
        with pytest.raises(InvalidArgumentError) as refused:
            await redis_store.read("chat-1", bad)
        assert isinstance(refused.value, SessionError) and isinstance(refused.value, ValueError)
        with pytest.raises(InvalidArgumentError):
            async for _ in redis_store.tail("chat-1", bad):
                pass
        with pytest.raises(InvalidArgumentError):
            await redis_store.read("chat-1", 0, bad)
    assert [e.n for e in await redis_store.read("chat-1", 5)] == [5, 6]


# the console script pip writes for `redis-session`, plus an import hook that sends this process a
# SIGINT the moment `redis_session.live` starts importing: a Ctrl-C halfway through the imports,
# on an event rather than after a guessed delay
_INTERRUPTED_COMMAND = """\
import os, signal, sys
from importlib.abc import MetaPathFinder

# what the test's diagnosis needs should the Ctrl-C be lost: how this process started
print("sigint:", signal.getsignal(signal.SIGINT), "blocked:", signal.pthread_sigmask(signal.SIG_BLOCK, []),
      file=sys.stderr, flush=True)

class Interrupt(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "redis_session.live":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupt())
from redis_session.cli import main
if __name__ == "__main__":
    sys.exit(main())
"""


_HOOK_ONLY = "sys.meta_path.insert(0, Interrupt())\n"


def test_ctrl_c_while_the_command_imports_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """A Ctrl-C in the first half second of `redis-session …` (the package's imports, before any
    of the CLI's code runs) printed a KeyboardInterrupt traceback from an import and died of the
    signal (-2). It exits 130 (128 + SIGINT), quietly."""
    script = tmp_path / "redis-session"  # argv[0] is the command's name, as for the installed script
    script.write_text(_INTERRUPTED_COMMAND)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    r = _run_as_from_a_shell([sys.executable, str(script), "gateway", "--workers", "2"], env)
    assert r.returncode == 130, (r.returncode, r.stderr[-800:])
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr[-800:]
    # the same as `python -m redis_session.cli` (the hook comes from a sitecustomize: while the
    # package imports, argv[0] is "-m"); this printed a KeyboardInterrupt traceback
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_INTERRUPTED_COMMAND.split("sys.meta_path.insert")[0] + _HOOK_ONLY)
    r = _run_as_from_a_shell(
        [sys.executable, "-m", "redis_session.cli", "gateway", "--workers", "2"], {**env, "PYTHONPATH": str(hook)}
    )
    assert r.returncode == 130, (r.returncode, r.stderr[-800:])
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr[-800:]
    # a program that only imports the library keeps Python's own Ctrl-C (a KeyboardInterrupt)
    lib = tmp_path / "app.py"
    lib.write_text(
        _INTERRUPTED_COMMAND.replace("from redis_session.cli import main", "import redis_session; main = None")
    )
    r = _run_as_from_a_shell([sys.executable, str(lib)], env)
    assert r.returncode == -signal.SIGINT and "KeyboardInterrupt" in r.stderr, (r.returncode, r.stderr[-300:])


def _shell_signals() -> None:
    # what a shell gives a command it starts: SIGINT at its default and unblocked, whatever the
    # test process's threads had when it forked
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _run_as_from_a_shell(cmd: list[str], env: dict[str, str]) -> Any:
    """`cmd` in a session of its own (its process group is killed when it outlives the deadline,
    servers and workers it started included), its stderr in the failure when it does."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        preexec_fn=_shell_signals,
    )  # fmt: skip
    try:
        out, errs = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, errs = proc.communicate()
        raise AssertionError(f"the command did not stop on its Ctrl-C within 120 s: {errs[-1500:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, errs)


def test_ctrl_c_while_the_gateway_workers_start_exits_0(redis_url: str, prefix: str) -> None:
    """Ctrl-C just after `gateway --workers 2` forked its workers, while they were still starting
    (before that it is a Ctrl-C before serving: 130): a worker that took the passed-on SIGTERM
    before its server handled it died of it,
    and the command exited 143. That is the stop asked for: exit 0, no traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "redis_session.cli", "gateway", "--url", redis_url, "--prefix", prefix,
           "--port", str(port), "--workers", "2"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_SESSION_TOKEN")}
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, start_new_session=True
    )
    try:
        assert proc.stderr is not None
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        deadline = time.monotonic() + 60
        while len(children.read_text().split()) < 2:  # both forked: from here on a Ctrl-C is a stop
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-800:]
            time.sleep(0.001)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole process group
        _, rest = proc.communicate(timeout=60)
        assert proc.returncode == 0, (proc.returncode, rest[-800:])
        assert "Traceback" not in rest, rest[-800:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("edit", ["header not a hash", "n not a number"])
async def test_ls_and_doctor_all_go_on_past_an_unreadable_header(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, edit: str
) -> None:
    """One header edited outside redis-session made `ls` and `doctor --all` exit on the
    corruption error, listing and checking nothing: an operator could not find the others, nor
    which one was broken. `ls` lists the others and names that one on stderr; `doctor --all`
    checks every one and reports that one's header."""
    import redis.asyncio as aioredis

    for sid in ("a", "b", "c"):
        await redis_store.create(SessionHeader(id=sid), [NewEntry("user/message", {"content": "x"})])
    raw = aioredis.Redis.from_url(redis_url)
    try:
        if edit == "header not a hash":
            await raw.delete(redis_store.keys.hdr("b"))
            await raw.set(redis_store.keys.hdr("b"), "oops")
        else:
            await raw.hset(redis_store.keys.hdr("b"), "n", "twelve")
    finally:
        await raw.aclose()
    r = cli("ls", url=redis_url, prefix=prefix)
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines()[1:]] == ["c", "a"]
    assert "'b'" in r.stderr and "cannot be read" in r.stderr and "redis-session doctor b" in r.stderr
    r = cli("ls", "--json", url=redis_url, prefix=prefix)
    assert [json.loads(line)["id"] for line in r.stdout.splitlines()] == ["c", "a"]
    r = cli("doctor", "--all", "--json", url=redis_url, prefix=prefix)
    assert r.returncode == 1, r.stderr
    reports = {x["session"]: x for x in map(json.loads, r.stdout.splitlines())}
    assert set(reports) == {"a", "b", "c"} and reports["a"]["ok"] and reports["c"]["ok"]
    assert [p["code"] for p in reports["b"]["problems"]] == ["header"]
    assert "3 session(s) checked, 1 with problems" in r.stderr
