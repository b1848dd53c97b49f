"""The embedded server's commands (`server start`, `stop`, `status`) and `cli`: redis-cli against
the current server."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import PORT_RANGE, DirOpt, JsonOpt, UrlOpt, announce, app, emit_json, out, server_app


@server_app.command("start")
def server_start(
    data_dir: DirOpt = None,
    port: Annotated[
        int | None,
        typer.Option(
            **PORT_RANGE, help="Port (0: any free one; default: $REDIS_SESSION_PORT, else 6390; a free one if taken)."
        ),
    ] = None,
) -> None:
    """Start (or find) the embedded server and print its URL."""
    from ..redis.embedded import ensure_server

    server = ensure_server(data_dir, port=port)
    if server.note:
        announce(server.note)
    if server.started:
        announce(f"started the embedded server at {server.url}, data in {server.data_dir}")
    out.print(server.url, highlight=False)


@server_app.command("stop")
def server_stop(data_dir: DirOpt = None) -> None:
    """Stop the embedded server."""
    from ..redis.embedded import default_data_dir, stop_server

    if not stop_server(data_dir):  # already stopped: what was asked holds, so exit 0 (as `systemctl stop`)
        where = (data_dir or default_data_dir()).expanduser().resolve()
        out.print(f"not running (data dir {where})", highlight=False)
        return
    out.print("stopped")


@server_app.command("status")
def server_status(data_dir: DirOpt = None, as_json: JsonOpt = False) -> None:
    """The embedded server's URL, data dir, pid and memory. Exit 1 if it is not running."""
    from ..redis.embedded import default_data_dir, running_server, server_info

    found = running_server(data_dir)
    if found is None:
        where = (data_dir or default_data_dir()).expanduser().resolve()
        if as_json:
            emit_json({"running": False, "data_dir": str(where)})
        else:
            out.print(f"not running (data dir {where})", highlight=False)
        raise typer.Exit(1)
    info = server_info(found)
    status = {
        "running": True,
        "url": found.url,
        "data_dir": str(found.data_dir),
        "pid": found.pid,
        "memory": info.get("used_memory_human", "?"),
        "memory_peak": info.get("used_memory_peak_human", "?"),
        "version": info.get("valkey_version") or info.get("redis_version") or "?",
        "uptime_s": int(info.get("uptime_in_seconds", "0") or 0),
        "keys": info.get("db0", "keys=0").split(",")[0].removeprefix("keys="),
    }
    if as_json:
        emit_json(status)
        return
    out.print(f"running   {found.url}", highlight=False)
    out.print(f"data dir  {found.data_dir}", highlight=False)
    out.print(f"pid       {found.pid}", highlight=False)
    out.print(f"memory    {status['memory']} (peak {status['memory_peak']})", highlight=False)
    out.print(f"server    valkey {status['version']}, up {status['uptime_s']}s, {status['keys']} keys", highlight=False)


@app.command(
    "cli",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
)
def cli_cmd(
    args: Annotated[list[str] | None, typer.Argument(help="A command and its arguments, as for redis-cli.")] = None,
    url: UrlOpt = None,
    builtin: Annotated[
        bool, typer.Option("--builtin", help="Use the built-in client even when redis-cli is installed.")
    ] = False,
) -> None:
    """Run redis-cli against the current server (`redis-session cli HGETALL 'rs:{chat-1}:hdr'`).

    Uses redis-cli or valkey-cli when installed, else a built-in client that runs the command and
    prints the reply the way redis-cli does. With no command: an interactive prompt."""
    from ..redis.connect import resolve_url
    from .rediscli import run_builtin, run_external

    target = resolve_url(url, announce=announce)
    argv = list(args or [])
    code = None if builtin else run_external(target, argv)
    if code is None:
        code = run_builtin(target, argv)
    if code:
        raise typer.Exit(code)
