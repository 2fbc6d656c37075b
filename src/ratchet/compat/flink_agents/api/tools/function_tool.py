"""`FunctionTool`, where Flink Agents' API layer keeps it."""

from ratchet.compat.flink_agents.api.tools.tool import FunctionTool

__all__ = ["FunctionTool"]
