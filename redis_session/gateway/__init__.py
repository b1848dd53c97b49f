"""The HTTP gateway: REST + SSE over a store, the OpenAPI document and the web viewer.

`create_app` and `serve` are loaded on first use, so importing one of the gateway's modules
(``gateway.routes``, ``gateway.sse`` …) never runs ``gateway.app`` — which imports them all —
half-way through: the package's modules only ever import downwards. (`openapi` is a leaf.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .openapi import openapi

if TYPE_CHECKING:
    from .app import create_app, serve

__all__ = ["create_app", "openapi", "serve"]


def __getattr__(name: str) -> Any:
    if name in ("create_app", "serve"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
