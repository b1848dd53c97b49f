"""The control run of the frameworks' own tests, derived from the one stored copy.

A copy in ``<framework>/upstream/`` is upstream's file with every line we changed or added ending
in a marker that says which side runs it and what upstream's line is::

    <code>  # redis-session (upstream: <upstream's line>)   ours runs <code>; the control, upstream's line
    <code>  # redis-session (both; upstream: <upstream's line>)   both sides run <code> (location, server)
    <code>  # redis-session (both; added)   both sides run <code>; upstream has no such line
    <code>  # redis-session (added)   ours runs <code>; the control has an empty line there

``<upstream's line>`` is upstream's line without its indentation (the copy's is the same). A test
file with an ours-only line is collected twice: as it is (ours), and as ``<name>[control]``, whose
module is compiled from `control_source` (line for line, under the stored file's name: a control
traceback points at the stored file's lines). `upstream_source` gives back the file the copy was
made from (for a refresh: ``python tests/frameworks/_control.py upstream <copy>``).
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import types
from pathlib import Path
from typing import Any

import pytest

MARKER = "# redis-session"


@dataclasses.dataclass(frozen=True)
class Marked:
    """One marked line of a copy."""

    lineno: int  # 1-based
    code: str  # the copy's line without its marker
    both: bool  # the control runs `code` too
    upstream: str | None  # upstream's line (indented as `code`); None: the line is ours


def marked_lines(source: str) -> list[Marked]:
    """Every marked line of `source` (the last ``# redis-session (...)`` on a line is its marker);
    a marker that names neither upstream's text nor ``added`` raises ValueError."""
    out: list[Marked] = []
    for lineno, line in enumerate(source.splitlines(), 1):
        cut = line.rfind(MARKER)
        if cut < 0:
            continue
        code, tail = line[:cut].rstrip(), line[cut + len(MARKER) :]
        if not tail.strip():
            raise ValueError(f"line {lineno}: a '# redis-session' marker names no upstream text: {line!r}")
        if not tail.startswith(" ("):
            continue  # the words inside a line's text, not a marker
        if not tail.endswith(")"):
            raise ValueError(f"line {lineno}: a marker ends the line, in parentheses: {line!r}")
        spec = tail[2:-1]
        both = spec.startswith("both; ")
        spec = spec.removeprefix("both; ")
        indent = code[: len(code) - len(code.lstrip())]
        if spec == "added":
            upstream = None
        elif spec.startswith("upstream: ") and spec.removeprefix("upstream: ").strip():
            upstream = indent + spec.removeprefix("upstream: ")
        else:
            raise ValueError(f"line {lineno}: the marker names neither 'upstream: <line>' nor 'added': {line!r}")
        out.append(Marked(lineno, code, both, upstream))
    return out


def control_source(source: str) -> str:
    """`source` with every ours-only marked line restored to upstream's (an added one emptied);
    the same number of lines, every other line as it is."""
    lines = source.splitlines(keepends=True)
    for m in marked_lines(source):
        if not m.both:
            end = "\n" if lines[m.lineno - 1].endswith("\n") else ""
            lines[m.lineno - 1] = (m.upstream or "") + end
    return "".join(lines)


def upstream_source(source: str) -> str:
    """The upstream file the copy was made from: added lines dropped, changed lines restored."""
    marks = {m.lineno: m for m in marked_lines(source)}
    out = []
    for lineno, line in enumerate(source.splitlines(keepends=True), 1):
        m = marks.get(lineno)
        if m is None:
            out.append(line)
        elif m.upstream is not None:
            out.append(m.upstream + ("\n" if line.endswith("\n") else ""))
    return "".join(out)


def has_control(source: str) -> bool:
    return any(not m.both for m in marked_lines(source))


def load_control_module(path: Path, name: str, config: pytest.Config | None = None) -> types.ModuleType:
    """Run the control source of `path` as the module `name`, compiled under `path`'s own name
    (asserts rewritten as pytest rewrites a test module's)."""
    source = control_source(path.read_text(encoding="utf-8"))
    filename = str(path)
    tree = ast.parse(source, filename=filename)
    if config is not None and config.getoption("assertmode", "rewrite") == "rewrite":
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source.encode("utf-8"), filename, config)
    code = compile(tree, filename, "exec", dont_inherit=True)
    mod = types.ModuleType(name)
    mod.__file__ = filename
    if "." in name:
        mod.__package__ = name.rpartition(".")[0]
    sys.modules[name] = mod  # pydantic, dataclasses and typing look a class's module up by name
    try:
        exec(code, mod.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


class ControlModule(pytest.Module):
    """A stored copy collected a second time, as ``<name>[control]``: its module is the control
    source (upstream's lines where ours differs), so the tests run on the framework's own class."""

    def _getobj(self) -> Any:
        mod = load_control_module(self.path, f"{_module_name(self.path)}_control", self.config)
        self.config.pluginmanager.consider_module(mod)
        return mod


def _module_name(path: Path) -> str:
    # the name pytest's prepend import mode gives the stored file: its dotted package path
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").exists():
        parts.append(folder.name)
        folder = folder.parent
    return ".".join(reversed(parts))


def is_control(node: pytest.Item | pytest.Collector) -> bool:
    """Whether `node` runs on the framework's own implementation (the derived control)."""
    return node.getparent(ControlModule) is not None


def collect_control(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """Beside pytest's own Module for a stored copy with an ours-only line, its control (the
    `pytest_collect_file` hook of conftest.py)."""
    if file_path.suffix != ".py" or file_path.parent.name != "upstream":
        return None
    if not any(file_path.match(p) for p in parent.config.getini("python_files")):
        return None
    if not has_control(file_path.read_text(encoding="utf-8")):
        return None
    name = f"{file_path.name}[control]"
    nodeid = f"{parent.nodeid}/{name}" if parent.nodeid else name
    return ControlModule.from_parent(parent, path=file_path, name=name, nodeid=nodeid)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("upstream", "control"):
        print("usage: python tests/frameworks/_control.py upstream|control <copy>", file=sys.stderr)
        return 2
    source = Path(argv[1]).read_text(encoding="utf-8")
    sys.stdout.write(upstream_source(source) if argv[0] == "upstream" else control_source(source))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
