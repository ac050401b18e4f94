"""The real engines, installed from the package registries, as the authority on our contract.

The operator generates ``vllm serve`` and ``sglang.launch_server`` pods it cannot run on a
machine without GPUs; the gateway and the worker speak KV events and the P/D handshake
with engines they have never met. This package installs each supported engine version
into its own virtual environment (cached by version, like the local cluster's Go
binaries) and runs *probes* inside it: small scripts that feed our manifests, payloads
and request bodies to the engine's own parsers, config classes, publishers and
connectors, and answer what the engine made of them as JSON.

- :mod:`.envs`: the cached virtual environments (``mooncake-operator conformance install``);
- :mod:`.runner`: a probe run, one-shot or live (a publisher serving on loopback);
- ``probes/``: the scripts, run by the engine's interpreter (the standard library and the
  engine only; nothing of ours is importable there).

The checks themselves are the tests in ``tests/conformance``. No product part imports
this package.
"""
