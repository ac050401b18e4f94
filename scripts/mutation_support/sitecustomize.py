"""``sitecustomize`` of a mutation staging directory with ``subprocess_coverage`` (copied
into its ``mutants/``, which is on PYTHONPATH; not imported by the project).

mutmut learns which tests reach which function by recording trampoline hits in its own
process only. In a subprocess a test starts (a worker, the gateway, a CLI) during the
stats run (``MUTANT_UNDER_TEST=stats``), this records every mutated function the
subprocess runs into ``$MOONCAKE_MUTATION_HITS/<pid>.hits``; the staging's pytest plugin
credits them to the running test. Each name is written once per epoch (the plugin starts
a new one at every test's setup). Outside the stats run this does nothing.
"""

from __future__ import annotations

import contextlib
import os
import time


def _install(folder: str) -> None:
    from mutmut.mutation import trampoline

    epoch_path = os.path.join(folder, "epoch")
    fd = os.open(os.path.join(folder, f"{os.getpid()}.hits"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    seen: set[str] = set()
    epoch = [-1, 0.0]  # epoch file mtime, when last looked at

    def hit(name: str, caller: str | None = None) -> None:
        now = time.monotonic()
        if now - epoch[1] > 0.02:
            epoch[1] = now
            try:
                mtime = os.stat(epoch_path).st_mtime_ns
            except OSError:
                mtime = -1
            if mtime != epoch[0]:
                epoch[0] = mtime
                seen.clear()
        if name not in seen:
            seen.add(name)
            os.write(fd, name.encode() + b"\n")

    trampoline.record_trampoline_hit = hit  # type: ignore[attr-defined]


if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get("MOONCAKE_MUTATION_HITS"):
    # never break the subprocess over coverage bookkeeping
    with contextlib.suppress(Exception):
        _install(os.environ["MOONCAKE_MUTATION_HITS"])
