"""Trace-driven discrete-event simulator over the Conductor core.

Its surface for the other packages: ``trace`` (the trace loader and the bundled trace),
``metrics`` (TTFT/TBT summaries) and ``presets`` (the published settings); the CLI loads
``cli`` by name. The rest is internal (an import-linter contract holds this).
"""
