"""Every code block of README.md, run in order the way a reader runs them.

A new user ran the README top to bottom and hit a 409, a 412, a TypeScript snippet that did not
compile, an `InvalidEntryError`, a `SessionForkError`, a top-level `await` and an AttributeError.
This test runs every block on a fresh embedded server (a private data dir, no ``$REDIS_URL``, an
empty ``$HOME``), in README order:

- ``python`` blocks in one Python process, one after another (names carry over, as in one REPL
  session; a block is compiled with its README line numbers, so a traceback points at the line);
- ``bash``/``sh``/``shell``/``console`` blocks with ``bash -e``, the venv's ``redis-session`` first
  on PATH (the Quick start activates the venv); an ``# HTTP/1.1 NNN`` comment is an expected
  status line that must appear in the output, in order;
- ``ts``/``typescript`` blocks compiled with the client's ``tsc`` against ``clients/typescript/src``
  (the import of ``redis-session-client`` pointed there) and run with node;
- with a gateway already running on a free port (the README's ``127.0.0.1:8765`` is rewritten to
  it) with the README's example tokens ``s3cret-writer`` (write) and ``s3cret-reader`` (read), and
  ``RS_TOKEN=s3cret-writer``.

A block that cannot run here (it installs, deploys, calls a paid API or needs files the reader has)
carries ``norun`` in its info string (```` ```bash norun ````); ``text`` blocks are never run. A
failure names the block by its README line.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from redis_session.redis.embedded import free_port, stop_server

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PACKAGE = ROOT / "clients" / "typescript"
BIN = Path(sys.executable).parent
LANGS = {
    "python": "python",
    "py": "python",
    "bash": "shell",
    "sh": "shell",
    "shell": "shell",
    "console": "shell",
    "ts": "ts",
    "typescript": "ts",
}
FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")
WRITER, READER = "s3cret-writer", "s3cret-reader"
BLOCK_TIMEOUT = 180.0


@dataclass(frozen=True)
class Block:
    line: int  # README line of the block's first line of code (1-based)
    info: str
    flags: tuple[str, ...]
    code: str

    @property
    def kind(self) -> str | None:
        return LANGS.get(self.info)

    @property
    def where(self) -> str:
        return f"README.md:{self.line} (```{' '.join((self.info, *self.flags))})"


def readme_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start = i + 1
        j = start
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        assert j < len(lines), f"README.md:{i + 1}: a code block that never closes"
        blocks.append(Block(start + 1, m.group(1).lower(), tuple(m.group(2).split()), "\n".join(lines[start:j]) + "\n"))
        i = j + 1
    return blocks


# --------------------------------------------------------------------------- static checks


def test_every_block_says_what_it_is() -> None:
    """Every block names its language (`text` for output and listings): a block without one could
    be a command a reader pastes, which this test would never have run. Blocks in a language this
    test runs run unless marked `norun`; any other language (`text`, `yaml`, …) is never run."""
    blocks = readme_blocks(README.read_text())
    assert len(blocks) > 20
    for b in blocks:
        assert b.info, f"{b.where}: say the block's language (`text` for output, `bash norun` for a command not run)"
        assert set(b.flags) <= {"norun"}, f"{b.where}: unknown flags {b.flags} (only `norun`)"
    assert sum(b.kind is not None and "norun" not in b.flags for b in blocks) >= 10


def _install_lines() -> Iterator[tuple[str, str]]:
    for path in [
        README,
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "Dockerfile",
        *sorted(ROOT.glob("examples/*.py")),
    ]:
        for k, line in enumerate(path.read_text().splitlines(), 1):
            for m in re.finditer(r"pip install([^`\n;&|]*)", line):
                yield f"{path.relative_to(ROOT)}:{k}", m.group(1)
    for path in sorted((ROOT / "redis_session").rglob("*.py")):
        for k, line in enumerate(path.read_text().splitlines(), 1):
            for m in re.finditer(r"pip install([^`\n;&|]*)", line):
                yield f"{path.relative_to(ROOT)}:{k}", m.group(1)


def test_every_install_line_names_the_distribution_in_pyproject() -> None:
    """`redis-session` on PyPI is someone else's 2018 project, so an install line
    naming it installs a stranger's code. Every install line names pyproject's [project] name."""
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    assert name != "redis-session"
    seen = 0
    for where, args in _install_lines():
        for word in re.findall(r"""(?:^|\s)['"]?([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?['"]?""", args):
            if word in {"q", "e", "U", "r"} or word.startswith("-"):
                continue
            if word.startswith(("redis-session", "redis_session", "redis-agent")):
                assert word == name, f"{where}: `pip install {args.strip()}` must name {name!r}"
                seen += 1
    assert seen >= 4  # the four adapter extras at least


# --------------------------------------------------------------------------- the run


_WORKER = r"""
import json, sys, traceback
ns = {"__name__": "__main__"}
for raw in sys.stdin:
    req = json.loads(raw)
    out = {"ok": True}
    try:
        exec(compile("\n" * (req["line"] - 1) + req["code"], "README.md", "exec"), ns)
    except ModuleNotFoundError as e:
        out = {"ok": False, "missing": e.name, "error": traceback.format_exc()}
    except BaseException:
        out = {"ok": False, "error": traceback.format_exc()}
    sys.stdout.flush()
    sys.stderr.flush()
    print("\n\x00RESULT " + json.dumps(out), flush=True)
"""

# third-party modules a block may need that an environment without the adapters' extras lacks
EXTRAS = {"agents", "langchain_core", "langgraph", "google"}


class PythonSession:
    """One Python process that runs blocks one after another in one namespace."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-c", _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, block: Block) -> tuple[dict[str, object], str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"line": block.line, "code": block.code}) + "\n")
        self.proc.stdin.flush()
        output: list[str] = []
        deadline = time.monotonic() + BLOCK_TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                return {"ok": False, "error": f"no end after {BLOCK_TIMEOUT:.0f} s"}, "".join(output)
            if line is None:
                return {"ok": False, "error": "the Python process died"}, "".join(output)
            if line.startswith("\x00RESULT "):
                return json.loads(line[len("\x00RESULT ") :]), "".join(output)
            output.append(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _run_shell(block: Block, env: dict[str, str], cwd: Path) -> str | None:
    try:
        r = subprocess.run(
            ["bash", "-e", "-c", block.code],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=BLOCK_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return f"no end after {BLOCK_TIMEOUT:.0f} s"
    if r.returncode != 0:
        return f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rest = r.stdout
    for status in re.findall(r"#\s*(HTTP/1\.1 \d{3})", block.code):
        at = rest.find(status)
        if at < 0:
            return f"expected {status!r} (the block's comment) in the output, in order:\n{r.stdout[-4000:]}"
        rest = rest[at + len(status) :]
    return None


def _node_missing() -> str | None:
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def _run_ts(block: Block, env: dict[str, str]) -> str | None:
    if not (PACKAGE / "node_modules" / "typescript").is_dir():
        ci = subprocess.run(["npm", "ci"], cwd=PACKAGE, capture_output=True, text=True, env=env, timeout=600)
        if ci.returncode != 0:
            return f"npm ci failed:\n{ci.stdout[-2000:]}{ci.stderr[-2000:]}"
    work = PACKAGE / f".readme-{os.getpid()}-{block.line}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        code = block.code.replace("'redis-session-client'", "'../src/index.js'")
        (work / "snippet.ts").write_text(code)
        config = {
            "extends": "../tsconfig.json",
            "compilerOptions": {"rootDir": "..", "outDir": "out", "declaration": False, "sourceMap": False},
            "include": ["snippet.ts"],
        }
        (work / "tsconfig.json").write_text(json.dumps(config))
        tsc = subprocess.run(
            [str(PACKAGE / "node_modules" / ".bin" / "tsc"), "-p", str(work)],
            capture_output=True,
            text=True,
            env=env,
            timeout=BLOCK_TIMEOUT,
        )
        if tsc.returncode != 0:
            # tsc names snippet.ts(line,col): shift to README lines
            text = re.sub(
                r"\S*snippet\.ts\((\d+),(\d+)\)",
                lambda m: f"README.md:{int(m.group(1)) + block.line - 1}:{m.group(2)}",
                tsc.stdout + tsc.stderr,
            )
            return f"tsc:\n{text[-4000:]}"
        node = subprocess.run(
            ["node", str(work / "out" / work.name / "snippet.js")],
            capture_output=True,
            text=True,
            env=env,
            timeout=BLOCK_TIMEOUT,
        )
        if node.returncode != 0:
            return f"node exit {node.returncode}:\n{node.stdout[-2000:]}\n{node.stderr[-3000:]}"
        return None
    except subprocess.TimeoutExpired:
        return f"no end after {BLOCK_TIMEOUT:.0f} s"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _wait_http(url: str, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the gateway exited: {proc.communicate()[1][-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the gateway did not answer {url} within {timeout} s")


@pytest.mark.timeout(1200)
def test_every_readme_block_runs_in_order(tmp_path: Path) -> None:
    blocks = [b for b in readme_blocks(README.read_text()) if b.kind is not None]
    home, user, work = tmp_path / "data", tmp_path / "user-home", tmp_path / "work"
    user.mkdir()
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "REDIS_SESSION_URL", "COLUMNS")}
    env.update(
        REDIS_SESSION_HOME=str(home),
        HOME=str(user),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",  # an activated venv
        RS_TOKEN=WRITER,
        PYTHONUNBUFFERED="1",
        REDIS_SESSION_PORT=str(free_port()),  # the embedded server's; never a developer's 6390
    )
    port = free_port()
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{WRITER} write\n{READER} read\n")
    gateway = subprocess.Popen(
        [str(BIN / "redis-session"), "gateway", "--port", str(port), "--tokens", str(tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=work,
    )
    python = None
    failures: list[str] = []
    skipped: list[str] = []
    ran = 0
    try:
        _wait_http(f"http://127.0.0.1:{port}/healthz", gateway)
        python = PythonSession(env, work)
        for b in blocks:
            if "norun" in b.flags:
                continue
            b = Block(b.line, b.info, b.flags, b.code.replace("127.0.0.1:8765", f"127.0.0.1:{port}"))
            ran += 1
            if b.kind == "python":
                result, output = python.run(b)
                if result.get("missing") and str(result["missing"]).split(".")[0] in EXTRAS:
                    skipped.append(f"{b.where}: needs {result['missing']} (an adapter's extra)")
                elif not result["ok"]:
                    failures.append(f"{b.where}:\n{output[-2000:]}{result['error']}")
            elif b.kind == "shell":
                error = _run_shell(b, env, work)
                if error is not None:
                    failures.append(f"{b.where}: {error}")
            elif (why := _node_missing()) is not None:
                skipped.append(f"{b.where}: {why}")
            elif (error := _run_ts(b, env)) is not None:
                failures.append(f"{b.where}: {error}")
    finally:
        if python is not None:
            python.close()
        gateway.terminate()
        try:
            gateway.wait(timeout=30)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait()
        stop_server(home)
    assert not failures, "\n\n".join(failures) + ("\n\nskipped:\n" + "\n".join(skipped) if skipped else "")
    assert ran >= 10


def test_the_quick_start_puts_redis_session_on_path() -> None:
    """After the Quick start `redis-session` was not on PATH (the venv was never
    activated). The Quick start activates it; a shell without it reaches the command through the
    venv's path, as the README says."""
    text = README.read_text()
    quick = text[text.index("## Quick start") : text.index("\n## ", text.index("## Quick start") + 5)]
    first = readme_blocks(quick)[0]
    for line in (x for x in first.code.splitlines() if x and not x.startswith("#")):
        assert ". .venv/bin/activate && pip install" in line and "&& redis-session " not in line.split("activate")[0]
    assert "`.venv/bin/redis-session …`" in quick
    venv = Path(sys.prefix)
    activate = venv / "bin" / "activate"
    if not activate.is_file():
        pytest.skip(f"{venv} is not a venv")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if Path(p) != venv / "bin")
    script = (
        "command -v redis-session || echo 'not on PATH'; . {a} && command -v redis-session && redis-session --version"
    )
    r = subprocess.run(["bash", "-c", script.format(a=activate)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    _before, found, version = r.stdout.splitlines()[-3:]
    assert found == str(venv / "bin" / "redis-session") and version.startswith("redis-session ")
    r = subprocess.run([str(venv / "bin" / "redis-session"), "--version"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.startswith("redis-session "), r.stderr


def test_a_failing_block_is_named_by_its_readme_line(tmp_path: Path) -> None:
    """The harness itself: blocks share one namespace in order, and a failure's traceback and the
    block's name carry its README line, so a block an edit broke is found by its line."""
    text = "intro\n\n```python\nx = 41\n```\n\ntext\n\n```python\ny = x + 1\nraise ValueError(y)\n```\n"
    first, second = readme_blocks(text)
    assert (first.line, second.line) == (4, 10) and second.where == "README.md:10 (```python)"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    python = PythonSession(env, tmp_path)
    try:
        assert python.run(first)[0] == {"ok": True}
        result, _ = python.run(second)
    finally:
        python.close()
    assert not result["ok"]
    assert 'File "README.md", line 11' in str(result["error"]) and "ValueError: 42" in str(result["error"])
