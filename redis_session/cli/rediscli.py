"""`redis-session cli`: redis-cli against the current server, or a built-in stand-in.

The embedded server ships no ``redis-cli``; the built-in client runs a command with redis-py and
prints the reply the way redis-cli does: on a terminal ``1) "a"`` / ``(integer) 3`` / ``(nil)``,
piped the raw values one per line (``--raw`` and ``--no-raw`` choose, as in redis-cli).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from typing import Any

_STATUS = {b"OK", b"PONG", b"QUEUED"}  # replies redis-cli prints unquoted (status replies)
_ESCAPES = {0x5C: "\\\\", 0x22: '\\"', 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t", 0x07: "\\a", 0x08: "\\b"}


def find_redis_cli() -> str | None:
    for name in ("redis-cli", "valkey-cli"):
        found = shutil.which(name)
        if found:
            return found
    return None


def run_external(url: str, args: list[str]) -> int | None:
    """Run redis-cli (or valkey-cli) on `url`; its exit code, or None when neither is installed."""
    binary = find_redis_cli()
    if binary is None:
        return None
    return subprocess.call([binary, "-u", url, *args])


def quote(value: bytes) -> str:
    """A bulk string as redis-cli shows it: quoted, with C escapes and ``\\xNN`` for other bytes."""
    parts = ['"']
    for b in value:
        if b in _ESCAPES:
            parts.append(_ESCAPES[b])
        elif 0x20 <= b < 0x7F:
            parts.append(chr(b))
        else:
            parts.append(f"\\x{b:02x}")
    parts.append('"')
    return "".join(parts)


def format_reply(reply: Any, *, top: bool = True) -> list[str]:
    """Lines of a reply in redis-cli's terminal format."""
    if isinstance(reply, Exception):
        return [f"(error) {reply}"]
    if reply is None:
        return ["(nil)"]
    if isinstance(reply, bool):
        return ["OK" if reply else "(nil)"]
    if isinstance(reply, int):
        return [f"(integer) {reply}"]
    if isinstance(reply, float):
        return [f"(double) {reply}"]
    if isinstance(reply, str):
        reply = reply.encode()
    if isinstance(reply, bytes):
        return [reply.decode() if top and reply in _STATUS else quote(reply)]
    if isinstance(reply, dict):
        reply = [x for kv in reply.items() for x in kv]
    if isinstance(reply, list | tuple | set):
        items = list(reply)
        if not items:
            return ["(empty array)"]
        width = len(str(len(items)))
        lines: list[str] = []
        for i, item in enumerate(items, 1):
            prefix = f"{i:>{width}}) "
            sub = format_reply(item, top=False)
            lines.append(prefix + sub[0])
            lines += [" " * len(prefix) + line for line in sub[1:]]
        return lines
    return [str(reply)]


def format_raw(reply: Any) -> list[str]:
    """Lines of a reply in redis-cli's ``--raw`` format (what it prints when piped)."""
    if isinstance(reply, Exception):
        return [str(reply)]
    if reply is None:
        return [""]
    if isinstance(reply, bytes):
        return [reply.decode(errors="replace")]
    if isinstance(reply, dict):
        reply = [x for kv in reply.items() for x in kv]
    if isinstance(reply, list | tuple | set):
        return [line for item in reply for line in format_raw(item)]
    return [str(reply)]


def _client(url: str) -> Any:
    import redis

    from ..redis.wire import plain_replies

    # replies as the server sent them, not redis-py's Python shapes
    return plain_replies(redis.Redis.from_url(url, decode_responses=False))


def _execute(client: Any, argv: list[str], raw: bool) -> int:
    import redis

    code = 0
    try:
        reply: Any = client.execute_command(*argv)
    except redis.ResponseError as e:
        reply, code = e, 1
    lines = format_raw(reply) if raw else format_reply(reply)
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()
    return code


def run_builtin(url: str, args: list[str]) -> int:
    """Run one command (or, without one, a prompt reading commands from stdin) on `url`."""
    import redis

    raw = not sys.stdout.isatty()
    while args and args[0] in ("--raw", "--no-raw"):
        raw = args.pop(0) == "--raw"
    client = _client(url)
    try:
        if args:
            return _execute(client, args, raw)
        return _repl(client, url, raw)
    except redis.ConnectionError as e:
        print(f"Could not connect to {url}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _repl(client: Any, url: str, raw: bool) -> int:
    interactive = sys.stdin.isatty()
    host = url.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    code = 0
    while True:
        try:
            line = input(f"{host}> " if interactive else "")
        except EOFError:
            return code
        try:
            argv = shlex.split(line)
        except ValueError as e:
            print(f"Invalid argument(s): {e}", file=sys.stderr)
            continue
        if not argv:
            continue
        if argv[0].lower() in ("quit", "exit"):
            return code
        code = _execute(client, argv, raw) or code
