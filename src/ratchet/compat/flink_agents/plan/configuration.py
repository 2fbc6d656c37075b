"""`AgentConfiguration`, where Flink Agents' plan layer keeps it."""

from ratchet.compat.flink_agents.api.configuration import Configuration as AgentConfiguration

__all__ = ["AgentConfiguration"]
