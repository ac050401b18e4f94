"""Mooncake worker: simulated engine and pod agent."""
