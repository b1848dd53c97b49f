"""Runs ADK's own session-service tests (copied from google/adk-python, Apache-2.0) as they are
written: their ``@pytest.mark.asyncio`` marks are registered here and the module's ``pytestmark``
runs them on anyio's pytest plugin (the project does not use pytest-asyncio). The
``session_service`` fixture is the one place changed: it yields our service (on the memory store
and on the real server), ADK 2.13's own ``RedisSessionService`` on the same server, and ADK's
``InMemorySessionService`` as the control.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "asyncio: an async test (run by anyio's plugin in this folder)")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
