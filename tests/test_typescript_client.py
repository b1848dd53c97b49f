"""The TypeScript client (clients/typescript) against a real gateway on a real server: `npm ci`,
then `npm test` (tsc, then `node --test` over the compiled tests: the client, and the seed flows
through the ChatLuna and dsh stores) with the gateway's URL and tokens in the environment."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import anyio
import pytest

from redis_session import RedisSessionStore, Sessions
from redis_session.gateway.auth import Token

from support import running_gateway

pytestmark = pytest.mark.anyio

PACKAGE = Path(__file__).resolve().parent.parent / "clients" / "typescript"
ADMIN, READ, TENANT = "ts-admin-0123456789", "ts-read-0123456789", "ts-tenant-0123456789"
STALE_AFTER = 3.0


def _node_missing() -> str | None:
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (CI installs Debian's nodejs and npm)"
    return None


@pytest.mark.skipif(_node_missing() is not None, reason=_node_missing() or "")
async def test_typescript_client_against_a_real_gateway(
    redis_store: RedisSessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_store.block_ms = 200  # an idle tail notices a deletion this soon
    # the gateway's repair takes an answer quiet for 3 s (not 30) for dead: the heartbeat test
    # (answers.test.ts) keeps a live writer quiet longer than that and sees it left alone
    monkeypatch.setitem(Sessions.repair.__kwdefaults__, "stale_after", STALE_AFTER)
    tokens = [
        Token.make(ADMIN, ["admin"], name="ts admin"),
        Token.make(READ, ["read"], name="ts reader"),
        Token.make(TENANT, ["write"], "tenant/", name="ts tenant"),
    ]
    env = {
        **os.environ,
        "RS_TOKEN_ADMIN": ADMIN,
        "RS_TOKEN_READ": READ,
        "RS_TOKEN_TENANT": TENANT,
        "RS_TENANT_PREFIX": "tenant/",
        "RS_STALE_AFTER_MS": str(round(STALE_AFTER * 1000)),
        "npm_config_audit": "false",
        "npm_config_fund": "false",
        "npm_config_update_notifier": "false",
    }
    with anyio.fail_after(600):
        if not (PACKAGE / "node_modules" / "typescript").is_dir():
            ci = await anyio.run_process(["npm", "ci"], cwd=PACKAGE, env=env, check=False)
            assert ci.returncode == 0, (ci.stdout + ci.stderr).decode()[-4000:]
        async with running_gateway(redis_store, tokens=tokens, heartbeat=1.0) as base:
            env["REDIS_SESSION_URL"] = base
            run = await anyio.run_process(["npm", "test"], cwd=PACKAGE, env=env, check=False)
    out = (run.stdout + run.stderr).decode()
    assert run.returncode == 0, out[-8000:]
    assert "# fail 0" in out and "# skipped 0" in out, out[-4000:]
    # every test the suite declares ran and passed: none skipped, none lost to a broken file
    declared = sum(
        len(re.findall(r"^\s*(?:test|it)\(", f.read_text(), re.M)) for f in (PACKAGE / "test").glob("*.test.ts")
    )
    assert declared >= 30 and f"# pass {declared}" in out, (declared, out[-4000:])
