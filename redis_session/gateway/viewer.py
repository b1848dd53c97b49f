"""The gateway's web viewer page and its Content-Security-Policy."""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib import resources


@cache
def _viewer() -> tuple[bytes, str]:
    """The viewer page, and a Content-Security-Policy that admits exactly its inline script and
    style (by hash) and connections to this origin."""
    html = resources.files("redis_session").joinpath("gateway", "static", "viewer.html").read_bytes()
    text = html.decode()

    def hashes(tag: str) -> str:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.S)
        digests = [base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() for s in found]
        return " ".join(f"'sha256-{d}'" for d in digests)

    csp = (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    )
    return html, csp
