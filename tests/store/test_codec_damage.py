"""Crafted or damaged bytes: `decode` raises a codec error and nothing else, and never crashes.

Stored bytes must be safe to load from an untrusted or damaged disk. Two reported crashes are
pinned (about 200 nested extension records overflowed the C stack and killed the process; a
Decimal record with a garbage payload raised decimal.InvalidOperation), every extension
decoder is fed malformed payloads, and hypothesis feeds arbitrary bytes and mutated valid
encodings. `make fuzz` (scripts/fuzz_codec.py) runs the same check for a million inputs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from enum import Enum
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgpack import ExtType
from test_codec import values

from ratchet import InvalidArgumentError, StateError
from ratchet.store._sqlite import DB_NAME, SqliteStore
from ratchet.store.codec import (
    MAX_DECODE_DEPTH,
    MAX_DEPTH,
    CodecError,
    CorruptDataError,
    UnknownTypeError,
    UnknownValue,
    decode,
    encode,
    encode_canonical,
    register,
)

pack = msgpack.packb


def ext(code: int, payload: Any) -> bytes:
    """An extension record (any code, -128..127) whose payload is `payload` packed, or the
    bytes as they are."""
    data = payload if isinstance(payload, bytes) else pack(payload)
    return b"\xc9" + len(data).to_bytes(4, "big") + (code % 256).to_bytes(1, "big") + data


def decode_in_child(script: str) -> subprocess.CompletedProcess[str]:
    """Run `script` in a child, so a regression that crashes the interpreter fails one test."""
    prelude = (
        "import msgpack, threading\nfrom msgpack import ExtType\nfrom ratchet.store import codec\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- the reported crashes ----------------------------------------------------------------------

NESTINGS = {
    # each wraps `inner` (packed bytes) in one more extension record
    "tuple": "lambda inner: msgpack.packb(ExtType(2, b'\\x91' + inner))",
    "frozenset": "lambda inner: msgpack.packb(ExtType(4, b'\\x91' + inner))",
    "registered": "lambda inner: msgpack.packb(ExtType(12, b'\\x92\\xa1x' + inner))",
    "tuple in a list": "lambda inner: msgpack.packb(ExtType(2, b'\\x91\\x91' + inner))",
}


@pytest.mark.parametrize("levels", [200, 5000])
@pytest.mark.parametrize("kind", list(NESTINGS), ids=lambda k: k.replace(" ", "-"))
def test_deeply_nested_records_are_corrupt_not_a_crash(kind: str, levels: int) -> None:
    child = decode_in_child(
        f"""
        wrap = {NESTINGS[kind]}
        blob = msgpack.packb(0)
        for _ in range({levels}):
            blob = wrap(blob)
        try:
            codec.decode(blob, unknown="generic")
        except Exception as exc:
            print(type(exc).__name__, exc)
        """
    )
    assert child.returncode == 0, f"the decoding process died: {child.returncode} {child.stderr}"
    assert child.stdout == (
        f"CorruptDataError extension records are nested more than {MAX_DECODE_DEPTH} deep, "
        "deeper than encode ever writes them\n"
    )


def test_the_deepest_values_encode_writes_decode_even_on_a_small_thread_stack() -> None:
    # MAX_DEPTH containers, the innermost holding one more record: MAX_DEPTH + 1 records deep.
    child = decode_in_child(
        f"""
        deep = 2**70
        for _ in range({MAX_DEPTH}):
            deep = (deep,)
        keyed = {{(2**70,): 1}}  # a tuple key sits one level below its dict
        for _ in range({MAX_DEPTH - 1}):
            keyed = (keyed,)
        results = []
        def work():
            for value in (deep, keyed):
                results.append(codec.decode(codec.encode(value)) == value)
            try:
                codec.decode(msgpack.packb(ExtType(2, b"\\x91" + codec.encode(deep))))
            except codec.CorruptDataError as exc:
                results.append(str(exc))
        threading.stack_size(512 * 1024)
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        print(results)
        """
    )
    assert child.returncode == 0, f"the decoding process died: {child.returncode} {child.stderr}"
    assert child.stdout == (
        f"[True, True, 'extension records are nested more than {MAX_DECODE_DEPTH} deep, deeper "
        "than encode ever writes them']\n"
    )
    # ... and encode refuses one container more, so nothing it writes is refused by decode.
    deeper: Any = 2**70
    for _ in range(MAX_DEPTH + 1):
        deeper = (deeper,)
    with pytest.raises(CodecError, match=f"nested more than {MAX_DEPTH} levels deep"):
        encode(deeper)


def test_a_decimal_with_a_garbage_payload_is_corrupt() -> None:
    with pytest.raises(CorruptDataError) as info:
        decode(ext(10, b"garbage"))
    assert str(info.value) == (
        "cannot decode a Decimal record (ext 10, 7 bytes): InvalidOperation: "
        "[<class 'decimal.ConversionSyntax'>]"
    )
    assert isinstance(info.value.__cause__, InvalidOperation)
    assert decode(ext(10, b"-1.50E+3")) == Decimal("-1.50E+3")


# --- every extension decoder, fed what encode never writes -------------------------------------


def in_tuples(blob: bytes, levels: int = 12) -> bytes:
    """`blob` inside `levels` nested tuples: deep enough for the heap-allocated unpacker."""
    for _ in range(levels):
        blob = ext(2, b"\x91" + blob)
    return blob


MALFORMED = [
    (ext(1, b""), None),  # an empty big int is 0: harmless, decodes
    (ext(2, b"\xc1"), r"tuple record \(ext 2, 1 bytes\): FormatError"),
    (ext(2, pack([1]) + b"\x00"), "tuple record .*ExtraData"),
    (ext(3, [[1], [2]]), "set record .*TypeError: unhashable type: 'list'"),
    (ext(4, {"a": 1}), "frozenset payload is a dict, not a list"),
    (ext(6, [2020, 1, 1]), "datetime payload has 3 items, not 9"),
    (ext(6, [2020, 13, 1, 0, 0, 0, 0, 0, None]), "datetime record .*ValueError: month must be"),
    (ext(6, [2020, 1, 1, 0, 0, 0, 0, 2, None]), "datetime record .*ValueError: fold must be"),
    (ext(6, ["2020", 1, 1, 0, 0, 0, 0, 0, None]), "datetime record .*TypeError"),
    (ext(6, [2020, 1, 1, 0, 0, 0, 0, 0, 86_400_000_000]), "datetime record .*ValueError"),
    (ext(6, [2**63, 1, 1, 0, 0, 0, 0, 0, None]), "datetime record .*OverflowError"),
    (ext(6, [2020, 1, 1, 0, 0, 0, 0, 0, [0]]), "time zone payload has 1 items, not 2"),
    (ext(6, [2020, 1, 1, 0, 0, 0, 0, 0, [0, 5]]), "datetime record .*TypeError"),
    (ext(6, [2020, 1, 1, 0, 0, 0, 0, 0, "../../etc/passwd"]), "time zone '../../etc/passwd'"),
    (ext(6, [2020, 1, 1, 0, 0, 0, 0, 0, "No/Such_Zone"]), "time zone 'No/Such_Zone'"),
    (ext(7, 0), "date record .*ValueError"),
    (ext(7, 2**62), "date record .*(ValueError|OverflowError)"),
    (ext(7, True), "date payload is a bool, not a int"),
    (ext(8, [25, 0, 0, 0, 0, None]), "time record .*ValueError: hour must be"),
    (ext(9, [10**10, 0, 0]), "timedelta record .*OverflowError"),
    (ext(9, [1, 2]), "timedelta payload has 2 items, not 3"),
    (ext(10, b"\xff"), "Decimal record .*UnicodeDecodeError"),
    (ext(10, b""), "Decimal record .*InvalidOperation"),
    (ext(11, b"short"), "UUID record .*ValueError: bytes is not a 16-char string"),
    (ext(12, ["a.B"]), "registered object payload has 1 items, not 2"),
    (ext(12, [7, {}]), "registered object name is a int, not a str"),
    (ext(12, [[1], {}]), "registered object name is a list, not a str"),
    (ext(12, b"\xc1"), "registered object record .*FormatError"),
    (ext(99, b""), "unknown extension type code 99"),
    (
        in_tuples(ext(2, b"\x92\x01")),
        r"^cannot decode a tuple record \(ext 2, 2 bytes\): ValueError: Unpack failed: incomplete",
    ),
    (
        in_tuples(ext(2, pack([1]) + b"\x00")),
        r"^cannot decode a tuple record \(ext 2, 3 bytes\): ValueError: 1 bytes of extra data",
    ),
    (in_tuples(ext(8, [25, 0, 0, 0, 0, None])), "time record .*ValueError: hour must be"),
    (in_tuples(b"\xc1"), "tuple record .*FormatError"),
    (ext(-1, b"abc"), r"cannot decode 9 bytes: ValueError"),  # a bad msgpack Timestamp
    (b"\x81\x91\x01\x02", r"cannot decode 4 bytes: TypeError"),  # a map with a list key
    (b"\x91" * 2000 + b"\x00", "cannot decode 2001 bytes: StackError"),  # 2000 nested lists
    (b"\xdd\xff\xff\xff\xff", "cannot decode 5 bytes: ValueError"),  # a 4-billion-item list
    (b"\xc9\xff\xff\xff\xff\x02", "cannot decode 6 bytes: ValueError"),  # a 4 GB extension record
]


@pytest.mark.parametrize(("data", "message"), MALFORMED, ids=[d[:12].hex() for d, _ in MALFORMED])
def test_malformed_records_are_corrupt_data(data: bytes, message: str | None) -> None:
    for unknown in ("raise", "generic"):
        if message is None:
            decode(data, unknown=unknown)  # type: ignore[arg-type]
            continue
        with pytest.raises(CorruptDataError, match=message) as info:
            decode(data, unknown=unknown)  # type: ignore[arg-type]
        assert isinstance(info.value, ValueError)


def test_a_nested_failure_keeps_its_cause_and_its_innermost_message() -> None:
    data = pack([1, ExtType(2, pack([ExtType(6, pack([2020, 13, 1, 0, 0, 0, 0, 0, None]))]))])
    with pytest.raises(CorruptDataError, match=r"^cannot decode a datetime record") as info:
        decode(data)
    assert isinstance(info.value.__cause__, ValueError)


# --- hypothesis: arbitrary and damaged bytes --------------------------------------------------

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))


def decodes_or_codec_error(data: bytes) -> None:
    """The property: a value, CorruptDataError or UnknownTypeError; in generic mode never the
    latter. Anything else escapes and fails the test with the input in hypothesis' report."""
    try:
        decode(data)
    except (CorruptDataError, UnknownTypeError):
        pass
    try:
        decode(data, unknown="generic")
    except CorruptDataError:
        pass


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_a_codec_error(data: bytes) -> None:
    decodes_or_codec_error(data)


def mutate(blob: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(blob)
    for op, at, byte in ops:
        i = at % (len(out) + 1)
        if op == "flip" and out:
            out[i % len(out)] ^= 1 << (byte % 8)
        elif op == "set" and out:
            out[i % len(out)] = byte
        elif op == "insert":
            out[i:i] = bytes([byte])
        elif op == "delete":
            del out[i : i + 1 + byte % 4]
        elif op == "truncate":
            del out[i:]
        elif op == "ext":  # an extension record header: its payload is whatever follows
            out[i:i] = bytes([0xC7, byte % 16, 1 + byte % 12])
        elif op == "duplicate":
            out[i:i] = out[i : i + 1 + byte % 8]
    return bytes(out)


OPS = st.tuples(
    st.sampled_from(["flip", "set", "insert", "delete", "truncate", "ext", "duplicate"]),
    st.integers(0, 2**16),
    st.integers(0, 255),
)


@FUZZ
@given(values, st.booleans(), st.lists(OPS, min_size=1, max_size=4))
def test_damaged_encodings_decode_or_raise_a_codec_error(
    value: Any, canonical: bool, ops: list[tuple[str, int, int]]
) -> None:
    blob = encode_canonical(value) if canonical else encode(value)
    decodes_or_codec_error(mutate(blob, ops))


# Payloads shaped like the real ones (lists of small ints, strs, None), with wrong lengths, types
# and ranges: arbitrary bytes rarely get past msgpack into the extension decoders.
payload_items = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-3, 30),
    st.text(max_size=12),
    st.binary(max_size=17),
    st.lists(st.integers(-(2**40), 2**40) | st.text(max_size=4), max_size=3),
)


@FUZZ
@given(st.integers(-2, 13), st.lists(payload_items, max_size=10) | payload_items | st.binary())
def test_extension_records_with_wrong_payloads_are_corrupt_data(code: int, payload: Any) -> None:
    data = ext(code, payload)
    decodes_or_codec_error(data)
    decodes_or_codec_error(pack([ExtType(2, b"\x91" + data)]))  # inside a tuple in a list


# --- unknown="generic": a value of a type this process has not registered ----------------------


class Mood(Enum):
    CALM = "calm"


@dataclass
class Ticket:
    id: int
    when: datetime
    tags: tuple[str, ...]


register(Ticket, "tests.damage.Ticket")

NOT_HERE = {  # stored by a process that had these types registered; this one does not
    "order": ExtType(
        12, encode(["shop.Order", {"id": 7, "items": ("a", "b"), "paid": Decimal("9.50")}])
    ),
    "mood": ExtType(12, encode(["shop.Mood", "calm"])),
}


def test_generic_decoding_gives_a_marked_stand_in_for_an_unregistered_type() -> None:
    data = pack(NOT_HERE["order"])
    with pytest.raises(UnknownTypeError, match="'shop.Order', which is not registered"):
        decode(data)  # the default is unchanged
    order = decode(data, unknown="generic")
    assert type(order) is UnknownValue
    assert order.type_name == "shop.Order"
    assert order.state == {"id": 7, "items": ("a", "b"), "paid": Decimal("9.50")}
    assert type(order.state["items"]) is tuple  # the state keeps its exact types
    assert repr(order) == (
        "UnknownValue('shop.Order', {'id': 7, 'items': ('a', 'b'), 'paid': Decimal('9.50')})"
    )
    assert order == UnknownValue("shop.Order", dict(order.state))
    assert order != UnknownValue("shop.Other", order.state)


def test_generic_decoding_works_inside_known_types_sets_and_keys() -> None:
    ticket = encode(Ticket(1, datetime(2026, 1, 2), ("x",)))
    data = pack(
        {
            "ticket": msgpack.unpackb(ticket, ext_hook=ExtType),
            "moods": ExtType(4, pack([NOT_HERE["mood"]])),  # a frozenset member
            "by_order": {NOT_HERE["order"]: 1},  # a dict key
        }
    )
    out = decode(data, unknown="generic")
    assert out["ticket"] == Ticket(1, datetime(2026, 1, 2), ("x",))  # registered: rebuilt
    assert out["moods"] == frozenset({UnknownValue("shop.Mood", "calm")})
    assert list(out["by_order"]) == [decode(pack(NOT_HERE["order"]), unknown="generic")]
    assert hash(UnknownValue("a.B", {"x": [1, {2}]})) == hash(UnknownValue("a.B", {"x": [1, {2}]}))


def test_generic_decoding_still_refuses_data_that_does_not_fit_a_registered_type() -> None:
    data = ext(12, ["tests.damage.Ticket", {"id": 1}])
    with pytest.raises(CorruptDataError, match="cannot rebuild registered type 'tests.damage"):
        decode(data, unknown="generic")


def test_a_stand_in_cannot_be_stored_and_unknown_takes_two_modes() -> None:
    order = decode(pack(NOT_HERE["order"]), unknown="generic")
    with pytest.raises(CodecError) as info:
        encode({"o": order})
    assert str(info.value) == (
        "value at 'o' is a <class 'ratchet.store.codec.UnknownValue'> standing in for "
        "registered type 'shop.Order', which this process has not registered; register that "
        "class with ratchet.register_type(...) and decode the data again"
    )
    with pytest.raises(InvalidArgumentError, match='unknown= must be "raise" or "generic"'):
        decode(b"\x00", unknown="skip")  # type: ignore[arg-type]


# --- damaged state in the SQLite store -------------------------------------------------------


def test_a_damaged_meta_record_is_a_state_error_naming_it(tmp_path: Path) -> None:
    store = SqliteStore.open(tmp_path, "agent", "fp", [])
    store.conn.execute("UPDATE meta SET value = ? WHERE name = 'source'", (ext(10, b"garbage"),))
    store.close()
    store = SqliteStore.open(tmp_path, "agent", "fp", [])
    try:
        with pytest.raises(StateError) as info:
            store.load()
    finally:
        store.close()
    assert str(info.value).startswith(
        f"{tmp_path / DB_NAME}: the meta record 'source' cannot be decoded (cannot decode a "
        "Decimal record (ext 10, 7 bytes): InvalidOperation"
    )
    assert isinstance(info.value.__cause__, CorruptDataError)
