"""The cold-tier half of `RedisSessionStore`: archived segments of a session's log in an
object store (`redis_session.cold`), and the header field ``cold`` that names them.

Reads splice archived entries in front of the hot stream (`_with_cold`, `_own_range`,
`_cold_gap`); the archiver's steps (`cold_state`, `begin_upload`, `commit_archive`,
`commit_restore`, ...) commit through ``lua/archive.lua``; objects of a life that is over go only
once its end is as durable as the store's writes (`_durable_fence`). The store's connection
primitives (`_raw`, `_pipeline`, `_eval`, `_send_write`) come from `store.py`.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..cold.segments import ColdSegment, ColdTier, cold_end, decode_cold, encode_cold, hot_start, segment_name
from ..errors import (
    SegmentMissingError,
    SessionError,
    SessionNotFoundError,
    SessionReplacedError,
    StoreUnavailableError,
)
from ..keys import Keys, validate_session_id
from ..model import Entry, legacy_incarnation, now_ms
from ..store.protocol import ColdState
from .replies import as_int, as_str, confirmed, io_guard, stream_fields
from .rows import rows_to_entries
from .wire import pack

log = logging.getLogger("redis_session.redis.store")

_STAGING_TTL_MS = 3_600_000  # a restore's staging stream, if its process dies before the script


class ColdTierOps:
    """Mixed into `RedisSessionStore`: what the store does with the cold tier."""

    if TYPE_CHECKING:  # provided by RedisSessionStore
        keys: Keys
        prefix: str
        cold: ColdTier | None
        _durable: bytes
        _last_acks: Any

        async def _raw(self, *args: Any) -> Any: ...
        async def _pipeline(self, *commands: Sequence[Any]) -> builtins.list[Any]: ...
        async def _eval(self, name: str, keys: Sequence[str], args: Sequence[Any], *, durable: bool = False) -> Any: ...
        async def _send_write(
            self, route: str | bytes, packed: bytes, count: int, soft_tail: bool = False
        ) -> builtins.list[Any]: ...
        @staticmethod
        def _check_incarnation(session_id: str, expected: str | None, inc_raw: Any, born_raw: Any) -> str: ...
        async def read(
            self, session_id: str, start: int = 0, stop: int | None = None, *, incarnation: str | None = None
        ) -> builtins.list[Entry]: ...

    async def cold_tier(self) -> ColdTier | None:
        """The cold tier: the one given, else the object store recorded under ``{prefix}:cold:url``."""
        if self.cold is None:
            with io_guard():
                url = as_str(await self._raw("GET", self.keys.cold_url))
            if url:
                self.cold = ColdTier(url, prefix=self.prefix)
        return self.cold

    async def _tier_for(self, session_id: str, segments: Sequence[ColdSegment]) -> ColdTier:
        tier = await self.cold_tier()
        if tier is None:
            seg = segments[0]
            raise SegmentMissingError(
                session_id,
                seg.lo,
                seg.hi,
                "?",
                f"no cold tier: set one (RedisSessionStore(cold=…) or {self.keys.cold_url})",
            )
        return tier

    async def _with_cold(
        self,
        session_id: str,
        inc: str,
        cold_raw: bytes | None,
        lo: int,
        stop: int | None,
        n: int,
        own: builtins.list[Entry],
        incarnation: str | None,
    ) -> builtins.list[Entry]:
        """`own` (the hot stream's part of a read from `lo`) with the archived entries before it."""
        if cold_raw is None or min(n if stop is None else stop, n, hot_start(cold_raw)) <= lo:
            return own  # the range is all hot (a tail read): nothing decoded
        segments = decode_cold(cold_raw)
        hi = min(n if stop is None else stop, n, cold_end(segments, lo))
        tier = await self._tier_for(session_id, segments)
        try:
            cold = await tier.read(session_id, inc, segments, lo, hi)
        except SegmentMissingError:
            # a restore or a delete removes objects after its script: if the header moved on, so
            # does this read (it raises for a deleted session); else the object is really gone
            with io_guard():
                now = await self._raw("HGET", self.keys.hdr(session_id), "cold")
            if now == cold_raw:
                raise
            fresh = await self.read(session_id, lo, stop, incarnation=incarnation or inc)
            return [e for e in fresh if e.n < hi] + own
        return cold + own

    async def _own_range(self, session_id: str, lo: int, hi: int, _depth: int = 0) -> builtins.list[Entry]:
        """Entries [lo, hi) of one session's own log (an ancestor a branch reads): its hot
        stream, and its archived segments where the range starts below them."""
        if hi <= lo:
            return []
        hdr_key = self.keys.hdr(session_id)
        for _attempt in range(3):
            (cold_raw, inc_raw, born_raw), rows, after = await self._pipeline(
                ("HMGET", hdr_key, "cold", "incarnation", "created_at"),
                ("XRANGE", self.keys.log(session_id), f"{lo}-1", f"{hi - 1}-1"),
                ("HGET", hdr_key, "cold"),
            )
            if after == cold_raw:
                break
        else:
            raise StoreUnavailableError(f"session {session_id!r} was archived or restored during every read attempt")
        own = rows_to_entries(rows)
        if cold_raw is None:
            return own
        inc = self._check_incarnation(session_id, None, inc_raw, born_raw)
        segments = decode_cold(cold_raw)
        top = min(hi, cold_end(segments, lo))
        if top <= lo:
            return own
        tier = await self._tier_for(session_id, segments)
        try:
            return await tier.read(session_id, inc, segments, lo, top) + own
        except SegmentMissingError:
            # a merge or a restore deletes the objects it replaced after its script: if the
            # header moved on, so does this read
            with io_guard():
                now = await self._raw("HGET", hdr_key, "cold")
            if now == cold_raw or _depth > 3:
                raise
            return await self._own_range(session_id, lo, hi, _depth + 1)

    async def _cold_gap(self, session_id: str, nxt: int, batch: builtins.list[Entry], inc: str) -> builtins.list[Entry]:
        """A tail's `batch` read from the hot stream, with the entries [nxt, first) before it
        that were archived behind the tail (or before its start). Unchanged when there is no
        such gap or the cold tier does not hold it all (the tail's sequence check reports it)."""
        if batch[0].n <= nxt:
            return batch
        got = await self.read(session_id, nxt, batch[0].n, incarnation=inc)
        return got + batch if len(got) == batch[0].n - nxt and got[0].n == nxt else batch

    async def _drop_cold(self, session_id: str, incarnation: str, cold_raw: bytes) -> None:
        """Delete a deleted (or purged) session's segments; what fails here is left to `Archiver.sweep`."""
        with contextlib.suppress(Exception):
            tier = await self.cold_tier()
            if tier is not None and await self._durable_fence(session_id):
                await tier.drop(session_id, incarnation, decode_cold(cold_raw))

    async def _durable_fence(self, session_id: str) -> bool:
        """Whether every write before this call is as durable as the store's writes (a replica
        or the AOF has it): what a delete, a purge or a swap removed may then go from the object
        store too. Unconfirmed, a failover (or a restart) could bring back a header naming the
        segments: they are left to `Archiver.sweep`, which keeps what a header names.

        Two replicated writes that cancel out (a member added to and removed from the session's
        ``coldpending`` set: the same slot, so the same node) and the durability wait, in one
        round trip: the replication stream is ordered, so a replica that acknowledged them has
        everything written before."""
        if not self._durable:
            return True
        key = self.keys.cold_pending(session_id)
        packed = pack(("ZADD", key, 0, "~fence")) + pack(("ZREM", key, "~fence")) + self._durable
        try:
            replies = await self._send_write(key, packed, 3, soft_tail=True)
        except Exception:
            return False
        if confirmed(replies[2]):
            return True
        log.warning("session %s: not confirmed durable; its segment objects are left to the sweep", session_id)
        return False

    async def cold_state(self, session_id: str) -> ColdState | None:
        validate_session_id(session_id)
        with io_guard():
            h = await self._raw(
                "HMGET", self.keys.hdr(session_id), "n", "deleted", "at", "incarnation", "created_at", "cold",
                "updated_at", "last_cut", "ttl_ms",
            )  # fmt: skip
        n_raw, deleted, at_raw, inc_raw, born_raw, cold_raw, upd, last_cut, ttl = h
        if n_raw is None:
            return None
        return ColdState(
            incarnation=self._check_incarnation(session_id, None, inc_raw, born_raw),
            n=int(n_raw),
            own_start=int(at_raw or 0),
            cold=decode_cold(cold_raw),
            cold_raw=bytes(cold_raw or b""),
            updated_at=int(upd or 0),
            last_cut=as_int(last_cut),
            ephemeral=ttl is not None,
            deleted=deleted is not None,
        )

    async def begin_upload(self, session_id: str, segment: ColdSegment) -> None:
        validate_session_id(session_id)
        key = self.keys.cold_pending(session_id)
        with io_guard():  # kept a day past the last upload: a dead archiver's records go by themselves
            await self._pipeline(("ZADD", key, now_ms(), segment_name(segment)), ("PEXPIRE", key, 86_400_000))

    async def pending_upload(self, session_id: str, name: str) -> int | None:
        validate_session_id(session_id)
        with io_guard():
            got = await self._raw("ZSCORE", self.keys.cold_pending(session_id), name)
        return None if got is None else int(float(got))

    async def release_upload(self, session_id: str, name: str) -> bool:
        validate_session_id(session_id)
        with io_guard():
            return int(await self._raw("ZREM", self.keys.cold_pending(session_id), name)) == 1

    async def record_cold_url(self, tier: ColdTier, *, replace: bool = False) -> None:
        """Record `tier` as where this prefix's segments live (``{prefix}:cold:url``), the one
        check every archiving path passes through: another URL already recorded is refused
        (`ValueError`) unless `replace` (readers would look for the archived segments there)."""
        tier.bind(self.prefix)
        with io_guard():
            if not replace and not await self._raw("SET", self.keys.cold_url, tier.url, "NX"):
                old = as_str(await self._raw("GET", self.keys.cold_url))
                if old is not None and old != tier.url:
                    raise self._other_cold_url(old, tier.url)
            elif replace:
                await self._raw("SET", self.keys.cold_url, tier.url)

    async def check_cold_url(self, tier: ColdTier) -> None:
        """`record_cold_url`'s refusal (`ValueError`) without writing anything: called before a
        claim writes to `tier`'s folder, so an archive to another URL leaves no trace there."""
        with io_guard():
            old = as_str(await self._raw("GET", self.keys.cold_url))
        if old is not None and old != tier.url:
            raise self._other_cold_url(old, tier.url)

    def _other_cold_url(self, old: str, new: str) -> ValueError:
        return ValueError(
            f"this prefix's cold segments live in {old}; archiving to {new} would leave readers looking for them "
            f"there: archive without --to (or to {old}), or to move them copy the objects over, then record the "
            f"new URL (redis-session cli SET {self.keys.cold_url} {new}; in code set_cold_url(..., replace=True))"
        )

    async def drop_life_segments(self, session_id: str, incarnation: str) -> int:
        """Delete every segment object of one life of `session_id` that is over (deleted, purged
        or replaced by `swap_session`: call it after the swap with the replaced incarnation).
        Refused (`ValueError`) while that life is still the id's, live or hidden; the number of
        objects deleted. What fails here is left to `Archiver.sweep`."""
        validate_session_id(session_id)
        with io_guard():
            inc_raw, born_raw = await self._raw("HMGET", self.keys.hdr(session_id), "incarnation", "created_at")
        if born_raw is not None and (as_str(inc_raw) or legacy_incarnation(int(born_raw))) == incarnation:
            raise ValueError(f"session {session_id!r}: the life {incarnation!r} is still there")
        tier = await self.cold_tier()
        if tier is None or not await self._durable_fence(session_id):
            return 0
        keys = [info.key async for info in tier.objects.list(tier.life_dir(session_id, incarnation))]
        for key in keys:
            await tier.objects.delete(key)
        return len(keys)

    async def commit_archive(self, session_id: str, state: ColdState, segment: ColdSegment) -> str:
        validate_session_id(session_id)
        kept = [s for s in state.cold if s.hi <= segment.lo]  # a merge replaces those after
        if cold_end(kept, state.own_start) != segment.lo or segment.hi <= state.hot_start:
            raise ValueError(f"segment [{segment.lo}, {segment.hi}) does not end the archived range at the hot log")
        new = encode_cold([*kept, segment])
        keys = [
            self.keys.hdr(session_id), self.keys.log(session_id), self.keys.restore(session_id),
            self.keys.cold_pending(session_id),
        ]  # fmt: skip
        args = ["archive", state.incarnation, state.cold_raw, new, state.hot_start, segment.hi, segment_name(segment)]
        with io_guard():
            res = await self._eval("archive", keys, args, durable=True)
            acks = self._last_acks  # taken before any other await: other tasks share the store
        return self._archive_reply(session_id, res, acks)

    async def commit_restore(self, session_id: str, state: ColdState, entries: builtins.list[Entry]) -> str:
        validate_session_id(session_id)
        if not state.cold:
            return "done"
        # a staging stream of this restore only (two restores at once never mix their rows); it
        # expires by itself if this process dies before its script
        staging = f"{self.keys.restore(session_id)}:{secrets.token_hex(6)}"
        args = ["restore", state.incarnation, state.cold_raw, state.hot_start, state.own_start]
        with io_guard():
            try:
                for i in range(0, len(entries), 500):
                    chunk = entries[i : i + 500]
                    await self._pipeline(
                        *[("XADD", staging, f"{e.n}-1", *stream_fields(e)) for e in chunk],
                        ("PEXPIRE", staging, _STAGING_TTL_MS),
                    )
                keys = [self.keys.hdr(session_id), self.keys.log(session_id), staging]
                res = await self._eval("archive", keys, args, durable=True)
                acks = self._last_acks  # taken before any other await: other tasks share the store
            finally:
                await self._raw("DEL", staging)
        return self._archive_reply(session_id, res, acks)

    @staticmethod
    def _archive_reply(session_id: str, res: Any, acks: Any = None) -> str:
        code = int(res[0])
        if code == 0:
            # the objects the commit replaced may go only once it is as durable as the store's
            # writes: a failover (or a restart) that lost it brings back a header naming them
            return "done" if confirmed(acks) else "unconfirmed"
        if code == 3:
            raise SessionNotFoundError(session_id)
        if code == 8:
            raise SessionReplacedError(session_id, "archived while the session was replaced")
        if code == 9:
            return "moved"
        if code == 11:
            return "expired"
        if code == 2:
            raise SessionError(f"session {session_id!r}: the archived range is beyond n={int(res[1])}")
        raise SessionError(
            f"session {session_id!r}: the hot stream does not hold the range to move (at {as_str(res[1])!r}); "
            "run `redis-session doctor`"
        )
