"""Every Redis key name, in one place.

All keys of one session share the hash tag ``{<id>}`` so each script touches one cluster slot::

    {prefix}:{<id>}:hdr     HASH    header fields, n, last_cut, updated_at
    {prefix}:{<id>}:log     STREAM  entry n at stream ID "<n>-1"
    {prefix}:{<id>}:proj    HASH    the projector's snapshot: n, state (JSON), updated_at
    {prefix}:{<id>}:plock   STRING  a projector's short fold lock (SET NX PX)
    {prefix}:{<id>}:compact STRING  a compactor's lock while it summarises (SET NX PX, renewed)
    {prefix}:{<id>}:idem    ZSET    idempotency key -> first n * 65536 + batch length, and at the same
                                    score "<key>\0<digest>" (the batch's digest); last 1024 keys kept
    {prefix}:{<id>}:kids    ZSET    live branches of this session (list index, lexicographic)
    {prefix}:{<id>}:draft   STRING  the streaming assistant draft (JSON)
    {prefix}:{<id>}:lease   STRING  the writer lease token
    {prefix}:{<id>}:live    STREAM  streamed answers in flight: begin, deltas, end records (plain
                                    XADD, MAXLEN-capped, PEXPIRE: a dead writer's records vanish)
    {prefix}:{<id>}:restore:<token>  STREAM  one restore's staged archived entries (renamed
                                    onto log; PEXPIRE 1 h: a dead restorer's vanish)
    {prefix}:{<id>}:coldpending  ZSET  segment objects being uploaded (object name -> ms): the
                                    sweep never deletes one; archive.lua names it and drops it

Cross-session keys (never needed for an append's correctness)::

    {prefix}:sessions:{<k>} ZSET    list index shard k (crc32(id) % index_shards): members
                                    "<inverted created_at>:<id>", newest first; list() merges them
    {prefix}:feed:{<k>}     STREAM  change feed shard k: "session S reached n"
    {prefix}:events         PUBSUB  session-branch notifications
    {prefix}:projector:<group>:stats  HASH  projector counters summed over workers
    {prefix}:compactor:{<group>}:stats  HASH  compactor counters summed over workers
    {prefix}:cold:url       STRING  where this prefix's cold segments live (an object store URL)
    {prefix}:archiver:{<group>}:stats  HASH  archiver counters summed over workers
"""

from __future__ import annotations

import re
import unicodedata
import zlib

from .errors import InvalidSessionIdError

MAX_ID_LENGTH = 256
_BAD_ID = re.compile(r"[{}\s\x00-\x1f\x7f]")
# 13 digits hold every ms timestamp until the year 2286.
_TS_MAX = 9_999_999_999_999


def validate_session_id(session_id: object) -> str:
    """Return the id if it is safe, else raise `InvalidSessionIdError`.

    Ids are 1-256 characters, with no braces (they would move the hash tag, so the session's keys
    could land in another slot), no whitespace and no control characters; ``"."`` and ``".."``
    are refused (URL parsers drop such a path segment, so HTTP could never reach the session).
    """
    if not isinstance(session_id, str):
        raise InvalidSessionIdError(f"session id must be a str, got {type(session_id).__name__}")
    if not session_id:
        raise InvalidSessionIdError("session id must not be empty")
    if len(session_id) > MAX_ID_LENGTH:
        raise InvalidSessionIdError(f"session id is {len(session_id)} characters; the limit is {MAX_ID_LENGTH}")
    try:
        session_id.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidSessionIdError("session id is not valid unicode (a lone surrogate)") from None
    if session_id in (".", ".."):
        # a URL path segment "." or ".." is removed by every URL parser (fetch, browsers, proxies):
        # /sessions/./entries reaches /sessions/entries, so such a session could never be used
        raise InvalidSessionIdError(
            f"session id {session_id!r} is not allowed: a URL path segment of only dots is removed by URL parsers"
        )
    bad = _BAD_ID.search(session_id)
    if bad:
        raise InvalidSessionIdError(
            f"session id {session_id[:80]!r} contains {bad.group()!r}: "
            "braces, whitespace and control characters are not allowed"
        )
    return session_id


def validate_new_session_id(session_id: object) -> str:
    """`validate_session_id`, plus the rule for an id being created (create, open of a missing
    session, branch, fork, import): no invisible format character (Unicode category Cf: zero-width
    ones such as U+200B and U+FEFF, bidirectional controls such as U+202E and U+2066..U+2069), so
    two ids that look the same in the viewer, a terminal or a log always name one session.

    Only new ids: a session created under such an id before this rule stays readable, writable
    and deletable through `validate_session_id` (an operator can still clean it up)."""
    sid = validate_session_id(session_id)
    if not sid.isascii():
        for c in sid:
            if unicodedata.category(c) == "Cf":
                name = unicodedata.name(c, "a format character")
                raise InvalidSessionIdError(
                    f"session id {sid[:80]!r} contains U+{ord(c):04X} ({name}): a new session id may not "
                    "hold invisible format characters (zero-width or bidirectional controls, Unicode "
                    "category Cf), which would make two different ids look the same"
                )
    return sid


_ESCAPED = re.compile(r"[{}%\s\x00-\x1f\x7f]")


def escape_key(key: str) -> str:
    """A foreign key (a nanobot key, a ChatLuna conversation, a dsh or tutorial id) as the text of
    a session id: each character ids forbid (braces, whitespace, control characters), each
    invisible format character (Unicode category Cf, refused in new ids) and each ``%`` replaced
    by its UTF-8 bytes as ``%XX`` (``"tg:{1} a"`` → ``"tg:%7B1%7D%20a"``). Injective;
    `unescape_key` reverses it. The result may still be no valid id (too long, a lone surrogate):
    callers decide (hash it, or refuse)."""

    def esc(c: str) -> str:
        return "".join(f"%{b:02X}" for b in c.encode("utf-8"))

    mapped = _ESCAPED.sub(lambda m: esc(m.group()), key)
    if mapped.isascii():
        return mapped
    return "".join(esc(c) if unicodedata.category(c) == "Cf" else c for c in mapped)


def unescape_key(session_id: str) -> str:
    """The key `escape_key` escaped to `session_id` (text without ``%`` is its own key)."""
    from urllib.parse import unquote

    return unquote(session_id, errors="strict") if "%" in session_id else session_id


# A replacing import builds its session under a staging id (`importers.common.staging_id`):
# "<target id[:160]>.import-<16 hex>.<hex>". Such a session is never listed and expires by itself
# (a crashed import leaks nothing); the swap makes it the target's, listed and lasting.
GONE_TTL_MS = 24 * 60 * 60 * 1000
"""How long a deleted session's ``create_key`` is remembered (`Keys.gone`), from its delete: a
keyed create retried within it after the session was deleted is refused. The IETF
Idempotency-Key draft's usual window (24 h)."""

STAGING_TTL_MS = 15 * 60 * 1000
_STAGING = re.compile(r"\.import-[0-9a-f]{16}\.[0-9a-f]+\Z")


def is_staging_id(session_id: str) -> bool:
    """Whether `session_id` names a replacing import's staging copy (not listed, expiring)."""
    return _STAGING.search(session_id) is not None


def validate_prefix(prefix: str) -> str:
    if not prefix or _BAD_ID.search(prefix) or len(prefix) > 64:
        raise ValueError(f"invalid key prefix {prefix!r}")
    return prefix


class Keys:
    """Key names for one prefix."""

    __slots__ = ("feed_shards", "index_shards", "prefix")

    def __init__(self, prefix: str = "rs", feed_shards: int = 4, index_shards: int = 4) -> None:
        self.prefix = validate_prefix(prefix)
        if not 1 <= feed_shards <= 1024 or not 1 <= index_shards <= 1024:
            raise ValueError("feed_shards and index_shards must be in [1, 1024]")
        self.feed_shards = feed_shards
        self.index_shards = index_shards

    def _k(self, session_id: str, part: str) -> str:
        return f"{self.prefix}:{{{session_id}}}:{part}"

    def hdr(self, session_id: str) -> str:
        return self._k(session_id, "hdr")

    def log(self, session_id: str) -> str:
        return self._k(session_id, "log")

    def proj(self, session_id: str) -> str:
        return self._k(session_id, "proj")

    def idem(self, session_id: str) -> str:
        return self._k(session_id, "idem")

    def kids(self, session_id: str) -> str:
        return self._k(session_id, "kids")

    def draft(self, session_id: str) -> str:
        return self._k(session_id, "draft")

    def lease(self, session_id: str) -> str:
        return self._k(session_id, "lease")

    def plock(self, session_id: str) -> str:
        """A projector's short per-session fold lock (same slot as the session; not one of
        `session_keys`: it expires by itself)."""
        return self._k(session_id, "plock")

    def compact_lock(self, session_id: str) -> str:
        """A compactor's per-session lock (same slot as the session; expires on its own)."""
        return self._k(session_id, "compact")

    def compactor_stats(self, group: str) -> str:
        """HASH of the counters every compactor worker of `group` adds to."""
        return f"{self.prefix}:compactor:{group}:stats"

    def live(self, session_id: str) -> str:
        return self._k(session_id, "live")

    def gone(self, session_id: str) -> str:
        """SET: the ``create_key`` of each life of this id that was deleted (`GONE_TTL_MS`): a
        keyed create retried after its reply was lost and the session deleted since is refused
        (append.lua), never made again."""
        return self._k(session_id, "gone")

    def restore(self, session_id: str) -> str:
        """The prefix of a restore's staging streams (``…:restore:<token>``: same slot; renamed
        onto the log by archive.lua)."""
        return self._k(session_id, "restore")

    def cold_pending(self, session_id: str) -> str:
        """ZSET: this session's segment uploads not yet committed (object name -> upload time)."""
        return self._k(session_id, "coldpending")

    @property
    def cold_url(self) -> str:
        """STRING: the object store URL of this prefix's cold segments (`redis-session archive`)."""
        return f"{self.prefix}:cold:url"

    @property
    def cold_store(self) -> str:
        """STRING: a random id of this store (this server and prefix), made at its first archive;
        its cold tier's ``<prefix>/store-id`` object holds it, so two stores never share (and a
        sweep of one never takes) one folder's objects."""
        return f"{self.prefix}:cold:store"

    def archiver_stats(self, group: str) -> str:
        return f"{self.prefix}:archiver:{group}:stats"

    def delete_keys(self, session_id: str) -> list[str]:
        """delete.lua's keys: every per-session key (`session_keys`), then `gone`."""
        return [*self.session_keys(session_id), self.gone(session_id)]

    def session_keys(self, session_id: str) -> list[str]:
        """Every per-session key, in the order the Lua scripts take them."""
        return [
            self.hdr(session_id),
            self.log(session_id),
            self.idem(session_id),
            self.proj(session_id),
            self.draft(session_id),
            self.kids(session_id),
            self.lease(session_id),
            self.live(session_id),
        ]

    def sessions(self, session_id: str) -> str:
        """The list-index shard that holds `session_id` (each shard in its own slot)."""
        return f"{self.prefix}:sessions:{{{zlib.crc32(session_id.encode()) % self.index_shards}}}"

    def all_sessions(self) -> list[str]:
        return [f"{self.prefix}:sessions:{{{k}}}" for k in range(self.index_shards)]

    @property
    def events(self) -> str:
        return f"{self.prefix}:events"

    def projector_stats(self, group: str) -> str:
        """HASH of a projector group's counters, summed over its workers."""
        return f"{self.prefix}:projector:{group}:stats"

    def feed_shard(self, session_id: str) -> int:
        return zlib.crc32(session_id.encode()) % self.feed_shards

    def feed(self, shard: int) -> str:
        return f"{self.prefix}:feed:{{{shard}}}"

    def all_feeds(self) -> list[str]:
        return [self.feed(i) for i in range(self.feed_shards)]


def index_member(created_at: int, session_id: str) -> str:
    """List-index member: sorts lexicographically newest first, ties broken by id."""
    return f"{_TS_MAX - max(0, min(created_at, _TS_MAX)):013d}:{session_id}"


def id_from_index_member(member: str) -> str:
    return member[14:]


def stream_id(n: int) -> str:
    """Stream ID of entry n (`0-0` is not a valid XADD ID, so the sequence part is 1)."""
    return f"{n}-1"
