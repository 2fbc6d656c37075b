"""Apache Flink Agents' Python API on ratchet: `flink_agents.X` is `ratchet.compat.flink_agents.X`.

Their agents run on ratchet's embedded engine with only their imports changed; with a state
directory the local runner they removed comes back durable across `kill -9`
(docs/flink-agents.md). `to_ratchet(agent)` gives a ratchet `Agent` for `ratchet run` and
`ratchet flink run`. Importing this package never imports PyFlink.
"""

from ratchet.compat.flink_agents.runtime._adapter import to_ratchet

__all__ = ["to_ratchet"]
