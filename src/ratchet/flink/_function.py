"""The PyFlink functions: line parsing and the keyed agent operator around `AgentCore`."""

from __future__ import annotations

import json
import logging
from typing import Any

from pyflink.common import Types
from pyflink.datastream import FlatMapFunction, KeyedProcessFunction, OutputTag, RuntimeContext
from pyflink.datastream.functions import TimeDomain
from pyflink.datastream.state import MapStateDescriptor, ValueStateDescriptor

from ratchet.runtime._flink_core import AgentCore, CoreConfig, Step
from ratchet.runtime._journal import encode_memory

log = logging.getLogger("ratchet.flink")

# Event-time timers at this timestamp fire only at the end of a bounded input (the source's
# final watermark); the operator then waits until the key's runs are done.
END_OF_INPUT = (1 << 63) - 2

# A key with work running also keeps a processing-time timer this far ahead (rounded up to a
# whole second, so that the callbacks of one second register one timer, not one each). Its
# short poll timer alone is not enough: a checkpoint can hold a key's state without the poll
# timer its last callback registered (the JVM fired the previous one and the new registration
# had not reached it; seen after restores in about one Python-worker kill in four, with
# `--follow`), and after a restore from it the key had work and no timer: it never ran again.
# The backstop was registered at least one callback earlier, so the checkpoint holds it.
BACKSTOP_MS = 3000

MEMORY_TAG = OutputTag("ratchet-memory", Types.STRING())
"""Side output of `apply_agent(..., emit_memory=True)`: one JSON line per key at end of input,
`{"key": ..., "memory": "<base64 of the codec-encoded memory>"}` (decode with
`ratchet.flink.decode_memory_line`)."""

_BYTES = Types.PRIMITIVE_ARRAY(Types.BYTE())


class ParseLines(FlatMapFunction):
    """JSON Lines to `(key, line)`; a line that is not an object with the key field is logged
    and skipped (it cannot be admitted, and failing the job would fail it again on restart)."""

    def __init__(self, key_field: str) -> None:
        self.key_field = key_field

    def flat_map(self, value: str) -> Any:
        text = value.strip()
        if not text:
            return
        try:
            obj = json.loads(text)
        except ValueError as exc:
            log.warning("skipping input line that is not JSON (%s): %.200s", exc, text)
            return
        if not isinstance(obj, dict) or self.key_field not in obj:
            log.warning("skipping input line without key field %r: %.200s", self.key_field, text)
            return
        key = obj[self.key_field]
        if isinstance(key, bool) or not isinstance(key, str | int):
            log.warning("skipping input line whose key is %s: %.200s", type(key).__name__, text)
            return
        yield str(key), text


class _State:
    """`KeyStore` over the function's keyed state (the current key is set by Flink)."""

    def __init__(self, rc: RuntimeContext) -> None:
        self.key = rc.get_state(ValueStateDescriptor("ratchet-key", _BYTES))
        self.inputs_st = rc.get_map_state(
            MapStateDescriptor("ratchet-inputs", Types.LONG(), _BYTES)
        )
        self.run = rc.get_state(ValueStateDescriptor("ratchet-run", _BYTES))
        self.calls_st = rc.get_map_state(
            MapStateDescriptor("ratchet-calls", Types.STRING(), _BYTES)
        )

    def get_key(self) -> bytes | None:
        v = self.key.value()
        return None if v is None else bytes(v)

    def put_key(self, value: bytes) -> None:
        self.key.update(value)

    def inputs(self) -> list[tuple[int, bytes]]:
        return [(int(k), bytes(v)) for k, v in self.inputs_st.items()]

    def put_input(self, seq: int, value: bytes) -> None:
        self.inputs_st.put(seq, value)

    def remove_input(self, seq: int) -> None:
        self.inputs_st.remove(seq)

    def get_run(self) -> bytes | None:
        v = self.run.value()
        return None if v is None else bytes(v)

    def put_run(self, value: bytes) -> None:
        self.run.update(value)

    def clear_run(self) -> None:
        self.run.clear()

    def calls(self) -> list[bytes]:
        return [bytes(v) for v in self.calls_st.values()]

    def put_call(self, name: str, value: bytes) -> None:
        self.calls_st.put(name, value)

    def clear_calls(self) -> None:
        self.calls_st.clear()


class AgentFunction(KeyedProcessFunction):
    """Runs a ratchet agent per key: the same run machine as the embedded engine.

    `agent` is a `module:Class` / `file.py:Class` spec or an Agent instance (shipped to the
    Python workers with the job). `json_pairs`: elements are `(key, json_line)` from
    `ParseLines`; otherwise each element is the input value itself.
    """

    def __init__(
        self,
        agent: Any,
        core_config: CoreConfig,
        agent_config: dict[str, Any] | None = None,
        json_pairs: bool = False,
        emit_memory: bool = False,
    ) -> None:
        self.agent = agent
        self.core_config = core_config
        self.agent_config = agent_config
        self.json_pairs = json_pairs
        self.emit_memory = emit_memory
        self.core: AgentCore | None = None

    def open(self, runtime_context: RuntimeContext) -> None:
        from ratchet.agents._context import AgentBinding
        from ratchet.agents._run import load_agent

        agent = load_agent(self.agent) if isinstance(self.agent, str) else self.agent
        self.core = AgentCore(AgentBinding(agent, self.agent_config), self.core_config)
        self.core.open()
        self.state = _State(runtime_context)

    def close(self) -> None:
        if self.core is not None:
            self.core.close()

    def process_element(self, value: Any, ctx: KeyedProcessFunction.Context) -> Any:
        assert self.core is not None
        key = ctx.get_current_key()
        if self.json_pairs:
            value = json.loads(value[1])
        step = self.core.element(key, value, self.state)
        self._timers(ctx, step, register_end=self.emit_memory)
        yield from step.outputs

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> Any:
        assert self.core is not None
        key = ctx.get_current_key()
        end = ctx.time_domain() == TimeDomain.EVENT_TIME and timestamp >= END_OF_INPUT
        step = self.core.timer(key, self.state, end=end)
        if not end:
            self._timers(ctx, step, register_end=False)
        yield from step.outputs
        if end and self.emit_memory:
            import base64

            memory = self.core.memory(key, self.state)
            if memory is not None:
                line = json.dumps(
                    {"key": key, "memory": base64.b64encode(encode_memory(memory)).decode()}
                )
                yield MEMORY_TAG, line

    def _timers(self, ctx: Any, step: Step, register_end: bool) -> None:
        ts = ctx.timer_service()
        if step.poll_ms is not None:
            now = ts.current_processing_time()
            ts.register_processing_time_timer(now + step.poll_ms)
            ts.register_processing_time_timer((now + BACKSTOP_MS) // 1000 * 1000 + 1000)
        if step.active or register_end:
            ts.register_event_time_timer(END_OF_INPUT)
