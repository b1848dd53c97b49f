"""The cold tier: archived ranges of session logs as immutable segment objects outside Redis
(a local folder by default; S3, GCS, Azure through obstore). See docs/design.md "Cold segments"."""

from .objects import CloudObjects, LocalFolder, ObjectInfo, ObjectMissing, ObjectStore, open_objects
from .segments import (
    ColdSegment,
    ColdStats,
    ColdTier,
    cold_end,
    decode_cold,
    decode_segment,
    encode_cold,
    encode_segment,
    hot_start,
    segment_key,
)

__all__ = [
    "CloudObjects",
    "ColdSegment",
    "ColdStats",
    "ColdTier",
    "LocalFolder",
    "ObjectInfo",
    "ObjectMissing",
    "ObjectStore",
    "cold_end",
    "decode_cold",
    "decode_segment",
    "encode_cold",
    "encode_segment",
    "hot_start",
    "open_objects",
    "segment_key",
]
