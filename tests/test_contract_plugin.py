"""The reusable contract suite and the pytest plugin, used the way a third-party backend would:
a test file of its own, outside this repository's conftest, run by a separate pytest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from redis_session.testing.contract import SessionStoreContract

THIRD_PARTY = '''
import pytest

from redis_session import RedisSessionStore
from redis_session.testing.contract import SessionStoreContract


class MyStore(RedisSessionStore):
    """A third-party backend (here a subclass, so that it passes)."""


class TestMyStore(SessionStoreContract):
    @pytest.fixture
    async def store(self, redis_session_url, redis_session_prefix, redis_session_cleanup):
        store = MyStore.from_url(redis_session_url, prefix=redis_session_prefix)
        yield store
        await store.aclose()


@pytest.mark.anyio
async def test_the_plugin_store_fixture(redis_session_store, redis_session_prefix):
    assert redis_session_store.prefix == redis_session_prefix


@pytest.fixture
def anyio_backend():
    return "asyncio"
'''


def test_a_third_party_backend_runs_the_contract_with_the_plugin(tmp_path: Path) -> None:
    (tmp_path / "test_my_store.py").write_text(textwrap.dedent(THIRD_PARTY))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "redis_session.testing.pytest_plugin"]
    cmd += ["-k", "create or tail_of_branch or hostile or plugin", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout


def test_the_base_class_is_not_collected_on_its_own() -> None:
    assert not SessionStoreContract.__name__.startswith("Test")
    cases = [name for name in vars(SessionStoreContract) if name.startswith("test_")]
    assert len(cases) >= 50
