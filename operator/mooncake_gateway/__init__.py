"""KV-cache-aware OpenAI-compatible gateway: tokenize, ask the Conductor in-process,
send prefill then decode, stream back; learns the cluster from KV events and metrics.

Its surface for the other packages: ``replay`` (the trace replay client); the CLI loads
``cli`` by name. The rest is internal (an import-linter contract holds this).
"""
