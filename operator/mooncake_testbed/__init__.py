"""Local processes for tests and benchmarks: workers, a gateway and a real ``mooncake_master``,
each on free 127.0.0.1 ports, started as subprocesses and stopped on exit.

Both ``tests/`` and ``benchmarks/`` use this module; nothing in the product imports it.
A missing external program raises :class:`Unavailable` with a one-line instruction.
"""
