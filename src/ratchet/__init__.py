"""ratchet: durable, event-driven AI agents and incremental, verified check pipelines."""
