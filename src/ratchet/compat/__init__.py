"""Compatibility packages: other agent frameworks' APIs, running on ratchet's engines."""
