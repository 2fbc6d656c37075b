"""Tools: `Tool`, `ToolType`, `FunctionTool` and injected arguments."""

from ratchet.compat.flink_agents.api.tools.tool_parameter_injection import (
    InjectedArg,
    ToolParameterSource,
)

__all__ = ["InjectedArg", "ToolParameterSource"]
