"""Fuzz the codec's decoder: whatever the bytes, `decode` returns a value or raises
CorruptDataError / UnknownTypeError (with unknown="generic", only CorruptDataError), and never
crashes, hangs or exhausts memory.

    .venv/bin/python scripts/fuzz_codec.py                   # a million inputs (`make fuzz`)
    .venv/bin/python scripts/fuzz_codec.py --inputs 20000    # a quick run
    .venv/bin/python scripts/fuzz_codec.py --replay 91c1     # decode one input, say what happens

Inputs start from valid encodings of random admissible values (every extension type,
registered enums, dataclasses and models, types this process does not know, the deepest
nesting encode admits) plus a few known attacks, and are mutated: by atheris (coverage-guided
libFuzzer) when it is installed, else by a seeded random driver (`--engine random`). Each
input is decoded in both `unknown=` modes.

The fuzzing runs in a child process that writes each input to a small shared file before
decoding it, so a crash or a hang of the interpreter is reported with its input too. A failure
is printed with the input in hex (replay it with --replay) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta, timezone
from datetime import time as dtime
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Any
from uuid import UUID

MAX_LEN = 4096  # longest input
HANG_SECONDS = 20.0  # one input taking this long is a failure
_HEADER = struct.Struct("<QI")  # inputs done, length of the current input
_SHARED_SIZE = _HEADER.size + MAX_LEN


# --- the child: fuzzing ----------------------------------------------------------------------------


def _load_codec(instrument: bool) -> Any:
    if instrument:
        import atheris

        with atheris.instrument_imports(include=["ratchet.store.codec"]):
            from ratchet.store import codec
    else:
        from ratchet.store import codec
    return codec


def _register_types(codec: Any) -> None:
    from pydantic import BaseModel

    class Mood(Enum):
        CALM = "calm"
        PAIR = (1, 2)

    @dataclass
    class Ticket:
        id: int
        tags: tuple[str, ...] = ()
        seen: int = field(init=False, default=0)

    class Order(BaseModel):
        name: str
        items: list[int] = []
        when: datetime | None = None

    codec.register(Mood, "fuzz.Mood")
    codec.register(Ticket, "fuzz.Ticket")
    codec.register(Order, "fuzz.Order")
    _TYPES.update(Mood=Mood, Ticket=Ticket, Order=Order)


_TYPES: dict[str, Any] = {}


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    """A random value encode admits (the registered types included)."""
    scalars = [
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: rng.randint(-(2**70), 2**70),
        lambda: rng.randint(-5, 300),
        lambda: rng.choice([0.0, -0.0, 1.5, float("nan"), float("inf"), 1e300]),
        lambda: "".join(rng.choice("ab\u00e9\u4e2d\ud800 ") for _ in range(rng.randint(0, 6))),
        lambda: rng.randbytes(rng.randint(0, 6)),
        lambda: bytearray(rng.randbytes(rng.randint(0, 4))),
        lambda: datetime(
            rng.randint(1, 9999),
            rng.randint(1, 12),
            rng.randint(1, 28),
            rng.randint(0, 23),
            fold=rng.randint(0, 1),
            tzinfo=rng.choice([None, UTC, timezone(timedelta(hours=-3), "X"), _zone()]),
        ),
        lambda: date.fromordinal(rng.randint(1, 3_000_000)),
        lambda: dtime(rng.randint(0, 23), rng.randint(0, 59), tzinfo=rng.choice([None, UTC])),
        lambda: timedelta(rng.randint(-(10**6), 10**6), rng.randint(0, 86399)),
        lambda: Decimal(rng.choice(["1.50", "-0", "NaN", "sNaN", "-Infinity", "1E+999999"])),
        lambda: UUID(int=rng.getrandbits(128)),
        lambda: rng.choice(list(_TYPES["Mood"])),
    ]
    if depth > 3 or rng.random() < 0.4:
        return rng.choice(scalars)()
    n = rng.randint(0, 4)
    kind = rng.randrange(8)
    if kind == 0:
        return [_random_value(rng, depth + 1) for _ in range(n)]
    if kind == 1:
        return tuple(_random_value(rng, depth + 1) for _ in range(n))
    if kind == 2:
        keys = [rng.choice(["k", "key", 1, -7, b"b", (1, "t")]) for _ in range(n)]
        return {k: _random_value(rng, depth + 1) for k in keys}
    if kind == 3:
        return {rng.randint(0, 9) for _ in range(n)}
    if kind == 4:
        return frozenset({(rng.randint(0, 3), "x"), rng.choice(list(_TYPES["Mood"]))})
    if kind == 5:
        return _TYPES["Ticket"](rng.randint(0, 99), tuple("abc"[: rng.randint(0, 3)]))
    if kind == 6:
        return _TYPES["Order"](name="o", items=list(range(n)), when=datetime(2026, 1, 1))
    return {"nested": _random_value(rng, depth + 1), "again": _random_value(rng, depth + 1)}


def _zone() -> Any:
    from zoneinfo import ZoneInfo

    return ZoneInfo("UTC")


def _seeds(codec: Any, rng: random.Random, count: int) -> list[bytes]:
    import msgpack

    seeds = []
    for _ in range(count):
        value = _random_value(rng)
        seeds.append(codec.encode_canonical(value) if rng.random() < 0.2 else codec.encode(value))
    deep: Any = 2**70
    for _ in range(codec.MAX_DEPTH):
        deep = (deep,)
    unknown = msgpack.ExtType(12, codec.encode(["fuzz.NotHere", {"a": (1, 2), "b": [b"x"]}]))
    nested = msgpack.packb(0)
    for _ in range(200):
        nested = msgpack.packb(msgpack.ExtType(2, b"\x91" + nested))
    seeds += [
        codec.encode(deep),  # the deepest nesting encode writes
        msgpack.packb([unknown, {"k": unknown}]),  # a type this process does not know
        nested,  # 200 nested records: crashed the interpreter before the depth limit
        msgpack.packb(msgpack.ExtType(10, b"garbage")),  # raised decimal.InvalidOperation
    ]
    return [s[:MAX_LEN] for s in seeds]


def _mutate(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randint(0, len(out))
        op = rng.randrange(8)
        if op == 0 and out:
            out[i % len(out)] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[i % len(out)] = rng.choice([0x00, 0x7F, 0x80, 0xC1, 0xC7, 0xD4, 0xDC, 0xFF])
        elif op == 2:
            out[i:i] = rng.randbytes(rng.randint(1, 4))
        elif op == 3:
            del out[i : i + rng.randint(1, 8)]
        elif op == 4:
            del out[i:]
        elif op == 5:  # an extension record header; its payload is whatever follows
            out[i:i] = bytes([0xC7, rng.randrange(32), rng.randint(1, 12)])
        elif op == 6:
            other = rng.choice(seeds)
            j = rng.randrange(len(other) + 1)
            out[i:i] = other[j : j + rng.randint(1, 64)]
        else:
            out[i:i] = out[i : i + rng.randint(1, 16)]
    return bytes(out[:MAX_LEN])


def _worker(args: argparse.Namespace) -> None:
    fd = os.open(args.shared, os.O_RDWR)
    shared = mmap.mmap(fd, _SHARED_SIZE)
    codec = _load_codec(args.engine == "atheris")
    _register_types(codec)
    allowed = (codec.CorruptDataError, codec.UnknownTypeError)
    decode = codec.decode
    done = 0
    started = time.monotonic()
    progress_every = max(args.inputs // 10, 1)

    def one(data: bytes) -> None:
        nonlocal done
        _HEADER.pack_into(shared, 0, done, len(data))
        shared[_HEADER.size : _HEADER.size + len(data)] = data
        try:
            try:
                decode(data)
            except allowed:
                pass
            try:
                decode(data, unknown="generic")
            except codec.CorruptDataError:
                pass
        except BaseException as exc:  # anything else is what this looks for
            print(
                f"FAILURE: {type(exc).__name__}: {exc}\ninput ({len(data)} bytes, hex): "
                f"{data.hex()}\n{traceback.format_exc()}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
        done += 1
        if done % progress_every == 0 or done == args.inputs:
            elapsed = time.monotonic() - started
            print(f"  {done:,} inputs, {elapsed:.1f} s", file=sys.stderr, flush=True)
        if done == args.inputs:
            print(f"DONE {done} {time.monotonic() - started:.3f}", flush=True)
            if args.engine == "atheris":
                os._exit(0)  # libFuzzer would count its own runs; ours are the figure

    rng = random.Random(args.seed)
    seeds = _seeds(codec, rng, 2000)
    if args.engine == "atheris":
        import atheris

        corpus = Path(args.shared).with_name("corpus")
        corpus.mkdir()
        for i, seed in enumerate(seeds):
            (corpus / f"seed{i}").write_bytes(seed)
        atheris.Setup(
            [
                sys.argv[0],
                f"-seed={args.seed % 2**31 or 1}",
                f"-max_len={MAX_LEN}",
                f"-timeout={int(HANG_SECONDS)}",
                "-rss_limit_mb=4096",
                f"-artifact_prefix={corpus.parent}/",
                str(corpus),
            ],
            one,
        )
        atheris.Fuzz()
    for seed in seeds:
        one(seed)
    while done < args.inputs:
        if rng.random() < 0.05:
            one(rng.randbytes(rng.randint(0, 64)))
        else:
            one(_mutate(rng, rng.choice(seeds), seeds))


# --- the parent: run the child, report --------------------------------------------------------------


def _replay(hex_input: str) -> int:
    from ratchet.store import codec

    _register_types(codec)
    data = bytes.fromhex(hex_input)
    status = 0
    for unknown in ("raise", "generic"):
        try:
            value = codec.decode(data, unknown=unknown)
            print(f"unknown={unknown!r}: {value!r}")
        except (codec.CorruptDataError, codec.UnknownTypeError) as exc:
            print(f"unknown={unknown!r}: {type(exc).__name__}: {exc}")
            if unknown == "generic" and isinstance(exc, codec.UnknownTypeError):
                status = 1
        except Exception:
            print(f"unknown={unknown!r}: FAILURE\n{traceback.format_exc()}")
            status = 1
    return status


def _engine(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        import atheris  # noqa: F401
    except ImportError:
        return "random"
    return "atheris"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--inputs", type=int, default=1_000_000, help="inputs to try (1,000,000)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--engine", choices=["auto", "atheris", "random"], default="auto")
    p.add_argument("--replay", metavar="HEX", help="decode one input given in hex and report")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shared", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.replay is not None:
        return _replay(args.replay)
    if args.worker:
        _worker(args)
        return 0
    engine = _engine(args.engine)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"fuzz_codec: {args.inputs:,} inputs, engine {engine}, seed {seed}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fuzz_codec-") as tmp:
        shared = Path(tmp) / "current"
        shared.write_bytes(bytes(_SHARED_SIZE))
        log = Path(tmp) / "child.log"
        cmd = [sys.executable, __file__, "--worker", "--shared", str(shared)]
        cmd += ["--inputs", str(args.inputs), "--seed", str(seed), "--engine", engine]
        started = time.monotonic()
        with log.open("wb") as err:
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, cwd=tmp)
            hang = _watch(child, shared)
        elapsed = time.monotonic() - started
        out = child.stdout.read().decode() if child.stdout else ""
        text = log.read_text(errors="replace")
        coverage = [line for line in text.splitlines() if line.startswith("#") and "cov:" in line]
        for line in text.splitlines():
            if line.startswith("  ") and line.endswith(" s"):
                print(line, flush=True)
        if coverage:
            print(f"  libFuzzer, last report: {coverage[-1]}", flush=True)
        done_line = [line for line in out.splitlines() if line.startswith("DONE ")]
        if child.returncode == 0 and done_line and not hang:
            _, count, seconds = done_line[0].split()
            n, secs = int(count), float(seconds)
            print(
                f"fuzz_codec: {n:,} inputs in {secs:.1f} s ({n / secs:,.0f} inputs/s), "
                f"0 failures (engine {engine}, seed {seed}; {elapsed:.1f} s with start-up)"
            )
            return 0
        with shared.open("rb") as fh:
            raw = fh.read()
        done, length = _HEADER.unpack_from(raw, 0)
        current = raw[_HEADER.size : _HEADER.size + length]
        print(text[-6000:], file=sys.stderr)
        what = "hung" if hang else f"exited with status {child.returncode}"
        print(
            f"fuzz_codec: FAILURE after {done:,} inputs ({elapsed:.1f} s): the fuzzing process "
            f"{what} on this input ({len(current)} bytes, hex):\n{current.hex()}\n"
            f"replay: {sys.executable} {__file__} --replay {current.hex()}",
            file=sys.stderr,
        )
        return 1


def _watch(child: subprocess.Popen[bytes], shared: Path) -> bool:
    """Wait for the child; kill it and return True if one input takes over HANG_SECONDS."""
    last, since = -1, time.monotonic()
    while child.poll() is None:
        time.sleep(0.5)
        with shared.open("rb") as fh:
            done, _ = _HEADER.unpack(fh.read(_HEADER.size))
        if done != last:
            last, since = done, time.monotonic()
        elif time.monotonic() - since > HANG_SECONDS + 10:
            child.kill()
            child.wait()
            return True
    return False


if __name__ == "__main__":
    sys.exit(main())
