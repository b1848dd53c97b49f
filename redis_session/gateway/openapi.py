"""The OpenAPI 3.1 document of the gateway (served at ``/openapi.json``)."""

from __future__ import annotations

from typing import Any

from .common import FORMATS, MAX_ENTRY_LIMIT


def openapi(*, auth: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the gateway."""

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    def error(description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": ref("Error")}}}

    def ok(description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": schema}}}

    sid = {
        "name": "session_id",
        "in": "path",
        "required": True,
        "description": "Session id, percent-encoded (`/` as `%2F`). 1-256 characters; "
        "no braces, whitespace or control characters.",
        "schema": {"type": "string", "minLength": 1, "maxLength": 256},
    }

    def nonneg(name: str, description: str) -> dict[str, Any]:
        return {"name": name, "in": "query", "description": description, "schema": {"type": "integer", "minimum": 0}}

    common = {"401": error("Missing or wrong bearer token")} if auth else {}
    session_errors = {
        "400": error("Invalid session id or parameter"),
        "404": error("Unknown session"),
        "503": error("The store is unreachable"),
        **common,
    }
    json_any: dict[str, Any] = {}
    header = {
        "type": "object",
        "required": ["id"],
        "properties": {
            "id": {"type": "string"},
            "format_version": {"type": "integer"},
            "created_at": {"type": "integer", "description": "ms since the epoch"},
            "parent": {"type": ["string", "null"]},
            "at": {"type": ["integer", "null"], "description": "branch point in the parent's log"},
            "delegation_depth": {"type": "integer"},
            "title": {"type": ["string", "null"]},
            "origin": json_any,
            "incarnation": {"type": "string", "description": "unique per creation of the id"},
        },
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "redis-session gateway",
            "version": "1",
            "description": "Read-only access to agent sessions and their live tails.",
        },
        "paths": {
            "/healthz": {
                "get": {
                    "summary": "Liveness and store reachability (no token needed)",
                    "security": [],
                    "responses": {
                        "200": ok("The store answers", {"type": "object"}),
                        "503": error("The store is unreachable"),
                    },
                }
            },
            "/": {
                "get": {
                    "summary": "The web viewer",
                    "responses": {"200": {"description": "HTML page", "content": {"text/html": {}}}, **common},
                }
            },
            "/openapi.json": {
                "get": {"summary": "This document", "responses": {"200": ok("OpenAPI document", {}), **common}}
            },
            "/sessions": {
                "get": {
                    "summary": "List sessions, newest first",
                    "parameters": [
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100},
                        },
                        {
                            "name": "cursor",
                            "in": "query",
                            "description": "`cursor` of the previous page",
                            "schema": {"type": "string"},
                        },
                        {
                            "name": "parent",
                            "in": "query",
                            "description": "only the live branches of this session",
                            "schema": {"type": "string"},
                        },
                    ],
                    "responses": {"200": ok("One page", ref("SessionPage")), "400": error("Bad parameter"), **common},
                }
            },
            "/sessions/{session_id}": {
                "get": {
                    "summary": "A session's head",
                    "parameters": [sid],
                    "responses": {"200": ok("The head", ref("SessionHead")), **session_errors},
                }
            },
            "/sessions/{session_id}/entries": {
                "get": {
                    "summary": "Stored entries [start, stop), at most `limit` of them",
                    "parameters": [
                        sid,
                        nonneg("start", "first n (default 0)"),
                        nonneg("stop", "end n, exclusive (default: the session's n)"),
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ENTRY_LIMIT},
                        },
                    ],
                    "responses": {"200": ok("Entries", ref("EntryPage")), **session_errors},
                }
            },
            "/sessions/{session_id}/messages": {
                "get": {
                    "summary": "The projection: what the model sees",
                    "parameters": [
                        sid,
                        {
                            "name": "format",
                            "in": "query",
                            "schema": {"type": "string", "enum": list(FORMATS), "default": "openai"},
                        },
                    ],
                    "responses": {"200": ok("Messages", ref("Messages")), **session_errors},
                }
            },
            "/sessions/{session_id}/events": {
                "get": {
                    "summary": "Live tail (Server-Sent Events)",
                    "description": "Each entry is an event whose `id` is its n and whose data is the entry "
                    "as JSON; `event: draft` carries `{draft}` when the streaming draft changes; "
                    "`event: end` when the session is deleted (`event: replaced` first when it was replaced); "
                    "`: ping` comments after `heartbeat` "
                    "idle seconds. Reconnect with `Last-Event-ID` (resumes at id + 1), else `start`.",
                    "parameters": [
                        sid,
                        nonneg("start", "first n (default 0)"),
                        {
                            "name": "Last-Event-ID",
                            "in": "header",
                            "description": "the last n received; takes precedence over `start`",
                            "schema": {"type": "string"},
                        },
                    ],
                    "responses": {
                        "200": {"description": "An event stream", "content": {"text/event-stream": {}}},
                        **session_errors,
                        "503": error("The store is unreachable, or too many live streams"),
                    },
                }
            },
            "/events": {
                "get": {
                    "summary": "Store-wide notifications (Server-Sent Events)",
                    "description": "`event: session-branch` with `{parent, session, at}` when a branch or fork "
                    "is created (what the viewer's branch tree and session list follow); `: ping` comments "
                    "after `heartbeat` idle seconds. Stores without pub/sub send only the pings.",
                    "responses": {"200": {"description": "An event stream", "content": {"text/event-stream": {}}}},
                }
            },
        },
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error", "message"],
                    "properties": {"error": {"type": "string"}, "message": {"type": "string"}},
                },
                "SessionHeader": header,
                "SessionHead": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "header": ref("SessionHeader"),
                        "n": {"type": "integer", "description": "number of entries"},
                        "updated_at": {"type": "integer"},
                        "last_cut": {"type": ["integer", "null"]},
                    },
                },
                "SessionPage": {
                    "type": "object",
                    "properties": {
                        "items": {"type": "array", "items": ref("SessionHeader")},
                        "cursor": {"type": ["string", "null"], "description": "null on the last page"},
                    },
                },
                "Entry": {
                    "type": "object",
                    "required": ["n", "time", "type", "data"],
                    "properties": {
                        "n": {"type": "integer"},
                        "time": {"type": "integer", "description": "ms since the epoch"},
                        "type": {"type": "string"},
                        "data": {"type": "object"},
                        "meta": {"type": "object"},
                        "surface": {"type": "object"},
                    },
                },
                "EntryPage": {
                    "type": "object",
                    "properties": {
                        "n": {"type": "integer", "description": "the session's n when read"},
                        "entries": {"type": "array", "items": ref("Entry")},
                        "next": {"type": ["integer", "null"], "description": "start of the next page"},
                    },
                },
                "Messages": {
                    "type": "object",
                    "properties": {
                        "session": {"type": "string"},
                        "format": {"type": "string", "enum": list(FORMATS)},
                        "messages": {
                            "description": "openai: a list of chat messages; anthropic: "
                            "{system, messages}; neutral: [{role, content: blocks, source: [n]}]"
                        },
                    },
                },
            }
        },
    }
    if auth:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "query": {"type": "apiKey", "in": "query", "name": "token"},
        }
        doc["security"] = [{"bearer": []}, {"query": []}]
    return doc
