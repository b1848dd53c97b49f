"""The HTTP gateway: REST + SSE over a store, the OpenAPI document and the web viewer."""

from .app import create_app, serve
from .openapi import openapi

__all__ = ["create_app", "openapi", "serve"]
