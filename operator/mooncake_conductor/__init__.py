"""The Conductor core: pure, I/O-free scheduling logic after Mooncake (FAST'25).

Block keys, the global prefix index, cost models, policies, decode selection,
admission, chunked pipeline prefill planning and hot-prefix replication. The
gateway, the simulator, the worker and the operator all call into this package;
it imports none of them (enforced by import-linter).
"""
