"""The OpenAPI 3.1 document of the gateway (served at ``/openapi.json``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .common import FORMATS, MAX_ENTRY_LIMIT

_MADE_AND_DELETED = (
    "; or `session_replaced`: this keyed request's session was made and deleted since (a retry never makes it again)"
)


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
            "create_key": {
                "type": ["string", "null"],
                "description": "`<32 hex>.<16 hex>`: SHA-256 of the Idempotency-Key it was created with, "
                "and a digest of that request's fields (a retry with another body is told apart)",
            },
        },
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "redis-session gateway",
            "version": "1",
            "description": "Agent sessions: reads, live tails (SSE) and writes with expected-n (If-Match) "
            "and idempotency (Idempotency-Key).",
        },
        "paths": {
            "/healthz": {
                "get": {
                    "summary": "Liveness: the process answers; never asks the store (no token needed)",
                    "security": [],
                    "responses": {"200": ok("The process answers", {"type": "object"})},
                }
            },
            "/readyz": {
                "get": {
                    "summary": "Readiness: the store answers (no token needed)",
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
                        {
                            "name": "last",
                            "in": "query",
                            "description": "Only the newest `last` (neutral) messages; the answer adds `total`",
                            "schema": {"type": "integer", "minimum": 1},
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
                    "idle seconds. Reconnect with `Last-Event-ID` (resumes at id + 1), else `start` with "
                    "`incarnation` (a resume: past the log's end, `event: rewound` `{session, cursor, n}` "
                    "then `end`); `start` without a pin is a fresh tail, which waits for a log it is ahead of. "
                    "With `deltas=1`, `event: delta` carries `{answer, index, kind, text, callId?, name?}` "
                    "for each delta of a streamed answer, and event ids become `<n>/<live id>` "
                    "(last entry n, last delta's live stream id) once a delta was sent; "
                    "`Last-Event-ID` resumes both without gap or repeat.",
                    "parameters": [
                        sid,
                        nonneg("start", "first n (default 0)"),
                        {
                            "name": "deltas",
                            "in": "query",
                            "description": "1 or true: also send streamed answers' deltas (`event: delta`); "
                            "0 or false (the default): entries only; any other value is a 400",
                            "schema": {"type": "string", "enum": ["0", "1", "true", "false"]},
                        },
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
                        "unreadable": {
                            "type": "array",
                            "items": {"type": "string"},
                            "description": "ids listed on this page whose header could not be read (edited "
                            "outside redis-session); `redis-session doctor` says what is wrong",
                        },
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
                        "total": {"type": "integer", "description": "with `last`: how many there are"},
                        "messages": {
                            "description": "openai: a list of chat messages; anthropic: "
                            "{system, messages}; neutral: [{role, content: blocks, source: [n]}]"
                        },
                    },
                },
            }
        },
    }
    for path, ops in _write_paths(sid, ref, error, ok, common).items():
        doc["paths"].setdefault(path, {}).update(ops)
    doc["components"]["schemas"].update(_write_schemas(ref))
    _pin_every_session_route(doc, error)
    if auth:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "query": {"type": "apiKey", "in": "query", "name": "token"},
        }
        doc["security"] = [{"bearer": []}, {"query": []}]
    return doc


PIN = (
    "Pins the life of the id (`header.incarnation`): once it was deleted and created again, 409 "
    "`session_replaced` and nothing is read or written (an event stream: before it opens)."
)


def _pin_every_session_route(doc: dict[str, Any], error: Callable[[str], dict[str, Any]]) -> None:
    """Every ``/sessions/{session_id}…`` operation takes the pin (`routes._pinned`): the
    ``X-Session-Incarnation`` header (or If-Match's incarnation) or ``?incarnation=``; 409."""
    header: dict[str, Any] = {
        "name": "X-Session-Incarnation",
        "in": "header",
        "description": PIN,
        "schema": {"type": "string"},
    }
    query: dict[str, Any] = {"name": "incarnation", "in": "query", "description": PIN, "schema": {"type": "string"}}
    for path, item in doc["paths"].items():
        if not path.startswith("/sessions/{session_id}"):
            continue
        for op in item.values():
            params = op.setdefault("parameters", [])
            names = {(p["name"].lower(), p["in"]) for p in params}
            for extra in (header, query):
                if (str(extra["name"]).lower(), extra["in"]) not in names:
                    params.append(extra)
            responses = op["responses"]
            if "409" not in responses:
                responses["409"] = error("The id was deleted and created again (pinned incarnation)")
            elif not re.search(r"session_replaced|pinned incarnation", responses["409"]["description"]):
                described = responses["409"]["description"]
                responses["409"] = {**responses["409"], "description": f"{described}; or `session_replaced`: {PIN}"}


def _write_paths(
    sid: dict[str, Any],
    ref: Callable[[str], dict[str, str]],
    error: Callable[[str], dict[str, Any]],
    ok: Callable[[str, dict[str, Any]], dict[str, Any]],
    common: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """The write operations (scope `write`, `admin` for DELETE)."""

    def header(name: str, description: str) -> dict[str, Any]:
        return {"name": name, "in": "header", "description": description, "schema": {"type": "string"}}

    if_match = header(
        "If-Match",
        'The expected n: `"<n>"`, or `"<n>;<incarnation>"` to pin the life of the id too; `*` or none: '
        "append at the end whatever n is.",
    )
    incarnation = header("X-Session-Incarnation", "Only write to this life of the id (`header.incarnation`); else 409.")
    key = header(
        "Idempotency-Key",
        "1-256 characters. A retry with the same key and body returns the first answer and never writes "
        "twice; the same key with another body answers 422 `idempotency_key_reused`.",
    )
    etag = {"ETag": {"description": 'The session\'s n after the write, `"<n>"`', "schema": {"type": "string"}}}

    def body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
        return {"required": required, "content": {"application/json": {"schema": schema}}}

    def created(description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {**ok(description, schema), "headers": etag}

    write_errors = {
        "400": error("Malformed id, header or JSON"),
        "403": error("The token lacks the scope, or the id is outside its tenant"),
        "404": error("Unknown session"),
        "413": error("Body, entry or batch over its limit"),
        "422": error("Invalid body (`path` names the field), or a reused Idempotency-Key"),
        "503": error("The store is unreachable"),
        **common,
    }
    conflict = {
        "409": error("The id was deleted and created again (pinned incarnation)"),
        "412": {**ok("Stale If-Match: `expected_n`, `actual_n`", ref("Conflict")), "headers": etag},
    }
    return {
        "/sessions": {
            "post": {
                "summary": "Create a session (optionally with its first entries)",
                "parameters": [key],
                "requestBody": body(ref("CreateSession"), required=False),
                "responses": {
                    "201": created("The new session's head", ref("SessionHead")),
                    "409": error("The id exists" + _MADE_AND_DELETED),
                    **write_errors,
                },
            }
        },
        "/sessions/{session_id}": {
            "delete": {
                "summary": "Delete a session (scope admin); its live branches keep their prefix",
                "parameters": [sid, if_match, incarnation],
                "responses": {"204": {"description": "Deleted"}, **write_errors, **conflict},
            }
        },
        "/sessions/{session_id}/entries": {
            "post": {
                "summary": "Append one entry or a batch, all or nothing",
                "parameters": [sid, if_match, incarnation, key],
                "requestBody": body(ref("AppendBody")),
                "responses": {"201": created("The stored entries", ref("Written")), **write_errors, **conflict},
            }
        },
        "/sessions/{session_id}/branch": {
            "post": {
                "summary": "Branch at `at`: a new session holding the parent's entries [0, at)",
                "parameters": [sid, key],
                "requestBody": body(ref("BranchBody")),
                "responses": {
                    "201": created("The branch's head", ref("SessionHead")),
                    "409": error("The branch id exists" + _MADE_AND_DELETED),
                    **write_errors,
                },
            }
        },
        "/sessions/{session_id}/fork": {
            "post": {
                "summary": "dsh fork: a child holding [0, boundary], the boundary a turn/end (default: the last entry)",
                "parameters": [sid, key],
                "requestBody": body(ref("ForkBody"), required=False),
                "responses": {
                    "201": created("The fork's head", ref("SessionHead")),
                    "409": error("The fork id exists" + _MADE_AND_DELETED),
                    **write_errors,
                    "422": error("INVALID_BOUNDARY or OPEN_TURN (`code`), or an invalid body"),
                },
            }
        },
        "/sessions/{session_id}/draft": {
            "get": {
                "summary": "The streaming draft (`{draft}`, null when none)",
                "parameters": [sid],
                "responses": {"200": ok("The draft", {"type": "object"}), **write_errors},
            },
            "put": {
                "summary": "Publish the streaming draft (a JSON object), or clear it (null)",
                "parameters": [sid],
                "requestBody": body({"type": ["object", "null"]}),
                "responses": {"204": {"description": "Stored"}, **write_errors},
            },
        },
        "/sessions/{session_id}/repair": {
            "post": {
                "summary": "Close a turn a crashed writer left open (dsh interrupted-turn closers)",
                "parameters": [sid],
                "responses": {
                    "200": created("The entries appended ([] when nothing was open)", ref("Written")),
                    "409": error("A live writer holds the lease"),
                    **write_errors,
                },
            }
        },
        **_answer_paths(sid, ref, body, created, [if_match, incarnation, key], write_errors, conflict),
    }


def _answer_paths(
    sid: dict[str, Any],
    ref: Callable[[str], dict[str, str]],
    body: Callable[[dict[str, Any]], dict[str, Any]],
    created: Callable[[str, dict[str, Any]], dict[str, Any]],
    headers: list[dict[str, Any]],
    write_errors: dict[str, Any],
    conflict: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """The streaming routes (scope `write`): begin an answer, send its deltas in batches, end it."""
    if_match, incarnation, key = headers
    answer = {
        "name": "answer",
        "in": "path",
        "required": True,
        "description": "The answer id the begin answered",
        "schema": {"type": "string", "pattern": "^[0-9A-Za-z_.-]{1,64}$"},
    }
    replaced = {"409": conflict["409"]}
    return {
        "/sessions/{session_id}/answers": {
            "post": {
                "summary": "Begin a streamed answer: a `begin` record on the session's live stream "
                "(with an Idempotency-Key, a retry gets the same answer id)",
                "parameters": [sid, incarnation, key],
                "requestBody": {**body(ref("AnswerBegin")), "required": False},
                "responses": {"201": created("The answer", ref("Answer")), **write_errors, **replaced},
            }
        },
        "/sessions/{session_id}/answers/{answer}/deltas": {
            "post": {
                "summary": "A batch of deltas: live for tailing readers (SSE `?deltas=1`), and one packed "
                "`assistant/chunk` row in the log; a retried batch (same `first_index`) is written nowhere twice. "
                "An empty batch (`deltas: []`) is the writer's heartbeat: nothing is written, the answer's lease "
                "is refreshed (repair leaves an answer alone while its writer wrote or beat within 30 s); 409 "
                "`answer_ended` once it ended",
                "parameters": [sid, answer, incarnation],
                "requestBody": body(ref("DeltaBatch")),
                "responses": {
                    "200": created("A heartbeat (an empty batch): nothing written", ref("Written")),
                    "201": created("The chunk row", ref("Written")),
                    **write_errors,
                    **replaced,
                },
            }
        },
        "/sessions/{session_id}/answers/{answer}/end": {
            "post": {
                "summary": "End the answer: the `assistant/message` (committed) or the `assistant/interrupted` "
                "mark, then the live `end` record; If-Match as on /entries (412: nothing written)",
                "parameters": [sid, answer, if_match, incarnation, key],
                "requestBody": body(ref("AnswerEnd")),
                "responses": {
                    "201": created("The closing entry", ref("Written")),
                    **write_errors,
                    **conflict,
                },
            }
        },
    }


def _answer_schemas() -> dict[str, Any]:
    turn_step = {"turn": {"type": ["integer", "null"]}, "step": {"type": ["integer", "null"]}}
    delta = {
        "type": "object",
        "required": ["text"],
        "additionalProperties": False,
        "properties": {
            "text": {"type": "string", "description": "the piece of text, reasoning or tool-call arguments"},
            "kind": {"type": "string", "enum": ["text", "reasoning", "tool-call"], "default": "text"},
            "callId": {"type": "string", "minLength": 1, "description": "tool-call deltas only (required)"},
            "name": {"type": "string", "description": "tool-call deltas only (the first one of a call)"},
        },
    }
    return {
        "AnswerBegin": {"type": "object", "additionalProperties": False, "properties": turn_step},
        "Answer": {
            "type": "object",
            "properties": {
                "answer": {"type": "string"},
                "n": {"type": "integer", "description": "the log's n when the answer began (end's `begun_at`)"},
                "incarnation": {"type": ["string", "null"]},
                "begin_id": {"type": ["string", "null"], "description": "the begin's live id (end's `begin_id`)"},
            },
        },
        "Delta": delta,
        "DeltaBatch": {
            "type": "object",
            "required": ["first_index", "deltas"],
            "additionalProperties": False,
            "properties": {
                "first_index": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "the first delta's index in the answer",
                },
                "deltas": {
                    "type": "array",
                    "items": {"$ref": "#/components/schemas/Delta"},
                    "description": "none: a heartbeat (the writer is alive, nothing to send)",
                },
                **turn_step,
            },
        },
        "AnswerEnd": {
            "type": "object",
            "required": ["reason", "begun_at"],
            "additionalProperties": False,
            "properties": {
                "reason": {"type": "string", "enum": ["committed", "interrupted"]},
                "begun_at": {"type": "integer", "minimum": 0, "description": "the `n` the begin answered"},
                "begin_id": {"type": "string", "description": "the begin's live id: older live records are trimmed"},
                **turn_step,
                "content": {
                    "type": "array",
                    "items": {"type": "object"},
                    "description": "default: assembled from the deltas",
                },
                "usage": {"type": "object"},
                "meta": {"type": "object"},
                "cause": {"type": "string", "enum": ["cancelled", "error"], "description": "an interruption's reason"},
                "expected_n": {"type": "integer", "minimum": 0, "description": "as If-Match"},
            },
        },
    }


def _write_schemas(ref: Callable[[str], dict[str, str]]) -> dict[str, Any]:
    new_entry = {
        "type": "object",
        "required": ["type", "data"],
        "additionalProperties": False,
        "properties": {
            "type": {"type": "string", "description": "e.g. user/message, assistant/message, tool/result, cut"},
            "data": {"type": "object"},
            "meta": {"type": ["object", "null"]},
            "surface": {"type": ["object", "null"], "description": "dsh {surfaceOp, sourceEventSeqs}"},
            "time": {"type": ["integer", "null"], "minimum": 0, "description": "ms; default: the server's clock"},
        },
    }
    return {
        "NewEntry": new_entry,
        "AppendBody": {
            "oneOf": [
                ref("NewEntry"),
                {"type": "array", "items": ref("NewEntry"), "minItems": 1},
                {
                    "type": "object",
                    "required": ["entries"],
                    "properties": {"entries": {"type": "array", "items": ref("NewEntry"), "minItems": 1}},
                },
            ]
        },
        "CreateSession": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "id": {"type": "string", "description": "default: session-<uuid hex> (behind a tenant's prefix)"},
                "title": {"type": ["string", "null"]},
                "origin": {},
                "delegation_depth": {"type": "integer", "minimum": 0},
                "ttl": {"type": "number", "exclusiveMinimum": 0, "description": "seconds: an ephemeral session"},
                "entries": {"type": "array", "items": ref("NewEntry")},
                "created_at": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "ms since the epoch, kept as given (default: the server's clock)",
                },
            },
        },
        "BranchBody": {
            "type": "object",
            "required": ["at"],
            "additionalProperties": False,
            "properties": {
                "at": {"type": "integer", "minimum": 0},
                "id": {"type": "string", "description": "default: <parent>:branch:<hex>"},
                "delegation_depth": {"type": "integer", "minimum": 0},
                "title": {"type": ["string", "null"]},
                "origin": {},
            },
        },
        "ForkBody": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"boundary": {"type": "integer", "minimum": 0}, "id": {"type": "string"}},
        },
        "Written": {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "description": "the session's n after these entries"},
                "entries": {"type": "array", "items": ref("Entry")},
            },
        },
        **_answer_schemas(),
        "Conflict": {
            "type": "object",
            "properties": {
                "error": {"type": "string", "const": "conflict"},
                "message": {"type": "string"},
                "expected_n": {"type": "integer"},
                "actual_n": {"type": "integer"},
            },
        },
    }
