"""Trace-driven discrete-event simulator over the Conductor core."""
