"""The entry model on its own: `encode_batch`, the `Vocabulary`, surfaces and `NewEntry` shapes.

No store and no server: what is checked here is what every store relies on before a write.
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

import msgspec
import pytest

from redis_session import InvalidEntryError, NewEntry, Surface, SurfaceReplace, Vocabulary
from redis_session.model import (
    DEFAULT_SCHEMAS,
    ENTRY_DECODER,
    ENTRY_LIST_DECODER,
    EncodedEntry,
    Entry,
    as_new_entry,
    encode_batch,
    kind_of,
)


def enc(*items: Any, vocabulary: Vocabulary | None = None, **kw: Any) -> list[EncodedEntry]:
    return encode_batch(items, vocabulary or Vocabulary(), **kw)


def one(entry_type: str, data: Any, vocabulary: Vocabulary | None = None, **kw: Any) -> EncodedEntry:
    return enc(NewEntry(entry_type, data), vocabulary=vocabulary, **kw)[0]


# --------------------------------------------------------------------------- every default schema

MSG = {"role": "assistant", "content": "ok"}

#: For each default type: a valid payload, and a copy with one field of the wrong type.
SAMPLES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "user/message": ({"content": "hi"}, {"content": 5}),
    "assistant/message": (
        {"content": [{"type": "text", "text": "hi"}, {"type": "reasoning", "text": "hm"}], "turn": 1},
        {"content": "hi", "turn": "one"},
    ),
    "tool/result": (
        {"callId": "c1", "content": [{"type": "tool-result", "toolCallId": "c1", "content": "42"}]},
        {"callId": 1, "content": "42"},
    ),
    "context/message": ({"content": "ctx", "source": {"file": "a.md"}}, {"content": None}),
    "steering/message": ({"content": "steer", "turn": 2}, {"content": "steer", "turn": [2]}),
    "message": (
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "robot", "content": "hi"},
    ),
    "cut": ({"before": 0, "summary": [MSG], "reason": "budget"}, {"before": "0", "summary": [], "reason": "x"}),
    "turn/start": ({"turn": 1, "trigger": {"kind": "user"}}, {"turn": 0}),
    "turn/end": ({"turn": 1, "reason": "completed"}, {"turn": 1, "reason": 7}),
    "step/start": ({"turn": 1, "step": 1}, {"turn": 1, "step": "1"}),
    "step/end": ({"turn": 1, "step": 2}, {"turn": 1}),
    "assistant/chunk": ({"turn": 1, "step": 1, "chunk": {"text": "He"}}, {"turn": "1"}),
    "assistant/interrupted": (
        {"answer": "a1b2c3d4e5", "reason": "cancelled", "deltas": 2, "content": [{"type": "text", "text": "Hel"}]},
        {"answer": "a1", "reason": "cancelled", "deltas": "2", "content": []},
    ),
    "tool/call": ({"callId": "c1", "name": "ls", "arguments": "{}"}, {"callId": "c1", "name": "ls", "arguments": {}}),
    "prompt/blocked": ({"content": "no", "reason": "policy"}, {"content": "no"}),
    "todo/write": (
        {"todos": [{"content": "ship", "status": "in_progress"}]},
        {"todos": [{"content": "ship", "status": "someday"}]},
    ),
    "request/header": ({"header": {"model": "m"}}, {"header": "m"}),
    "request/header-delta": ({"system": {"text": "s"}, "messagePrefix": []}, {"tools": ["t"]}),
    "prompt": ({"messages": [MSG]}, {"$wrong": float("nan")}),
    "preset/selected": ({"presetId": "p1", "revision": "3"}, {"presetId": 1}),
    "request/context": ({"provider": "openai", "model": "gpt", "contextWindow": 128_000}, {"provider": "openai"}),
    "agent/input-enqueued": (
        {"messageId": "m1", "target": "next-turn", "wakeup": True},
        {"messageId": "m1", "target": "later"},
    ),
    "agent/input-admitted": ({"messageId": "m1", "n": 3}, {"messageId": "m1", "n": -1}),
    "agent/input-discarded": ({"messageId": "m1", "reason": "dup"}, {"messageId": "m1"}),
    "turn-skip": ({"reason": "busy", "turn": 3}, {"reason": None}),
    "session/meta": ({"anything": [1, {"goes": True}]}, {"$wrong": float("inf")}),
}  # fmt: skip


def test_every_default_schema_has_a_sample() -> None:
    assert set(SAMPLES) == set(DEFAULT_SCHEMAS)


@pytest.mark.parametrize("entry_type", sorted(SAMPLES))
def test_schema_accepts_valid_sample(entry_type: str) -> None:
    good, _ = SAMPLES[entry_type]
    e = one(entry_type, good)
    assert e.type == entry_type
    assert e.data == good
    assert msgspec.json.decode(e.data_raw) == good


@pytest.mark.parametrize("entry_type", sorted(SAMPLES))
def test_schema_rejects_wrong_type(entry_type: str) -> None:
    _, bad = SAMPLES[entry_type]
    with pytest.raises(InvalidEntryError) as err:
        one(entry_type, bad)
    assert err.value.index == 0


@pytest.mark.parametrize("entry_type", sorted(t for t, s in DEFAULT_SCHEMAS.items() if s is None))
def test_schemaless_types_need_a_json_object(entry_type: str) -> None:
    for not_an_object in ([1, 2], "text", 3, None):
        with pytest.raises(InvalidEntryError, match="JSON object"):
            one(entry_type, not_an_object)


def test_unknown_fields_are_kept() -> None:
    data = {"content": "hi", "x-client": {"trace": "abc"}}
    assert one("user/message", data).data == data


# --------------------------------------------------------------------------- error messages


@pytest.mark.parametrize(
    ("entry_type", "data", "path"),
    [
        ("turn/start", {"turn": "one"}, "$.turn"),
        ("step/end", {"turn": 1, "step": "x"}, "$.step"),
        ("tool/call", {"callId": "c", "name": "n", "arguments": 1}, "$.arguments"),
        ("todo/write", {"todos": [{"content": "a", "status": "nope"}]}, "$.todos[0].status"),
        ("cut", {"before": 0, "summary": [{"role": "x"}], "reason": "r"}, "$.summary[0].role"),
    ],
)
def test_errors_name_the_field(entry_type: str, data: dict[str, Any], path: str) -> None:
    with pytest.raises(InvalidEntryError) as err:
        one(entry_type, data)
    assert f"`{path}`" in str(err.value)
    assert entry_type in str(err.value)


def test_error_names_the_entry_of_a_batch() -> None:
    with pytest.raises(InvalidEntryError) as err:
        enc(("user/message", {"content": "ok"}), ("turn/start", {"turn": "x"}))
    assert err.value.index == 1
    assert str(err.value).startswith("entry 1:")


def test_turn_end_reason_must_be_known() -> None:
    assert one("turn/end", {"turn": 1, "reason": {"kind": "aborted", "by": "user"}}).data["turn"] == 1
    with pytest.raises(InvalidEntryError, match="reason"):
        one("turn/end", {"turn": 1, "reason": "bored"})


def test_image_block_needs_url_or_data() -> None:
    one("user/message", {"content": [{"type": "image", "url": "https://x/y.png"}]})
    with pytest.raises(InvalidEntryError, match="url"):
        one("user/message", {"content": [{"type": "image", "mimeType": "image/png"}]})


# --------------------------------------------------------------------------- vocabulary


class Vote(msgspec.Struct):
    choice: str
    weight: int = 1


class Rating(TypedDict):
    stars: int


def test_define_a_struct_schema() -> None:
    v = Vocabulary()
    v.define("poll/vote", Vote)
    assert "poll/vote" in v
    assert one("poll/vote", {"choice": "a", "weight": 2}, v).data == {"choice": "a", "weight": 2}
    with pytest.raises(InvalidEntryError, match=r"\$\.weight"):
        one("poll/vote", {"choice": "a", "weight": "heavy"}, v)
    with pytest.raises(InvalidEntryError, match="choice"):
        one("poll/vote", {"weight": 1}, v)


def test_define_other_schema_kinds_and_none() -> None:
    v = Vocabulary()
    v.define("rating", Rating)
    v.define("scores", dict[str, int])
    v.define("free")
    one("rating", {"stars": 5}, v)
    one("scores", {"a": 1, "b": 2}, v)
    one("free", {"whatever": [None]}, v)
    with pytest.raises(InvalidEntryError):
        one("rating", {"stars": "five"}, v)
    with pytest.raises(InvalidEntryError):
        one("scores", {"a": "1"}, v)


def test_define_replaces_but_cut_is_fixed() -> None:
    v = Vocabulary()
    v.define("user/message", Vote)  # replaced: now a vote
    one("user/message", {"choice": "x"}, v)
    with pytest.raises(InvalidEntryError):
        one("user/message", {"content": "hi"}, v)
    with pytest.raises(ValueError, match="cut"):
        v.define("cut", Vote)


def test_define_rejects_bad_type_names() -> None:
    v = Vocabulary()
    for bad in ["", "has space", "{brace}", "-leading", "x" * 129, 'quote"d']:
        with pytest.raises(InvalidEntryError):
            v.define(bad, None)


def test_copy_is_independent() -> None:
    v = Vocabulary()
    c = v.copy()
    c.define("only/in/copy", Vote)
    assert "only/in/copy" in c and "only/in/copy" not in v


def test_strict_mode_rejects_unknown_types() -> None:
    strict = Vocabulary(strict=True)
    with pytest.raises(InvalidEntryError, match="unknown entry type"):
        one("my/mark", {"x": 1}, strict)
    one("user/message", {"content": "known types still work"}, strict)
    strict.define("my/mark")
    one("my/mark", {"x": 1}, strict)


def test_lenient_mode_accepts_unknown_types_as_marks() -> None:
    e = one("my/mark", {"x": 1})
    assert e.data == {"x": 1} and kind_of(e.type) == "mark"
    with pytest.raises(InvalidEntryError, match="JSON object"):
        one("my/mark", [1])


def test_custom_vocabulary_from_schemas() -> None:
    v = Vocabulary(strict=True, schemas={"vote": Vote})
    one("vote", {"choice": "x"}, v)
    with pytest.raises(InvalidEntryError):
        one("user/message", {"content": "not in this vocabulary"}, v)


# --------------------------------------------------------------------------- lossless JSON


class _Obj:
    pass


@pytest.mark.parametrize(
    "value",
    [
        {"x": math.nan},
        {"x": math.inf},
        {"x": -math.inf},
        {"x": b"bytes"},
        {"x": {1, 2}},
        {"x": (1, 2)},
        {"x": {1: "int key"}},
        {"x": _Obj()},
    ],
    ids=["nan", "inf", "-inf", "bytes", "set", "tuple", "int-key", "object"],
)
def test_lossy_data_is_rejected(value: dict[str, Any]) -> None:
    with pytest.raises(InvalidEntryError, match="JSON"):
        one("my/mark", value)


def test_cycles_are_rejected() -> None:
    d: dict[str, Any] = {}
    d["self"] = d
    with pytest.raises(InvalidEntryError):
        one("my/mark", d)


def test_lossy_meta_is_rejected_and_meta_must_be_an_object() -> None:
    with pytest.raises(InvalidEntryError, match="meta"):
        enc(NewEntry("user/message", {"content": "x"}, {"usage": math.nan}))
    with pytest.raises(InvalidEntryError, match="meta"):
        enc(NewEntry("user/message", {"content": "x"}, ["not", "an", "object"]))
    [e] = enc(NewEntry("user/message", {"content": "x"}, {"turn": 1}))
    assert e.meta == {"turn": 1} and e.meta_raw == b'{"turn":1}'


def test_encoded_data_is_a_snapshot() -> None:
    data = {"content": [{"type": "text", "text": "a"}]}
    e = one("user/message", data)
    data["content"][0]["text"] = "changed"
    assert e.data["content"][0]["text"] == "a"


# --------------------------------------------------------------------------- batch rules


def test_limits() -> None:
    with pytest.raises(InvalidEntryError, match="bytes"):
        one("user/message", {"content": "x" * 2000}, max_entry_bytes=1000)
    with pytest.raises(InvalidEntryError, match="at most 3"):
        enc(*[("user/message", {"content": "x"})] * 4, max_batch=3)
    assert len(enc(*[("user/message", {"content": "x"})] * 3, max_batch=3)) == 3


def test_entries_must_be_a_sequence_of_entries() -> None:
    for bad in ["user/message", b"raw", {"type": "user/message", "data": {}}]:
        with pytest.raises(InvalidEntryError):
            encode_batch(bad, Vocabulary())  # type: ignore[arg-type]
    assert encode_batch([], Vocabulary()) == []


def test_cut_before_is_checked_against_its_own_n() -> None:
    cut = NewEntry("cut", {"before": 5, "summary": [], "reason": "r"})
    assert enc(cut, first_n=5)[0].bound == 5
    with pytest.raises(InvalidEntryError, match="before"):
        enc(cut, first_n=4)
    # in a batch, each entry has its own n
    assert enc(("user/message", {"content": "x"}), cut, first_n=4)[1].bound == 5
    # without a first n (an append at the end) the store checks it later
    assert enc(cut)[0].bound == 5


def test_bound_is_the_largest_n_an_entry_refers_to() -> None:
    """append.lua's 6th per-entry value: what both stores check against the entry's own n."""
    am = ("assistant/message", {"content": "x"})
    assert enc(am)[0].bound is None
    assert enc((*am, None, {"sourceEventSeqs": [3, 1]}))[0].bound == 4
    replace = {"surfaceOp": {"op": "replace", "start": 2, "end": 6}, "sourceEventSeqs": [2]}
    assert enc((*am, None, replace), first_n=7)[0].bound == 7
    with pytest.raises(InvalidEntryError, match=r"replace 2\.\.6"):
        enc((*am, None, replace), first_n=6)


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True, 1 << 53])
def test_time_must_be_non_negative_int_ms(bad: Any) -> None:
    with pytest.raises(InvalidEntryError, match="time"):
        enc(NewEntry("user/message", {"content": "x"}, time=bad))
    assert enc(NewEntry("user/message", {"content": "x"}, time=0))[0].time == 0


def test_stored_entry() -> None:
    [e] = enc(NewEntry("user/message", {"content": "x"}, {"turn": 1}, time=123))
    s = e.stored(7, 999)
    assert s == Entry(n=7, time=123, type="user/message", data={"content": "x"}, meta={"turn": 1})
    [e] = enc(NewEntry("user/message", {"content": "x"}))
    assert e.stored(7, 999).time == 999


# --------------------------------------------------------------------------- NewEntry shapes


def test_new_entry_from_tuple() -> None:
    assert as_new_entry(("user/message", {"content": "x"})) == NewEntry("user/message", {"content": "x"})
    full = ("assistant/message", {"content": "x"}, {"turn": 1}, {"surfaceOp": "append"}, 5)
    assert as_new_entry(full) == NewEntry(*full)
    for bad in [("user/message",), ("t", {}, None, None, None, "sixth")]:
        with pytest.raises(InvalidEntryError, match="tuple"):
            as_new_entry(bad)


def test_new_entry_from_mapping() -> None:
    got = as_new_entry({"type": "user/message", "data": {"content": "x"}, "meta": {"turn": 1}})
    assert got == NewEntry("user/message", {"content": "x"}, {"turn": 1})
    with pytest.raises(InvalidEntryError, match="mapping"):
        as_new_entry({"type": "user/message", "data": {}, "colour": "red"})
    with pytest.raises(InvalidEntryError, match="mapping"):
        as_new_entry({"data": {}})


def test_new_entry_other_shapes_are_rejected() -> None:
    for bad in [42, "user/message", ["user/message", {}], None]:
        with pytest.raises(InvalidEntryError, match="expected a NewEntry"):
            as_new_entry(bad)  # type: ignore[arg-type]


def test_batch_mixes_shapes() -> None:
    batch = enc(
        NewEntry("user/message", {"content": "a"}),
        ("user/message", {"content": "b"}),
        {"type": "user/message", "data": {"content": "c"}},
    )
    assert [e.data["content"] for e in batch] == ["a", "b", "c"]


def test_type_name_is_validated() -> None:
    for bad in ["", "a b", 'a"b', 5, None]:
        with pytest.raises(InvalidEntryError, match="type"):
            enc(NewEntry(bad, {}))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- surfaces (dsh)


def test_surface_decoding() -> None:
    s = msgspec.json.decode(b'{"surfaceOp":"append","sourceEventSeqs":[1,2]}', type=Surface)
    assert s.op == "append" and s.source_event_seqs == [1, 2] and not s.is_replace
    r = msgspec.json.decode(b'{"surfaceOp":{"op":"replace","start":3,"end":5},"sourceEventSeqs":[3,4,5]}', type=Surface)
    assert r.op == SurfaceReplace(op="replace", start=3, end=5) and r.is_replace
    assert msgspec.json.decode(b"{}", type=Surface).op == "append"  # absent means append
    assert msgspec.json.encode(r) == b'{"surfaceOp":{"op":"replace","start":3,"end":5},"sourceEventSeqs":[3,4,5]}'
    for bad in [b'{"surfaceOp":"prepend"}', b'{"surfaceOp":{"op":"replace","start":-1,"end":0}}', b'{"x":1}']:
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(bad, type=Surface)


def test_surface_on_entries() -> None:
    replace = {"surfaceOp": {"op": "replace", "start": 0, "end": 1}, "sourceEventSeqs": [0, 1]}
    [e] = enc(NewEntry("assistant/message", {"content": "x"}, None, replace), first_n=2)
    assert e.surface is not None and e.surface.is_replace
    assert msgspec.json.decode(e.surface_raw or b"") == replace
    # a Surface struct is accepted as is
    [e2] = enc(NewEntry("assistant/message", {"content": "x"}, None, Surface(source_event_seqs=[0])), first_n=1)
    assert e2.surface == Surface(op="append", source_event_seqs=[0])


@pytest.mark.parametrize(
    ("entry_type", "surface", "first_n", "match"),
    [
        ("turn/start", {"surfaceOp": "append"}, 0, "surface-eligible"),
        ("assistant/message", {"surfaceOp": "bogus"}, 0, "surface"),
        ("assistant/message", {"surfaceOp": "append", "sourceEventSeqs": [0, 0]}, 1, "duplicates"),
        ("assistant/message", {"surfaceOp": "append", "sourceEventSeqs": [2]}, 2, "earlier"),
        ("assistant/message", {"surfaceOp": {"op": "replace", "start": 0, "end": 0}}, 1, "sourceEventSeqs"),
        ("assistant/message", {"surfaceOp": {"op": "replace", "start": 0, "end": 0}, "sourceEventSeqs": [0]}, None,
         "expected_n"),
    ],
)  # fmt: skip
def test_bad_surfaces(entry_type: str, surface: dict[str, Any], first_n: int | None, match: str) -> None:
    data = {"turn": 1} if entry_type == "turn/start" else {"content": "x"}
    with pytest.raises(InvalidEntryError, match=match):
        enc(NewEntry(entry_type, data, None, surface), first_n=first_n)


# --------------------------------------------------------------------------- decoding what is stored


def test_entry_decoding_and_kind() -> None:
    raw = (
        b'[{"n":0,"time":1,"type":"user/message","data":{"content":"a"}},'
        b'{"n":1,"time":2,"type":"cut","data":{"before":0,"summary":[],"reason":"r"},"meta":{"k":1}},'
        b'{"n":2,"time":3,"type":"assistant/message","data":{"content":"b"},'
        b'"surface":{"surfaceOp":"append","sourceEventSeqs":[0]}}]'
    )
    entries = ENTRY_LIST_DECODER.decode(raw)
    assert [e.kind for e in entries] == ["message", "cut", "message"]
    assert entries[1].meta == {"k": 1}
    assert entries[2].surface == Surface(source_event_seqs=[0])
    assert msgspec.json.encode(entries[0]) == b'{"n":0,"time":1,"type":"user/message","data":{"content":"a"}}'
    assert ENTRY_DECODER.decode(msgspec.json.encode(entries[2])) == entries[2]
    assert kind_of("turn/start") == "mark"


def test_check_ijson_finds_every_duplicate_name_its_fast_path_skips_none() -> None:
    """`check_ijson` skips the second parse when the colons of the text are all accounted for
    (members, and colons inside kept strings): random documents with and without duplicate
    names, colons in names and values and \\u escapes, against the full check."""
    import json
    import random

    from redis_session.model import NotIJsonError, _find_duplicate, _unique, check_ijson

    rng = random.Random(7)
    words = ["a", "b", "c:d", ":", "x:y:z", "é", "\\u003a", "k"]

    def text(depth: int) -> str:
        r = rng.random()
        if depth > 3 or r < 0.3:
            return json.dumps(rng.choice(words)).replace("\\\\u003a", "\\u003a") if rng.random() < 0.7 else "1"
        if r < 0.5:
            return "[" + ",".join(text(depth + 1) for _ in range(rng.randint(0, 3))) + "]"
        names = [rng.choice(words) for _ in range(rng.randint(0, 4))]
        return "{" + ",".join(f"{json.dumps(k)}:{text(depth + 1)}" for k in names) + "}"

    seen = {True: 0, False: 0}
    for _ in range(3000):
        raw = text(0).encode()
        value = msgspec.json.decode(raw)
        want = _find_duplicate(json.loads(raw, object_pairs_hook=_unique))
        try:
            check_ijson(value, raw)
            got = None
        except NotIJsonError as e:
            got = (e.path, e.key)
        assert got == want, raw
        seen[want is None] += 1
    assert seen[True] > 100 and seen[False] > 100  # both kinds were tried
