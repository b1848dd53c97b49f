"""Who may call the gateway, and what they may do.

A token carries scopes — ``read`` (every GET), ``write`` (read, plus create, append, branch, fork,
draft, repair), ``admin`` (write, plus delete); each includes the ones before it — and optionally a
session-id ``prefix`` it is confined to (a tenant): such a token sees only ids that start with the
prefix (lists are filtered, any other id answers 404, as if it did not exist) and creates only
such ids. Tokens come from a file or the environment (`load_tokens`, `parse_tokens`); the single
``token=`` of `create_app` is an all-scopes token without a prefix.

Token file formats (`parse_tokens`)::

    # lines: TOKEN [SCOPES [PREFIX]]  (SCOPES comma-separated, default read; `#` comments;
    # `;` also separates entries, for an environment variable)
    9f2c...e1  admin
    a71b...03  write     acme/
    c0d4...9a  read      acme/

    {"tokens": [{"token": "a71b...03", "scopes": ["write"], "prefix": "acme/", "name": "acme pods"}]}

A request presents its token as ``Authorization: Bearer <token>`` or ``?token=<token>``
(EventSource cannot set headers), once: two ``Authorization`` headers, both, or ``?token=`` twice
answer 400 (which one counts is what a proxy and the gateway could disagree on). It is compared
with *every* configured token in constant time
(`hmac.compare_digest` of SHA-256 digests, no early exit), so the answer time says nothing about
which token, or how much of one, matched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote_to_bytes

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import SessionNotFoundError
from .body import Unprocessable, decode_json
from .common import _JSON, PROBE_PATHS, _BadRequest, _error

SCOPES = ("read", "write", "admin")
"""Each scope includes the ones before it."""
TOKENS_ENV = "REDIS_SESSION_TOKENS"
PRINCIPAL = "redis_session.principal"
"""The ASGI scope key under which the authenticated `Token` travels to the handlers."""
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no space (token files)


class Forbidden(Exception):
    """The token is valid but lacks the scope (or the tenant) for this request: a 403."""


@dataclass(frozen=True)
class Token:
    """One bearer token: its scopes (expanded: ``write`` holds ``read``) and tenant prefix."""

    secret: str = field(repr=False)
    scopes: frozenset[str]
    prefix: str | None = None
    name: str = ""

    @classmethod
    def make(cls, secret: str, scopes: Iterable[str] = ("read",), prefix: str | None = None, name: str = "") -> Token:
        if not isinstance(secret, str) or not secret:
            raise ValueError("a token is a non-empty string")
        wanted = list(scopes)
        if not wanted or any(s not in SCOPES for s in wanted):
            raise ValueError(f"scopes must be a non-empty subset of {', '.join(SCOPES)}, got {wanted!r}")
        top = max(SCOPES.index(s) for s in wanted)
        if prefix is not None and (not isinstance(prefix, str) or not prefix):
            raise ValueError("a tenant prefix is a non-empty string")
        return cls(secret, frozenset(SCOPES[: top + 1]), prefix, name)

    def allows(self, scope: str) -> bool:
        return scope in self.scopes

    def sees(self, session_id: str) -> bool:
        return self.prefix is None or session_id.startswith(self.prefix)

    def require(self, scope: str) -> None:
        if scope not in self.scopes:
            raise Forbidden(f"this token may not {scope} (its scopes: {', '.join(sorted(self.scopes))})")

    def check_session(self, session_id: str) -> None:
        """A session outside the tenant does not exist, as far as this token can tell."""
        if not self.sees(session_id):
            raise SessionNotFoundError(session_id)

    def check_new_id(self, session_id: str) -> None:
        """An id this token creates must be inside its tenant (a 403: nothing is revealed)."""
        if not self.sees(session_id):
            raise Forbidden(f"this token creates only sessions whose id starts with {self.prefix!r}")


OPEN = Token.make("open", SCOPES, name="no auth")
"""The principal of every request when the gateway has no tokens."""


def principal(scope: Scope) -> Token:
    token: Token = scope.get(PRINCIPAL, OPEN)
    return token


class TokenSet:
    """The configured tokens; `authenticate` compares a presented one with all of them."""

    def __init__(self, tokens: Sequence[Token]) -> None:
        seen: set[str] = set()
        for t in tokens:
            if t.secret in seen:
                raise ValueError(f"token {t.name or '?'} is configured twice")
            seen.add(t.secret)
        self._tokens = [(hashlib.sha256(t.secret.encode()).digest(), t) for t in tokens]

    def __len__(self) -> int:
        return len(self._tokens)

    def authenticate(self, given: bytes) -> Token | None:
        digest = hashlib.sha256(given).digest()
        found: Token | None = None
        for known, token in self._tokens:  # every one, whatever matched: no early exit
            same = hmac.compare_digest(digest, known)
            found = token if same and found is None else found
        return found


def parse_tokens(text: str, source: str = "tokens") -> list[Token]:
    """Tokens from a token file's text (JSON or lines, see the module doc); ValueError names the
    source and the entry at fault."""
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        return _parse_json(stripped, source)
    out: list[Token] = []
    for lineno, raw in enumerate(re.split(r"[\n;]", text), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 3:
            raise ValueError(f"{source}: entry {lineno}: expected TOKEN [SCOPES [PREFIX]], got {len(parts)} fields")
        scopes = parts[1].split(",") if len(parts) > 1 else ["read"]
        try:
            if not _TOKEN_CHARS.fullmatch(parts[0]) or "," in parts[0]:
                raise ValueError("a token in a token file is printable ASCII without spaces, ';' or ','")
            out.append(Token.make(parts[0], scopes, parts[2] if len(parts) > 2 else None, f"{source}:{lineno}"))
        except ValueError as e:
            raise ValueError(f"{source}: entry {lineno}: {e}") from None
    return out


def _parse_json(text: str, source: str) -> list[Token]:
    try:
        doc: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON: {e}") from None
    items = doc.get("tokens") if isinstance(doc, Mapping) else doc
    if not isinstance(items, list):
        raise ValueError(f'{source}: expected {{"tokens": [...]}} or a list of tokens')
    out: list[Token] = []
    for i, item in enumerate(items):
        try:
            if not isinstance(item, Mapping) or set(item) - {"token", "scopes", "prefix", "name"}:
                raise ValueError("each token is {token, scopes?, prefix?, name?}")
            scopes = item.get("scopes", ["read"])
            if isinstance(scopes, str) or not isinstance(scopes, list):
                raise ValueError("scopes is a list of strings")
            secret = item.get("token")
            if not isinstance(secret, str):
                raise ValueError("token is a string")
            out.append(Token.make(secret, scopes, item.get("prefix"), str(item.get("name") or f"#{i}")))
        except ValueError as e:
            raise ValueError(f"{source}: token {i}: {e}") from None
    return out


def load_tokens(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> list[Token]:
    """Tokens from `path` (a token file) and the ``REDIS_SESSION_TOKENS`` variable of `env`
    (default ``os.environ``), both if both are given."""
    out: list[Token] = []
    if path is not None:
        out += parse_tokens(Path(path).read_text(encoding="utf-8"), str(path))
    text = (os.environ if env is None else env).get(TOKENS_ENV)
    if text:
        out += parse_tokens(text, TOKENS_ENV)
    return out


COOKIE = "rs_token"
"""The viewer's sign-in cookie (HttpOnly, SameSite=Strict): set by ``POST /signin``, so the token
never sits in a URL (history, logs, Referer)."""
SIGNIN_LIMIT = 8192


class AmbiguousCredentials(Exception):
    """More than one ``Authorization`` header or ``?token=``: a 400, send it once."""


class _TokenAuth:
    """401 for every HTTP request without a known token (``Authorization: Bearer``, the sign-in
    cookie, or ``?token=`` for EventSource clients that can set neither); the token found travels
    to the handlers in the ASGI scope (`principal`). ``POST /signin`` (a form or JSON ``{token}``)
    checks a token and sets the cookie; ``POST /signout`` clears it."""

    def __init__(self, app: ASGIApp, tokens: TokenSet) -> None:
        self.app = app
        self.tokens = tokens

    def _find(self, scope: Scope) -> Token | None:
        """The token the request presents: its one ``Authorization: Bearer`` or ``?token=``
        (`AmbiguousCredentials` when it sends more than one of them: which one counts is what a
        proxy appending its own and the client's would disagree on), else the sign-in cookie."""
        given: list[bytes | None] = []  # None: an Authorization that is no bearer token
        cookies: list[bytes] = []
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                given.append(token.strip() if scheme.lower() == b"bearer" else None)
            elif name == b"cookie":
                for part in value.split(b";"):
                    k, _, v = part.strip().partition(b"=")
                    if k == COOKIE.encode() and v:
                        cookies.append(unquote_to_bytes(v))
        query = scope.get("query_string", b"").decode("latin-1")
        given += [v.encode() for k, v in parse_qsl(query, keep_blank_values=True) if k == "token"]
        if len(given) > 1:
            raise AmbiguousCredentials(
                f"the request presents {len(given)} credentials (Authorization headers and ?token=): send one"
            )
        if not given and len(set(cookies)) > 1:
            # two sign-in cookies that differ (one set for a parent domain or another path by
            # someone else's page): which one counts must not be the browser's order
            shown = len(set(cookies))
            raise AmbiguousCredentials(f"the request presents {shown} different {COOKIE} cookies: sign in again")
        for secret in [*given, *cookies]:
            if secret and (token := self.tokens.authenticate(secret)):
                return token
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # the probes carry no session data, so orchestrators need no token
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST" and scope["path"] in ("/signin", "/signout"):
            await (await self._sign(scope, receive))(scope, receive, send)
            return
        try:
            token = self._find(scope)
        except AmbiguousCredentials as e:  # before any token is looked at: 400, whatever they are
            await _error(400, "bad_request", str(e))(scope, receive, send)
            return
        if token is not None:
            await self.app({**scope, PRINCIPAL: token}, receive, send)
            return
        headers = {"WWW-Authenticate": "Bearer"}
        response: Response
        if scope["path"] in ("/", scope.get("root_path", "") + "/") and _accepts_html(scope):
            response = _login_page(401)  # a person at the viewer's address: the sign-in form
        else:
            response = _error(401, "unauthorized", "a bearer token is required", headers)
        await response(scope, receive, send)

    async def _sign(self, scope: Scope, receive: Receive) -> Response:
        form = any(k == b"content-type" and b"form" in v for k, v in scope.get("headers", ()))
        # Secure over https, and whenever the browser reached the gateway by a name that is not this
        # machine's own (a TLS ingress in front of it forwards plain http): only a local gateway
        # (localhost, 127.0.0.1, [::1]) may set it without, and browsers keep Secure cookies there too
        secure = "; Secure" if scope.get("scheme") == "https" or not _local_host(scope) else ""
        attrs = f"; Path={scope.get('root_path', '') or '/'}; HttpOnly; SameSite=Strict{secure}"
        if scope["path"] == "/signout":
            return Response(status_code=303, headers={"Location": "./", "Set-Cookie": f"{COOKIE}={attrs}; Max-Age=0"})
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > SIGNIN_LIMIT):
            return _error(413, "too_large", f"a sign-in body is at most {SIGNIN_LIMIT} bytes")
        body = await _read_small(receive, SIGNIN_LIMIT)
        given: str | None = None
        next_hash = ""
        if form:
            pairs = parse_qsl((body or b"").decode("utf-8", "replace"), keep_blank_values=True)
            tokens = [v for k, v in pairs if k == "token"]
            if len(tokens) > 1:
                return _login_page(400, "Send one token.")
            given = tokens[0] if tokens else None
            raw_next = next((v for k, v in pairs if k == "next"), "")
            next_hash = raw_next if raw_next.startswith("#") and "\n" not in raw_next else ""
        elif body:
            try:  # the one body decoder of every route: I-JSON, or a 400/422 and no cookie
                doc = decode_json(body)
            except _BadRequest as e:
                return _error(400, "bad_request", str(e))
            except Unprocessable as e:
                return _JSON({"error": "invalid", "message": str(e), "path": e.path}, status_code=422)
            given = doc.get("token") if isinstance(doc, dict) and isinstance(doc.get("token"), str) else None
        token = self.tokens.authenticate(given.encode()) if given else None
        if token is None:
            if form:
                return _login_page(401, "That token is not one this gateway knows.")
            return _error(401, "unauthorized", "unknown token", {"WWW-Authenticate": "Bearer"})
        cookie = f"{COOKIE}={quote(given or '', safe='')}{attrs}"
        if form:
            return Response(
                status_code=303, headers={"Location": "./" + quote(next_hash, safe="#/%:"), "Set-Cookie": cookie}
            )
        return Response(status_code=204, headers={"Set-Cookie": cookie})


def _local_host(scope: Scope) -> bool:
    """Whether the request names this machine (its Host is localhost or a loopback address)."""
    host = next((v for k, v in scope.get("headers", ()) if k == b"host"), b"").decode("latin-1").lower()
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]", 1)[0] + "]"
    return name in ("localhost", "[::1]") or name.startswith("127.")


async def _read_small(receive: Receive, limit: int) -> bytes | None:
    """A request body of at most `limit` bytes (None when it is larger)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _accepts_html(scope: Scope) -> bool:
    return any(k == b"accept" and b"text/html" in v for k, v in scope.get("headers", ()))


_LOGIN_STYLE = """
  :root { --bg: #0f1115; --panel: #161a21; --line: #262c36; --text: #d7dce4; --dim: #7d8696;
    --accent: #79c0ff; --bad: #ff7b72; font: 14px/1.5 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
  * { box-sizing: border-box; }
  body { margin: 0; min-height: 100vh; display: grid; place-items: center; background: var(--bg); color: var(--text); }
  form { width: min(26em, 92vw); padding: 1.6em; background: var(--panel); border: 1px solid var(--line);
    border-radius: 8px; }
  h1 { font-size: 16px; margin: 0 0 .3em; }
  p { color: var(--dim); margin: 0 0 1em; }
  label { display: block; margin-bottom: .3em; }
  input[type=password] { width: 100%; font: inherit; padding: .5em .6em; background: var(--bg); color: var(--text);
    border: 1px solid var(--line); border-radius: 4px; }
  input[type=password]:focus { outline: none; border-color: var(--accent); }
  button { margin-top: 1em; width: 100%; font: inherit; padding: .5em; border: 0; border-radius: 4px;
    background: var(--accent); color: #0b1a2b; cursor: pointer; font-weight: bold; }
  .error { color: var(--bad); margin: .6em 0 0; }
"""
_LOGIN_SCRIPT = "document.getElementById('next').value = location.hash;"


def _login_page(status: int, error: str = "") -> Response:
    """The styled "this gateway needs a token" page: a form that POSTs to /signin (the token is sent
    in the body and kept in an HttpOnly cookie, never in the URL)."""
    import html as html_

    err = f'<p class="error" role="alert">{html_.escape(error)}</p>' if error else ""
    page = (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>redis-session viewer: sign in</title><link rel=icon href='data:,'>"
        f"<style>{_LOGIN_STYLE}</style></head><body>"
        '<form method="post" action="signin">'
        "<h1>redis-session</h1><p>This gateway needs a token.</p>"
        '<label for="token">Token</label>'
        '<input id="token" type="password" name="token" autocomplete="current-password" autofocus required>'
        '<input id="next" type="hidden" name="next" value="">'
        f"<button>Sign in</button>{err}</form>"
        f"<script>{_LOGIN_SCRIPT}</script></body></html>"
    )
    csp = (
        f"default-src 'none'; style-src {_sha(_LOGIN_STYLE)}; script-src {_sha(_LOGIN_SCRIPT)}; "
        "img-src data:; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    )
    headers = {"WWW-Authenticate": "Bearer", "Content-Security-Policy": csp, "Cache-Control": "no-store"}
    return Response(page.encode(), status, headers, media_type="text/html; charset=utf-8")


def _sha(text: str) -> str:
    import base64

    return f"'sha256-{base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()}'"
