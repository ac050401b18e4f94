"""What two components say to each other: KV-event codec and subscriber, the pod-annotation
contract, label/annotation/port conventions, the simulated tokenizer, process lifecycle.

The worker, the gateway and the operator import this package; none of them imports
another's internals (enforced by import-linter in ``pyproject.toml``).
"""
