"""Tests for the safe typed codec: exact-type round trips, refusals with paths, digests."""

from __future__ import annotations

import collections
import math
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta, timezone, tzinfo
from decimal import Decimal
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any
from uuid import UUID
from zoneinfo import ZoneInfo

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, RootModel

from ratchet.store import codec
from ratchet.store.codec import (
    MAX_DEPTH,
    CodecError,
    CorruptDataError,
    UnknownTypeError,
    check_admissible,
    decode,
    digest,
    encode,
    encode_canonical,
    lookup,
    register,
    registered_name,
)

# --- registered test classes -----------------------------------------------------------------


class Color(Enum):
    RED = 1
    GREEN = "g"
    PAIR = (1, 2)


class Level(IntEnum):
    LOW = 1
    HIGH = 2


@dataclass
class Box:
    label: str
    content: Any = None


@dataclass(frozen=True)
class Point:
    x: int
    y: int


@dataclass
class Counter:
    start: int
    seen: int = field(init=False, default=0)


class Inner(BaseModel):
    data: bytes
    when: datetime | None = None


class Outer(BaseModel):
    name: str
    inner: Inner
    tags: tuple[str, ...] = ()
    counts: dict[str, int] = {}
    level: Level = Level.LOW


register(Color, "tests.codec.Color")
register(Level, "tests.codec.Level")
register(Box, "tests.codec.Box")
register(Point, "tests.codec.Point")
register(Counter, "tests.codec.Counter")
register(Outer, "tests.codec.Outer")


class MyBytes(bytes):
    pass


class MyStr(str):
    pass


@dataclass
class Unregistered:
    x: int


class Unstored(IntEnum):
    A = 1


class Opaque:
    pass


class LocalTZ(tzinfo):
    def utcoffset(self, dt: datetime | None) -> timedelta:
        return timedelta(hours=1)

    def dst(self, dt: datetime | None) -> timedelta:
        return timedelta(0)


# --- exact structural equality -----------------------------------------------------------------


def _same_tz(a: tzinfo | None, b: tzinfo | None) -> bool:
    if a is None or b is None:
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, ZoneInfo):
        return a.key == b.key  # type: ignore[attr-defined]
    return a.utcoffset(None) == b.utcoffset(None) and a.tzname(None) == b.tzname(None)


def same(a: Any, b: Any, ordered: bool = True) -> bool:
    """Equal and of exactly the same type at every level (nan equals nan, -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    t = type(a)
    if t is float:
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if t is Decimal:
        return str(a) == str(b)
    if t in (list, tuple):
        return len(a) == len(b) and all(same(x, y, ordered) for x, y in zip(a, b))
    if t is dict:
        if len(a) != len(b):
            return False
        if ordered:
            return all(
                same(ka, kb, ordered) and same(va, vb, ordered)
                for (ka, va), (kb, vb) in zip(a.items(), b.items())
            )
        return all(
            any(same(ka, kb, ordered) and same(va, b[kb], ordered) for kb in b)
            for ka, va in a.items()
        )
    if t in (set, frozenset):
        return len(a) == len(b) and all(any(same(x, y, ordered) for y in b) for x in a)
    if t in (datetime, time):
        return (
            a.replace(tzinfo=None) == b.replace(tzinfo=None)
            and a.fold == b.fold
            and _same_tz(a.tzinfo, b.tzinfo)
        )
    if isinstance(a, Enum):
        return a is b
    if t in (Box, Point, Counter):
        return all(same(getattr(a, f), getattr(b, f), ordered) for f in a.__dataclass_fields__)
    if isinstance(a, BaseModel):
        return a == b and all(
            same(getattr(a, f), getattr(b, f), ordered) for f in type(a).model_fields
        )
    return a == b


def roundtrip(value: Any) -> Any:
    out = decode(encode(value))
    assert same(value, out), (value, out)
    return out


# --- strategies ---------------------------------------------------------------------------------

offsets = st.timedeltas(
    min_value=timedelta(hours=-23, minutes=-59), max_value=timedelta(hours=23, minutes=59)
)
fixed_tz = st.builds(timezone, offsets) | st.builds(timezone, offsets, st.text(max_size=6))
any_tz = st.none() | fixed_tz | st.timezones()
big_ints = st.integers(min_value=-(2**200), max_value=2**200)

hashable_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    big_ints,
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.datetimes(timezones=any_tz),
    st.dates(),
    st.times(timezones=any_tz),
    st.timedeltas(),
    st.decimals(allow_nan=False),
    st.uuids(),
    st.sampled_from(Color),
    st.sampled_from(Level),
    st.builds(Point, st.integers(), st.integers()),
)
hashables = st.recursive(
    hashable_scalars,
    lambda c: st.lists(c, max_size=3).map(tuple) | st.frozensets(c, max_size=3),
    max_leaves=6,
)
dict_keys = st.one_of(
    st.text(max_size=8), st.integers(), big_ints, st.binary(max_size=8), st.tuples(hashables)
)
leaves = st.one_of(
    hashable_scalars,
    st.floats(),  # nan, inf, -0.0
    st.decimals(allow_nan=True),  # NaN, sNaN, Infinity
    st.binary(max_size=8).map(bytearray),
    st.builds(
        Outer,
        name=st.text(max_size=5),
        inner=st.builds(Inner, data=st.binary(max_size=5), when=st.none() | st.datetimes()),
        tags=st.lists(st.text(max_size=3), max_size=3).map(tuple),
        counts=st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
        level=st.sampled_from(Level),
    ),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(dict_keys, children, max_size=4),
        st.sets(hashables, max_size=4),
        st.frozensets(hashables, max_size=4),
        st.builds(Box, label=st.text(max_size=4), content=children),
    )


values = st.recursive(leaves, _containers, max_leaves=16)
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- properties ------------------------------------------------------------------------------


@PROPERTY
@given(values)
def test_roundtrip_keeps_exact_types(value: Any) -> None:
    roundtrip(value)
    check_admissible(value)


@PROPERTY
@given(values)
def test_canonical_encoding_decodes_and_digest_survives_roundtrip(value: Any) -> None:
    assert same(value, decode(encode_canonical(value)), ordered=False)
    assert digest(value) == digest(decode(encode(value)))
    assert encode_canonical(value) == encode_canonical(decode(encode_canonical(value)))


@PROPERTY
@given(st.dictionaries(dict_keys, values, max_size=6), st.sets(hashables, max_size=6))
def test_digest_ignores_insertion_order(d: dict[Any, Any], s: set[Any]) -> None:
    assert digest(d) == digest(dict(reversed(d.items())))
    assert digest(s) == digest(set(reversed(list(s))))
    assert digest(frozenset(s)) == digest(frozenset(reversed(list(s))))


# --- explicit round trips --------------------------------------------------------------------


def test_bytes_that_are_not_utf8_stay_bytes() -> None:
    out = roundtrip(b"\xff\xfe\x00\x80")
    assert type(out) is bytes
    roundtrip({b"\xff": b"\xc3\x28", "k": [b"\x80"]})
    assert type(roundtrip(bytearray(b"\xff"))) is bytearray


@pytest.mark.parametrize(
    "n", [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 2**1000, -(2**1000)]
)
def test_ints_of_any_size(n: int) -> None:
    assert roundtrip(n) == n
    assert roundtrip({n: [n]}) == {n: [n]}


def test_bool_stays_bool_and_tuple_stays_tuple() -> None:
    out = roundtrip([True, 1, False, 0, (1, [2, (3,)]), {"t": ()}])
    assert [type(x) for x in out[:4]] == [bool, int, bool, int]
    assert type(out[4]) is tuple
    assert type(out[4][1]) is list
    assert type(out[4][1][1]) is tuple


def test_floats_keep_sign_nan_and_infinity() -> None:
    assert math.copysign(1, roundtrip(-0.0)) == -1
    assert math.isnan(roundtrip(float("nan")))
    assert roundtrip([math.inf, -math.inf]) == [math.inf, -math.inf]


def test_datetimes_naive_aware_and_zoneinfo() -> None:
    naive = datetime(2024, 2, 29, 12, 30, 1, 5)
    assert roundtrip(naive).tzinfo is None
    aware = datetime(2024, 1, 1, tzinfo=timezone(timedelta(hours=-5, seconds=7), "EST-ish"))
    out = roundtrip(aware)
    assert out.tzinfo.tzname(None) == "EST-ish"
    assert roundtrip(datetime(2024, 1, 1, tzinfo=UTC)).tzinfo is UTC
    ny = ZoneInfo("America/New_York")
    ambiguous = datetime(2021, 11, 7, 1, 30, fold=1, tzinfo=ny)
    out = roundtrip(ambiguous)
    assert out.tzinfo is ny
    assert out.fold == 1
    assert out.utcoffset() == timedelta(hours=-5)
    roundtrip(time(23, 59, 59, 999999, tzinfo=timezone(timedelta(hours=2))))
    roundtrip([date(1, 1, 1), date(9999, 12, 31), timedelta(days=-3, microseconds=1)])


def test_decimal_and_uuid() -> None:
    for text in [
        "1.10",
        "-0",
        "NaN",
        "-sNaN",
        "Infinity",
        "1E+999",
        "123456789012345678901234567890",
    ]:
        assert str(roundtrip(Decimal(text))) == text
    u = UUID("12345678-1234-5678-1234-567812345678")
    assert roundtrip(u) == u


def test_strings_with_lone_surrogates() -> None:
    roundtrip("a\ud800b")
    roundtrip({"\udcff": ("\ud800", "ok")})


def test_dict_keys_of_every_admitted_type_and_tuple_keys_stay_tuples() -> None:
    value = {"s": 1, 2: 2, b"b": 3, (1, "x", (2.5, b"y")): 4, 2**80: 5}
    out = roundtrip(value)
    assert list(out) == list(value)
    assert (1, "x", (2.5, b"y")) in out


def test_registered_enum_dataclass_and_model() -> None:
    assert roundtrip([Color.RED, Color.GREEN, Color.PAIR, Level.HIGH])[3] is Level.HIGH
    roundtrip(Box("b", {"p": Point(1, 2), "s": {Point(3, 4)}}))
    model = Outer(
        name="o",
        inner=Inner(data=b"\xff\x00", when=datetime(2020, 1, 1, tzinfo=UTC)),
        tags=("a", "b"),
        counts={"x": 1},
        level=Level.HIGH,
    )
    out = roundtrip(model)
    assert type(out.inner.data) is bytes
    assert type(out.tags) is tuple


def test_dataclass_init_false_fields_are_restored() -> None:
    c = Counter(3)
    c.seen = 7
    out = roundtrip(c)
    assert (out.start, out.seen) == (3, 7)


def test_threads_can_encode_concurrently() -> None:
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(300):
                v = {"i": i, "j": j, "t": (i, "x" * j), "s": {j}}
                assert same(decode(encode(v)), v)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# --- refusals ----------------------------------------------------------------------------------


def _message(value: Any, path: str = "") -> str:
    with pytest.raises(CodecError) as info:
        check_admissible(value, path)
    with pytest.raises(CodecError) as info2:
        encode(value) if not path else encode({path: value})
    assert isinstance(info.value, TypeError)
    if not path:
        assert str(info2.value) == str(info.value)
    return str(info.value)


def test_subclasses_of_admitted_types_are_refused() -> None:
    assert _message(MyBytes(b"x")) == (
        f"top-level value is a {MyBytes!r}, a subclass of bytes; subclasses are refused "
        "because they would come back as a plain bytes; convert it with bytes(value) instead"
    )
    assert _message({"a": [MyStr("s")]}, "doc") == (
        f"value at 'doc.a[0]' is a {MyStr!r}, a subclass of str; subclasses are refused "
        "because they would come back as a plain str; convert it with str(value) instead"
    )
    point = collections.namedtuple("point", "x y")(1, 2)
    assert "a subclass of tuple" in _message(point)
    assert "or a registered dataclass" in _message(point)
    assert "a subclass of dict" in _message(collections.OrderedDict(a=1))
    assert _message(Unstored.A) == (
        f"top-level value is a {Unstored!r}; register the enum with "
        "ratchet.register_type(Unstored) or store its .value instead"
    )


def test_unregistered_dataclass_message_names_the_path() -> None:
    order = {"items": [1, 2, Unregistered(3)]}
    assert _message(order, "order") == (
        f"value at 'order.items[2]' is a {Unregistered!r}; register it with "
        "ratchet.register_type(Unregistered) or convert it to a dict instead"
    )


def test_unknown_objects_are_refused_with_advice() -> None:
    msg = _message([Opaque()])
    assert msg.startswith(f"value at '[0]' is a {Opaque!r}; only None, bool, int, float, str,")
    assert msg.endswith(
        "make it a dataclass or pydantic model and register it with "
        "ratchet.register_type(...) instead"
    )
    assert _message(memoryview(b"x")) == (
        "top-level value is a <class 'memoryview'>; convert it with bytes(value) instead"
    )


def test_paths_for_keys_sets_and_registered_fields() -> None:
    assert _message({"my key": {3: Opaque()}}, "order").startswith(
        f"value at 'order[\"my key\"][3]' is a {Opaque!r};"
    )
    assert _message({"s": {(1, Opaque())}}).startswith("value at 's{(1, <")
    assert _message(Box("b", [Opaque()]), "box").startswith(
        f"value at 'box.content[0]' is a {Opaque!r};"
    )


def test_dict_keys_of_other_types_are_refused() -> None:
    assert _message({"d": {1.5: "x"}}, "order") == (
        "dict key 1.5 at 'order.d' is a <class 'float'>; keys must be str, int, bytes or "
        "tuple: convert the key, e.g. str(key)"
    )
    assert _message({True: 1}) == (
        "dict key True at the top level is a <class 'bool'>; keys must be str, int, bytes or "
        "tuple (bool keys are refused: True == 1)"
    )
    assert "at '[1]', something that is a" in _message({(1, Opaque()): 1})
    assert "is a <class 'NoneType'>" in _message({None: 1})


def test_recursive_containers_are_refused_clearly() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    assert _message(loop) == (
        "value at '[1]' refers back to the top-level value (a self-referencing structure); "
        "break the cycle, e.g. store an id instead"
    )
    d: dict[str, Any] = {}
    d["me"] = ({"again": d},)
    assert _message({"x": d}, "mem") == (
        "value at 'mem.x.me[0].again' refers back to its container 'mem.x' (a "
        "self-referencing structure); break the cycle, e.g. store an id instead"
    )
    box = Box("b")
    box.content = [box]
    assert "refers back to the top-level value" in _message(box)


def test_too_deep_nesting_is_refused_without_recursion_error() -> None:
    deep: Any = 0
    for _ in range(MAX_DEPTH + 5):
        deep = (deep,)
    msg = _message(deep)
    assert msg.startswith("value at '[0][0]")
    assert msg.endswith(
        f"is nested more than {MAX_DEPTH} levels deep; flatten it (e.g. store a list of records with parent ids)"
    )
    ok: Any = 0
    for _ in range(MAX_DEPTH - 1):
        ok = [ok]
    roundtrip(ok)


def test_unsupported_tzinfo_is_refused() -> None:
    assert _message(datetime(2020, 1, 1, tzinfo=LocalTZ()), "when") == (
        f"value at 'when' is a datetime with tzinfo {LocalTZ!r}; only datetime.timezone and "
        "zoneinfo.ZoneInfo time zones are admitted: convert it with "
        "value.astimezone(timezone(value.utcoffset())) instead"
    )


# --- decoding bad data -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "cannot decode 0 bytes: ValueError: Unpack failed: incomplete input"),
        (b"\xc1", "cannot decode 1 bytes: FormatError: not valid msgpack"),
        (b"\x01\x02", "cannot decode 2 bytes: ExtraData: unpack(b) received extra data."),
        (msgpack.packb(msgpack.ExtType(99, b"")), "unknown extension type code 99"),
        (msgpack.packb(msgpack.ExtType(2, msgpack.packb(5))), "tuple payload is a int, not a list"),
    ],
)
def test_corrupt_bytes_raise_corrupt_data_error(data: bytes, message: str) -> None:
    with pytest.raises(CorruptDataError) as info:
        decode(data)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_truncated_encoding_is_corrupt() -> None:
    data = encode({"k": (1, 2, datetime(2020, 1, 1)), "u": UUID(int=5)})
    for cut in range(len(data)):
        with pytest.raises(CorruptDataError):
            decode(data[:cut])


def test_unknown_registered_name_raises_unknown_type_error() -> None:
    data = msgpack.packb(msgpack.ExtType(12, msgpack.packb(["os.system", {"cmd": "x"}])))
    with pytest.raises(UnknownTypeError) as info:
        decode(data)
    assert str(info.value) == (
        "the data names registered type 'os.system', which is not registered in this "
        "process; call ratchet.register_type(<the class>, name='os.system') before "
        "decoding"
    )
    assert isinstance(info.value, TypeError)


def test_data_that_no_longer_fits_its_class_is_corrupt() -> None:
    data = msgpack.packb(msgpack.ExtType(12, msgpack.packb(["tests.codec.Color", 42])))
    with pytest.raises(
        CorruptDataError, match="cannot rebuild registered type 'tests.codec.Color'"
    ):
        decode(data)


def test_decode_wants_bytes() -> None:
    with pytest.raises(TypeError, match="decode\\(\\) takes bytes, not <class 'str'>"):
        decode("abc")  # type: ignore[arg-type]


# --- registry ------------------------------------------------------------------------------


def test_register_names_and_conflicts() -> None:
    @register
    @dataclass
    class Local:
        a: int

    assert registered_name(Local) == f"{__name__}.{Local.__qualname__}"
    assert lookup(registered_name(Local)) is Local
    assert register(Local) is Local  # same class again: fine
    roundtrip(Local(1))

    @dataclass
    class Other:
        a: int

    with pytest.raises(ValueError, match="that name is already registered"):
        register(Other, registered_name(Local))
    with pytest.raises(ValueError, match="it is already registered as"):
        register(Local, "tests.codec.another-name")
    with pytest.raises(TypeError, match="register\\(\\) takes an Enum, a dataclass"):
        register(Opaque)
    with pytest.raises(TypeError, match="register\\(\\) takes a class"):
        register("tests.codec.x")  # type: ignore[type-var]
    assert registered_name(Opaque) is None
    with pytest.raises(UnknownTypeError):
        lookup("tests.codec.never")


# --- digest ----------------------------------------------------------------------------------


def test_digest_is_stable_across_set_insertion_orders() -> None:
    a = {"tags": {"b", "a", "c"}, "n": frozenset([3, 1, 2]), "m": {"y": 1, "x": 2}}
    b = {"m": {"x": 2, "y": 1}, "n": frozenset([2, 3, 1]), "tags": {"c", "a", "b"}}
    assert digest(a) == digest(b)
    assert encode(a) != encode(b)  # encode keeps insertion order; only digests normalise it
    assert digest(1) != digest(True) != digest(1.0)
    assert digest((1, 2)) != digest([1, 2])


def test_canonical_bytes_and_digest_are_pinned() -> None:
    """The wire format is frozen: stored state and recorded digests must stay valid."""
    value = {
        "when": datetime(2020, 1, 2, 3, 4, 5, 6, tzinfo=UTC),
        "b": {3, 1, 2},
        "a": (1, b"x", 2**70),
    }
    assert encode_canonical(value).hex() == (
        "83a161c711029301c40178c70901400000000000000000a162d60393010203"
        "a47768656ec70c0699cd07e40102030405060000"
    )
    assert digest(value) == "bb55b5cedf5628db256ee2144d0e5078bd936c749ac63383a3ec6bf84360fa9e"


# --- safety --------------------------------------------------------------------------------


def test_codec_never_uses_pickle() -> None:
    source = Path(codec.__file__).read_text()
    assert "import pickle" not in source
    assert "from pickle" not in source
    assert "importlib" not in source
    assert "__import__" not in source
    assert "pickle" not in vars(codec)


def test_decode_imports_nothing() -> None:
    script = (
        "import sys\n"
        "from ratchet.store.codec import decode, encode, register\n"
        "from datetime import datetime, timezone\n"
        "from decimal import Decimal\n"
        "from uuid import UUID\n"
        "data = encode([(1, 2**70), {3}, frozenset(), bytearray(b'x'), datetime.now(timezone.utc),\n"
        "               datetime.now().date(), datetime.now().time(), Decimal('1.5'), UUID(int=1)])\n"
        "before = set(sys.modules)\n"
        "decode(data)\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


class Names(RootModel[list[str]]):
    pass


register(Names, "tests.codec.Names")


class Loose(BaseModel):
    x: int


def test_root_model_and_unregistered_model() -> None:
    out = roundtrip(Names(["a", "b"]))
    assert out.root == ["a", "b"]
    assert _message({"m": Loose(x=1)}) == (
        f"value at 'm' is a {Loose!r}; register it with ratchet.register_type(Loose) "
        "or store its model_dump() instead"
    )


def test_deep_shared_structure_is_refused_quickly() -> None:
    shared: Any = 0
    for _ in range(MAX_DEPTH + 5):
        shared = [shared, shared]  # 2**105 paths, 105 distinct lists
    assert "is nested more than" in _message(shared)


# --- encode_built: ratchet's own records, packed directly ------------------------------------

_built_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
    st.binary(max_size=8), st.lists(st.integers(), max_size=2).map(tuple),
)  # fmt: skip
built_values = st.recursive(
    _built_leaves,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=16,
)


@PROPERTY
@given(built_values)
def test_encode_built_gives_the_bytes_encode_gives(value: Any) -> None:
    # Big ints, tuples and lone surrogates among them take encode's own path.
    assert codec.encode_built(value) == encode(value)


def test_encode_built_falls_back_for_what_msgpack_refuses() -> None:
    for value in [{"n": 2**70}, {"t": (1, 2)}, {"s": "\udc80"}, [{1, 2}], {"d": date(2026, 1, 1)}]:
        assert codec.encode_built(value) == encode(value)
        assert same(decode(codec.encode_built(value)), value)
    assert codec.encode_built({"after": "a fallback"}) == encode({"after": "a fallback"})


# --- encode's shortcut for plain dicts and lists: the bytes lowering would give ---------------


@PROPERTY
@given(
    st.dictionaries(st.text(max_size=6) | st.integers(-3, 3) | st.booleans(), values, max_size=4)
)
def test_encode_of_a_dict_gives_the_bytes_of_its_lowered_form(value: Any) -> None:
    _assert_encodes_as_lowered(value)


def _assert_encodes_as_lowered(value: Any) -> None:
    """`encode` gives the bytes of the value's lowered form, or refuses it as lowering does."""
    try:
        lowered = codec._pack(codec._lower_top(value, "", False))
    except codec.CodecError:
        with pytest.raises(codec.CodecError):
            encode(value)
        return
    assert encode(value) == lowered


@PROPERTY
@given(built_values)
def test_encode_of_plain_data_gives_the_bytes_of_its_lowered_form(value: Any) -> None:
    wrapped = {"v": value}
    assert encode(wrapped) == codec._pack(codec._lower_top(wrapped, "", False))


@PROPERTY
@given(st.lists(values, max_size=4))
def test_encode_of_a_list_gives_the_bytes_of_its_lowered_form(value: Any) -> None:
    _assert_encodes_as_lowered(value)
    _assert_encodes_as_lowered([value, {"v": value}])


def test_encode_of_a_list_nested_past_the_limit_is_refused_as_before() -> None:
    deep: Any = []
    for _ in range(codec.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(codec.CodecError, match="nested"):
        encode(deep)


def test_encode_of_a_dict_nested_past_the_limit_is_refused_as_before() -> None:
    deep: Any = {}
    for _ in range(codec.MAX_DEPTH + 1):
        deep = {"d": deep}
    with pytest.raises(codec.CodecError, match="nested"):
        encode(deep)
    ok: Any = {}
    for _ in range(codec.MAX_DEPTH - 1):
        ok = {"d": ok}
    assert decode(encode(ok)) == ok


@PROPERTY
@given(
    st.dictionaries(st.text(max_size=6) | st.integers(-3, 3) | st.booleans(), values, max_size=4)
)
def test_check_admissible_of_a_dict_agrees_with_encode(value: Any) -> None:
    try:
        encode(value)
    except codec.CodecError as exc:
        with pytest.raises(type(exc)):
            codec.check_admissible(value, "v")
        return
    codec.check_admissible(value, "v")
