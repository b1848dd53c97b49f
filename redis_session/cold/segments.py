"""Cold segments: an archived range [lo, hi) of one session's own log, as one immutable object.

An object is zstd-compressed JSONL in the native export's entry format (`importers.native`): line
1 says what it holds, every further line is one stored entry::

    {"_type":"redis-session/segment","version":1,"session":"s1","incarnation":"…","lo":0,"hi":190}
    {"n":0,"time":1718000000000,"type":"user/message","data":{"content":"hi"}}

Its key names the store prefix, the session, the incarnation, the range, the checksum and a
nonce, and the header's ``cold`` field lists ``lo:hi:checksum:size:nonce`` per segment,
``;``-separated (`ColdSegment`; the checksum is the first 48 bits of the object's SHA-256, and
the zstd frame carries its own content checksum too): the key is derived, so one or two segments
stay under Redis's 64-byte limit for a compact (listpack) header hash. The nonce makes every
upload its own object: an archiver never writes over an object another one named (a restore or a
delete deleting "its" object could otherwise delete a later archiver's identical upload). Reading one
checks the checksum, the line-1 identity and every n; a failure is `SegmentCorruptError`, an
absent object `SegmentMissingError`, both naming the range. `ColdTier` reads through a small LRU of decoded segments.
"""

from __future__ import annotations

import builtins
import hashlib
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import quote

import msgspec
import zstandard

from ..errors import SegmentCorruptError, SegmentMissingError, SessionError
from ..model import ENTRY_LIST_DECODER, Entry
from .objects import ObjectMissing, ObjectStore, open_objects

SEGMENT_TYPE = "redis-session/segment"
SEGMENT_VERSION = 1
_ZSTD_LEVEL = 3


class ColdSegment(msgspec.Struct, frozen=True):
    """One archived range as the header lists it: [lo, hi), the object's checksum (the first 12
    hex digits of its SHA-256), its size in bytes and the upload's nonce (6 hex digits)."""

    lo: int
    hi: int
    checksum: str
    size: int
    nonce: str


class _SegmentHead(msgspec.Struct):
    type_: str = msgspec.field(name="_type")
    version: int = 0
    session: str = ""
    incarnation: str = ""
    lo: int = -1
    hi: int = -1


_encode = msgspec.json.Encoder()
_HEX6 = re.compile(r"[0-9a-f]{6}")
_head_decoder = msgspec.json.Decoder(_SegmentHead)


def decode_cold(raw: bytes | str | None) -> builtins.list[ColdSegment]:
    """The header's ``cold`` field (None or empty: nothing archived); `SessionError` if damaged."""
    if not raw:
        return []
    text = raw.decode() if isinstance(raw, bytes) else raw
    out = []
    try:
        for part in text.split(";"):
            lo, hi, checksum, size, nonce = part.split(":")
            seg = ColdSegment(int(lo), int(hi), checksum, int(size), nonce)
            if not (0 <= seg.lo < seg.hi and len(checksum) == 12 and seg.size > 0 and _HEX6.fullmatch(nonce)):
                raise ValueError(part)
            out.append(seg)
    except ValueError as e:
        raise SessionError(f"the header's cold field is damaged ({e}): run `redis-session doctor`") from None
    return out


def hot_start(raw: bytes) -> int:
    """Where the hot stream starts, from a non-empty ``cold`` field: its last segment's hi (read
    without decoding the list; a damaged field reads as 0, and `decode_cold` reports it)."""
    try:
        return int(raw[raw.rfind(b";") + 1 :].split(b":", 2)[1])
    except (IndexError, ValueError):
        return 0


def encode_cold(segments: Sequence[ColdSegment]) -> bytes:
    return ";".join(f"{s.lo}:{s.hi}:{s.checksum}:{s.size}:{s.nonce}" for s in segments).encode()


def cold_end(segments: Sequence[ColdSegment], own_start: int) -> int:
    """Where the hot stream starts: the end of the last archived range (else `own_start`)."""
    return segments[-1].hi if segments else own_start


def session_dir(session_id: str) -> str:
    """The session's folder name in the object store: percent-encoded (no ``/``, no ``.``), and a
    hash for ids too long for one path component."""
    q = quote(session_id, safe="-_~").replace(".", "%2E")
    if len(q) > 200:
        return "h-" + hashlib.sha256(session_id.encode()).hexdigest()
    return "s-" + q


def _quote_inc(incarnation: str) -> str:
    return quote(incarnation, safe="-_~").replace(".", "%2E")


def segment_name(seg: ColdSegment) -> str:
    """The last part of a segment's object key (what a pending upload is recorded as)."""
    return f"{seg.lo:012d}-{seg.hi:012d}-{seg.checksum}-{seg.nonce}.jsonl.zst"


def segment_key(prefix: str, session_id: str, incarnation: str, seg: ColdSegment) -> str:
    return f"{prefix}/{session_dir(session_id)}/{_quote_inc(incarnation)}/{segment_name(seg)}"


def encode_segment(session_id: str, incarnation: str, entries: Sequence[Entry]) -> bytes:
    """`entries` (contiguous n) as one compressed segment object."""
    lo, hi = entries[0].n, entries[-1].n + 1
    if hi - lo != len(entries):
        raise ValueError("a segment holds contiguous entries")
    head = _encode.encode(
        {"_type": SEGMENT_TYPE, "version": SEGMENT_VERSION, "session": session_id,
         "incarnation": incarnation, "lo": lo, "hi": hi}
    )  # fmt: skip
    body = b"\n".join([head, *[_encode.encode(e) for e in entries]]) + b"\n"
    return zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True).compress(body)


def describe(data: bytes, lo: int, hi: int) -> ColdSegment:
    """The header's record of a new upload of `data` (a fresh nonce: its own object)."""
    checksum = hashlib.sha256(data).hexdigest()[:12]
    return ColdSegment(lo=lo, hi=hi, checksum=checksum, size=len(data), nonce=secrets.token_hex(3))


def decode_segment(session_id: str, incarnation: str, seg: ColdSegment, key: str, data: bytes) -> builtins.list[Entry]:
    """The entries of a segment object, checked against what the header says it holds."""

    def bad(detail: str) -> SegmentCorruptError:
        return SegmentCorruptError(session_id, seg.lo, seg.hi, key, detail)

    if len(data) != seg.size or hashlib.sha256(data).hexdigest()[:12] != seg.checksum:
        raise bad("the object fails its checksum")
    try:
        body = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 31)
    except zstandard.ZstdError as e:
        raise bad(f"the object does not decompress: {e}") from None
    first, _, rest = body.partition(b"\n")
    try:
        head = _head_decoder.decode(first)
        # JSON strings never hold a raw newline: the lines are the array's items
        entries = ENTRY_LIST_DECODER.decode(b"[" + rest.rstrip(b"\n").replace(b"\n", b",") + b"]")
    except msgspec.DecodeError as e:
        raise bad(f"the object does not decode: {e}") from None
    if (head.type_, head.session, head.incarnation, head.lo, head.hi) != (
        SEGMENT_TYPE, session_id, incarnation, seg.lo, seg.hi
    ):  # fmt: skip
        raise bad("the object holds another session's or another range's entries")
    if len(entries) != seg.hi - seg.lo or any(e.n != seg.lo + i for i, e in enumerate(entries)):
        raise bad("the object's entries are not [lo, hi)")
    return entries


@dataclass
class ColdStats:
    """Counters of one process's cold reads (the archiver's metrics export them)."""

    segment_reads: int = 0  # objects fetched from the store
    cache_hits: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    read_latencies: builtins.list[float] = field(default_factory=list)  # last 1 000 fetches, seconds


class ColdTier:
    """Reads (and writes) a store prefix's cold segments: an object store and an LRU of decoded
    segments keyed by object key (objects are immutable), holding at most `cache_segments`
    segments and `cache_entries` entries.

    Its objects live under the store's key prefix (``<prefix>/s-<id>/…``): a tier built without
    `prefix` takes it from the store it is attached to (`bind`), and one tier is never shared by
    two prefixes (a sweep of one would take the other's segments)."""

    def __init__(
        self,
        objects: ObjectStore | str,
        *,
        prefix: str | None = None,
        cache_segments: int = 64,
        cache_entries: int = 100_000,
    ) -> None:
        self.objects = open_objects(objects) if isinstance(objects, str) else objects
        self._prefix = prefix
        self.cache_segments = cache_segments
        self.cache_entries = cache_entries
        self._cache: OrderedDict[str, builtins.list[Entry]] = OrderedDict()
        self._cached = 0  # entries held by the LRU
        self.stats = ColdStats()

    @property
    def url(self) -> str:
        return self.objects.url

    @property
    def prefix(self) -> str:
        """The store key prefix its objects are named under (`ValueError` before `bind`)."""
        if self._prefix is None:
            raise ValueError("this cold tier is attached to no store yet (ColdTier(url, prefix=…) or a store's cold=)")
        return self._prefix

    def bind(self, prefix: str) -> ColdTier:
        """Attach the tier to the store prefix `prefix`: a tier built without one takes it; one
        of another prefix is refused (`ValueError`: its sweep would see the other's objects)."""
        if self._prefix is None:
            self._prefix = prefix
        elif self._prefix != prefix:
            raise ValueError(
                f"this cold tier names its objects under the prefix {self._prefix!r}, not the store's {prefix!r}: "
                "give each store prefix its own ColdTier"
            )
        return self

    def life_dir(self, session_id: str, incarnation: str) -> str:
        """The folder of one life's segment objects (``<prefix>/s-<id>/<incarnation>/``)."""
        return f"{self.prefix}/{session_dir(session_id)}/{_quote_inc(incarnation)}/"

    def key(self, session_id: str, incarnation: str, seg: ColdSegment) -> str:
        return segment_key(self.prefix, session_id, incarnation, seg)

    def clear_cache(self) -> None:
        """Forget every decoded segment (the next read of each fetches its object again)."""
        self._cache.clear()
        self._cached = 0

    async def segment(self, session_id: str, incarnation: str, seg: ColdSegment) -> builtins.list[Entry]:
        """All entries of one segment (checked), from the LRU or the object store."""
        key = self.key(session_id, incarnation, seg)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.stats.cache_hits += 1
            return hit
        t0 = time.perf_counter()
        try:
            data = await self.objects.get(key)
        except ObjectMissing:
            raise SegmentMissingError(session_id, seg.lo, seg.hi, key, "the object store has no such object") from None
        entries = decode_segment(session_id, incarnation, seg, key, data)
        dt = time.perf_counter() - t0
        st = self.stats
        st.segment_reads += 1
        st.bytes_read += len(data)
        st.read_seconds += dt
        st.read_latencies.append(dt)
        if len(st.read_latencies) > 1000:
            del st.read_latencies[:500]
        self._remember(key, entries)
        return entries

    async def read(
        self, session_id: str, incarnation: str, segments: Sequence[ColdSegment], start: int, stop: int
    ) -> builtins.list[Entry]:
        """Archived entries [start, stop) (within the segments' span), in order."""
        out: builtins.list[Entry] = []
        for seg in segments:
            lo, hi = max(seg.lo, start), min(seg.hi, stop)
            if hi > lo:
                entries = await self.segment(session_id, incarnation, seg)
                out.extend(entries[lo - seg.lo : hi - seg.lo] if (lo, hi) != (seg.lo, seg.hi) else entries)
        return out

    async def write(self, session_id: str, incarnation: str, entries: Sequence[Entry]) -> ColdSegment:
        """Upload `entries` as one segment, read it back and verify it: its `ColdSegment`."""
        seg, data = self.encode(session_id, incarnation, entries)
        await self.upload(session_id, incarnation, seg, data, entries)
        return seg

    @staticmethod
    def encode(session_id: str, incarnation: str, entries: Sequence[Entry]) -> tuple[ColdSegment, bytes]:
        """`entries` as a segment object not uploaded yet (the archiver records it pending first)."""
        data = encode_segment(session_id, incarnation, entries)
        return describe(data, entries[0].n, entries[-1].n + 1), data

    async def upload(
        self, session_id: str, incarnation: str, seg: ColdSegment, data: bytes, entries: Sequence[Entry]
    ) -> None:
        """Upload an `encode`d segment, read it back and verify it holds `entries`."""
        key = self.key(session_id, incarnation, seg)
        await self.objects.put(key, data)
        try:
            back = await self.objects.get(key)
        except ObjectMissing:
            raise SegmentMissingError(
                session_id, seg.lo, seg.hi, key, "the object was not there after its upload"
            ) from None
        got = decode_segment(session_id, incarnation, seg, key, back)
        if got != builtins.list(entries):
            raise SegmentCorruptError(session_id, seg.lo, seg.hi, key, "the object read back holds other entries")
        self._remember(key, got)  # a merge with the next range reads it from here

    def _remember(self, key: str, entries: builtins.list[Entry]) -> None:
        if len(entries) <= self.cache_entries:
            self._cache[key] = entries
            self._cached += len(entries)
            while len(self._cache) > self.cache_segments or self._cached > self.cache_entries:
                self._cached -= len(self._cache.popitem(last=False)[1])

    async def drop(self, session_id: str, incarnation: str, segments: Sequence[ColdSegment]) -> None:
        for seg in segments:
            key = self.key(session_id, incarnation, seg)
            dropped = self._cache.pop(key, None)
            self._cached -= 0 if dropped is None else len(dropped)
            await self.objects.delete(key)
