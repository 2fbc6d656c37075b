"""The coordinator of `--workers N` leaves its sink's thread the GIL (the engine's side of
the same claim is in test_engine.py, `test_no_input_is_admitted_while_the_writer_works`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ratchet import run
from ratchet.runtime._io import CallbackSink
from ratchet.runtime._multiproc import BATCH

N = 30_000
AGENT = f"{Path(__file__).with_name('inline_agent.py')}:Inline"


def test_the_coordinator_reads_no_further_while_its_sink_writes(tmp_path: Path) -> None:
    """The sink's thread needs the GIL between the lines it writes, and a coordinator reading
    and routing inputs (pure Python) meanwhile starved it, while the workers waited for those
    outputs' answer to finish their checkpoints. The coordinator waits for the sink: at most
    one batch of inputs is read while a write is in progress, however long it takes."""
    writing = threading.Event()
    taken_during: list[int] = []  # inputs read while each slow write was in progress
    got: list[dict[str, Any]] = []

    class SlowSink(CallbackSink):
        def write(self, records: list[dict[str, Any]]) -> int:
            taken_during.append(0)
            writing.set()
            try:
                time.sleep(0.03)  # a slow sink: the GIL is free meanwhile
                return super().write(records)
            finally:
                writing.clear()

    class Inputs:
        """Read again from the start at a restore: the same inputs in the same order."""

        def __iter__(self) -> Iterator[dict[str, Any]]:
            for i in range(N):
                if writing.is_set() and taken_during:
                    taken_during[-1] += 1
                yield {"key": f"k{i % 50}", "i": i}

    result = run(
        AGENT, inputs=Inputs(), output=SlowSink(got.append), state_dir=tmp_path / "s", workers=2
    )
    assert result.outputs == N and len({r["id"] for r in got}) == N, got[:2]
    assert max(taken_during) <= BATCH, f"inputs read during each slow write: {taken_during}"
    assert len(taken_during) >= 3, f"only {len(taken_during)} slow write(s): nothing measured"
