"""The Lua scripts of the store (``lua/*.lua``), loaded once: each with its source and SHA1 as
RESP bulks, ready for EVALSHA (EVAL when the server does not know it yet)."""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path


def lua_source(name: str) -> str:
    """The text of ``lua/<name>.lua``: inside the installed wheel, or the source checkout."""
    try:
        res = resources.files("redis_session").joinpath("lua", f"{name}.lua")
        if res.is_file():
            return res.read_text()
    except (FileNotFoundError, ModuleNotFoundError):  # pragma: no cover
        pass
    return (Path(__file__).resolve().parents[2] / "lua" / f"{name}.lua").read_text()


class Script:
    __slots__ = ("name", "sha", "sha_bulk", "source", "source_bulk")

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = lua_source(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()
        self.sha_bulk = b"$40\r\n%b\r\n" % self.sha.encode()
        source = self.source.encode()
        self.source_bulk = b"$%d\r\n%b\r\n" % (len(source), source)


SCRIPTS = {
    name: Script(name)
    for name in ("append", "delete", "unlink", "link", "draft", "lease", "proj", "swap", "archive", "answer")
}
