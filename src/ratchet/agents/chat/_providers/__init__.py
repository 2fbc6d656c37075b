"""Provider adapters. Each real provider imports its SDK lazily, so its extra is optional."""
