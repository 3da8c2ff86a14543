"""Metrics adapters: readings that need the broker (consumer lag per group and partition)."""
