"""The Conductor core: pure, I/O-free scheduling logic after Mooncake (FAST'25).

Block keys, the global prefix index, cost models, policies, decode selection,
admission, chunked pipeline prefill planning and hot-prefix replication. The
gateway, the simulator, the worker and the operator all call into this package;
it imports none of them (enforced by import-linter).

Its surface for the other packages: ``engine`` (``Conductor``, ``ConductorConfig``),
``state``, ``index``, ``blockkeys``, ``cost``, ``policies``, ``decode``, ``cpp``,
``topology``, ``replication``, ``peerload`` and ``warmup``. The compiled loops
(``kernels``, ``scoring_kernel``, ``decode_kernel``, ``blockkeys_kernel``, ``kernelrows``)
and the holder sets stay inside: callers reach them through the index, the block keys
and the policies (an import-linter contract holds this).
"""
