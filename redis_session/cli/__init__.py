"""The `redis-session` command line: commands, the terminal tail view and the demo."""

from .main import app, main

__all__ = ["app", "main"]
