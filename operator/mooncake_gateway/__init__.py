"""KV-cache-aware OpenAI-compatible gateway: tokenize, ask the Conductor in-process,
send prefill then decode, stream back; learns the cluster from KV events and metrics."""
