"""The control run of a copied upstream test file is derived from the one stored copy
(_control.py): it differs from the copy only on the copy's ours-only `# redis-session` lines, each
of which names upstream's text, so the control is upstream's file with only the location changes."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from ._control import control_source, has_control, load_control_module, marked_lines, upstream_source

HERE = Path(__file__).resolve().parent
COPIES = sorted(HERE.glob("*/upstream/test_*.py"))


def test_the_copies_are_stored_once() -> None:
    assert [p.relative_to(HERE).as_posix() for p in COPIES] == [
        "langchain/upstream/test_history.py",
        "openai_agents/upstream/test_redis_session.py",
    ]
    assert not list(HERE.glob("*/upstream/*_control.py"))


@pytest.mark.parametrize("copy", COPIES, ids=lambda p: p.relative_to(HERE).as_posix())
def test_the_control_differs_from_the_copy_only_on_its_ours_only_lines(copy: Path) -> None:
    stored = copy.read_text(encoding="utf-8")
    control = control_source(stored)
    marks = {m.lineno: m for m in marked_lines(stored)}
    ours_only = {n for n, m in marks.items() if not m.both}
    assert ours_only, "a copy with a control changes at least one line for ours"
    assert has_control(stored)
    stored_lines, control_lines = stored.splitlines(), control.splitlines()
    assert len(control_lines) == len(stored_lines)  # line for line: tracebacks keep their numbers
    for n, (s, c) in enumerate(zip(stored_lines, control_lines, strict=True), 1):
        if n in ours_only:
            assert c == marks[n].upstream, f"line {n}: the control runs upstream's text"
            assert marks[n].code != marks[n].upstream, f"line {n}: marked, yet upstream's"
        else:
            assert c == s, f"line {n} is not an ours-only line, yet the control changes it"
    compile(control, str(copy), "exec", dont_inherit=True)
    # every marked line names upstream's text (or says it is ours): the file it was copied from
    # comes back whole, without a marker left in it (a refresh is a three-way merge on it)
    upstream = upstream_source(stored)
    assert "# redis-session" not in upstream
    added = sum(1 for m in marks.values() if m.upstream is None)
    assert len(upstream.splitlines()) == len(stored_lines) - added


@pytest.mark.parametrize(
    "line",
    [
        "x = 1  # redis-session",
        "x = 1  # redis-session (upstream: )",
        "x = 1  # redis-session (changed)",
        "x = 1  # redis-session (both; upstream: x = 2",
    ],
)
def test_a_marker_that_names_no_upstream_text_is_refused(line: str) -> None:
    with pytest.raises(ValueError):
        marked_lines(f"a = 0\n{line}\n")


def test_the_marker_forms() -> None:
    source = (
        "# header  # redis-session (both; added)\n"
        "import ours  # redis-session (both; upstream: import upstream_location)\n"
        "def f():\n"
        "    return ours.C()  # redis-session (upstream: return theirs.C()  # (sic))\n"
        "    print('ours')  # redis-session (added)\n"
        "# the words '# redis-session' inside a line are no marker\n"
    )
    assert control_source(source).splitlines() == [
        "# header  # redis-session (both; added)",
        "import ours  # redis-session (both; upstream: import upstream_location)",
        "def f():",
        "    return theirs.C()  # (sic)",
        "",
        "# the words '# redis-session' inside a line are no marker",
    ]
    assert upstream_source(source).splitlines() == [
        "import upstream_location",
        "def f():",
        "    return theirs.C()  # (sic)",
        "# the words '# redis-session' inside a line are no marker",
    ]


def test_a_control_traceback_points_at_the_stored_file(tmp_path: Path) -> None:
    stored = tmp_path / "test_copy.py"
    stored.write_text(
        "import sys\n"
        'SIDE = "ours"  # redis-session (upstream: SIDE = "upstream")\n'
        "\n"
        "def test_fails():\n"
        "    raise RuntimeError(SIDE)\n",
        encoding="utf-8",
    )
    mod = load_control_module(stored, "rs_control_probe_test_copy")
    try:
        assert mod.SIDE == "upstream"
        assert mod.__file__ == str(stored)
        with pytest.raises(RuntimeError, match="upstream") as info:
            mod.test_fails()
        frame = traceback.extract_tb(info.value.__traceback__)[-1]
        assert (frame.filename, frame.lineno, frame.line) == (str(stored), 5, "raise RuntimeError(SIDE)")
    finally:
        sys.modules.pop("rs_control_probe_test_copy", None)


def test_each_copy_is_collected_on_both_sides() -> None:
    pytest.importorskip("langchain_core", reason="needs the langchain extra")
    pytest.importorskip("blockbuster", reason="needs the langchain-test extra")
    pytest.importorskip("agents", reason="needs the openai-agents extra")
    root = HERE.parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *map(str, COPIES)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    for copy in COPIES:
        rel = copy.relative_to(root).as_posix()
        ours = {i.split("::", 1)[1] for i in ids if i.startswith(f"{rel}::")}
        control = {i.split("::", 1)[1] for i in ids if i.startswith(f"{rel}[control]::")}
        assert ours, rel
        assert control == ours, rel
