"""Part of the Apache Flink Agents compatibility layer (module layout as theirs)."""
