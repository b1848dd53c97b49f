"""Bad input on the command line: a clear one-line error, a non-zero exit and nothing written.

Each test runs `redis-session` as a user does (a subprocess, `test_cli.cli`) against a real server,
and checks the keys of its prefix (or the database) before and after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis.asyncio as aioredis
import zstandard
from test_cli import cli

from redis_session import NewEntry, RedisSessionStore, SessionHeader
from redis_session.archiver import Archiver
from redis_session.cold import ColdTier

pytestmark = pytest.mark.anyio


def um(text: str) -> NewEntry:
    return NewEntry("user/message", {"content": text})


async def keys_of(r: aioredis.Redis, prefix: str) -> list[str]:
    return sorted([k async for k in r.scan_iter(match=f"{prefix}:*", count=1000)])


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


# --------------------------------------------------------------------------- archive / restore


async def test_a_refused_restore_writes_nothing_and_the_first_archive_goes_where_asked(
    redis_store: RedisSessionStore, raw_redis: aioredis.Redis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """`restore <unknown id>` was refused but recorded the default cold URL (`<prefix>:cold:url`,
    `:cold:store`), so the operator's first real archive, to another URL, was then refused too
    (with a hint naming a Python argument the CLI has not). A restore that is refused, or has
    nothing to do, writes nothing; a refused archive to another URL writes nothing there either,
    and says what a CLI user can do."""
    await redis_store.create(SessionHeader(id="s1"), [um("a"), um("b")])
    before = await keys_of(raw_redis, prefix)
    r = cli("restore", "no-such", url=redis_url, prefix=prefix)
    assert r.returncode == 1 and r.stderr.strip() == "error: session 'no-such' not found", r.stderr
    r = cli("restore", "s1", url=redis_url, prefix=prefix)  # nothing archived: nothing to bring back
    assert r.returncode == 0 and r.stdout.strip() == "s1: nothing [0, 0)", r.stderr
    assert await keys_of(raw_redis, prefix) == before  # no cold:url, no cold:store

    r = cli("archive", "s1", "--to", str(tmp_path / "x"), "--json", url=redis_url, prefix=prefix)
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "archived", r.stderr
    recorded = await raw_redis.get(f"{prefix}:cold:url")
    assert recorded == (tmp_path / "x").as_uri()

    r = cli("archive", "s1", "--to", str(tmp_path / "y"), url=redis_url, prefix=prefix)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cold segments live in" in r.stderr and "archive without --to" in r.stderr
    assert f"redis-session cli SET {prefix}:cold:url" in r.stderr
    assert files_under(tmp_path / "y") == []  # not even the store-id claim
    assert await raw_redis.get(f"{prefix}:cold:url") == recorded


@pytest.mark.parametrize("extra", [(), ("--to", "TMP"), ("--json",), ("--min-entries", "5")])
async def test_archive_of_an_unknown_session_is_not_found_and_writes_nothing(
    redis_store: RedisSessionStore,
    raw_redis: aioredis.Redis,
    redis_url: str,
    prefix: str,
    tmp_path: Path,
    extra: tuple[str, ...],
) -> None:
    """`archive no-such-id` printed "no-such-id: absent [0, 0) 0 B", exit 0, and recorded the
    prefix's cold tier (a mistyped id pinned the default URL). It is `show`'s error now."""
    await redis_store.create(SessionHeader(id="s1"), [um("a")])
    before = await keys_of(raw_redis, prefix)
    args = [str(tmp_path / "cold") if a == "TMP" else a for a in extra]
    r = cli("archive", "no-such-id", *args, url=redis_url, prefix=prefix)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and r.stderr.strip() == "error: session 'no-such-id' not found"
    assert await keys_of(raw_redis, prefix) == before
    assert files_under(tmp_path / "cold") == []


async def test_archiver_in_code_records_nothing_for_an_unknown_session(
    redis_store: RedisSessionStore, raw_redis: aioredis.Redis, prefix: str, tmp_path: Path
) -> None:
    """The root of the two above: `Archiver.archive` claimed and recorded its tier before it
    looked at the session."""
    archiver = Archiver(redis_store, ColdTier(str(tmp_path / "cold")))
    assert (await archiver.archive("no-such-id")).status == "absent"
    assert await keys_of(raw_redis, prefix) == []
    assert files_under(tmp_path / "cold") == []


# --------------------------------------------------------------------------- --url


@pytest.mark.parametrize("db", ["/abc", "/1x", "/3.5", "/-1", "/%31x", "/1/2"])
async def test_a_url_whose_database_is_no_integer_is_refused_not_database_0(
    redis_url: str, prefix: str, tmp_path: Path, db: str
) -> None:
    """redis-py ignores a database part that is no integer: `--url redis://host:port/abc` wrote
    into database 0. It is refused (exit 1, as the CLI answers `/99`), nothing written anywhere."""
    parts = urlsplit(redis_url)
    bad = urlunsplit((parts.scheme, parts.netloc, db, "", ""))
    path = tmp_path / "s.jsonl"
    path.write_text(
        json.dumps({"_type": "redis-session", "version": 1, "header": {"id": "u1"}, "n": 1})
        + "\n"
        + json.dumps({"n": 0, "time": 1, "type": "user/message", "data": {"content": "hi"}})
        + "\n"
    )
    db0 = aioredis.Redis.from_url(urlunsplit((parts.scheme, parts.netloc, "/0", "", "")))
    try:
        for args in (("import", str(path)), ("ls",)):
            r = cli(*args, url=bad, prefix=prefix)
            assert r.returncode == 1, (args, r.returncode, r.stdout, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
            assert f"the database part {db!r} is not a non-negative integer" in r.stderr
            assert r.stdout == ""
            assert await keys_of(db0, prefix) == []
        r = cli("ls", url=redis_url, prefix=prefix)  # the URL it was meant to be still works
        assert r.returncode == 0, r.stderr
    finally:
        await db0.aclose()


# --------------------------------------------------------------------------- contradictory options


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("show", "chat-1", "--start", "5", "--stop", "1"), "stop (1) is before start (5)"),
        (("show", "chat-1", "--format", "openai"), "'--format': goes with --messages"),
        (("show", "chat-1", "--format", "json", "--json"), "'--format': goes with --messages"),
        (("show", "chat-1", "--messages", "--start", "2"), "with --messages the whole projection is shown"),
    ],
)
async def test_contradictory_show_options_are_usage_errors(
    redis_store: RedisSessionStore, redis_url: str, prefix: str, args: tuple[str, ...], says: str
) -> None:
    """`show ID --start 5 --stop 1` printed the header and no entry, exit 0 (the gateway answers
    400); `--format` without `--messages` was ignored. Both are usage errors: exit 2, one line."""
    await redis_store.create(SessionHeader(id="chat-1"), [um(str(i)) for i in range(8)])
    r = cli(*args, url=redis_url, prefix=prefix)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr
    # what they meant still works
    r = cli("show", "chat-1", "--start", "1", "--stop", "5", "--json", url=redis_url, prefix=prefix)
    assert r.returncode == 0 and [json.loads(x)["n"] for x in r.stdout.splitlines()[1:]] == [1, 2, 3, 4]
    r = cli("show", "chat-1", "--start", "3", "--stop", "3", "--json", url=redis_url, prefix=prefix)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1  # an empty range: the header alone
    r = cli("show", "chat-1", "--messages", "--format", "openai", "--json", url=redis_url, prefix=prefix)
    assert r.returncode == 0 and json.loads(r.stdout)[0]["role"] == "user", r.stderr


@pytest.mark.parametrize("args", [("--version", "extra-arg"), ("-V", "x"), ("--version", "ls")])
def test_version_with_an_argument_is_a_usage_error(args: tuple[str, ...]) -> None:
    r = cli(*args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("redis-session "), r.stderr
    r = cli("--dir", "somewhere")  # options without a command: click's own usage error, as before
    assert r.returncode == 2 and "Missing command" in r.stderr


# --------------------------------------------------------------------------- import: memory


_MEASURED = """\
import resource, subprocess, sys
rc = subprocess.run(sys.argv[2:]).returncode
with open(sys.argv[1], "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc)
"""


def measured_import(path: Path, redis_url: str, prefix: str, tmp_path: Path) -> tuple[Any, int]:
    """`redis-session import PATH` as a user runs it; its result and its peak RSS (KiB)."""
    report = tmp_path / f"rss-{path.name}"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    cmd = [sys.executable, "-c", _MEASURED, str(report), sys.executable, "-m", "redis_session.cli", "import",
           str(path), "--url", redis_url, "--prefix", prefix]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    return r, int(report.read_text())


def zstd_file(path: Path, head: bytes, filler: bytes, repeat: int) -> Path:
    """`head`, then `filler` `repeat` times, as one zstd frame (a few KB for hundreds of MB)."""
    c = zstandard.ZstdCompressor(level=3).compressobj()
    parts = [c.compress(head)]
    parts += [c.compress(filler) for _ in range(repeat)]
    parts.append(c.flush())
    path.write_bytes(b"".join(parts))
    return path


def native_head(sid: str) -> bytes:
    return (
        json.dumps({"_type": "redis-session", "version": 1, "header": {"id": sid}, "n": 1})
        + "\n"
        + json.dumps({"n": 0, "time": 1, "type": "user/message", "data": {"content": "hi"}})
        + "\n"
    ).encode()


async def test_import_reads_a_file_as_a_stream_in_bounded_memory(
    redis_store: RedisSessionStore, raw_redis: aioredis.Redis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """The importer read the whole decompressed file, and a `Line` per blank line, into memory:
    a 32 KB `.jsonl.zstd` of blanks took 2 GB, and under a memory cap ended in a MemoryError
    traceback. Read as a stream, blank lines are counted, never kept; a line longer than any
    entry is refused at the line limit, naming its file and line, nothing written."""
    tiny = zstd_file(tmp_path / "tiny.jsonl.zstd", native_head("tiny"), b"", 0)
    r, base = measured_import(tiny, redis_url, prefix, tmp_path)
    assert r.returncode == 0 and "imported tiny" in r.stdout, r.stderr

    # 2 million blank lines after the entry: imported, in the memory of the tiny file
    blanks = zstd_file(tmp_path / "blanks.jsonl.zstd", native_head("blanks"), b"\n" * 1000, 2000)
    r, peak = measured_import(blanks, redis_url, prefix, tmp_path)
    assert r.returncode == 0 and "imported blanks (1 entries" in r.stdout, r.stderr
    assert peak - base < 64 << 10, f"{(peak - base) >> 10} MiB more than a one-entry file"
    assert [e.data for e in await redis_store.read("blanks")] == [{"content": "hi"}]

    # 256 MiB of spaces on one line (the attacker's zip bomb, a few KB compressed): refused
    keys = await keys_of(raw_redis, prefix)
    bomb = zstd_file(tmp_path / "bomb.jsonl.zstd", native_head("bomb"), b" " * (1 << 20), 256)
    r, peak = measured_import(bomb, redis_url, prefix, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and f"{bomb}:3: the line is over " in r.stderr, r.stderr
    assert peak - base < 64 << 10, f"{(peak - base) >> 10} MiB more than a one-entry file"
    assert await keys_of(raw_redis, prefix) == keys
