"""`SessionLease`: the cooperative "one writer per session" lock a `Session` handle holds
(``async with s.lease():``), renewed in the background and checked before each of the handle's
writes (docs/design.md §5)."""

from __future__ import annotations

import logging
import uuid
from types import TracebackType
from typing import Any, Protocol

import anyio

from .errors import LeaseHeldError, LeaseLostError, SessionReplacedError
from .model import SessionHeader, ttl_ms
from .store import SessionStore

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL = 30.0


class LeaseHolder(Protocol):
    """What a lease needs of the handle holding it (a `Session`): its id, its header (the life it
    holds the lease in), its store, and the slot where the handle keeps the lease it holds."""

    _store: SessionStore
    _lease: SessionLease | None

    @property
    def id(self) -> str: ...

    @property
    def header(self) -> SessionHeader: ...


class SessionLease:
    """The writer lease of one session, held by one `Session` handle (``async with s.lease():``).

    Entering acquires the store's lease with a fresh token (`LeaseHeldError` at once when another
    holder has it); a background task renews it every ttl/3 while the block runs; leaving stops the
    renewal and releases it (also on error or cancellation).

    **Fencing.** While a handle holds a lease, each of its writes first checks, locally and without
    a round trip, that the lease is still *valid*: the last renewal succeeded and was sent less
    than ``0.9 * ttl`` ago (the server's expiry runs from when it received the renewal, so this is
    a safe under-estimate with a 10% margin for latency). A write after that raises
    `LeaseLostError` and writes nothing. A renewal the server refuses (the lease expired and another
    token took it) invalidates the lease at once. The store's append script does not check the
    token, so a write whose check passed just before expiry may still land after it: the real
    fence is ``expected_n`` — a new holder works from the head it read, so a late write of the old
    holder either lands before that read (and the new holder sees it) or makes the new holder's
    next write conflict. Entries can never interleave silently.
    """

    def __init__(self, session: LeaseHolder, ttl: float) -> None:
        self.session = session
        self.ttl_ms = ttl_ms(ttl)  # checks it: InvalidArgumentError for a non-positive or non-number ttl
        self.ttl = float(ttl)
        self.token = uuid.uuid4().hex
        self._valid_until = 0.0
        self._lost = False
        self._tg: Any = None

    @property
    def held(self) -> bool:
        """Whether the lease is (as far as this process can tell) still ours."""
        return not self._lost and anyio.current_time() < self._valid_until

    def check(self) -> None:
        """Raise `LeaseLostError` unless `held`."""
        if not self.held:
            why = "was taken over" if self._lost else "expired (renewals failed)"
            raise LeaseLostError(f"the lease on session {self.session.id!r} {why}; nothing was written")

    async def _acquire(self) -> bool:
        sent = anyio.current_time()
        ok = await self.session._store.acquire_lease(
            self.session.id, self.token, self.ttl_ms, incarnation=self.session.header.incarnation or None
        )
        if ok:
            self._valid_until = sent + self.ttl * 0.9
        return ok

    async def _renew(self) -> None:
        while True:
            await anyio.sleep(self.ttl / 3)
            try:
                ok = await self._acquire()
            except SessionReplacedError:
                self._lost = True  # the id was deleted and created again: that lease is gone with it
                log.warning("the lease on %r ended with its life (the id was re-created)", self.session.id)
                return
            except Exception as e:  # the server is unreachable: keep trying while the lease lasts
                log.warning("renewing the lease on %r failed: %s", self.session.id, e)
                if not self.held:
                    return
                continue
            if not ok:
                self._lost = True
                log.warning("the lease on %r was taken over by another holder", self.session.id)
                return

    async def __aenter__(self) -> SessionLease:
        if self.session._lease is not None:
            raise RuntimeError(f"this handle already holds the lease on {self.session.id!r}")
        if not await self._acquire():
            raise LeaseHeldError(f"session {self.session.id!r}: another holder owns the lease")
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._renew)
        self.session._lease = self
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # The body's own exception propagates untouched: the renewal task group is closed as if
        # the body ended normally (it never raises itself), so nothing is wrapped in a group.
        self.session._lease = None
        self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.session._store.release_lease(self.session.id, self.token)
                except Exception as e:  # it expires on its own
                    log.warning("releasing the lease on %r failed: %s", self.session.id, e)
            self._lost = True


__all__ = ["DEFAULT_LEASE_TTL", "LeaseHolder", "SessionLease"]
