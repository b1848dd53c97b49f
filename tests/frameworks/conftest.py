"""The frameworks' own tests: a stored copy with an ours-only line runs a second time as its
control, ``<name>[control]``, derived from it at collection (_control.py, README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._control import collect_control


@pytest.hookimpl(trylast=True)  # after pytest's own Module for the file: ours first, then the control
def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    return collect_control(file_path, parent)
