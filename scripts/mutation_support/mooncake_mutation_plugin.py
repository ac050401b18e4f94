"""pytest plugin that scripts/mutation.py loads (``-p mooncake_mutation_plugin``) in every
pytest run mutmut makes in a mutation staging directory. Copied there; not imported by the
project.

- Hypothesis runs derandomized and without an example database or deadline, so a mutant
  is killed (or not) the same way on every run, and a slow trampolined call is no failure.
- With ``MOONCAKE_MUTATION_HITS`` set (a target's ``subprocess_coverage``), during
  mutmut's stats run it credits the mutated functions that *subprocesses* ran (recorded by
  the staging's ``sitecustomize``) to the test that was running, as mutmut does for the
  functions run in its own process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

HITS_ENV = "MOONCAKE_MUTATION_HITS"
EPOCH_FILE = "epoch"

_offsets: dict[str, int] = {}


def pytest_configure(config: pytest.Config) -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # pragma: no cover - hypothesis is a dev dependency
        return
    settings.register_profile(
        "mooncake-mutation", derandomize=True, database=None, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile("mooncake-mutation")


def _hits_dir() -> Path | None:
    folder = os.environ.get(HITS_ENV)
    if folder and os.environ.get("MUTANT_UNDER_TEST") == "stats":
        return Path(folder)
    return None


def read_new_hits(folder: Path, offsets: dict[str, int]) -> set[str]:
    """Function names appended to ``folder/*.hits`` since the offsets (complete lines only)."""
    names: set[str] = set()
    for path in sorted(folder.glob("*.hits")):
        start = offsets.get(path.name, 0)
        with path.open("rb") as f:
            f.seek(start)
            data = f.read()
        end = data.rfind(b"\n") + 1
        offsets[path.name] = start + end
        names.update(line for line in data[:end].decode().splitlines() if line)
    return names


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    folder = _hits_dir()
    if folder is None:
        return
    # a new epoch: subprocesses forget which names they already wrote, so this test is
    # credited with everything they run from now on
    epoch = folder / EPOCH_FILE
    epoch.touch()
    now = time.time_ns()
    os.utime(epoch, ns=(now, now))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Any) -> None:
    folder = _hits_dir()
    if folder is None:
        return
    from mutmut.state import state

    # before mutmut's own teardown hook files state()._stats under this test's node id
    state()._stats.update(read_new_hits(folder, _offsets))
