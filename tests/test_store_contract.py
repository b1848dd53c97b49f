"""The SessionStore contract on every backend: the memory store, a real server and a real 3+3
cluster (the `store` fixture in conftest.py). The cases themselves are
`redis_session.testing.contract`, reusable by third-party backends."""

from __future__ import annotations

from redis_session.testing.contract import SessionStoreContract


class TestSessionStoreContract(SessionStoreContract):
    """Every contract case, once per backend of the `store` fixture."""
