"""The commands that write: `branch`, `import`, `repair`; and `export`, `import`'s way back."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ..checks import MAX_N
from .common import (
    CliError,
    JsonOpt,
    PrefixOpt,
    UrlOpt,
    app,
    emit_json,
    err,
    open_sessions,
    opened,
    out,
    progress_bar,
    run,
)


@app.command("branch")
def branch_cmd(
    session: str,
    at: Annotated[int, typer.Option("--at", min=0, max=MAX_N, help="Branch point: the child holds entries [0, at).")],
    branch_id: Annotated[str | None, typer.Option("--id", help="Id of the new branch.")] = None,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
) -> None:
    """Branch a session at entry AT (costs the same for any parent length)."""

    async def main() -> None:
        sessions = open_sessions(url, prefix)
        try:
            b = await sessions.branch(session, at, branch_id=branch_id)
            out.print(b.id)
        finally:
            await sessions.aclose()

    run(main)


@app.command("export")
def export_cmd(
    session: str,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="File (default: stdout).")] = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="redis-session (ours: every entry) | nanobot | dsh | tutorial (that system's own file, "
            "for its own loader)",
        ),
    ] = "redis-session",
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    as_json: JsonOpt = False,
) -> None:
    """Export a session as JSONL: ours (header line, then one entry per line), or the file nanobot,
    dsh or the tutorial harness would have written for it."""

    async def main() -> int:
        from ..importers import export_session

        async with opened(url, prefix) as store:
            if output is None:
                return await export_session(store, session, sys.stdout, format=fmt)
            return await export_session(store, session, output, format=fmt)

    n = run(main)
    if output is None:
        return
    if as_json:
        emit_json({"session": session, "entries": n, "output": str(output)})
    else:
        err.print(f"exported {n} entries to {output} ({fmt})", highlight=False, markup=False)


@app.command("import")
def import_cmd(
    path: Annotated[
        Path, typer.Argument(help="A JSONL file (.jsonl or .jsonl.zstd) or a folder of them (nanobot sessions/).")
    ],
    fmt: Annotated[str, typer.Option("--format", help="auto | redis-session | nanobot | dsh | tutorial")] = "auto",
    session_id: Annotated[str | None, typer.Option("--id", help="Import under this id (single file).")] = None,
    on_exists: Annotated[str, typer.Option("--on-exists", help="When the id exists: error | skip | replace")] = "error",
    keep_going: Annotated[
        bool,
        typer.Option(
            "--keep-going", help="Import every good file of a folder; list the bad ones at the end (exit 1 if any)."
        ),
    ] = False,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    as_json: JsonOpt = False,
) -> None:
    """Import sessions: our JSONL, nanobot session files, dsh logs (.jsonl or .jsonl.zstd), or the
    tutorial's JSONL. Each file is all or nothing. A folder stops at the first bad file (the files
    before it stay imported) unless --keep-going."""
    if not path.exists():
        raise CliError(f"{path}: no such file or folder")

    async def main() -> list[Any]:
        from ..importers import import_path

        async with opened(url, prefix) as store:
            with progress_bar(f"importing {path.name}") as on_progress:
                return list(
                    await import_path(
                        store,
                        path,
                        format=fmt,
                        session_id=session_id,
                        progress=on_progress,
                        on_exists=on_exists,
                        errors="collect" if keep_going else "stop",
                    )
                )

    results = run(main)
    failed = [r for r in results if r.status == "failed"]
    for r in results:
        if r.status != "failed":
            _print_result(r, as_json)
    if not failed:
        return
    if as_json:
        for r in failed:
            _print_result(r, as_json)
    if keep_going:
        good = len(results) - len(failed)
        err.print(f"{good} file(s) imported, {len(failed)} failed:", highlight=False, markup=False)
        for r in failed:
            err.print(f"  {r.error}", highlight=False, markup=False)
        raise typer.Exit(1)
    [bad] = failed
    assert bad.error is not None
    ok = [r for r in results if r.status != "failed"]
    if len(ok) or path.is_dir():
        done = ", ".join(Path(r.path).name for r in ok) or "none"
        raise CliError(
            f"{bad.error} — stopped at this file; imported before it: {done}; "
            "the files after it were not tried (--keep-going imports every good file)"
        )
    raise bad.error


def _print_result(r: Any, as_json: bool) -> None:
    if as_json:
        doc = {"path": r.path, "session": r.session_id, "format": r.format, "status": r.status, "entries": r.entries}
        if r.repaired:
            doc["repaired"] = list(r.repaired)
        if r.original_id is not None:
            doc["original_id"] = r.original_id
        if r.error is not None:
            doc["error"] = str(r.error)
        emit_json(doc)
        return
    line = f"{r.status} {r.session_id} ({r.entries} entries, {r.format}) from {r.path}"
    if r.original_id is not None:
        line += f" (key {r.original_id!r} mapped to a valid id)"
    out.print(line, highlight=False)
    for note in r.repaired:
        out.print(f"  repaired: {note}", highlight=False)


@app.command("repair")
def repair_cmd(
    session: str,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    as_json: JsonOpt = False,
) -> None:
    """Close a turn a crashed writer left open (as dsh's load() does): an interrupted error result
    for each unanswered tool call, step/end, turn/end {interrupted}; and drop stale branch links."""

    async def main() -> list[Any]:
        sessions = open_sessions(url, prefix)
        try:
            return list(await sessions.repair(session))
        finally:
            await sessions.aclose()

    appended = run(main)
    if as_json:
        emit_json({"session": session, "appended": [{"n": e.n, "type": e.type} for e in appended]})
    elif appended:
        kinds = ", ".join(e.type for e in appended)
        out.print(f"repaired {session}: appended {len(appended)} entries ({kinds})", highlight=False)
    else:
        out.print(f"nothing to repair in {session}: no open turn", highlight=False)
