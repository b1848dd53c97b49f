"""The Redis layer: `RedisSessionStore`, its Lua scripts, the wire and cluster code (the only
modules that touch redis-py's internals), the embedded server and the connection factory."""

from .connect import is_cluster, open_store, resolve_url
from .store import RedisSessionStore

__all__ = ["RedisSessionStore", "is_cluster", "open_store", "resolve_url"]
