"""What the HTTP parser saw of a request that the ASGI scope would not tell: the request target
as it came on the request line.

An absolute-form target (``GET http://evil.example/sessions HTTP/1.1``) names its own host; RFC 9112
§3.2.2 makes that authority, not ``Host``, the one the request is for. uvicorn's h11 protocol keeps
it in ``raw_path``, but its httptools protocol keeps only the path, so the host check
(`routes._WebGuard`) would see ``Host`` alone and let another host's request through. `serve`
runs uvicorn with `http_protocol`, which puts the target under `TARGET` in the scope whenever it
is not origin-form (``/path``), so the guard can refuse an authority that is not the Host."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
from typing import Any, cast

TARGET = "redis_session.request_target"
"""ASGI scope key: the raw request target (bytes), present when it is not origin-form."""


def http_protocol(http: str) -> str | type[asyncio.Protocol]:
    """uvicorn's `http` setting for `http` (``auto``, ``httptools``, ``h11``): the httptools
    protocol is replaced by one that keeps a non-origin-form target in the scope (h11 keeps it
    in ``raw_path`` already); any other value is returned as it is."""
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return _httptools_protocol() if http == "httptools" else http


@functools.cache
def _httptools_protocol() -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # needs httptools (the fast extra)

    class TargetKeepingHttpTools(HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            target = bytes(self.url)
            if not target.startswith(b"/"):
                cast(dict[str, Any], self.scope)[TARGET] = target  # the scope the app is given
            super().on_headers_complete()

    return TargetKeepingHttpTools
