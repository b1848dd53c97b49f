"""The web viewer in a real browser: headless Chromium, driven over the Chrome DevTools Protocol
(``--remote-debugging-pipe``: NUL-separated JSON on file descriptors 3 and 4, so no websocket
client is needed), watches a session while a writer appends to it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import anyio
import pytest

from redis_session import RedisSessionStore, SessionHeader

from support import running_gateway

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


pytestmark = [
    pytest.mark.anyio,
    pytest.mark.browser,
    pytest.mark.skipif(
        not os.access(CHROMIUM, os.X_OK),
        reason=f"Chromium is not installed at {CHROMIUM} (apt-get install chromium, or set $CHROMIUM)",
    ),
]


# Chromium reads CDP from fd 3 and writes to fd 4. Popen cannot place descriptors at given numbers
# without a preexec_fn (unsafe with threads), so a tiny Python puts them there, then execs Chromium.
_TRAMPOLINE = """
import fcntl, os, sys
high = [fcntl.fcntl(int(fd), fcntl.F_DUPFD, 10) for fd in sys.argv[1:3]]  # out of the way of 3, 4
for fd in sys.argv[1:3]:
    os.close(int(fd))
os.dup2(high[0], 3)
os.dup2(high[1], 4)  # dup2 makes both inheritable
os.execv(sys.argv[3], sys.argv[3:])
"""


class Chromium:
    """Headless Chromium with a CDP session on one page. Blocking pipe I/O runs in a thread."""

    def __init__(self) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="rs-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _TRAMPOLINE,
                str(to_browser_r),
                str(from_browser_w),
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                f"--user-data-dir={self._profile.name}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            pass_fds=(to_browser_r, from_browser_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._next_id = 0
        self.session: str | None = None

    def _read_message(self) -> dict[str, Any]:
        while b"\0" not in self._buf:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        msg: dict[str, Any] = json.loads(raw)
        return msg

    def _call(self, method: str, params: dict[str, Any], session: str | None) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result

    async def call(self, method: str, params: dict[str, Any] | None = None, *, page: bool = True) -> dict[str, Any]:
        session = self.session if page else None
        return await anyio.to_thread.run_sync(self._call, method, params or {}, session)

    async def open(self, url: str) -> None:
        target = await self.call("Target.createTarget", {"url": "about:blank"}, page=False)
        attached = await self.call(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, page=False
        )
        self.session = attached["sessionId"]
        await self.call("Runtime.enable")
        await self.call("Page.navigate", {"url": url})

    async def eval(self, expression: str) -> Any:
        res = await self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    async def wait_for(self, expression: str, seconds: float = 10.0) -> Any:
        """Poll `expression` in the page until it is truthy; its value. While the page is still
        loading (the element it names is not there yet) the expression may throw: that counts as
        not yet, and the last error is reported if time runs out."""
        last: RuntimeError | None = None
        try:
            with anyio.fail_after(seconds):
                while True:
                    try:
                        value = await self.eval(expression)
                    except RuntimeError as e:
                        last, value = e, None
                    if value:
                        return value
                    await anyio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(f"not true within {seconds}s: {expression} (last error: {last})") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call("Browser.close", {}, None)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        self._profile.cleanup()


@contextlib.contextmanager
def chromium() -> Iterator[Chromium]:
    browser = Chromium()
    try:
        yield browser
    finally:
        browser.close()


ENTRY_TEXT = (
    "(n => { const e = document.querySelector('#entries [data-n=\"' + n + '\"]'); return e && e.textContent; })"
)


@pytest.mark.parametrize("token", [None, "s3cret+token/x"])
async def test_viewer_shows_entries_as_they_are_appended(redis_store: RedisSessionStore, token: str | None) -> None:
    sid = "chat:ü/1"  # `:`, `/` and unicode on their way through URLs, hashes and EventSource
    await redis_store.create(
        SessionHeader(id=sid, title="browser test"), [("user/message", {"content": "hello from the test"})]
    )
    await redis_store.create(SessionHeader(id=f"{sid}:branch", parent=sid, at=1))
    with anyio.fail_after(45), chromium() as browser:
        async with running_gateway(redis_store, token=token) as base:
            query = f"?token={quote(token, safe='')}" if token else ""
            await browser.open(f"{base}/{query}#{quote(sid, safe='')}")

            # the backlog, the live connection, the derived messages and the branch
            assert "hello from the test" in await browser.wait_for(f"{ENTRY_TEXT}(0)")
            await browser.wait_for("document.getElementById('status').textContent === 'live'")
            await browser.wait_for("!!document.querySelector('#messages .msg.user')")
            assert "branch" in await browser.wait_for("document.getElementById('family').textContent")
            assert await browser.eval("document.querySelector('#sessions li.active').dataset.id") == sid

            # a writer appends: a mark, a streamed assistant reply, then the reply itself
            await redis_store.put(sid, None, [("test/mark", {"marker": "appended-while-watching"})])
            assert "appended-while-watching" in await browser.wait_for(f"{ENTRY_TEXT}(1)")
            for piece in ["The answer", " is", " 42."]:
                await redis_store.put(sid, None, [("assistant/chunk", {"turn": 1, "step": 1, "chunk": piece})])
                await anyio.sleep(0.05)
            streamed = await browser.wait_for(
                "(() => { const s = document.querySelector('#entries .stream .body');"
                " return s && s.textContent === 'The answer is 42.' && s.textContent; })()"
            )
            assert streamed == "The answer is 42."
            await redis_store.put(sid, None, [("assistant/message", {"content": "The answer is 42."})])
            await browser.wait_for(f"{ENTRY_TEXT}(5)")
            assistant = await browser.wait_for(
                "(() => { const m = document.querySelector('#messages .msg.assistant .content');"
                " return m && m.textContent; })()"
            )
            assert assistant == "The answer is 42."

            # the streaming draft shows, then clears when the reply is committed
            await redis_store.set_draft(sid, {"content": "thinking about it"})
            assert await browser.wait_for(
                "!document.getElementById('draft').hidden && document.getElementById('draft').textContent"
            ) == ("thinking about it")
            await redis_store.set_draft(sid, None)
            await browser.wait_for("document.getElementById('draft').hidden")

            rows = await browser.eval("[...document.querySelectorAll('#entries li')].map(li => li.dataset.n)")
            assert rows == ["0", "1", "2", "5"]  # the three chunks share one row


async def test_viewer_stays_live_header_cut_branches_and_list(redis_store: RedisSessionStore) -> None:
    """Issue 18: n, the last cut, the branch tree, the session list and the newest entry all follow
    a session a writer appends to, compacts and branches, each within a second."""
    from redis_session import Sessions

    sessions = Sessions(redis_store)
    s = await sessions.open("live-1")
    await s.append("user/message", {"content": "first"})

    async def within_1s(browser: Chromium, expression: str) -> Any:
        return await browser.wait_for(expression, seconds=1.0)

    with anyio.fail_after(60), chromium() as browser:
        async with running_gateway(redis_store) as base:
            await browser.open(f"{base}/#live-1")
            await browser.wait_for("document.getElementById('status').textContent === 'live'")
            await browser.wait_for("document.getElementById('n').textContent === '1'")
            await anyio.sleep(0.5)  # the store-wide event stream is connected by now

            for turn in (1, 2, 3):
                await s.append_many(
                    [
                        ("turn/start", {"turn": turn}),
                        ("user/message", {"content": f"question {turn}"}),
                        ("assistant/message", {"turn": turn, "content": f"answer {turn}"}),
                        ("turn/end", {"turn": turn, "reason": "completed"}),
                    ]
                )
            assert await within_1s(browser, "document.getElementById('n').textContent === '13'")
            assert "answer 3" in await within_1s(browser, f"{ENTRY_TEXT}(11)")
            # turns are groups, collapsible
            assert await browser.eval("document.querySelectorAll('#entries li.turn-group').length") == 3
            await browser.eval("document.querySelector('#entries li.turn-group .turn-head').click()")
            assert await browser.eval("document.querySelector('#entries .turn-group').classList.contains('collapsed')")

            await s.compact(before=9, summary=[{"role": "user", "content": "summary"}], reason="token_limit")
            assert await within_1s(browser, "document.getElementById('last-cut').textContent === '13'")
            assert await within_1s(browser, "document.getElementById('n').textContent === '14'")

            b = await sessions.branch("live-1", 5, branch_id="live-1-alt")
            assert await within_1s(browser, "!!document.querySelector('#tree li[data-id=\"live-1-alt\"] a')")
            assert await within_1s(browser, "!!document.querySelector('#sessions li[data-id=\"live-1-alt\"]')")

            # filter by entry type: only cuts
            await browser.eval(
                "(() => { const f = document.getElementById('type-filter'); f.value = 'cut';"
                " f.dispatchEvent(new Event('change')); })()"
            )
            visible = await browser.eval(
                "[...document.querySelectorAll('#entries li.entry')]"
                ".filter(li => !li.hidden).map(li => li.dataset.type)"
            )
            assert visible == ["cut"]
            await browser.eval(
                "(() => { const f = document.getElementById('type-filter'); f.value = '';"
                " f.dispatchEvent(new Event('change')); })()"
            )
            # the provider-format messages are one click away
            href = await browser.eval("document.getElementById('raw-openai').href")
            assert href.endswith("/sessions/live-1/messages?format=openai")

            # auto-follow, unless the user scrolled up; then "jump to live"
            await s.append_many([("test/mark", {"i": i}) for i in range(80)])
            assert await within_1s(browser, f"{ENTRY_TEXT}(93)")
            assert await within_1s(  # scrolled in the next frame (one layout per frame, not per entry)
                browser,
                "(() => { const b = document.getElementById('entries-scroll');"
                " return b.scrollHeight - b.scrollTop - b.clientHeight < 40; })()",
            )
            await browser.eval("document.getElementById('entries-scroll').scrollTop = 0")
            assert await within_1s(browser, "!document.getElementById('jump').hidden")
            await s.append("test/mark", {"i": "while scrolled up"})
            await within_1s(browser, f"{ENTRY_TEXT}(94)")
            assert await browser.eval("document.getElementById('entries-scroll').scrollTop") == 0
            await browser.eval("document.getElementById('jump').click()")
            assert await within_1s(
                browser,
                "(() => { const b = document.getElementById('entries-scroll');"
                " return b.scrollHeight - b.scrollTop - b.clientHeight < 40; })()",
            )
            # the branch is a link in the tree: it opens the branch
            await browser.eval("document.querySelector('#tree li[data-id=\"live-1-alt\"] a').click()")
            assert await within_1s(browser, "document.getElementById('n').textContent === '5'")
            assert await within_1s(browser, "document.getElementById('tree').textContent.includes('live-1')")
            assert b.id == "live-1-alt"
